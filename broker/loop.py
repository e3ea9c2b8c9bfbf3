"""The broker loop: poll, then backend, frontend, tick. Readable in one screen per verb.

Jobs flow client -> frontend -> dispatcher (the queue, which worker takes each job) -> backend
-> worker, and the worker's reply bytes go back untouched; which workers may serve a job's model
is placement's answer (broker/placement.py), and the broker's own refusals are ProtocolErrors
answered through `Frontend.fail`. Timers (heartbeats, deadlines, respawns, spills) run only
in `tick`, with one `now` read per turn; the poll sleeps until a socket is readable or the next
timer that can change something, so a loaded broker with no free worker does not spin. The loop
never tokenizes and never decodes a reply.
"""

from __future__ import annotations

from dataclasses import replace
import gc
import itertools
import logging
import signal
import socket
import time
from typing import Any, Callable

import zmq

from tokenbroker import __version__
from tokenbroker.common.errors import ProtocolError
from tokenbroker.common.protocol import (ADMIN_OPS, CATALOG_OPS, MAX_BATCH_JOBS, MODEL_OPS, NIL, W_BYE, Envelope,
                                         ok_reply, req, unpack)

from .backend import BATCH_BYTES, LIVENESS_S, Backend, Draining, Joined, Left, ModelLoaded, Results, WorkerState
from .catalog import FAILED, LOADING, WORKER, Catalog, Entry, add_model_spec, served_backends
from .config import BrokerConfig
from ._dispatch import Dispatcher
from ._frontend import Drain
from ._intake import Intake
from ._jobs import Job, JobTable
from ._plane import WAKE, Plane
from ._router import Router
from .frontend import REPLY_FRAME_BYTES, Frontend, Peek, Peer
from .metrics import LATENCY_BUCKETS, PoolMetrics
from .placement import Load, Placement
from .snapshot import ModelView, PoolSnapshot, WorkerView
from .supervisor import Supervisor

log = logging.getLogger(__name__)

FRONTEND_BATCH = 4096  # messages read per turn (a full drain, bounded so the backend is never starved)
FRONTEND_BATCH_BYTES = 64 * 1024 * 1024  # and payload bytes read per turn
BACKEND_BATCH = 8192  # worker messages read per turn
PUBLISH_EVERY_S = 0.1  # the exporter's view of the pool is at most this old
SHUTDOWN_GRACE_S = 10.0
MEMO_MAX = 1024  # model names the intake remembers resolved (broker/_intake.pyx `Intake.models`)
MEMO_NAME_CHARS = 256  # and the longest it remembers (a longer name takes the loop's path each time)
REAP_EVERY_S = 0.02  # children are looked at this often, and at once on SIGCHLD (fork mode: the template reports)
PLAN_EVERY_S = 0.05  # placement looks again this often while requests queue (else once a second)
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
WAKE_SIGNALS = (*STOP_SIGNALS, signal.SIGCHLD, signal.SIGHUP)  # SIGHUP: re-read the CURVE key folders


class BootFailed(Exception):
    """A local worker could not load its tokenizers: the broker must not start."""


def _everyone(user_id: str | None, address: str | None) -> bool:
    return True


