"""What the loop hands the metrics exporter each turn: a frozen copy of the pool's state.

Scrapes run on the exporter's HTTP thread and read only the last published PoolSnapshot, never
live loop structures (broker/metrics.py). Every field is the broker's own, so it is read as typed;
only a worker's heartbeat `report` came over the wire, and the exporter reads it with guards.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class WorkerView:
    """One connected worker as the exporter shows it."""

    name: str
    host: str
    pid: int
    state: str  # "idle", "busy" or "draining" (metrics.WORKER_STATES)
    in_flight: int
    capacity: int
    report: Mapping[str, Any]  # its latest heartbeat body, as it sent it: untrusted


@dataclass(frozen=True, slots=True)
class ModelView:
    """One catalog model (docs/protocol.md "The model catalog") as the exporter shows it."""

    state: str  # "loading", "ready" or "failed" (catalog.LOADING, READY, FAILED)
    replicas: int  # workers holding it loaded
    loading: bool  # a worker is loading it now
    queued: int  # requests waiting for a worker that holds it


@dataclass(frozen=True)
class PoolSnapshot:
    """The pool at the end of one loop turn; published, never changed afterwards."""

    queue_depth: int = 0  # requests waiting for a worker
    held: int = 0  # requests received and not yet answered
    restarts: int = 0  # local workers restarted after an exit
    recycled: int = 0  # local workers replaced because their memory passed --worker-max-memory
    workers: tuple[WorkerView, ...] = ()
    router: Mapping[str, int] = field(default_factory=dict)  # Router.stats()
    models: Mapping[str, ModelView] = field(default_factory=dict)  # catalog model name -> its view
    stopping: bool = False  # told to stop: answering what it holds, taking nothing new (/ready fails)
