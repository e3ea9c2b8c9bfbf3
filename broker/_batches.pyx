# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""The backend's batches over libzmq: B_JOBS built and sent from the jobs one turn hands a worker
(`send_jobs`), and the W_RESULTS that arrive received, checked and handed to the intake
(`drain`), in compiled code (common/protocol.py: B_JOBS = [J, JOB * n, payloads]; W_RESULTS =
[D, RESULT * n, replies]; the records' layout is common/_wire.pxd's).

Why here and not through pyzmq: a batch's records are written straight into the libzmq message
that carries them, its payloads copied once into one message made to measure (broker/_buffers.pyx;
a lone payload held as the libzmq message it came in is passed on by reference); a W_RESULTS
payload frame stays the libzmq message it came in, and the replies are views of it until the
frontend sends them. Every other message from a worker (READY, HEARTBEAT, LOADED, BYE, anything
malformed or unknown) goes to Python as its frames (broker/backend.py `Backend._on_frames`): one
path for control.
"""

from cpython.buffer cimport PyObject_GetBuffer, PyBuffer_Release, PyBUF_SIMPLE
from cpython.bytes cimport PyBytes_FromStringAndSize

from tokenbroker.broker._buffers cimport put_buffer, sized_message, whole_message
from tokenbroker.broker._intake cimport Intake
from tokenbroker.broker._jobs cimport Job
from tokenbroker.common._message cimport Message
from tokenbroker.common._pack cimport put_le
from tokenbroker.common._wire cimport (get_le, JOB_ID_AT, JOB_BUDGET_AT, JOB_SIZE_AT, JOB_BYTES, RESULT_BYTES,
                                       RESULT_SIZE_AT)
from tokenbroker.common._zmq cimport (EAGAIN, EINTR, ZMQ_DONTWAIT, ZMQ_SNDMORE, handle_of, load_libzmq, zmq_errno,
                                      zmq_error, zmq_msg_close, zmq_msg_data, zmq_msg_init, zmq_msg_init_size,
                                      zmq_msg_more, zmq_msg_recv, zmq_msg_send, zmq_msg_size, zmq_msg_t, zmq_send)

from zmq import ZMQError

from tokenbroker.common.protocol import B_JOBS, W_RESULTS

load_libzmq()

ctypedef unsigned char uchar
ctypedef unsigned long long u64

cdef uchar _JOBS = (<bytes>B_JOBS)[0]
cdef uchar _RESULTS = (<bytes>W_RESULTS)[0]
assert len(B_JOBS) == 1 and len(W_RESULTS) == 1


# --- B_JOBS ---------------------------------------------------------------------------------------

def send_jobs(sock, bytes wid, list jobs, double now, Py_ssize_t max_jobs, Py_ssize_t max_bytes) -> None:
    """Send `jobs` to worker `wid`, at most `max_jobs` jobs and `max_bytes` payload bytes past the
    first a message. Each job's budget is the time left of its deadline at `now` in ms (at least 1,
    at most 2**31-1). A job's `raw` is any buffer; a lone job whose raw is all of a Message (or a
    view of all of it) goes on as that message (zmq_msg_copy: no copy of a large one). ZMQError
    when a send fails."""
    cdef void* s = handle_of(sock)
    cdef Py_ssize_t start = 0, end, size, length
    while start < len(jobs):
        end, size = start, 0
        while end < len(jobs) and end - start < max_jobs:
            length = len((<Job>jobs[end]).raw)
            if end > start and size + length > max_bytes:
                break
            size += length
            end += 1
        _send_batch(s, wid, jobs, start, end, size, now)
        start = end


cdef int _send_batch(void* s, bytes wid, list jobs, Py_ssize_t start, Py_ssize_t end, Py_ssize_t size,
                     double now) except -1:
    """jobs[start:end] (`size` payload bytes) as one B_JOBS message: wid, kind, records, payloads."""
    cdef zmq_msg_t header, payloads
    cdef Py_ssize_t n = end - start, i
    cdef uchar* h
    cdef uchar* o
    cdef Job job
    cdef Message whole
    cdef double left
    cdef long long budget
    cdef int rc = 0
    cdef uchar kind = _JOBS
    zmq_msg_init(&header)
    zmq_msg_init(&payloads)  # empty until made: each holds nothing to free before it is sized
    try:
        if zmq_msg_init_size(&header, <size_t>(JOB_BYTES * n)) < 0:
            zmq_msg_init(&header)
            raise MemoryError()
        h = <uchar*>zmq_msg_data(&header)
        for i in range(n):
            job = <Job>jobs[start + i]
            left = (job.deadline - now) * 1000
            budget = <long long>left if left < 2147483647.0 else 2147483647
            if budget < 1:
                budget = 1
            put_le(h + JOB_BYTES * i + JOB_ID_AT, <u64>job.job_id, 8)
            put_le(h + JOB_BYTES * i + JOB_BUDGET_AT, <u64>budget, 4)
            put_le(h + JOB_BYTES * i + JOB_SIZE_AT, <u64>len(job.raw), 4)
        whole = whole_message((<Job>jobs[start]).raw) if n == 1 else None
        if whole is not None:
            whole.share(&payloads)
        else:
            sized_message(&payloads, <size_t>size)
            o = <uchar*>zmq_msg_data(&payloads)
            for i in range(start, end):
                o = put_buffer(o, (<Job>jobs[i]).raw)
        # Flags 0, as the backend's job sends always were: a ROUTER never blocks (it drops a message
        # for a peer whose queue is full), so a failure here is the socket's own.
        rc = zmq_send(s, <const char*>wid, <size_t>len(wid), ZMQ_SNDMORE)
        if rc >= 0:
            rc = zmq_send(s, &kind, 1, ZMQ_SNDMORE)
        if rc >= 0:
            rc = zmq_msg_send(&header, s, ZMQ_SNDMORE)
        if rc >= 0:
            rc = zmq_msg_send(&payloads, s, 0)
        if rc < 0:
            raise ZMQError(zmq_errno(), zmq_error(zmq_errno()))
    finally:
        zmq_msg_close(&header)  # each empty once sent: closing is a no-op then
        zmq_msg_close(&payloads)
    return 0


# --- W_RESULTS ------------------------------------------------------------------------------------

cpdef tuple drain(sock, dict workers, Intake intake, double now, double expiry, Py_ssize_t limit):
    """Receive what the backend socket holds, up to `limit` messages, until Python is needed.

    A W_RESULTS from a known worker (in `workers`, wid -> broker/backend.py WorkerState) is checked
    (`results_problem`), refreshes the worker's `expiry`, and goes to `intake.results` with its
    payload frame as a Message (the replies are views of it). Returns (messages taken, what for
    Python): None once nothing waits or `limit` is reached; a message's frames (bytes) for
    `Backend._on_frames`: any other kind, a W_RESULTS from a peer not in `workers`, or a malformed
    one; or the wid of a draining worker whose results were just finished (it may hold nothing now).
    ZMQError when the socket fails."""
    cdef void* s = handle_of(sock)
    cdef zmq_msg_t frame
    cdef Py_ssize_t taken = 0
    cdef bytes wid
    cdef list body
    cdef int rc, err
    while taken < limit:
        zmq_msg_init(&frame)
        rc = zmq_msg_recv(&frame, s, ZMQ_DONTWAIT)
        if rc < 0:
            zmq_msg_close(&frame)
            err = zmq_errno()
            if err == EAGAIN or err == EINTR:
                return taken, None
            raise ZMQError(err, zmq_error(err))
        taken += 1
        try:
            wid = _bytes(&frame)
            if not zmq_msg_more(&frame):  # an identity alone
                return taken, [wid]
            _next(s, &frame)  # the kind: the frames after the first are all there once it is
            worker = workers.get(wid) if _is_results(&frame) else None
            if worker is None:  # not a known worker's W_RESULTS: as it came, for Python
                return taken, _rest(s, &frame, [wid, _bytes(&frame)])
            worker.expiry = expiry
            body = _results(s, wid, intake, now)
            if body is not None:  # malformed
                return taken, [wid, W_RESULTS, *body]
        finally:
            zmq_msg_close(&frame)
        if worker.draining:
            return taken, wid
    return taken, None


cdef inline bint _is_results(zmq_msg_t* kind) noexcept:
    return zmq_msg_size(kind) == 1 and (<const uchar*>zmq_msg_data(kind))[0] == _RESULTS and zmq_msg_more(kind)


cdef list _results(void* s, bytes wid, Intake intake, double now):
    """A W_RESULTS body (its kind read): to `intake` when its header and one payload frame agree
    (None), else its frames as bytes, read to the message's end (the backend says why it dropped it)."""
    cdef zmq_msg_t header
    cdef Message blob = Message.__new__(Message)
    zmq_msg_init(&header)
    try:
        _next(s, &header)
        if not zmq_msg_more(&header):
            return [_bytes(&header)]
        _next(s, &blob.msg)
        blob.fill()
        if zmq_msg_more(&blob.msg) or _problem(<Py_ssize_t>zmq_msg_size(&header), <const uchar*>zmq_msg_data(&header),
                                               blob.size) is not None:
            return _rest(s, &blob.msg, [_bytes(&header), bytes(blob)])
        intake.results(wid, <const uchar*>zmq_msg_data(&header), <Py_ssize_t>zmq_msg_size(&header) // RESULT_BYTES,
                       blob, now)
        return None
    finally:
        zmq_msg_close(&header)


