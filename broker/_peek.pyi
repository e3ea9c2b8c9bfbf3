"""Type stub of broker/_peek.pyx."""

from __future__ import annotations

from tokenbroker.common._message import Message

MAX_DEPTH: int
MAX_FIELDS: int
MAX_ARRAY_REQUESTS: int
INPUT_FIELDS: tuple[str, ...]

class Peek:
    raw: bytes | memoryview | Message  # a Message as the frontend's drain received it
    raw_id: bytes
    op: str
    model: str | None
    deadline_ms: int | None
    affinity: str | None
    body: bytes | memoryview | Message  # raw itself, or a view of it for an array's element
    code: str | None  # set (with `message`) when the broker refuses the request: an array's element
    message: str | None
    @property
    def spans(self) -> dict[str, tuple[int, int]]: ...

def peek_request(raw: bytes | memoryview | Message) -> Peek: ...
def peek_array(raw: bytes | memoryview | Message) -> list[Peek]: ...
def first_type(raw: bytes | memoryview) -> str: ...
