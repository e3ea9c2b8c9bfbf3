"""Which queued job goes to which worker, and when: the broker's dispatch policy. No socket, no clock.

The `Dispatcher` owns where each job is: the pending queue, and for each worker the jobs it holds
(its `Slots`). (Which worker holds which *model* is broker/placement.py's.) The router
(tokenbroker.broker.router) is its policy for one pick, and reads each worker's load from the
slots themselves (`Slots.held`, `Slots.blocked`): the one place that counts it.

A turn of `assign(now)`:

1. Affinity pass: the first `lookahead` queued jobs are offered to their preferred worker only
   (`Router.pick(overflow=False)`); a job whose preferred worker is full but within the load
   bound stays queued. Without it a saturated pool hands each freed slot to the queue's head,
   whatever worker it prefers, and affinity is lost exactly when it matters most.
2. In order: the queue's head goes to any worker with room once it has waited `spill_wait`
   (or at once if it has no key), so a job never waits long while another worker idles.

What one turn assigns to a worker goes in one backend message (the backend splits it by count and
bytes), so a busy pool pays the hop once per batch, not per job. A worker is full at `capacity`
jobs, or at `worker_bytes` payload bytes once it holds one job: a huge request blocks the queue of
its own worker only, and small ones go elsewhere meanwhile. A `tokenize` longer than `worker_bytes`
is the exception when caches are off (`long_off_loop`): a worker encodes it off its round loop
(workers/background.py; with caches on it encodes inline, its prefixes cached); so is a `count`
that long, in every cache mode (workers/count_lane.py). Such a job does not count against the
worker's bytes; instead a worker holds one such job at a time, and the small
jobs keep flowing to it.

A job that names a model goes only to the workers that serve it, as broker/placement.py's
`Placement.eligible` says (the one owner of that answer): a catalog model's holders (none yet: it
waits for a load, within its deadline), another name's by what workers said in READY. A job that finds them all full waits without holding up
the jobs behind it; `demand` counts the queued jobs of each catalog model, for placement.

`next_timer(now)` says when waiting could change something: only when a worker has room and the
head waits for its spill time. With no room anywhere the broker sleeps until a worker answers.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from tokenbroker.common.protocol import Envelope

from .affinity import RouteKey
from .router import Router

AFFINITY_LOOKAHEAD = 64  # queued jobs offered to their preferred worker before strict order
PASSED_OVER_MAX = 1024  # queued jobs a turn may step past because their model's workers are full


def _unplaced(model: str | None, *, catalog: bool) -> frozenset[bytes] | None:
    """With no placement (a dispatcher on its own): a catalog model has no holders, any other goes anywhere."""
    return frozenset() if catalog else None


@dataclass(slots=True, eq=False)
class Job:
    """One client request held by the broker, from receipt to reply."""

    job_id: int
    envelope: Envelope
    raw_id: bytes  # the id's MessagePack bytes, echoed as they came
    raw: "bytes | memoryview"  # the request's bytes (a view of its frame when it came in an array)
    op: str
    route: RouteKey | None
    received: float
    deadline: float
    queued: float  # when it last entered the queue
    attempts: int = 0
    worker: bytes | None = None  # the worker holding it, while one does
    answered: bool = False
    model: str | None = None  # the served model it names (None: any worker's default will do)
    catalog: bool = False  # `model` is a catalog entry's name: only its holders may take it, or it waits
    long: bool = False  # a tokenize the worker encodes off its loop (set by the dispatcher when queued)


@dataclass(slots=True)
class Slots:
    """What one worker holds: its load, as the router reads it (router.WorkerLoad)."""

    capacity: int
    jobs: dict[int, Job] = field(default_factory=dict)
    bytes: int = 0
    long_jobs: int = 0  # long tokenize jobs held: encoded off the worker's loop, one at a time
    draining: bool = False  # said BYE: finishes what it holds, gets nothing new
    blocked: bool = False  # no room by payload bytes (or count): set when that changes

    @property
    def held(self) -> int:
        return len(self.jobs)


class Dispatcher:
    def __init__(self, router: Router, *, spill_wait: float, worker_bytes: int,
                 lookahead: int = AFFINITY_LOOKAHEAD,
                 eligible: Callable[..., frozenset[bytes] | None] = _unplaced,
                 long_off_loop: bool = False) -> None:
        self.router = router
        # Workers encode a long tokenize off their loop (only with caches off, which workers share).
        self.long_off_loop = long_off_loop
        self.eligible = eligible  # (model, catalog=) -> the workers that serve it, None: any (Placement.eligible)
        self.spill_wait = spill_wait
        self.worker_bytes = worker_bytes
        self.lookahead = lookahead
        self.workers: dict[bytes, Slots] = {}
        self.pending: deque[Job] = deque()
        self.waiting = 0  # queued jobs still unanswered
        self.demand: dict[str, int] = {}  # queued jobs still unanswered, per catalog model
        self._stale = 0  # answered jobs still in `pending`, dropped in batches
        self._free = 0  # slots free over the workers that take jobs

    # --- workers -------------------------------------------------------------------------

    def add_worker(self, wid: bytes, capacity: int) -> None:
        """A worker joined with `capacity` slots (which models it serves is placement's to say)."""
        slots = self.workers[wid] = Slots(capacity)
        self.router.add_worker(wid, slots)
        self._free += capacity

    def drain_worker(self, wid: bytes) -> None:
        """Nothing new goes to it; what it holds finishes there."""
        slots = self.workers.get(wid)
        if slots is not None and not slots.draining:
            slots.draining = True
            self._free -= self._room(slots)
            self.router.remove_worker(wid)

    def remove_worker(self, wid: bytes) -> list[Job]:
        """The worker is gone: returns the jobs it held (oldest first), held nowhere now."""
        slots = self.workers.pop(wid, None)
        if slots is None:
            return []
        if not slots.draining:
            self._free -= self._room(slots)
            self.router.remove_worker(wid)
        for job in slots.jobs.values():
            job.worker = None
        return list(slots.jobs.values())

    def held(self, wid: bytes) -> int:
        """How many jobs the worker holds now."""
        slots = self.workers.get(wid)
        return len(slots.jobs) if slots is not None else 0

    def full(self, wid: bytes) -> bool:
        """The worker takes no more jobs now (every slot used, or its byte limit reached, or draining)."""
        slots = self.workers.get(wid)
        return slots is None or slots.draining or self._room(slots) <= 0

    def holds_model(self, wid: bytes, model: str) -> bool:
        """Whether the worker holds a job of `model` (it must keep the model until answered)."""
        slots = self.workers.get(wid)
        return slots is not None and any(job.model == model for job in slots.jobs.values())

    # --- jobs ----------------------------------------------------------------------------

    def enqueue(self, job: Job) -> None:
        job.long = self._long(job)
        self.pending.append(job)
        self.waiting += 1
        if job.catalog:
            self._demand(job.model, 1)

    def requeue(self, job: Job) -> None:
        """A job whose worker died goes first; its queue time stays, so it may go anywhere at once."""
        self.pending.appendleft(job)
        self.waiting += 1
        if job.catalog:
            self._demand(job.model, 1)

    def queued(self, model: str) -> list[Job]:
        """The unanswered queued jobs of a catalog model (to answer them when it fails or goes)."""
        return [job for job in self.pending if job.catalog and job.model == model and not job.answered]

    def finish(self, wid: bytes, job_id: int, *, served: bool = False) -> Job | None:
        """`wid` answered `job_id`: the job, if that worker held it (else a stale or forged answer).

        `served`: the worker tokenized its input (an ok reply), so the router's index learns where
        its prefixes are; a rejected request teaches it nothing.
        """
        slots = self.workers.get(wid)
        if slots is None:
            return None
        job = slots.jobs.get(job_id)
        if job is None:
            return None
        before = self._room(slots)
        del slots.jobs[job_id]
        if job.long:
            slots.long_jobs -= 1
        else:
            slots.bytes -= len(job.raw)
        job.worker = None
        if served and job.route is not None:
            self.router.record(job.route, wid)
        if not slots.draining:
            self._set_room(slots, before)
        return job

    def clear(self) -> None:
        """Forget the queue (the broker has answered every job in it)."""
        self.pending.clear()
        self.waiting = 0
        self.demand.clear()
        self._stale = 0

    def dequeued(self, job: Job) -> None:
        """A queued job was answered where it waits (its deadline passed, or its model failed or
        was removed): it leaves the queue's count now. The caller has set `job.answered`."""
        self.waiting -= 1
        if job.catalog:
            self._demand(job.model, -1)
        self._stale += 1
        if self._stale > max(64, len(self.pending) // 2):
            self.pending = deque(j for j in self.pending if not j.answered)
            self._stale = 0

    # --- the policy ----------------------------------------------------------------------

    def assign(self, now: float) -> list[tuple[bytes, list[Job]]]:
        """Hand out what can go to a worker now; returns each worker's new jobs, in the order to send."""
        if self._free <= 0 or not self.waiting:
            return []
        out: dict[bytes, list[Job]] = {}
        kept: list[Job] = []
        pending = self.pending
        # Keys whose preferred worker is full (within the bound) this turn: picks only add load and
        # the bound only grows with it, so the same key would wait again; it is not asked twice.
        waits: set[RouteKey] = set()
        for _ in range(min(self.lookahead, len(pending))):
            if self._free <= 0:
                break
            job = pending.popleft()
            if job.answered:
                self._stale -= 1
                continue
            allowed = self._allowed(job)
            if allowed is None and job.route in waits:
                kept.append(job)
                continue
            wid = None if allowed is not None and not allowed else self.router.pick(
                job.route, overflow=False, allowed=allowed)
            if wid is None:
                kept.append(job)
                if allowed is None and job.route is not None:
                    waits.add(job.route)
            else:
                self._hand(job, wid, out)
        pending.extendleft(reversed(kept))
        spill_before = now - self.spill_wait
        passed: list[Job] = []  # jobs whose model's workers are all full: the rest may go past them
        while pending and self._free > 0 and len(passed) < PASSED_OVER_MAX:
            job = pending[0]
            if job.answered:
                pending.popleft()
                self._stale -= 1
                continue
            if job.route is not None and job.queued > spill_before:
                break  # it may still wait for its preferred worker (and the queue is in arrival order)
            allowed = self._allowed(job)
            wid = None if allowed is not None and not allowed else self.router.pick(job.route, allowed=allowed)
            if wid is None:
                if allowed is None:
                    break
                passed.append(pending.popleft())
                continue
            pending.popleft()
            self._hand(job, wid, out)
        pending.extendleft(reversed(passed))
        return list(out.items())

    def next_timer(self, now: float) -> float | None:
        """When a queued job may next spill to a free slot; None when only an answer can help.

        Called after `assign(now)`: a job past its spill time that is still queued waits for its
        model's workers (or every worker) to answer, not for a timer.
        """
        if self._free <= 0 or not self.waiting:
            return None
        for i, job in enumerate(self.pending):
            if i >= PASSED_OVER_MAX + self.lookahead:
                break
            if not job.answered and job.queued + self.spill_wait > now:
                return job.queued + self.spill_wait
        return None

    # --- internals -----------------------------------------------------------------------

    def _allowed(self, job: Job) -> frozenset[bytes] | None:
        """The workers that may take the job: those that serve its model (placement's answer: None,
        any); a long tokenize, only those not encoding one already."""
        allowed = self.eligible(job.model, catalog=job.catalog)
        if not job.long:
            return allowed
        free = frozenset(wid for wid, slots in self.workers.items() if not slots.long_jobs)
        return free if allowed is None else allowed & free

    def _long(self, job: Job) -> bool:
        """A tokenize the worker encodes off its loop (workers/ops.py OFFLOAD_BYTES is below this), or
        a count, which a worker counts off its loop in every cache mode (workers/count_lane.py)."""
        if len(job.raw) <= self.worker_bytes:
            return False
        return job.op == "count" or (self.long_off_loop and job.op == "tokenize")

    def _demand(self, model: str | None, change: int) -> None:
        left = self.demand.get(model, 0) + change  # type: ignore[arg-type]
        if left > 0:
            self.demand[model] = left  # type: ignore[index]
        else:
            self.demand.pop(model, None)  # type: ignore[arg-type]

    def _hand(self, job: Job, wid: bytes, out: dict[bytes, list[Job]]) -> None:
        """Give the job to the worker (its slots hold it from now on)."""
        slots = self.workers[wid]
        before = self._room(slots)
        slots.jobs[job.job_id] = job
        if job.long:
            slots.long_jobs += 1
        else:
            slots.bytes += len(job.raw)
        job.worker = wid
        job.attempts += 1
        self.waiting -= 1
        if job.catalog:
            self._demand(job.model, -1)
        self._set_room(slots, before)
        out.setdefault(wid, []).append(job)

    def _room(self, slots: Slots) -> int:
        """Free slots of a worker: none once its payload bytes reach the limit (if it holds a job)."""
        if slots.jobs and slots.bytes >= self.worker_bytes:
            return 0
        return slots.capacity - len(slots.jobs)

    def _set_room(self, slots: Slots, before: int) -> None:
        room = self._room(slots)
        self._free += room - before
        slots.blocked = room <= 0
