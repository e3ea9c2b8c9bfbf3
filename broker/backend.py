"""The worker side of the broker: who is connected, when each was last heard, and the frames.

Heartbeats the Paranoid Pirate way: any frame from a worker is proof of life, and a worker silent
for interval x liveness is gone. What each worker holds is the dispatcher's (docs/routing.md);
this module knows connections, not jobs.

Every frame from a worker is untrusted: a malformed READY, HEARTBEAT, RESULTS or BYE is dropped
and logged (at most once a second per kind), never raised, so no peer can stop the loop. The data
path is compiled (broker/_batches.pyx): a known worker's W_RESULTS is received, checked and
finished there, and B_JOBS are written there; every other message comes here as its frames.
Workers connect with identities ZeroMQ picks per connection and the ROUTER never hands an
identity over, so no peer can take another's connection; a READY that names a live worker is
refused unless it comes from the same process (its incarnation), which is how a reconnect looks.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import msgpack
import zmq

from tokenbroker.common.protocol import (
    B_HEARTBEAT,
    B_LOAD,
    B_RESET,
    B_UNLOAD,
    HEARTBEAT_INTERVAL_S,
    HEARTBEAT_LIVENESS,
    MAX_BATCH_JOBS,
    PROTOCOL_VERSION,
    W_BYE,
    W_HEARTBEAT,
    W_LOADED,
    W_READY,
    W_RESULTS,
    Loaded,
    LoadSpec,
    Ready,
)

from ._batches import drain, results_problem
from ._intake import Intake
from ._jobs import Job

log = logging.getLogger(__name__)

MAX_REPORT_BYTES = 64 * 1024  # a heartbeat body larger than this is dropped
MAX_LOADED_BYTES = 4 * 1024 * 1024  # a LOADED body (its special-token list) larger than this is dropped
# A worker parsing a tokenizer holds its GIL for the whole parse (seconds under load): it beats no
# heartbeat meanwhile, so while a LOAD is outstanding it may be silent this long before it is gone.
LOAD_GRACE_S = 60.0
BATCH_BYTES = 4 * 1024 * 1024  # payload bytes in one backend message, past its first job
LIVENESS_S = HEARTBEAT_INTERVAL_S * HEARTBEAT_LIVENESS  # a worker silent this long is gone


@dataclass
class WorkerState:
    wid: bytes
    ready: Ready
    expiry: float
    draining: bool = False
    report: dict[str, Any] = field(default_factory=dict)  # the latest heartbeat body (cumulative counters, rss)
    loads: int = 0  # LOADs sent that it has not answered
    load_grace: float = 0.0  # while `loads`: silent until then is still alive (LOAD_GRACE_S)

    @property
    def name(self) -> str:
        return self.ready.name


@dataclass(frozen=True)
class Joined:
    worker: WorkerState


@dataclass(frozen=True)
class Results:
    """A draining worker's W_RESULTS batch was finished (by the core, broker/_batches.pyx `drain`,
    which hands each batch to the intake with no event built): it may hold nothing now. A worker
    not draining gets no event for its results."""

    wid: bytes


@dataclass(frozen=True)
class ModelLoaded:
    """A worker finished (or failed) a load. `mismatch`: why its fingerprint was refused, if it was."""

    wid: bytes
    loaded: Loaded
    mismatch: str | None = None


@dataclass(frozen=True)
class Draining:
    """The worker said BYE: it finishes what it holds but takes nothing new."""

    wid: bytes


@dataclass(frozen=True)
class Left:
    wid: bytes
    why: str
    state: WorkerState | None = None  # set when the table already dropped it (a reconnect replaced it)


class _RateLimitedLog:
    """One warning per kind per second; the rest are counted and summed into the next one."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}
        self._quiet: dict[str, int] = {}

    def warn(self, kind: str, msg: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last.get(kind, -1e9) < 1.0:
            self._quiet[kind] = self._quiet.get(kind, 0) + 1
            return
        self._last[kind] = now
        quiet = self._quiet.pop(kind, 0)
        log.warning(msg + (f" ({quiet} more like it not shown)" if quiet else ""), *args)


class Backend:
    """Wraps the ROUTER socket workers connect to, and the table of workers."""

    def __init__(self, sock: zmq.Socket) -> None:
        self.sock = sock
        self.expected: dict[str, tuple[str, str]] = {}  # model -> (fingerprint, the worker that set it)
        self.workers: dict[bytes, WorkerState] = {}
        self.next_beat = 0.0
        self._log = _RateLimitedLog()

    @staticmethod
    def expiry(now: float) -> float:
        return now + LIVENESS_S

    def receive(self, intake: Intake, now: float, limit: int = 8192) -> Iterator[object]:
        """Drain what has arrived (up to `limit` messages), yielding events in arrival order.

        The W_RESULTS of known workers are finished in the core as they come (broker/_batches.pyx
        `drain` hands each to `intake`); the core stops at anything else, which `_on_frames` turns
        into events here, so each event is handled before the messages after it are read."""
        expiry = self.expiry(now)
        while limit > 0:
            try:
                taken, got = drain(self.sock, self.workers, intake, now, expiry, limit)
            except zmq.ZMQError:
                raise
            except Exception:  # a bug must cost this message, never the loop
                log.exception("dropped a backend message that could not be handled")
                limit -= 1
                continue
            limit -= taken
            if got is None:
                return
            yield from self.events_of(got, now)

    def events_of(self, got: bytes | list[bytes], now: float) -> list[object]:
        """The events of what `drain` left for Python (its second answer, not None)."""
        if isinstance(got, bytes):  # a draining worker's results were finished
            return [Results(got)]
        try:
            return self._on_frames(got, now)
        except Exception:  # a bug must cost this message, never the loop
            log.exception("dropped a backend message that could not be handled")
            return []

    def _drop(self, kind: str, msg: str, *args: object) -> list[object]:
        self._log.warn(kind, msg, *args)
        return []

    def _on_frames(self, frames: list[bytes], now: float) -> list[object]:
        wid, kind, body = frames[0], frames[1] if len(frames) > 1 else b"", frames[2:]
        worker = self.workers.get(wid)
        if worker is not None:
            worker.expiry = self.expiry(now)
        if worker is None and kind in (W_RESULTS, W_HEARTBEAT):
            self._send(wid, B_RESET)  # a worker we forgot (it was silent, stopped): it says READY again now
            return []
        if kind == W_RESULTS and worker is not None:  # one the core's drain refused (None: answered B_RESET above)
            return self._drop("results", "worker %s sent a malformed RESULTS: %s", worker.name, results_problem(body))
        if kind == W_HEARTBEAT and worker is not None:
            if len(body) != 1 or len(body[0]) > MAX_REPORT_BYTES:
                return self._drop("heartbeat", "worker %s sent a malformed HEARTBEAT (%d frames)", worker.name, len(body))
            try:
                report = msgpack.unpackb(body[0], raw=False, strict_map_key=False)
            except Exception as e:
                return self._drop("heartbeat", "worker %s sent an unreadable HEARTBEAT: %s", worker.name, e)
            if isinstance(report, dict):
                worker.report = report  # replaced, never edited: the exporter's thread reads the old one
            return []
        if kind == W_READY:
            return self._on_ready(wid, worker, body, now)
        if kind == W_LOADED and worker is not None:
            worker.loads = max(0, worker.loads - 1)  # the next one it loads starts now
            worker.load_grace = now + LOAD_GRACE_S if worker.loads else 0.0
            return self._on_loaded(worker, body)
        if kind == W_BYE:
            if worker is None or worker.draining:
                return []
            worker.draining = True
            return [Draining(wid)]
        if worker is None:
            return self._drop("unknown", "an unknown peer sent a message of kind %r: dropped", kind[:8])
        return self._drop("unknown", "worker %s sent an unknown message kind %r", worker.name, kind[:8])

    def _on_ready(self, wid: bytes, worker: WorkerState | None, body: list[bytes], now: float) -> list[object]:
        if len(body) != 1:
            return self._drop("ready", "a READY with %d body frames: dropped", len(body))
        try:
            ready = Ready.from_wire(body[0])
        except Exception as e:
            return self._drop("ready", "a peer sent an unreadable READY: %s", e)
        if ready.version != PROTOCOL_VERSION:
            return self._drop("ready", "worker %s speaks protocol %d, this broker %d: refused",
                              ready.name, ready.version, PROTOCOL_VERSION)
        refusal = self._admission(ready)
        if refusal is not None:
            log.error("refused worker %s (pid %d on %s): %s", ready.name, ready.pid, ready.host, refusal)
            return []
        for model, fingerprint in ready.fingerprints.items():
            self.expected.setdefault(model, (fingerprint, ready.name))
        events: list[object] = []
        for other in list(self.workers.values()):
            if other.wid != wid and other.name == ready.name:
                if not ready.incarnation or other.ready.incarnation != ready.incarnation:
                    return self._drop("ready", "a peer claims the name %s of a connected worker: refused", ready.name)
                # the same process on a new connection: the old one and what it held are gone
                events.append(Left(other.wid, "reconnected", self.workers.pop(other.wid)))
        state = WorkerState(wid=wid, ready=ready, expiry=self.expiry(now))
        self.workers[wid] = state
        self._send(wid, B_HEARTBEAT)  # READY answered at once: the worker knows it joined (workers/join.py)
        if worker is not None:  # READY again on a live connection: it restarted its session
            events.append(Left(wid, "reconnected", worker))
        events.append(Joined(state))
        return events

    def _admission(self, ready: Ready) -> str | None:
        """Why a worker may not join (a model loaded differently from the pool's), or None.

        Every model the worker serves must have the fingerprint of the first worker admitted for
        it (this broker loads no tokenizer itself): a worker started with another tokenizer file
        or template would silently give other ids.
        """
        for model, got in sorted(ready.fingerprints.items()):
            want = self.expected.get(model)
            if want is not None and want[0] != got:
                return (f"model {model!r} has fingerprint {got}, this broker expects {want[0]} "
                        f"(from worker {want[1]}): start it with the same model flags")
        return None

    def _on_loaded(self, worker: WorkerState, body: list[bytes]) -> list[object]:
        if len(body) != 1 or len(body[0]) > MAX_LOADED_BYTES:
            return self._drop("loaded", "worker %s sent a malformed LOADED", worker.name)
        try:
            loaded = Loaded.from_wire(body[0])
        except Exception as e:
            return self._drop("loaded", "worker %s sent an unreadable LOADED: %s", worker.name, e)
        mismatch = None
        if loaded.ok:
            want = self.expected.setdefault(loaded.name, (loaded.fingerprint, worker.name))
            if want[0] != loaded.fingerprint:
                mismatch = (f"model {loaded.name!r} has fingerprint {loaded.fingerprint} on worker {worker.name}, "
                            f"this broker expects {want[0]} (from worker {want[1]})")
        return [ModelLoaded(worker.wid, loaded, mismatch)]

    def forget_model(self, name: str) -> None:
        """A model left the catalog: the next one of that name may have another fingerprint."""
        self.expected.pop(name, None)

    def send_load(self, wid: bytes, spec: LoadSpec) -> None:
        worker = self.workers.get(wid)
        if worker is not None:
            worker.loads += 1
            worker.load_grace = max(worker.load_grace, time.monotonic() + LOAD_GRACE_S)
        self._send_frames([wid, B_LOAD, spec.to_wire()])

    def send_unload(self, wid: bytes, name: str) -> None:
        self._send_frames([wid, B_UNLOAD, name.encode()])

    def forget(self, wid: bytes) -> WorkerState | None:
        return self.workers.pop(wid, None)

    def tick(self, now: float) -> list[Left]:
        """Heartbeat every worker on time, and report the ones gone silent."""
        if now >= self.next_beat:
            for wid in self.workers:
                self._send(wid, B_HEARTBEAT)
            self.next_beat = now + HEARTBEAT_INTERVAL_S
        return [Left(w.wid, "silent") for w in self.workers.values() if w.expiry <= now and w.load_grace <= now]

    def send_heartbeat(self, wid: bytes) -> None:
        self._send(wid, B_HEARTBEAT)

    def _send(self, wid: bytes, kind: bytes) -> None:
        self._send_frames([wid, kind])

    def _send_frames(self, frames: list[bytes]) -> None:
        """A control message (the jobs go through the core): never blocks, and a failed send is
        the peer's loss (it is gone, or will hear the next heartbeat)."""
        try:
            self.sock.send_multipart(frames, zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def ready_count(self) -> int:
        return sum(1 for w in self.workers.values() if not w.draining)
