"""Type stub of broker/_batches.pyx."""

from __future__ import annotations

from typing import Any

from tokenbroker.broker._intake import Intake
from tokenbroker.broker._jobs import Job

def send_jobs(sock: Any, wid: bytes, jobs: list[Job], now: float, max_jobs: int, max_bytes: int) -> None: ...
def drain(sock: Any, workers: dict[bytes, Any], intake: Intake, now: float, expiry: float,
          limit: int) -> tuple[int, list[bytes] | bytes | None]: ...
def results_problem(body: list[bytes]) -> str | None: ...
