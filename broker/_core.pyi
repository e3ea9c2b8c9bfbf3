"""Type stub of the broker's compiled per-request core (broker/_core.pyx)."""

from typing import NamedTuple

from tokenbroker.common.errors import ProtocolError

MAX_DEPTH: int
MAX_FIELDS: int
MAX_BLOCKS: int
DIGEST_BYTES: int
MIN_BLOCK: int
MAX_BLOCK: int
GROWTH_DIVISOR: int
BOUNDARIES: tuple[int, ...]
MAX_HASHED_BYTES: int
INPUT_FIELDS: tuple[str, ...]
KEYLESS_OPS: frozenset[str]

class RouteKey(NamedTuple):
    key: bytes
    blocks: tuple[bytes, ...]

class Peek:
    raw: bytes | memoryview
    raw_id: bytes
    op: str
    model: str | None
    deadline_ms: int | None
    affinity: str | None
    body: bytes | memoryview
    @property
    def spans(self) -> dict[str, tuple[int, int]]: ...
    def value(self, name: str) -> bytes | memoryview | None: ...

def peek_request(raw: bytes | memoryview) -> Peek: ...
def peek_array(raw: bytes | memoryview) -> list[Peek | ProtocolError]: ...
def is_array(raw: bytes | memoryview) -> bool: ...
def first_type(raw: bytes | memoryview) -> str: ...
def route_key(peek: Peek) -> RouteKey | None: ...
def digest(data: bytes) -> bytes: ...
def text_blocks(seed: bytes, data: bytes) -> tuple[bytes, ...]: ...
def seed(kind: bytes, model: bytes) -> bytes: ...
