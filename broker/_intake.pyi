"""Type stub of broker/_intake.pyx."""

from __future__ import annotations

from typing import Any, Callable

from tokenbroker.broker._dispatch import Dispatcher
from tokenbroker.broker._jobs import Job, JobTable
from tokenbroker.broker._peek import Peek
from tokenbroker.common.protocol import Envelope

class Intake:
    jobs: JobTable
    dispatcher: Dispatcher
    models: dict[str | None, str | None]
    affinity: bool
    stopping: bool
    timeout_s: float
    max_pending: int
    max_pending_bytes: int
    max_client_pending: int
    def __init__(self, jobs: JobTable, dispatcher: Dispatcher, outbox: dict[Envelope, list[bytes | memoryview]],
                 requests: dict[tuple[str, str], int], latency: dict[str, list[float]], bounds: tuple[float, ...],
                 model_requests: dict[str, int], other: Callable[[Envelope, Any, Peek | None, float], None],
                 late: Callable[[Job, float], None], *, affinity: bool, timeout_s: float, max_pending: int,
                 max_pending_bytes: int, max_client_pending: int) -> None: ...
    def take(self, envelope: Envelope, peer: Any, item: Peek | list[Peek] | None, now: float) -> int: ...
    def refusal(self, client: bytes, size: int) -> str | None: ...
    def hold(self, envelope: Envelope, peek: Peek, now: float, model: str | None, catalog: bool) -> Job: ...