class Broker:
    def __init__(
        self,
        config: BrokerConfig,
        frontend: Frontend,
        backend: Backend,
        supervisor: Supervisor,
        metrics: PoolMetrics,
        wakeup: socket.socket,
        *,
        on_hangup: Callable[[], None] = lambda: None,
        is_admin: Callable[[str | None, str | None], bool] = _everyone,
    ) -> None:
        """`on_hangup`: what SIGHUP does (broker/security.py's reload); `is_admin`: who may use the
        admin ops, from a message's CURVE key and address (broker/security.py's admin_gate)."""
        self.on_hangup = on_hangup
        self.is_admin = is_admin
        self.config = config
        self.frontend = frontend
        self.backend = backend
        self.supervisor = supervisor
        self.metrics = metrics
        self.wakeup = wakeup
        self.router = Router(balance_factor=config.balance_factor, balance_margin=config.balance_margin)
        self.catalog = Catalog(config.models)
        self.placement = Placement(config.models.max_models)
        caches = config.models.cache
        self.dispatcher = Dispatcher(self.router, spill_wait=config.spill_wait_ms / 1000,
                                     worker_bytes=config.worker_max_bytes, eligible=self.placement.eligible,
                                     holders=self.placement.holders_of,
                                     long_off_loop=not (caches.l0_enabled or caches.l1_enabled))
        self.removing: set[str] = set()  # models removed whose queued jobs are still being served
        self.next_plan = 0.0
        self.jobs = JobTable()  # every job held, queued or at a worker, until answered
        # The per-request and per-result work, compiled; what is not the common case comes back
        # here (`_on_request`, `_late`). It counts into the metrics' own plain dicts (read per scrape).
        self.intake = Intake(self.jobs, self.dispatcher, frontend.outbox, metrics._requests, metrics._latency,
                             LATENCY_BUCKETS, metrics._model_requests, self._on_request, self._late,
                             affinity=config.routing == "affinity", timeout_s=config.request_timeout_ms / 1000,
                             max_pending=config.max_pending, max_pending_bytes=config.max_pending_bytes,
                             max_client_pending=config.max_client_pending)
        self.drain = Drain(frontend, self.intake)  # the frontend's messages, into the intake
        self.replan = True  # placement has something new to look at
        self.stopping_since: float | None = None
        self.next_publish = 0.0
        lim = config.models.limits
        self.limits = {  # told in ping replies, so clients can size their requests
            "max_request_bytes": config.max_request_bytes, "max_pending": config.max_pending,
            "max_client_pending": config.max_client_pending, "request_timeout_ms": config.request_timeout_ms,
            "max_batch_items": lim.max_batch_items, "max_reply_bytes": lim.max_reply_bytes,
        }
        self.poller = zmq.Poller()
        self.poller.register(backend.sock, zmq.POLLIN)
        self.poller.register(wakeup.fileno(), zmq.POLLIN)
        self.next_reap = 0.0

    @property
    def replan(self) -> bool:
        """Placement has something new to look at. Setting it also drops the intake's memo of
        resolved models: whatever made placement look again may change what a name resolves to
        or who holds it."""
        return self._replan

    @replan.setter
    def replan(self, value: bool) -> None:
        self._replan = value
        if value:
            self.intake.models.clear()

    # --- start -------------------------------------------------------------------------

    def wait_for_workers(self, count: int, timeout: float | None = None) -> None:
        """Serve nothing until `count` workers said READY; a boot error aborts the start.

        The frontend is not polled yet: a client that connects early waits, and costs nothing.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.backend.ready_count() < count:
            events = dict(self.poller.poll(200))
            now = time.monotonic()
            if self.wakeup.fileno() in events and self._stop_requested():
                raise KeyboardInterrupt
            if self.backend.sock in events:
                self._on_backend(now)
            for ex in self.supervisor.reap(now):
                if ex.boot_error:
                    raise BootFailed(f"{ex.describe()}: it could not load its tokenizers (its message is above)")
            self.supervisor.tick(now)
            if deadline is not None and now > deadline:
                raise BootFailed(f"only {self.backend.ready_count()} of {count} workers became ready in {timeout:.0f}s")

    # --- the loop ----------------------------------------------------------------------

    def run(self) -> None:
        """Serve until a stop signal; should the loop itself ever fail, answer every held request first."""
        try:
            self._serve()
        except Exception:
            log.exception("the broker loop failed: answering every held request 'internal' before stopping")
            self._fail_all(ProtocolError("internal", "the broker failed while holding this request (it is logged); retry"))
            self.frontend.flush(())
            raise
        self._fail_all(ProtocolError("overloaded", "the broker is shutting down; retry on another broker"))
        self.frontend.flush(())

    def _serve(self) -> None:
        """The data plane's turns run compiled (broker/_plane.pyx `Plane.run`); it comes back here
        for control only: a signal (WAKE), or a timer of the control plane due (TIMER: a reap, a
        heartbeat, placement, a metrics publication). Then `tick` runs them, and the turns go on."""
        plane = Plane(self, front_messages=FRONTEND_BATCH, front_bytes=FRONTEND_BATCH_BYTES, back_messages=BACKEND_BATCH,
                      liveness_s=LIVENESS_S, batch_jobs=MAX_BATCH_JOBS, batch_bytes=BATCH_BYTES,
                      reply_frame_bytes=REPLY_FRAME_BYTES, used=self._used if self.placement.cap else None)
        gc.freeze()  # what start-up built is never garbage: the collector stops walking it
        gc.set_threshold(10_000, 20, 20)  # a turn allocates thousands of short-lived objects, none cyclic
        while True:
            stopping = self.stopping_since is not None
            why = plane.run(self._python_at(), self.next_plan, stopping or bool(self.removing))
            now = time.monotonic()
            if why == WAKE:
                self.next_reap = 0.0  # SIGCHLD among them, maybe
                if self._stop_requested() and self.stopping_since is None:
                    log.info("stopping: answering the %d requests held", len(self.jobs))
                    self.stopping_since = now
                    self.intake.stopping = True  # every new request is refused from now on
            self.tick(now)
            self.frontend.flush(self.jobs.per_client)
            if self.stopping_since is not None and (not self.jobs or now - self.stopping_since > SHUTDOWN_GRACE_S):
                return

    def _python_at(self) -> float:
        """When the control plane's next timer is due: a reap, a heartbeat, a metrics publication."""
        return min(self.next_reap, self.backend.next_beat, self.next_publish)

    def _stop_requested(self) -> bool:
        try:
            data = self.wakeup.recv(512)
        except BlockingIOError:
            return False
        if signal.SIGHUP in data:
            self.on_hangup()
        return any(b in data for b in STOP_SIGNALS)

    # --- frontend ----------------------------------------------------------------------

    def _on_request(self, envelope: Envelope, peer: Peer | None, peek: Peek | None, now: float) -> None:
        """A request the intake leaves to Python: None (answered by the frontend already), a
        refused element of an array (its `code` set), ping, a catalog op, a refusal, a model it
        has not seen resolved (then it will have), a failed one."""
        if peek is None or peek.code is not None:
            if peek is not None:
                self.frontend.refuse(envelope, peek)
            self.metrics.request_done("invalid", "bad_request", 0.0)
            return
        if peek.op == "ping":
            self.frontend.reply(envelope, ok_reply(peek.raw_id, {
                "workers": self.backend.ready_count(), "version": __version__, "worker": "broker",
                "limits": self.limits}))
            self.metrics.request_done("ping", "ok", 0.0)
            return
        if peek.op in CATALOG_OPS:
            self._on_catalog_op(envelope, peer, peek)
            return
        why = self.intake.refusal(envelope.identity, len(peek.body))
        if why is not None:
            self.frontend.fail(envelope, peek.raw_id, ProtocolError("overloaded", f"{why}; retry later"))
            self.metrics.request_done(peek.op, "overloaded", 0.0)
            return
        names_entry = peek.op in MODEL_OPS or (peek.op == "count" and peek.model is not None)
        entry = self.catalog.resolve(peek.model) if names_entry else None
        if entry is not None and entry.state == FAILED:
            self.frontend.fail(envelope, peek.raw_id, self._failed(entry.name))
            self.metrics.request_done(peek.op, "unknown_model", 0.0)
            return
        self.intake.hold(envelope, peek, now, entry.name if entry is not None else (
            peek.model if peek.op in MODEL_OPS else None), entry is not None)
        if entry is not None and not self.placement.holders(entry.name):
            self.replan = True
        elif names_entry:  # the next request naming it needs no Python, until the catalog or placement changes
            self._memo(peek.model, entry.name if entry is not None else None)

    def _memo(self, model: str | None, name: str | None) -> None:
        """Names are the clients' to choose: the memo stays small, in count and in bytes."""
        if model is not None and len(model) > MEMO_NAME_CHARS:
            return
        memo = self.intake.models
        if len(memo) >= MEMO_MAX:
            memo.clear()
        memo[model] = name

    def _failed(self, model: str) -> ProtocolError:
        return ProtocolError("unknown_model", f"field 'model': model {model!r} failed to load: "
                             f"{self.catalog.entries[model].error}")

    @staticmethod
    def _timeout(job: Job) -> ProtocolError:
        return ProtocolError("timeout", f"no worker answered within the deadline "
                             f"({(job.deadline - job.received) * 1000:.0f} ms)")

    def _release(self, job: Job) -> None:
        self.jobs.release(job)

    def _fail(self, job: Job, error: ProtocolError, now: float) -> None:
        """Answer a held job with `error` (through Frontend.fail), counted by its code."""
        job.answered = True
        self.frontend.fail(job.envelope, job.raw_id, error)
        self.metrics.request_done(job.op, error.code, now - job.received)

    # --- dispatch ----------------------------------------------------------------------

    def _used(self, wid: bytes, batch: list[Job], now: float) -> None:
        """A batch went to `wid`: its catalog models were used now (placement caps models: the least
        recently used is the one a full worker lets go)."""
        for job in batch:
            if job.catalog:
                self.placement.used(wid, job.model, now)  # type: ignore[arg-type]

    def _unsent(self, wid: bytes, batch: list[Job], now: float, error: Exception) -> None:
        """The core could not send a batch (a bug): these requests are answered `internal`."""
        log.error("could not send %d jobs to a worker", len(batch), exc_info=error)
        for job in batch:
            self.dispatcher.finish(wid, job.job_id)
            self._release(job)
            self._fail(job, ProtocolError("internal", "the broker could not hand the request to a worker"), now)

    def _backend_fault(self, error: Exception) -> None:
        log.error("dropped a backend message that could not be handled", exc_info=error)

    # --- backend -----------------------------------------------------------------------

    def _on_backend(self, now: float, got: bytes | list[bytes] | None = None) -> None:
        """What the compiled turns' drain of the backend (broker/_batches.pyx `drain`, which
        finishes the workers' results in the core) left for Python: `got`, then whatever else waits,
        as events, in order."""
        first = self.backend.events_of(got, now) if got is not None else []
        for event in itertools.chain(first, self.backend.receive(self.intake, now)):
            try:
                if isinstance(event, Results):
                    self._gone_if_idle(event.wid, now)
                elif isinstance(event, ModelLoaded):
                    self._on_loaded(event, now)
                elif isinstance(event, Joined):
                    self._on_joined(event.worker, now)
                elif isinstance(event, Left):
                    self._worker_gone(event.wid, event.why, now, event.state)
                elif isinstance(event, Draining):
                    self.dispatcher.drain_worker(event.wid)  # nothing new goes to it; its jobs finish there
                    self.placement.drain_worker(event.wid)
                    self.replan = True
                    self._gone_if_idle(event.wid, now)
            except Exception:  # a bug must cost this event, never the loop
                log.exception("could not handle a backend event %s", type(event).__name__)

    def _late(self, job: Job, now: float) -> None:
        self._fail(job, self._timeout(job), now)

    def _gone_if_idle(self, wid: bytes, now: float) -> None:
        state = self.backend.workers.get(wid)
        if state is not None and state.draining and not self.dispatcher.held(wid):
            self._worker_gone(wid, "left", now)

    def _worker_gone(self, wid: bytes, why: str, now: float, state: WorkerState | None = None) -> None:
        state = state or self.backend.forget(wid)
        if state is None:
            return
        lost = self.dispatcher.remove_worker(wid)
        self.placement.remove_worker(wid)  # its loads under way are planned again elsewhere
        self.replan = True
        for entry in list(self.catalog.entries.values()):
            if entry.origin == WORKER and not self.placement.holders(entry.name):
                self.catalog.drop(entry.name)  # a worker's own model, gone with the last worker that had it
        self.metrics.worker_left(state.name, state.report)
        if lost or why not in ("leaving", "left"):
            log.warning("worker %s is gone (%s) holding %d jobs", state.name, why, len(lost))
        for job in sorted(lost, key=lambda j: j.job_id, reverse=True):
            if job.answered:  # its deadline passed while that worker held it: nothing more to do
                self._release(job)
            elif job.attempts >= 2:
                self._release(job)
                self._fail(job, ProtocolError("worker_failed", "two workers died while holding this request"), now)
            else:
                self.dispatcher.requeue(job)

    # --- timers ------------------------------------------------------------------------

    def tick(self, now: float) -> None:
        if now >= self.next_reap:  # a waitpid per child and a read of the template's pipe: not every turn
            self.next_reap = now + REAP_EVERY_S
            for ex in self.supervisor.reap(now):
                gone = next((w.wid for w in self.backend.workers.values() if w.name == ex.name), None)
                if gone is not None:
                    self._worker_gone(gone, ex.describe(), now)
            self.supervisor.tick(now)
        for left in self.backend.tick(now):
            state = self.backend.workers.get(left.wid)
            if state is not None:
                self.supervisor.kill(state.name)
            self._worker_gone(left.wid, left.why, now)
        self._expire(now)
        self._place(now)  # (what it frees or queues is dispatched as the turns resume: Plane.run)
        if now >= self.next_publish:
            self.metrics.publish(self.snapshot())
            self.next_publish = now + PUBLISH_EVERY_S

    def _expire(self, now: float) -> None:
        """Answer `timeout` for every job past its deadline; queued ones let go of their payload now."""
        for job in self.jobs.due(now):
            if job.worker is None:
                self._fail_waiting(job, self._timeout(job), now)
            else:
                self._fail(job, self._timeout(job), now)

    def snapshot(self) -> PoolSnapshot:
        """What the exporter shows, copied so the HTTP thread never reads live structures."""
        return PoolSnapshot(
            queue_depth=self.dispatcher.waiting,
            held=len(self.jobs),
            restarts=self.supervisor.restarts,
            recycled=self.supervisor.recycled,
            workers=tuple(
                WorkerView(
                    name=w.name,
                    host=w.ready.host,
                    pid=w.ready.pid,
                    state="draining" if w.draining else ("busy" if self.dispatcher.held(w.wid) else "idle"),
                    in_flight=self.dispatcher.held(w.wid),
                    capacity=w.ready.capacity,
                    report=w.report,
                )
                for w in self.backend.workers.values()
            ),
            router=self.router.stats(),
            models=self._model_snapshot(),
            stopping=self.stopping_since is not None,
        )

    # --- the model catalog (docs/protocol.md "The model catalog") ----------------------

    def _on_catalog_op(self, envelope: Envelope, peer: Peer | None, peek: Peek) -> None:
        """`models`, `add_model`, `remove_model`: answered here, from the catalog."""
        try:
            if peek.op in ADMIN_OPS and not self.is_admin(peer.user_id if peer else None, peer.address if peer else None):
                raise ProtocolError("forbidden", f"op {peek.op!r} is an admin op: use it from a loopback connection, "
                                    "or under CURVE with a key in the broker's --curve-admins")
            if peek.op == "models":
                reports = [w.report for w in self.backend.workers.values()]
                fields = {"models": self.catalog.describe(self.placement.replicas(), served_backends(reports))}
            elif peek.op == "add_model":
                fields = self._add_model(add_model_spec(unpack(memoryview(peek.body))))
            else:
                fields = self._remove_model(req(unpack(memoryview(peek.body)), "name", str))
        except ProtocolError as e:
            self.frontend.fail(envelope, peek.raw_id, e)
            self.metrics.request_done(peek.op, e.code, 0.0)
            return
        self.frontend.reply(envelope, ok_reply(peek.raw_id, {**fields, "worker": "broker"}))
        self.metrics.request_done(peek.op, "ok", 0.0)

    def _add_model(self, spec) -> dict:
        had = spec.name in self.catalog.entries and not self.catalog.entries[spec.name].removing
        entry = self.catalog.add(spec)
        if not had or entry.state == LOADING:
            self.placement.reset(entry.name)  # a retried model may be asked of every worker again
        log.info("add_model %s from %s: %s", entry.name, spec.source, entry.state)
        self.replan = True
        return {"state": entry.state}

    def _remove_model(self, name: str) -> dict:
        entry = self.catalog.entries.get(name)
        if entry is None or entry.removing:
            raise ProtocolError("unknown_model", f"field 'name': the catalog holds no model {name!r}")
        entry.removing = True
        self.intake.models.clear()  # the name resolves to nothing from now on
        self.removing.add(name)
        self.replan = True  # the removal is placement's to carry out (`_place`), at once
        log.info("remove_model %s: its queued requests are served where a worker holds it, then it goes", name)
        return {"removed": True}

    def _on_joined(self, w: WorkerState, now: float) -> None:
        log.info("worker %s joined (pid %d on %s, capacity %d, models %s)", w.name, w.ready.pid, w.ready.host,
                 w.ready.capacity, ", ".join(w.ready.models))
        ours, own = [], []
        for model in w.ready.models:
            info, fingerprint = w.ready.infos.get(model, {}), w.ready.fingerprints.get(model, "")
            entry = self.catalog.entries.get(model)
            if entry is not None and entry.origin != WORKER:
                self.catalog.loaded(model, info, fingerprint)
                ours.append(model)
            else:
                self.catalog.adopt(model, info, fingerprint)
                own.append(model)
        self.placement.add_worker(w.wid, ours, now, own=own, names=w.ready.names, globs=w.ready.maps,
                                  engine_limit=w.ready.engine_limit)
        self.dispatcher.add_worker(w.wid, w.ready.capacity)
        self.metrics.worker_joined(w.name)
        self.replan = True

    def _on_loaded(self, event: ModelLoaded, now: float) -> None:
        loaded, wid = event.loaded, event.wid
        name = loaded.name
        state = self.backend.workers.get(wid)
        worker = state.name if state is not None else "?"
        self.replan = True
        if event.mismatch is not None:
            log.error("refused model %s on worker %s: %s", name, worker, event.mismatch)
            self.placement.failed(wid, name, now, refuse=True)
            self.backend.send_unload(wid, name)
            self.metrics.model_load_failed(name)
            return
        entry = self.catalog.entries.get(name)
        if loaded.ok:
            if entry is None or entry.removing or not self.placement.loaded(wid, name, now):
                self.placement.failed(wid, name, now)  # not asked for, or removed meanwhile: let it go
                self.backend.send_unload(wid, name)
                return
            self.catalog.loaded(name, loaded.info, loaded.fingerprint)
            self.metrics.model_loaded(name, loaded.seconds)
            log.info("worker %s loaded model %s in %.2fs", worker, name, loaded.seconds)
            return
        self.placement.failed(wid, name, now, retry=loaded.retry, refuse=not loaded.retry)
        if loaded.retry or entry is None:
            return
        log.error("worker %s could not load model %s: %s", worker, name, loaded.error)
        self.metrics.model_load_failed(name)
        self.catalog.failed(name, loaded.error)
        if entry.state == FAILED:
            self._fail_queued(name, self._failed(name), now)

    def _fail_queued(self, model: str, error: ProtocolError, now: float) -> None:
        for job in self.dispatcher.queued(model):
            self._fail_waiting(job, error, now)

    def _fail_waiting(self, job: Job, error: ProtocolError, now: float) -> None:
        """Answer a job still in the queue: it leaves the queue's count and its payload goes now."""
        self._fail(job, error, now)
        self.dispatcher.dequeued(job)
        self._release(job)
        job.raw = b""

    def _place(self, now: float) -> None:
        """Send the loads and unloads placement asks for; finish the removals whose jobs are done."""
        for name in list(self.removing) if self.removing else ():
            if not self.placement.holders(name):
                self._fail_queued(name, ProtocolError(
                    "unknown_model", f"field 'model': model {name!r} was removed from the catalog"), now)
            if self.dispatcher.demand.get(name):
                continue  # queued jobs still go to the workers holding it
            unloads = self.placement.unload_everywhere(name, self.dispatcher.holds_model)
            if unloads is None:
                continue  # a worker still holds a job of it
            for unload in unloads:
                self.backend.send_unload(unload.wid, unload.model)
            self.catalog.drop(name)
            self.backend.forget_model(name)
            self.removing.discard(name)
            self.replan = True
        if not self.replan and now < self.next_plan:
            return
        self.replan = False
        self.next_plan = now + (PLAN_EVERY_S if self.dispatcher.demand else 1.0)
        entries = [e for e in self.catalog.entries.values() if e.placeable]
        for action in self.placement.plan(now, models=[e.name for e in entries],
                                          new={e.name for e in entries if e.state == LOADING},
                                          demand=self.dispatcher.demand, full=self.dispatcher.full,
                                          busy=self.dispatcher.holds_model,
                                          fingerprints={e.name: e.fingerprint for e in entries if e.fingerprint},
                                          tokenizers={e.name: e.info["tokenizer"] for e in entries if e.info.get("tokenizer")},
                                          jobs=self.dispatcher.held):
            if isinstance(action, Load):
                spec = self.catalog.entries[action.model].spec
                self.backend.send_load(action.wid, replace(spec, share=action.share) if action.share else spec)
            else:
                self.backend.send_unload(action.wid, action.model)
        self.intake.models.clear()  # a plan may change who holds a model: names are resolved afresh

    def _model_snapshot(self) -> dict[str, ModelView]:
        replicas = self.placement.replicas()
        loading = {m for h in self.placement.workers.values() for m in h.loading}
        return {e.name: ModelView(state=e.state, replicas=replicas.get(e.name, 0), loading=e.name in loading,
                                  queued=self.dispatcher.demand.get(e.name, 0))
                for e in self.catalog.entries.values() if not e.removing}

    # --- stop --------------------------------------------------------------------------

    def see_workers_off(self, timeout: float) -> None:
        """After the loop, once the local workers were told to stop: answer each one's BYE with a
        heartbeat, which tells it nothing more is on its way, so it leaves at once (it would
        otherwise wait two heartbeat intervals for a broker that no longer polls)."""
        deadline = time.monotonic() + timeout
        sock = self.backend.sock
        while self.supervisor.children and time.monotonic() < deadline:
            if sock.poll(50):
                for _ in range(1024):
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    if len(frames) >= 2 and frames[1] == W_BYE:
                        self.backend.send_heartbeat(frames[0])
            self.supervisor.reap(time.monotonic())

    def _fail_all(self, error: ProtocolError) -> None:
        now = time.monotonic()
        for job in self.jobs.unanswered():
            self._fail(job, error, now)
        self.jobs.clear()
        self.dispatcher.clear()


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
