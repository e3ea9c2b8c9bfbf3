"""The broker loop: poll, then frontend, backend, tick. Readable in one screen per verb.

Jobs flow client -> frontend -> pending queue -> router -> backend -> worker, and the worker's
reply bytes go back untouched. Timers (heartbeats, deadlines, respawns) run only in `tick`, with
one `now` read per turn. The loop never tokenizes and never decodes a reply.
"""

from __future__ import annotations

import heapq
import logging
import signal
import socket
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

import zmq

from tokenbroker import __version__
from tokenbroker.common.config import BrokerConfig
from tokenbroker.common.protocol import MAX_DEADLINE_MS, Envelope, error_reply, ok_reply

from .affinity import RouteKey, route_key
from .backend import Backend, Draining, Joined, Left, Result, WorkerState
from .frontend import Frontend
from .metrics import PoolMetrics
from .router import Router
from .supervisor import Supervisor

log = logging.getLogger(__name__)

FRONTEND_BATCH = 512  # messages read per turn, so the backend is never starved
PUBLISH_EVERY_S = 0.1  # the exporter's view of the pool is at most this old
AFFINITY_LOOKAHEAD = 64  # queued jobs offered to their preferred worker before strict FIFO
SHUTDOWN_GRACE_S = 10.0
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
WAKE_SIGNALS = (*STOP_SIGNALS, signal.SIGCHLD, signal.SIGHUP)  # SIGHUP: re-read the CURVE key folders


@dataclass
class Job:
    job_id: int
    envelope: Envelope
    request_id: bytes  # the id's MessagePack bytes, echoed as they came
    raw: bytes
    op: str
    route: RouteKey | None
    received: float
    deadline: float
    queued: float = 0.0  # when it last entered the pending queue
    attempts: int = 0
    worker: bytes | None = None
    answered: bool = False


class BootFailed(Exception):
    """A local worker could not load its tokenizers: the broker must not start."""


