"""Type stub of broker/_counters.pyx."""

from __future__ import annotations

def count_request(requests: dict[tuple[str, str], int], latency: dict[str, list[float]], bounds: tuple[float, ...], op: str, outcome: str, seconds: float) -> None: ...
