"""Type stub of broker/_frontend.pyx."""

from __future__ import annotations

from typing import Any

from tokenbroker.broker._intake import Intake

class Peer:
    @property
    def user_id(self) -> str | None: ...
    @property
    def address(self) -> str | None: ...

class Drain:
    def __init__(self, frontend: Any, intake: Intake) -> None: ...
    def drain(self, now: float, messages: int, budget: int) -> int: ...
