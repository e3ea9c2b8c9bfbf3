"""Type stub of broker/_peek.pyx."""

from __future__ import annotations

MAX_DEPTH: int
MAX_FIELDS: int
MAX_ARRAY_REQUESTS: int
INPUT_FIELDS: tuple[str, ...]

class Peek:
    raw: bytes | memoryview
    raw_id: bytes
    op: str
    model: str | None
    deadline_ms: int | None
    affinity: str | None
    body: bytes | memoryview
    code: str | None  # set (with `message`) when the broker refuses the request: an array's element
    message: str | None
    @property
    def spans(self) -> dict[str, tuple[int, int]]: ...

def peek_request(raw: bytes | memoryview) -> Peek: ...
def peek_array(raw: bytes | memoryview) -> list[Peek]: ...
def first_type(raw: bytes | memoryview) -> str: ...
