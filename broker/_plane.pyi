"""Type stub of broker/_plane.pyx."""

from __future__ import annotations

from typing import Any

from tokenbroker.broker._dispatch import Dispatcher
from tokenbroker.broker._frontend import Drain
from tokenbroker.broker._jobs import JobTable

TIMER: int
WAKE: int

class Plane:
    turns: int
    returns: int
    def __init__(self, front: Any, back: Any, wake_fd: int, broker: Any, jobs: JobTable, dispatcher: Dispatcher,
                 frontend: Any, outbox: dict[Any, Any], front_drain: Drain, front_messages: int,
                 front_bytes: int) -> None: ...
    def run(self, python_at: float, plan_at: float, one_turn: bool = False) -> int: ...
