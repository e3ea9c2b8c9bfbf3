# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""The loop's per-frame and per-batch work, compiled (broker/loop.py keeps the policy, per turn): the
intake admits a frame's requests (the refusal checks, the route key, the job table, the queue) and
finishes a worker's results (the dispatcher's `finish`, the release, the reply, the request
counters), so the loop runs Python per request only for what is not the common case. The replies
go to the frontend's outbox (broker/_outbox.pyx), sent once a turn.
"""

from tokenbroker.broker._counters cimport tally
from tokenbroker.broker._dispatch cimport Dispatcher
from tokenbroker.broker._jobs cimport Job, JobTable
from tokenbroker.broker._outbox cimport hold_reply
from tokenbroker.broker._peek cimport Peek
from tokenbroker.broker._routekey cimport route_key
from tokenbroker.common._message cimport Message
from tokenbroker.common._wire cimport get_le, RESULT_BYTES, RESULT_ID_AT, RESULT_OUTCOME_AT, RESULT_SIZE_AT

from sys import intern as _intern

from tokenbroker.common.protocol import MODEL_OPS, OUTCOMES as _OUTCOMES, SKIPPED as _SKIPPED

assert _OUTCOMES[1] == _SKIPPED  # Intake.results reads outcome 1 as skipped

ctypedef unsigned char uchar

cdef str OP_COUNT = _intern("count")  # as a Peek's `op` is (common/protocol.py OPS)
cdef frozenset _MODEL_OPS = MODEL_OPS  # `model` names a served model (count's, only when it gives one)


cdef object _UNSEEN = object()  # a `model` the intake's table does not know yet


cdef class Intake:
    """The loop's per-request and per-result work in one compiled call per frame and per W_RESULTS
    batch (broker/loop.py): admission, the route key, the job table, the queue, the replies and
    the request counters. Python keeps everything that is not the common case, through `other`
    (ping, the catalog ops, refusals, unreadable requests, a `model` not in `models` yet) and
    `late` (a job its worker skipped or answered empty): exceptional paths, in arrival order.

    `models` is the loop's memo of `Catalog.resolve` for the requests that need nothing else
    from Python: a request's `model` (None: the default) -> the catalog entry's name, or None
    when the catalog has no entry for it (a worker's own model, or one nobody serves). The loop
    fills it after handling such a request itself and clears it whenever the catalog or placement
    may have changed, so a memo never outlives what it read."""


    def __init__(self, JobTable jobs, Dispatcher dispatcher, dict outbox, dict requests, dict latency, tuple bounds,
                 dict model_requests, other, late, *, bint affinity, double timeout_s, long long max_pending,
                 long long max_pending_bytes, long long max_client_pending):
        self.jobs = jobs
        self.dispatcher = dispatcher
        self.models = {}
        self.outbox = outbox
        self.requests = requests
        self.latency = latency
        self.bounds = bounds
        self.model_requests = model_requests
        self.other = other
        self.late = late
        self.affinity = affinity
        self.stopping = False
        self.timeout_s = timeout_s
        self.max_pending = max_pending
        self.max_pending_bytes = max_pending_bytes
        self.max_client_pending = max_client_pending

    # --- requests

    cpdef Py_ssize_t take(self, envelope, peer, item, double now) except -1:
        """One client message (broker/_frontend.pyx `Drain` reads it): `item` a Peek, an array's
        Peeks (`peek_array`: the refused ones go to `other`), or None for a message the frontend
        answered itself. Returns the payload bytes of its requests (the drain bounds a turn by them)."""
        cdef Py_ssize_t total = 0
        if type(item) is list:
            for x in <list>item:  # the array's refused requests are answered first, as they were read
                if (<Peek>x).code is not None:
                    self.other(envelope, peer, x, now)
            for x in <list>item:
                if (<Peek>x).code is None:
                    total += self._one(envelope, peer, x, now)
            return total
        return self._one(envelope, peer, item, now)

    cdef Py_ssize_t _one(self, envelope, peer, item, double now) except -1:
        cdef Peek peek
        cdef Py_ssize_t size
        if item is None:
            self.other(envelope, peer, item, now)
            return 0
        peek = <Peek>item
        size = len(peek.body)
        if not self._fast(envelope, peek, size, now):
            self.other(envelope, peer, peek, now)
        return size

    cdef bint _fast(self, envelope, Peek peek, Py_ssize_t size, double now) except -1:
        """Admit a request that needs no Python: False leaves it to `other`."""
        cdef str op = peek.op
        model = None
        if op in _MODEL_OPS or (op is OP_COUNT and peek.model is not None):
            entry = self.models.get(peek.model, _UNSEEN)
            if entry is _UNSEEN:
                return False
            if entry is not None:
                model = entry
            elif op is not OP_COUNT:
                model = peek.model
        elif op is not OP_COUNT:
            return False
        else:
            entry = None
        if self.refusal(envelope[0], size) is not None:
            return False
        self.hold(envelope, peek, now, model, entry is not None)
        return True

    cpdef object refusal(self, bytes client, Py_ssize_t size):
        """Why a new request cannot be held now (answered overloaded), or None."""
        cdef long long waiting = self.dispatcher.waiting, held = self.jobs.held_bytes
        if self.stopping:
            return "the broker is shutting down"
        if waiting >= self.max_pending or held + size > self.max_pending_bytes:
            return (f"{waiting} requests ({held} bytes) are queued "
                    f"(--max-pending {self.max_pending}, --max-pending-bytes {self.max_pending_bytes})")
        if <long long>self.jobs.per_client.get(client, 0) >= self.max_client_pending:
            return f"this connection has {self.max_client_pending} requests held (--max-client-pending)"
        return None

    cpdef Job hold(self, envelope, Peek peek, double now, model, bint catalog):
        """Hold an admitted request: its route key, its job (deadline from now), the queue.
        `model`: the served model it names, `catalog`: a catalog entry's (counted per model)."""
        deadline_ms = peek.deadline_ms
        cdef double timeout_s = <double>(<long long>deadline_ms) / 1000.0 if deadline_ms else self.timeout_s
        route = route_key(peek) if self.affinity else None
        cdef Job job = self.jobs.admit(envelope, peek, route, now, timeout_s, model, catalog)
        if catalog:
            self.model_requests[model] = self.model_requests.get(model, 0) + 1
        self.dispatcher.enqueue(job)
        return job

    # --- results

    cdef int results(self, bytes wid, const uchar* header, Py_ssize_t n, Message blob, double now) except -1:
        """A worker's W_RESULTS batch of `n` records, received and checked by the backend's drain
        (broker/_batches.pyx): each job it held is finished and let go, and its reply, a view of
        the payload frame `blob` (no copy), goes to the outbox and the counters. A job answered
        skipped or empty goes to `late` (the broker answers timeout)."""
        cdef const uchar* p
        cdef Py_ssize_t i, at = 0, size, known = len(_OUTCOMES)
        cdef int code
        cdef Job job
        cdef JobTable jobs = self.jobs
        cdef Dispatcher dispatcher = self.dispatcher
        view = memoryview(blob)
        for i in range(n):
            p = header + RESULT_BYTES * i
            size = <Py_ssize_t>get_le(p + RESULT_SIZE_AT, 4)
            code = p[RESULT_OUTCOME_AT]
            found = dispatcher.finish(wid, <long long>get_le(p + RESULT_ID_AT, 8), code == 0)
            if found is not None:
                job = <Job>found
                jobs.release(job)
                if job.answered:
                    pass
                elif code == 1 or size == 0:  # skipped: the worker saw the budget run out a moment before the broker
                    self.late(job, now)
                else:
                    job.answered = True
                    hold_reply(self.outbox, job.envelope, view[at:at + size])
                    tally(self.requests, self.latency, self.bounds, job.op,
                          <str>_OUTCOMES[code] if code < known else "internal", now - job.received)
            at += size
        return 0