class Broker:
    on_hangup: Callable[[], None] = staticmethod(lambda: None)  # broker/security.py's reload, set by main

    def __init__(
        self,
        config: BrokerConfig,
        frontend: Frontend,
        backend: Backend,
        supervisor: Supervisor,
        metrics: PoolMetrics,
        wakeup: socket.socket,
    ) -> None:
        self.config = config
        self.frontend = frontend
        self.backend = backend
        self.supervisor = supervisor
        self.metrics = metrics
        self.wakeup = wakeup
        self.router = Router(balance_factor=config.balance_factor, balance_margin=config.balance_margin)
        self.jobs: dict[int, Job] = {}
        self.pending: deque[Job] = deque()
        self.waiting = 0  # jobs in `pending` still unanswered
        self.stale_pending = 0  # answered jobs still in `pending`, dropped in batches
        self.held_bytes = 0  # payload bytes of every job held (pending or in flight), bounded by max_pending_bytes
        self.deadlines: list[tuple[float, int]] = []
        self.next_id = 1
        self.stopping_since: float | None = None
        self.next_publish = 0.0
        self.poller = zmq.Poller()
        self.poller.register(frontend.sock, zmq.POLLIN)
        self.poller.register(backend.sock, zmq.POLLIN)
        self.poller.register(wakeup.fileno(), zmq.POLLIN)

    # --- start -------------------------------------------------------------------------

    def wait_for_workers(self, count: int, timeout: float | None = None) -> None:
        """Serve nothing until `count` workers said READY; a boot error aborts the start."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.backend.ready_count() < count:
            events = dict(self.poller.poll(200))
            now = time.monotonic()
            if self.wakeup.fileno() in events and self._stop_requested():
                raise KeyboardInterrupt
            if self.backend.sock in events:
                for event in self.backend.receive(now):
                    self._on_backend(event, now)
            for ex in self.supervisor.reap(now):
                if ex.boot_error:
                    raise BootFailed(f"{ex.describe()}: it could not load its tokenizers (its message is above)")
            self.supervisor.tick(now)
            if deadline is not None and now > deadline:
                raise BootFailed(f"only {self.backend.ready_count()} of {count} workers became ready in {timeout:.0f}s")

    # --- the loop ----------------------------------------------------------------------

    def run(self) -> None:
        while True:
            now = time.monotonic()
            events = dict(self.poller.poll(self._timeout_ms(now)))
            now = time.monotonic()
            if self.wakeup.fileno() in events and self._stop_requested() and self.stopping_since is None:
                log.info("stopping: answering the %d requests held", len(self.jobs))
                self.stopping_since = now
            if self.backend.sock in events:
                for event in self.backend.receive(now):
                    self._on_backend(event, now)
            if self.frontend.sock in events:
                self._on_frontend(now)
            self.tick(now)
            if self.stopping_since is not None and (not self.jobs or now - self.stopping_since > SHUTDOWN_GRACE_S):
                break
        self._fail_all("overloaded", "the broker is shutting down; retry on another broker")

    def _timeout_ms(self, now: float) -> int:
        nearest = self.backend.next_beat
        if self.deadlines:
            nearest = min(nearest, self.deadlines[0][0])
        if self.pending and self.config.spill_wait_ms:
            nearest = min(nearest, self.pending[0].queued + self.config.spill_wait_ms / 1000)
        return max(0, min(1000, int((nearest - now) * 1000) + 1))

    def _stop_requested(self) -> bool:
        try:
            data = self.wakeup.recv(512)
        except BlockingIOError:
            return False
        if signal.SIGHUP in data:
            self.on_hangup()
        return any(b in data for b in STOP_SIGNALS)

    # --- frontend ----------------------------------------------------------------------

    def _on_frontend(self, now: float) -> None:
        for _ in range(FRONTEND_BATCH):
            try:
                incoming = self.frontend.receive()
            except zmq.Again:
                return
            if incoming is None:
                self.metrics.request_done("invalid", "bad_request", 0.0)
                continue
            request, envelope = incoming.request, incoming.envelope
            if request.op == "ping":
                self.frontend.reply(envelope, ok_reply(request.raw_id, {
                    "workers": self.backend.ready_count(), "version": __version__, "worker": "broker"}))
                self.metrics.request_done("ping", "ok", time.monotonic() - now)
                continue
            full = self.waiting >= self.config.max_pending or \
                self.held_bytes + len(incoming.raw) > self.config.max_pending_bytes
            if self.stopping_since is not None or full:
                why = "the broker is shutting down" if self.stopping_since is not None else \
                    f"{self.waiting} requests ({self.held_bytes} bytes) are queued " \
                    f"(--max-pending {self.config.max_pending}, --max-pending-bytes {self.config.max_pending_bytes})"
                self.frontend.fail(envelope, request.raw_id, "overloaded", f"{why}; retry later")
                self.metrics.request_done(request.op, "overloaded", 0.0)
                continue
            timeout_ms = request.deadline_ms or self.config.request_timeout_ms
            route = route_key(request) if self.config.routing == "affinity" else None
            job = Job(self.next_id, envelope, request.raw_id, incoming.raw, request.op, route,
                      received=now, deadline=now + timeout_ms / 1000, queued=now)
            self.next_id += 1
            self._hold(job)
            self.pending.append(job)
            self.waiting += 1
            heapq.heappush(self.deadlines, (job.deadline, job.job_id))

    @staticmethod
    def _timeout_message(job: Job) -> str:
        return f"no worker answered within the deadline ({(job.deadline - job.received) * 1000:.0f} ms)"

    def _hold(self, job: Job) -> None:
        self.jobs[job.job_id] = job
        self.held_bytes += len(job.raw)

    def _release(self, job: Job) -> None:
        if self.jobs.pop(job.job_id, None) is not None:
            self.held_bytes -= len(job.raw)

    def _answer(self, job: Job, payload: bytes, outcome: str, now: float) -> None:
        job.answered = True
        self.frontend.reply(job.envelope, payload)
        self.metrics.request_done(job.op, outcome, now - job.received)

    def _fail(self, job: Job, code: str, message: str, now: float) -> None:
        self._answer(job, error_reply(job.request_id, code, message), code, now)

    # --- dispatch ----------------------------------------------------------------------

    def _dispatch(self, now: float) -> None:
        """Fill free worker slots: first the jobs whose preferred worker has room, then in order.

        Without the first pass a saturated pool hands each freed slot to the queue's head,
        whatever worker it prefers, and affinity is lost exactly when it matters most.
        """
        free = sum(w.ready.capacity - len(w.jobs) for w in self.backend.workers.values() if not w.draining)
        if free <= 0 or not self.pending:
            return
        kept: list[Job] = []
        spill_before = now - self.config.spill_wait_ms / 1000
        for _ in range(min(AFFINITY_LOOKAHEAD, len(self.pending))):
            if free <= 0:
                break
            job = self.pending.popleft()
            if job.answered:
                self._drop_stale(job)
                continue
            wid = self.router.pick(job.route, overflow=False)
            if wid is None:
                kept.append(job)
            else:
                self._send(job, wid, now)
                free -= 1
        self.pending.extendleft(reversed(kept))
        while self.pending and free > 0:
            job = self.pending[0]
            if job.answered:
                self.pending.popleft()
                self._drop_stale(job)
                continue
            if job.queued > spill_before:
                return  # it may still wait for its preferred worker (and the queue is in arrival order)
            wid = self.router.pick(job.route)
            if wid is None:
                return
            self.pending.popleft()
            self._send(job, wid, now)
            free -= 1

    def _send(self, job: Job, wid: bytes, now: float) -> None:
        self.waiting -= 1
        job.worker = wid
        job.attempts += 1
        budget_ms = min(MAX_DEADLINE_MS, max(1, int((job.deadline - now) * 1000)))
        try:
            self.backend.send_job(wid, job.job_id, budget_ms, job.raw)
        except Exception:  # a bug must cost this request, never the loop
            log.exception("could not send job of request id=%r to %r", job.request_id, wid)
            self.router.finished(wid)
            self._release(job)
            self._fail(job, "internal", "the broker could not hand the request to a worker", now)

    def _drop_stale(self, job: Job) -> None:
        """An answered job met at the queue's head: it was released when it was answered."""
        self._release(job)
        self.stale_pending = max(0, self.stale_pending - 1)

    def _requeue(self, job: Job) -> None:
        job.worker = None  # its queue time stays: its worker is gone, so it may go anywhere at once
        self.pending.appendleft(job)
        self.waiting += 1

    # --- backend -----------------------------------------------------------------------

    def _on_backend(self, event: object, now: float) -> None:
        if isinstance(event, Joined):
            w = event.worker
            log.info("worker %s joined (pid %d on %s, capacity %d)", w.name, w.ready.pid, w.ready.host, w.ready.capacity)
            self.router.add_worker(w.wid, w.ready.capacity)
            self.metrics.worker_joined(w.name)
        elif isinstance(event, Result):
            self._on_result(event, now)
        elif isinstance(event, Left):
            self._worker_gone(event.wid, event.why, now, event.state)
        elif isinstance(event, Draining):
            self.router.remove_worker(event.wid)  # nothing new goes to it; its jobs finish there

    def _on_result(self, result: Result, now: float) -> None:
        worker = self.backend.workers.get(result.wid)
        job = self.jobs.get(result.job_id)
        if worker is None or job is None or job.worker != result.wid:
            return  # a late answer for a job already retried elsewhere or answered
        worker.jobs.discard(job.job_id)
        self.router.finished(result.wid)
        self._release(job)
        if not job.answered:
            if result.payload:
                self._answer(job, result.payload, result.outcome, now)
            else:  # the worker saw the budget run out a moment before the broker's own timer
                self._fail(job, "timeout", self._timeout_message(job), now)
        if worker.draining and not worker.jobs:
            self._worker_gone(result.wid, "left", now)

    def _worker_gone(self, wid: bytes, why: str, now: float, state: WorkerState | None = None) -> None:
        state = state or self.backend.forget(wid)
        if state is None:
            return
        self.router.remove_worker(wid)
        self.metrics.worker_left(state.name, state.report)
        lost = [self.jobs[j] for j in state.jobs if j in self.jobs]
        if lost or why not in ("leaving", "left"):
            log.warning("worker %s is gone (%s) holding %d jobs", state.name, why, len(lost))
        for job in sorted(lost, key=lambda j: j.job_id, reverse=True):
            if job.answered:
                self._release(job)
            elif job.attempts >= 2:
                self._release(job)
                self._fail(job, "worker_failed", "two workers died while holding this request", now)
            else:
                self._requeue(job)

    # --- timers ------------------------------------------------------------------------

    def tick(self, now: float) -> None:
        for ex in self.supervisor.reap(now):
            self._worker_gone(ex.name.encode(), ex.describe(), now)
        self.supervisor.tick(now)
        for left in self.backend.tick(now):
            self.supervisor.kill(left.wid.decode(errors="replace"))
            self._worker_gone(left.wid, left.why, now)
        while self.deadlines and self.deadlines[0][0] <= now:
            _, job_id = heapq.heappop(self.deadlines)
            job = self.jobs.get(job_id)
            if job is None or job.answered:
                continue
            self._fail(job, "timeout", self._timeout_message(job), now)
            if job.worker is None:  # still queued: let go of it now, not when the queue next moves
                self.waiting -= 1
                self._release(job)
                job.raw = b""
                self.stale_pending += 1
        if self.stale_pending > max(64, len(self.pending) // 2):
            self.pending = deque(j for j in self.pending if not j.answered)
            self.stale_pending = 0
        self._dispatch(now)
        if now >= self.next_publish:
            self.metrics.publish(self.snapshot())
            self.next_publish = now + PUBLISH_EVERY_S

    def snapshot(self) -> dict:
        """What the exporter shows, copied so the HTTP thread never reads live structures."""
        return {
            "queue_depth": self.waiting,
            "held": len(self.jobs),
            "restarts": self.supervisor.restarts,
            "workers": [
                {
                    "name": w.name,
                    "host": w.ready.host,
                    "pid": w.ready.pid,
                    "state": "draining" if w.draining else ("busy" if w.jobs else "idle"),
                    "in_flight": len(w.jobs),  # what it holds, draining or not (the router forgets a draining one)
                    "capacity": w.ready.capacity,
                    "report": w.report,
                }
                for w in self.backend.workers.values()
            ],
            "router": self.router.stats(),
        }

    # --- stop --------------------------------------------------------------------------

    def _fail_all(self, code: str, message: str) -> None:
        now = time.monotonic()
        for job in list(self.jobs.values()):
            if not job.answered:
                self._fail(job, code, message, now)
        self.jobs.clear()
        self.held_bytes = 0
        self.pending.clear()
        self.waiting = 0


def install_signal_wakeup() -> tuple[socket.socket, Callable[[], None]]:
    """Handlers only wake the loop: set_wakeup_fd writes the signal number to a socketpair."""
    r, w = socket.socketpair()
    r.setblocking(False)
    w.setblocking(False)
    old = signal.set_wakeup_fd(w.fileno(), warn_on_full_buffer=False)
    for sig in WAKE_SIGNALS:
        signal.signal(sig, lambda *_: None)

    def restore() -> None:
        signal.set_wakeup_fd(old)
        for sig in WAKE_SIGNALS:
            signal.signal(sig, signal.SIG_DFL)
        r.close()
        w.close()

    return r, restore
