# cython: language_level=3, boundscheck=False, wraparound=False
"""The client's call registry: a pending call (`Call`: its packed fields, what settles it, its
timers), one awaitable for many (`Batch`), and the calls made, registered and queued on a link
(`submit_one`, `submit_batch`) in one call each.

Python (`_client_core`) keeps the policy (which broker, deadlines, liveness, retries); this keeps
what is done per call: `_fill` is the one place a Call's fields are set, `answered` the one place
a reply settles a call (`_replies` calls it for a frame's replies, the engine for what it gave up
retrying), `deadline_ms` what is left of a deadline as it is sent.
"""

from cpython.bytes cimport PyBytes_GET_SIZE
from heapq import heappush

from tokenbroker._packer cimport request_bytes

KIND_RAW = C_RAW
KIND_TOKENS = C_TOKENS
KIND_TEXT = C_TEXT
KIND_CHAT = C_CHAT
KIND_TOKENS_LIST = C_TOKENS | C_AS_LIST  # as KIND_TOKENS, ids as a list of int
KIND_CHAT_LIST = C_CHAT | C_AS_LIST


cdef class Batch:
    """One awaitable for many calls: `results[i]` is call i's result (or its reply map, or an
    exception), `future` gets this batch when the last one is in."""

    def __init__(self, object future, Py_ssize_t n):
        self.future = future
        self.results = [None] * n
        self.left = n
        self.odd = 0

    cpdef put(self, Py_ssize_t index, object value, bint odd):
        self.results[index] = value
        if odd:
            self.odd += 1
        self.left -= 1
        if self.left == 0 and not self.future.done():
            self.future.set_result(self)


cdef class Call:
    """One pending request: its packed fields (sent again on failover or retry), what settles it
    (its own future, or its place in a batch) and its timers."""

    def __init__(self, object rid, bytes head, Py_ssize_t nkeys, int kind, str op, object future,
                 double deadline, double timeout, Batch batch=None, Py_ssize_t index=0):
        _fill(self, rid, head, nkeys, kind, op, future, deadline, timeout, batch, index, None)

    def done(self) -> bool:
        """Its awaiter has stopped waiting or it is settled (a cancelled future is done at once)."""
        if self.batch is not None:
            return self.batch.future.done()
        return self.future.done()

    def payload(self, double now) -> bytes:
        """The request as it goes now: its fields, its id and what is left of its deadline."""
        return request_bytes(self.head, self.nkeys, self.id, deadline_ms(self.deadline - now))

    cpdef settle(self, object reply):
        """Settle with a reply map as it came (an error the engine gave up retrying)."""
        _resolve(self, reply, True, False)

    cpdef fail(self, object error):
        """Settle with an exception (expired, client closed)."""
        _resolve(self, error, True, True)


cdef inline int _fill(Call call, object rid, bytes head, Py_ssize_t nkeys, int kind, str op, object future,
                      double deadline, double timeout, Batch batch, Py_ssize_t index, object link) except -1:
    """Every field of a new call (the one place they are set)."""
    call.id = rid
    call.head = head
    call.nkeys = nkeys
    call.kind = kind
    call.op = op
    call.future = future
    call.batch = batch
    call.index = index
    call.deadline = deadline
    call.timeout = timeout
    call.link = link
    call.retry = None
    call.attempts = 0
    return 0


cdef inline int _resolve(Call call, object value, bint odd, bint error) except -1:
    """Hand a call's outcome to its awaiter: its place in its batch, or its own future (unless
    the awaiter stopped waiting)."""
    if call.batch is not None:
        call.batch.put(call.index, value, odd)
    elif not call.future.done():
        if error:
            call.future.set_exception(value)
        else:
            call.future.set_result(value)
    return 0


cdef int answered(Call call, dict calls, object value, bint odd) except -1:
    """A reply settles a pending call: it leaves the registry and its link, its retry timer is
    stopped, and `value` (`odd`: a reply map, not its result type) goes to its awaiter."""
    del calls[call.id]
    link = call.link
    if link is not None:
        (<dict>link.outstanding).pop(call.id, None)
    if call.retry is not None:
        call.retry.cancel()
    return _resolve(call, value, odd, False)


cdef long long MAX_DEADLINE_MS = 0


def configure(long long max_deadline_ms) -> None:
    """The largest `deadline_ms` sent (the contract's bound)."""
    global MAX_DEADLINE_MS
    MAX_DEADLINE_MS = max_deadline_ms


cdef long long deadline_ms(double left) noexcept:
    """What is left of a deadline as it is sent: whole ms, at least 1, at most the contract's bound."""
    cdef long long ms = <long long>(left * 1000) if left > -1e9 else 0
    if ms < 1:
        return 1
    if ms > MAX_DEADLINE_MS:
        return MAX_DEADLINE_MS
    return ms


def submit_one(bytes head, Py_ssize_t nkeys, int kind, str op, object future, object rid, double deadline,
               double timeout, double now, dict calls, object link, list heap, double grace) -> Call:
    """Make, register and queue one call to `link` (as `submit_batch` does for many); the caller
    schedules the link's flush."""
    cdef Call call = Call.__new__(Call)
    cdef dict outstanding = link.outstanding
    _fill(call, rid, head, nkeys, kind, op, future, deadline, timeout, None, 0, link)
    calls[rid] = call
    if not outstanding:
        link.busy_since = now
    outstanding[rid] = call
    link.sent += 1
    (<list>link.outbox).append(None)  # its request is written at the flush, into its frame (`_frames`)
    (<list>link.outbox_calls).append(call)
    link.outbox_bytes += PyBytes_GET_SIZE(head) + 32
    heappush(heap, (deadline + grace, rid))
    return call


def submit_batch(list heads, Py_ssize_t nkeys, int kind, str op, Batch batch, Py_ssize_t start, object first_id,
                 double deadline, double timeout, double now, dict calls, object link) -> object:
    """Make, register and queue the calls of `heads` (a batch's items `start`, `start + 1`, ...),
    ids from `first_id` on, all to `link`: in `calls`, in the link's outstanding and outbox (the
    batch's deadline is the caller's to watch, once). Returns the next free id."""
    cdef dict outstanding = link.outstanding
    cdef list outbox = link.outbox
    cdef list outbox_calls = link.outbox_calls
    cdef Py_ssize_t i, added = 0
    cdef long long rid = first_id
    cdef Call call
    cdef object key
    for i in range(len(heads)):
        key = rid
        call = Call.__new__(Call)
        _fill(call, key, <bytes>heads[i], nkeys, kind, op, None, deadline, timeout, batch, start + i, link)
        calls[key] = call
        outstanding[key] = call
        outbox.append(None)
        outbox_calls.append(call)
        added += PyBytes_GET_SIZE(call.head) + 32
        rid += 1
    link.outbox_bytes += added
    link.sent += len(heads)
    return rid
