# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""The dispatcher, compiled: which queued job goes to which worker, and when (docs/routing.md, "The
dispatcher", holds its design). A turn touches every queued job and every worker's counts, which
in Python cost 3-16 us per job (1-16 workers).
"""

from tokenbroker.broker._jobs cimport Job
from tokenbroker.broker._router cimport Router, Slots

from tokenbroker.common.protocol import LANE_COUNT_BYTES as _LANE_COUNT_BYTES


cdef frozenset _NOBODY = frozenset()


def _unplaced(model, *, catalog):
    """With no placement (a dispatcher on its own): a catalog model has no holders, any other goes anywhere."""
    return frozenset() if catalog else None


cdef class Dispatcher:
    """Which queued job goes to which worker, and when (docs/routing.md)."""


    def __init__(self, Router router, *, double spill_wait, long long worker_bytes, int lookahead=64,
                 eligible=_unplaced, dict holders=None, bint long_off_loop=False, int passed_over_max=1024):
        from collections import deque
        self.router = router
        self.long_off_loop = long_off_loop
        self.eligible = eligible
        self.holders = holders
        self.spill_wait = spill_wait
        self.worker_bytes = worker_bytes
        self.lookahead = lookahead
        self.passed_over_max = passed_over_max
        self.workers = {}
        self.pending = deque()
        self.waiting = 0
        self.demand = {}
        self._stale = 0
        self._free = 0

    # --- workers

    def add_worker(self, bytes wid, int capacity) -> None:
        """A worker joined with `capacity` slots (which models it serves is placement's to say)."""
        cdef Slots slots = Slots(capacity)
        self.workers[wid] = slots
        self.router.add_worker(wid, slots)
        self._free += capacity

    def drain_worker(self, bytes wid) -> None:
        """Nothing new goes to it; what it holds finishes there."""
        found = self.workers.get(wid)
        cdef Slots slots
        if found is not None and not (<Slots>found).draining:
            slots = <Slots>found
            slots.draining = True
            self._free -= self._room(slots)
            self.router.remove_worker(wid)

    def remove_worker(self, bytes wid) -> list:
        """The worker is gone: returns the jobs it held (oldest first), held nowhere now."""
        found = self.workers.pop(wid, None)
        cdef Slots slots
        if found is None:
            return []
        slots = <Slots>found
        if not slots.draining:
            self._free -= self._room(slots)
            self.router.remove_worker(wid)
        for job in slots.jobs.values():
            (<Job>job).worker = None
        return list(slots.jobs.values())

    def held(self, bytes wid) -> int:
        """How many jobs the worker holds now."""
        found = self.workers.get(wid)
        return len((<Slots>found).jobs) if found is not None else 0

    def full(self, bytes wid) -> bool:
        """The worker takes no more jobs now (every slot used, or its byte limit reached, or draining)."""
        found = self.workers.get(wid)
        return found is None or (<Slots>found).draining or self._room(<Slots>found) <= 0

    def holds_model(self, bytes wid, str model) -> bool:
        """Whether the worker holds a job of `model` (it must keep the model until answered)."""
        found = self.workers.get(wid)
        if found is None:
            return False
        for job in (<Slots>found).jobs.values():
            if (<Job>job).model == model:
                return True
        return False

    # --- jobs

    cpdef enqueue(self, Job job):
        # Off the worker's loop: a long tokenize when caches are off (workers/background.py), and a count
        # its worker counts on its lane, in every cache mode (workers/count_lane.py). A worker holds one such
        # job at a time: counted in bytes, four 300 KB bodies filled a worker and the small jobs queued behind.
        job.off_loop = (job.op == "count" and len(job.raw) > _LANE_COUNT_BYTES) or (
            self.long_off_loop and job.op == "tokenize" and len(job.raw) > self.worker_bytes)
        self.pending.append(job)
        self.waiting += 1
        if job.catalog:
            self._demand(job.model, 1)

    def requeue(self, Job job) -> None:
        """A job whose worker died goes first; its queue time stays, so it may go anywhere at once."""
        self.pending.appendleft(job)
        self.waiting += 1
        if job.catalog:
            self._demand(job.model, 1)

    def queued(self, str model) -> list:
        """The unanswered queued jobs of a catalog model (to answer them when it fails or goes)."""
        return [job for job in self.pending if (<Job>job).catalog and (<Job>job).model == model and not (<Job>job).answered]

    cpdef object finish(self, bytes wid, long long job_id, bint served=False):
        """`wid` answered `job_id`: the job, if that worker held it (else a stale or forged answer).
        `served`: the worker tokenized its input (an ok reply), so the router's index learns where
        its prefixes are; a rejected request teaches it nothing."""
        found = self.workers.get(wid)
        cdef Slots slots
        cdef Job job
        cdef long long before
        if found is None:
            return None
        slots = <Slots>found
        got = slots.jobs.get(job_id)
        if got is None:
            return None
        job = <Job>got
        before = self._room(slots)
        del slots.jobs[job_id]
        if job.off_loop:
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

    def dequeued(self, Job job) -> None:
        """A queued job was answered where it waits (its deadline passed, or its model failed or
        was removed): it leaves the queue's count now. The caller has set `job.answered`."""
        from collections import deque
        self.waiting -= 1
        if job.catalog:
            self._demand(job.model, -1)
        self._stale += 1
        if self._stale > max(64, len(self.pending) // 2):
            self.pending = deque([j for j in self.pending if not (<Job>j).answered])
            self._stale = 0

    # --- the policy

    def assign(self, double now) -> list:
        """Hand out what can go to a worker now; returns each worker's new jobs, in the order to send."""
        cdef dict out
        cdef list kept, passed
        cdef set waits
        cdef Job job
        cdef Py_ssize_t i, n
        cdef double spill_before
        if self._free <= 0 or not self.waiting:
            return []
        out = {}
        kept = []
        pending = self.pending
        # Keys whose preferred worker is full (within the bound) this turn: picks only add load and
        # the bound only grows with it, so the same key would wait again; it is not asked twice.
        waits = set()
        n = min(self.lookahead, len(pending))
        for i in range(n):
            if self._free <= 0:
                break
            job = <Job>pending.popleft()
            if job.answered:
                self._stale -= 1
                continue
            allowed = self._allowed(job)
            if allowed is None and job.route in waits:
                kept.append(job)
                continue
            wid = None if allowed is not None and not allowed else self.router.pick(job.route, overflow=False, allowed=allowed)
            if wid is None:
                kept.append(job)
                if allowed is None and job.route is not None:
                    waits.add(job.route)
            else:
                self._hand(job, <bytes>wid, out)
        pending.extendleft(reversed(kept))
        spill_before = now - self.spill_wait
        passed = []  # jobs whose model's workers are all full: the rest may go past them
        while pending and self._free > 0 and len(passed) < self.passed_over_max:
            job = <Job>pending[0]
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
            self._hand(job, <bytes>wid, out)
        pending.extendleft(reversed(passed))
        return list(out.items())

    def next_timer(self, double now):
        """When a queued job may next spill to a free slot; None when only an answer can help."""
        cdef Py_ssize_t i = 0
        cdef Job job
        if self._free <= 0 or not self.waiting:
            return None
        for j in self.pending:
            if i >= self.passed_over_max + self.lookahead:
                break
            i += 1
            job = <Job>j
            if not job.answered and job.queued + self.spill_wait > now:
                return job.queued + self.spill_wait
        return None

    # --- internals

    cdef object _allowed(self, Job job):
        """The workers that may take the job: those that serve its model (placement's answer: None,
        any); a long tokenize, only those not encoding one already."""
        if job.model is None:
            allowed = None  # each worker's default (as `eligible` answers)
        elif job.catalog and self.holders is not None:
            allowed = self.holders.get(job.model, _NOBODY)  # `eligible`'s answer, read with no Python call
        else:
            allowed = self.eligible(job.model, catalog=job.catalog)
        if not job.off_loop:
            return allowed
        free = frozenset([wid for wid, slots in self.workers.items() if not (<Slots>slots).long_jobs])
        return free if allowed is None else allowed & free

    cdef void _demand(self, model, long long change):
        cdef long long left = self.demand.get(model, 0) + change
        if left > 0:
            self.demand[model] = left
        else:
            self.demand.pop(model, None)

    cdef void _hand(self, Job job, bytes wid, dict out):
        """Give the job to the worker (its slots hold it from now on)."""
        cdef Slots slots = <Slots>self.workers[wid]
        cdef long long before = self._room(slots)
        slots.jobs[job.job_id] = job
        if job.off_loop:
            slots.long_jobs += 1
        else:
            slots.bytes += len(job.raw)
        job.worker = wid
        job.attempts += 1
        self.waiting -= 1
        if job.catalog:
            self._demand(job.model, -1)
        self._set_room(slots, before)
        batch = out.get(wid)
        if batch is None:
            out[wid] = [job]
        else:
            (<list>batch).append(job)

    cdef long long _room(self, Slots slots):
        """Free slots of a worker: none once its payload bytes reach the limit (if it holds a job)."""
        if slots.jobs and slots.bytes >= self.worker_bytes:
            return 0
        return slots.capacity - len(slots.jobs)

    cdef void _set_room(self, Slots slots, long long before):
        cdef long long room = self._room(slots)
        self._free += room - before
        slots.blocked = room <= 0
