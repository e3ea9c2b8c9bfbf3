"""Type stub of broker/_plane.pyx."""

from __future__ import annotations

from typing import Any, Callable

TIMER: int
WAKE: int

class Plane:
    def __init__(self, broker: Any, *, front_messages: int, front_bytes: int, back_messages: int, liveness_s: float,
                 batch_jobs: int, batch_bytes: int, reply_frame_bytes: int,
                 used: Callable[[bytes, list[Any], float], None] | None = None) -> None: ...
    def run(self, python_at: float, plan_at: float, one_turn: bool = False) -> int: ...
