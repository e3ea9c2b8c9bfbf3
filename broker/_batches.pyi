"""Type stub of broker/_batches.pyx."""

from __future__ import annotations

from tokenbroker.broker._jobs import Job

def job_batch(jobs: list[Job], now: float, start: int, max_jobs: int, max_bytes: int) -> tuple[int, bytes, bytes | memoryview]: ...
def check_results(body: list[bytes]) -> tuple[bytes, bytes]: ...
