"""Type stub of broker/_jobs.pyx."""

from __future__ import annotations

from tokenbroker.broker._peek import Peek
from tokenbroker.common._message import Message
from tokenbroker.broker._routekey import RouteKey
from tokenbroker.common.protocol import Envelope

class Job:
    job_id: int
    envelope: Envelope
    raw_id: bytes
    raw: bytes | memoryview | Message  # the payload as the frontend received it, or a view of it
    op: str
    route: RouteKey | None
    received: float
    deadline: float
    queued: float
    attempts: int
    worker: bytes | None
    answered: bool
    model: str | None
    catalog: bool
    off_loop: bool
    def __init__(self, job_id: int, envelope: Envelope, raw_id: bytes, raw: bytes | memoryview | Message, op: str,
                 route: RouteKey | None, received: float, deadline: float, queued: float, attempts: int = 0,
                 worker: bytes | None = None, answered: bool = False, model: str | None = None,
                 catalog: bool = False, off_loop: bool = False) -> None: ...

class JobTable:
    jobs: dict[int, Job]
    held_bytes: int
    per_client: dict[bytes, int]
    def __init__(self) -> None: ...
    def __len__(self) -> int: ...
    def __bool__(self) -> bool: ...
    def admit(self, envelope: Envelope, peek: Peek, route: RouteKey | None, now: float, timeout_s: float,
              model: str | None, catalog: bool) -> Job: ...
    def add(self, job: Job) -> None: ...
    def release(self, job: Job) -> None: ...
    def held_by(self, client: bytes) -> int: ...
    def due(self, now: float) -> list[Job]: ...
    def unanswered(self) -> list[Job]: ...
    def clear(self) -> None: ...