cdef inline bytes _bytes(zmq_msg_t* frame):
    return PyBytes_FromStringAndSize(<const char*>zmq_msg_data(frame), <Py_ssize_t>zmq_msg_size(frame))


cdef int _next(void* s, zmq_msg_t* frame) except -1:
    """The message's next frame into `frame` (which may hold the one before): it is there once the
    message's first is, and received again when a signal interrupts the call, so a message is
    never left half read."""
    cdef int err
    zmq_msg_close(frame)
    zmq_msg_init(frame)
    while zmq_msg_recv(frame, s, 0) < 0:
        err = zmq_errno()
        if err != EINTR:
            raise ZMQError(err, zmq_error(err))
    return 0


cdef list _rest(void* s, zmq_msg_t* frame, list frames):
    """The frames after `frame` read to the message's end, appended to `frames` as bytes."""
    while zmq_msg_more(frame):
        _next(s, frame)
        frames.append(_bytes(frame))
    return frames


cdef str _problem(Py_ssize_t header_size, const uchar* header, Py_ssize_t blob_size):
    """Why a W_RESULTS header and payload frame disagree, or None when they agree."""
    cdef Py_ssize_t i, total = 0
    if not header_size or header_size % RESULT_BYTES:
        return f"a result batch header of {header_size} bytes is not a whole number of {RESULT_BYTES}-byte records"
    for i in range(header_size // RESULT_BYTES):
        total += <Py_ssize_t>get_le(header + RESULT_BYTES * i + RESULT_SIZE_AT, 4)
    if total != blob_size:
        return f"a result batch's records count {total} payload bytes, its frame has {blob_size}"
    return None


def results_problem(list body) -> str | None:
    """Why a W_RESULTS body (the frames after its kind) is malformed, or None: the rules `drain`
    checks, in words for the backend's log of a batch it dropped."""
    cdef Py_buffer hb
    if len(body) != 2:
        return f"a result batch must be a header and one payload frame, got {len(body)} frames"
    PyObject_GetBuffer(body[0], &hb, PyBUF_SIMPLE)
    try:
        return _problem(hb.len, <const uchar*>hb.buf, len(body[1]))
    finally:
        PyBuffer_Release(&hb)
