"""Type stub of broker/_router.pyx."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Iterable

from tokenbroker.broker._jobs import Job
from tokenbroker.broker._routekey import RouteKey

class Slots:
    capacity: int
    jobs: dict[int, Job]
    bytes: int
    long_jobs: int
    draining: bool
    blocked: bool
    def __init__(self, capacity: int, jobs: dict[int, Job] | None = None, bytes: int = 0, long_jobs: int = 0,
                 draining: bool = False, blocked: bool = False) -> None: ...
    @property
    def held(self) -> int: ...

class RouterWorker:
    wid: bytes
    load: Slots
    salt: int
    alive: bool
    def __init__(self, wid: bytes, load: Slots, salt: int, alive: bool = True) -> None: ...

class Router:
    balance_factor: float
    balance_margin: int
    index_max_entries: int
    _workers: dict[bytes, RouterWorker]
    _index: OrderedDict[bytes, RouterWorker]
    def __init__(self, *, balance_factor: float = 1.25, balance_margin: int = 2, index_max_entries: int = 1 << 20) -> None: ...
    def add_worker(self, wid: bytes, load: Slots) -> None: ...
    def remove_worker(self, wid: bytes) -> None: ...
    def pick(self, key: RouteKey | None, *, overflow: bool = True, allowed: frozenset[bytes] | None = None) -> bytes | None: ...
    def record(self, key: RouteKey, wid: bytes) -> None: ...
    def bound(self, extra: int = 1) -> float: ...
    def stats(self) -> dict[str, int]: ...
    def _lookup(self, key: RouteKey) -> RouterWorker | None: ...
    def _rendezvous(self, key: bytes, workers: Iterable[RouterWorker]) -> RouterWorker: ...

def salt_of(wid: bytes) -> int: ...
