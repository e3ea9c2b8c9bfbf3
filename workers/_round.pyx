# The worker's round in C over libzmq (issue 40). B_JOBS messages are received into libzmq messages
# and kept as they came; each job's payload is read in place (workers/_core.pxd read_plain_at); the
# plain tokenizes of cache-less models are encoded one engine call per model and add_special_tokens
# (the engine is Python/Rust: called with the GIL, and given the texts, the only objects made per
# request); their replies are written straight into the W_RESULTS payload frame, which goes to
# libzmq without a copy. Python keeps control messages, lanes, caches and the rare ops:
# `Round.serve` hands those jobs back (as views of the held messages when large), and `Round.add`
# puts their replies beside the others in the same W_RESULTS message.
#
# One Round per worker, reused: take (under the socket's lock) -> serve (the compute, no lock) ->
# add -> send (under the lock), as workers/main.py's round loop runs it.

from cpython.exc cimport PyErr_CheckSignals
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.unicode cimport PyUnicode_DecodeUTF8
from libc.stdint cimport uint64_t
from libc.stdlib cimport free, malloc, realloc
from libc.string cimport memcmp, memcpy
from posix.time cimport CLOCK_MONOTONIC, clock_gettime, timespec

from tokenbroker.common._message cimport Message
from tokenbroker.common._pack cimport put_le
from tokenbroker.common._wire cimport (JOB_BUDGET_AT, JOB_BYTES, JOB_ID_AT, JOB_SIZE_AT, RESULT_BYTES, RESULT_OUTCOME_AT,
                                       RESULT_ID_AT, RESULT_SIZE_AT, get_le)
from tokenbroker.common._zmq cimport (EAGAIN, EINTR, ZMQ_DONTWAIT, ZMQ_POLLIN, ZMQ_SNDMORE, handle_of, load_libzmq,
                                      zmq_errno, zmq_error, zmq_msg_close, zmq_msg_data, zmq_msg_init, zmq_msg_init_data,
                                      zmq_msg_more, zmq_msg_recv, zmq_msg_send, zmq_msg_size, zmq_msg_t, zmq_poll,
                                      zmq_pollitem_t, zmq_send)
from tokenbroker.workers._core cimport Plain, check_ends, plain_text, read_plain_at, reply_bound, write_reply

import zmq

load_libzmq()

cdef enum:
    NOT_PLAIN = -1    # a job's group: served by Python
    SERVED = -2       # answered already (skipped, or written)


cdef struct Job:
    uint64_t job_id
    unsigned int budget_ms
    Py_ssize_t message  # index in Round.messages
    Py_ssize_t at       # the payload's place in that message
    Py_ssize_t size
    double received     # CLOCK_MONOTONIC seconds, as time.monotonic()
    Py_ssize_t group    # NOT_PLAIN, SERVED, or the plain group it is encoded in
    Plain plain


cdef double _now() noexcept nogil:
    cdef timespec t
    clock_gettime(CLOCK_MONOTONIC, &t)
    return t.tv_sec + t.tv_nsec * 1e-9


cdef void _free_frame(void* data, void* hint) noexcept nogil:
    free(data)


cdef class Round:
    """One round of a worker: the B_JOBS it took, and the W_RESULTS it will send."""
    cdef list messages        # Message per B_JOBS taken
    cdef Job* jobs
    cdef Py_ssize_t count, cap
    cdef unsigned char* head  # the RESULT records
    cdef Py_ssize_t head_size, head_cap
    cdef unsigned char* blob  # the replies, end to end (malloc: libzmq frees it once sent)
    cdef Py_ssize_t blob_size, blob_cap
    cdef readonly Py_ssize_t results
    cdef bytes jobs_kind, results_kind
    cdef dict outcome_index
    cdef int ok, skipped, internal

    def __init__(self, bytes jobs_kind not None, bytes results_kind not None, dict outcome_index not None):
        """The wire's facts as common/protocol.py defines them (B_JOBS, W_RESULTS, OUTCOME_INDEX); the
        JOB and RESULT record layouts are common/_wire.pxd's, as protocol.py's structs are."""
        if len(jobs_kind) != 1 or len(results_kind) != 1:
            raise ValueError("workers/_round.pyx takes one-byte message kinds")
        self.jobs_kind, self.results_kind, self.outcome_index = jobs_kind, results_kind, outcome_index
        self.ok, self.skipped, self.internal = outcome_index["ok"], outcome_index["skipped"], outcome_index["internal"]
        self.messages = []

    def __dealloc__(self):
        free(self.jobs)
        free(self.head)
        free(self.blob)

    @property
    def jobs(self) -> int:
        """Jobs taken and not yet sent."""
        return self.count

    @property
    def max_budget_ms(self) -> int:
        cdef Py_ssize_t i
        cdef unsigned int top = 0
        for i in range(self.count):
            top = max(top, self.jobs[i].budget_ms)
        return top

    # --- the loop ------------------------------------------------------------------------

    def spin(self, sock, list fds not None, double until, object resolve, Py_ssize_t alone, Py_ssize_t inline_bytes,
             Py_ssize_t copy_bytes, Py_ssize_t limit, Py_ssize_t max_jobs):
        """Serve rounds until Python is needed: poll the socket and `fds` (the lanes' and the loader's)
        until `until` (time.monotonic(): the next heartbeat), take the B_JOBS that arrive, serve them
        (`serve`) and send their results (`send`), turn after turn, all in C.

        Returns (frames, rest, sent, heard, dropped) once: `until` has passed; one of `fds` is readable
        (Python polls them); a signal came (Python runs its handler); a control message arrived
        (`frames`; the jobs taken before it stay in the round, for Python's turn); or a round holds
        jobs for Python (`rest`, as `serve` returns them: Ops.run serves them, then `add` and `send`).
        `sent`: results sent meanwhile; `heard`: anything arrived; `dropped`: W_RESULTS the socket's
        send timeout dropped."""
        cdef void* s = handle_of(sock)
        cdef int n = <int>len(fds) + 1, i, rc, dropped = 0
        cdef zmq_pollitem_t* items = <zmq_pollitem_t*>malloc(n * sizeof(zmq_pollitem_t))
        cdef long timeout
        cdef bint heard = False
        cdef Py_ssize_t sent = 0, got
        cdef object frames = None, rest = None
        if items == NULL:
            raise MemoryError()
        try:
            items[0].socket, items[0].fd, items[0].events = s, 0, ZMQ_POLLIN
            for i in range(1, n):
                items[i].socket, items[i].fd, items[i].events = NULL, fds[i - 1], ZMQ_POLLIN
            while True:
                timeout = <long>((until - _now()) * 1000)  # ms, rounded down as Poller.poll rounds
                if timeout < 0:
                    break
                with nogil:
                    rc = zmq_poll(items, n, timeout)
                if rc < 0:
                    if zmq_errno() != EINTR:
                        raise zmq.ZMQError(zmq_errno(), zmq_error(zmq_errno()))
                    PyErr_CheckSignals()
                    break
                if rc == 0:
                    break
                for i in range(1, n):
                    if items[i].revents:
                        break
                else:
                    i = 0
                if i:
                    break
                heard = True
                frames = self.take(sock, max_jobs)
                if frames is not None:
                    break
                if not self.count:  # nothing for a round (a malformed batch raised from take)
                    continue
                rest = self.serve(resolve, alone, inline_bytes, copy_bytes, limit)
                if rest:
                    break
                rest = None
                got = self.send(sock)
                if got < 0:
                    dropped += 1
                else:
                    sent += got
            return frames, rest, sent, heard, dropped
        finally:
            free(items)

    # --- receive -------------------------------------------------------------------------

    def take(self, sock, Py_ssize_t max_jobs):
        """Receive what waits while the round holds fewer than `max_jobs` jobs: a B_JOBS is kept here;
        the first other message is returned as its frames (bytes), for Python; None once nothing
        waits or the round is full. ValueError for a malformed B_JOBS (dropped)."""
        cdef void* s = handle_of(sock)
        cdef zmq_msg_t first
        cdef int rc
        cdef list frames
        while self.count < max_jobs:
            zmq_msg_init(&first)
            rc = zmq_msg_recv(&first, s, ZMQ_DONTWAIT)
            if rc < 0:
                zmq_msg_close(&first)
                if zmq_errno() in (EAGAIN, EINTR):
                    return None
                raise zmq.ZMQError(zmq_errno(), zmq_error(zmq_errno()))
            if zmq_msg_size(&first) == 1 and (<const char*>zmq_msg_data(&first))[0] == (<const char*>self.jobs_kind)[0] \
                    and zmq_msg_more(&first):
                zmq_msg_close(&first)
                self._take_jobs(s)
                continue
            frames = [PyBytes_FromStringAndSize(<const char*>zmq_msg_data(&first), zmq_msg_size(&first))]
            while zmq_msg_more(&first):
                zmq_msg_close(&first)
                zmq_msg_init(&first)
                zmq_msg_recv(&first, s, 0)  # the rest of a multipart message is there once its first frame is
                frames.append(PyBytes_FromStringAndSize(<const char*>zmq_msg_data(&first), zmq_msg_size(&first)))
            zmq_msg_close(&first)
            return frames
        return None

    cdef int _take_jobs(self, void* s) except -1:
        """A B_JOBS message's header and payload frames (its kind is read): its jobs, or ValueError."""
        cdef zmq_msg_t header, rest
        cdef Message body = Message.__new__(Message)
        cdef Py_ssize_t n, i, at = 0, size
        cdef const unsigned char* h
        cdef double now = _now()
        cdef Job* job
        cdef bint more
        zmq_msg_init(&header)
        try:
            if zmq_msg_recv(&header, s, 0) < 0:
                raise zmq.ZMQError(zmq_errno(), zmq_error(zmq_errno()))
            more = zmq_msg_more(&header)
            if more:
                zmq_msg_recv(&body.msg, s, 0)  # the rest of a multipart message is there once its first frame is
                more = zmq_msg_more(&body.msg)
                while more:  # frames past the payload: read to the end, and the batch dropped
                    zmq_msg_init(&rest)
                    zmq_msg_recv(&rest, s, 0)
                    more = zmq_msg_more(&rest)
                    zmq_msg_close(&rest)
                    at = -1
            if not zmq_msg_more(&header) or at < 0:
                raise ValueError("a job batch must be a header and one payload frame")
            body.fill()
            n = zmq_msg_size(&header) // JOB_BYTES
            h = <const unsigned char*>zmq_msg_data(&header)
            if n == 0 or zmq_msg_size(&header) % JOB_BYTES:
                raise ValueError(f"a job batch header of {zmq_msg_size(&header)} bytes is not a whole number of {JOB_BYTES}-byte records")
            for i in range(n):
                at += <Py_ssize_t>get_le(h + JOB_BYTES * i + JOB_SIZE_AT, 4)
            if at != body.size:
                raise ValueError(f"a job batch's records count {at} payload bytes, its frame has {body.size}")
            self._room_jobs(n)
            at = 0
            for i in range(n):
                size = <Py_ssize_t>get_le(h + JOB_BYTES * i + JOB_SIZE_AT, 4)
                job = &self.jobs[self.count + i]
                job.job_id = get_le(h + JOB_BYTES * i + JOB_ID_AT, 8)
                job.budget_ms = <unsigned int>get_le(h + JOB_BYTES * i + JOB_BUDGET_AT, 4)
                job.message, job.at, job.size, job.received = len(self.messages), at, size, now
                job.group = NOT_PLAIN
                at += size
            self.count += n
            self.messages.append(body)
        finally:
            zmq_msg_close(&header)
        return 0

    cdef int _room_jobs(self, Py_ssize_t n) except -1:
        cdef Job* grown
        if self.count + n <= self.cap:
            return 0
        grown = <Job*>realloc(self.jobs, (self.count + n) * 2 * sizeof(Job))
        if grown == NULL:
            raise MemoryError()
        self.jobs, self.cap = grown, (self.count + n) * 2
        return 0

    # --- serve -------------------------------------------------------------------------

    def serve(self, object resolve, Py_ssize_t alone, Py_ssize_t inline_bytes, Py_ssize_t copy_bytes, Py_ssize_t limit):
        """Serve the round's plain tokenizes of cache-less models (written into the results here);
        return the other jobs, as (job id, budget ms, received, payload), for workers/ops.py: payloads
        of `copy_bytes` or less as bytes, longer ones as views of the held message.

        `resolve(name)` says how a model name is served: (the engine's encode_flat, the reply's tail
        after `count`) when here and cache-less, else None (Python serves it). A plain job goes to
        Python too when its payload passes `inline_bytes` (the encode lane's), it is a batch of more
        than `alone` texts, or its reply might pass --max-reply-bytes (`limit`). Jobs past their
        budget are answered skipped, as ops.run does."""
        cdef double now = _now()
        cdef Py_ssize_t i, k, g
        cdef Job* job
        cdef Message m
        cdef list names = [], engines = [], groups = [], texts, out = []
        cdef object text, entry
        cdef const unsigned char* p
        for i in range(self.count):
            job = &self.jobs[i]
            if job.budget_ms and (now - job.received) * 1000 > job.budget_ms:
                self._result(job.job_id, self.skipped, NULL, 0)
                job.group = SERVED
                continue
            if job.size > inline_bytes:
                continue
            m = self.messages[job.message]
            p = m.data + job.at
            if not read_plain_at(p, job.size, &job.plain) or (job.plain.batch and job.plain.n > alone):
                continue
            k = self._engine(p, &job.plain, names, engines, resolve)
            if engines[k] is None:
                continue
            text = plain_text(p, job.size, &job.plain)
            if text is None:
                continue
            for g in range(len(groups)):  # (engine, add_special_tokens, texts): a few a round
                if groups[g][0] == k and groups[g][1] == job.plain.special:
                    break
            else:
                g = len(groups)
                groups.append((k, job.plain.special, []))
            texts = groups[g][2]
            if job.plain.batch:
                texts.extend(text)
            else:
                texts.append(text)
            job.group = g
        for g in range(len(groups)):
            self._encode_group(g, groups[g], engines[groups[g][0]], limit)
        for i in range(self.count):
            job = &self.jobs[i]
            if job.group != SERVED:
                m = self.messages[job.message]
                payload = (PyBytes_FromStringAndSize(<const char*>m.data + job.at, job.size) if job.size <= copy_bytes
                           else memoryview(m)[job.at:job.at + job.size])
                out.append((job.job_id, job.budget_ms, job.received, payload))
        return out

    cdef Py_ssize_t _engine(self, const unsigned char* p, Plain* plain, list names, list engines, object resolve) except -1:
        """The index in `engines` of the model a plain job names (resolved once a round per name)."""
        cdef Py_ssize_t k
        cdef bytes name
        for k in range(len(names)):
            name = names[k]
            if plain.model_at < 0:
                if name is None:
                    return k
            elif name is not None and PyBytes_GET_SIZE(name) == plain.model_len and \
                    memcmp(PyBytes_AS_STRING(name), p + plain.model_at, plain.model_len) == 0:
                return k
        if plain.model_at < 0:
            names.append(None)
            engines.append(resolve(None))
        else:
            names.append(PyBytes_FromStringAndSize(<const char*>p + plain.model_at, plain.model_len))
            engines.append(resolve(PyUnicode_DecodeUTF8(<const char*>p + plain.model_at, plain.model_len, NULL)))
        return len(names) - 1

    cdef int _encode_group(self, Py_ssize_t g, tuple group, tuple engine, Py_ssize_t limit) except -1:
        """One engine call for a group's texts, and each member's reply written from its buffers; a
        member the engine or the reply budget refuses stays for Python (which names the error)."""
        cdef Py_ssize_t i, first = 0, bound, size
        cdef Job* job
        cdef bytes flat, ends, tail = engine[1]
        cdef const unsigned char* rid
        cdef Message m
        cdef unsigned char* o
        try:
            flat, ends = engine[0](group[2], add_special_tokens=group[1])
        except Exception:  # noqa: a text the batch call refuses: each job alone, in Python
            for i in range(self.count):
                if self.jobs[i].group == g:
                    self.jobs[i].group = NOT_PLAIN
            return 0
        for i in range(self.count):
            job = &self.jobs[i]
            if job.group != g:
                continue
            check_ends(<const unsigned char*>PyBytes_AS_STRING(ends), PyBytes_GET_SIZE(ends), PyBytes_GET_SIZE(flat) // 4,
                       first, job.plain.n, job.plain.batch)
            m = self.messages[job.message]
            rid = m.data + job.at + job.plain.rid_at if job.plain.rid_at >= 0 else <const unsigned char*>b"\xc0"
            bound = reply_bound(<const unsigned char*>PyBytes_AS_STRING(ends), first, job.plain.n, job.plain.batch,
                                job.plain.u32, job.plain.rid_len if job.plain.rid_at >= 0 else 1, PyBytes_GET_SIZE(tail), limit)
            if bound >= 0:
                o = self._room_blob(bound)
                size = write_reply(o, <const unsigned char*>PyBytes_AS_STRING(flat), <const unsigned char*>PyBytes_AS_STRING(ends),
                                   first, job.plain.n, job.plain.batch, job.plain.u32, rid,
                                   job.plain.rid_len if job.plain.rid_at >= 0 else 1,
                                   <const unsigned char*>PyBytes_AS_STRING(tail), PyBytes_GET_SIZE(tail))
                if size <= limit:
                    self.blob_size += size
                    self._record(job.job_id, self.ok, size)
                    job.group = SERVED
            if job.group != SERVED:
                job.group = NOT_PLAIN  # the budget might refuse it: Python builds it (or its error)
            first += job.plain.n
        return 0

    # --- results -----------------------------------------------------------------------

    cdef unsigned char* _room_blob(self, Py_ssize_t need) except NULL:
        cdef unsigned char* grown
        cdef Py_ssize_t cap
        if self.blob_size + need > self.blob_cap or self.blob == NULL:
            cap = max(2 * self.blob_cap, self.blob_size + need, 4096)
            grown = <unsigned char*>realloc(self.blob, cap)
            if grown == NULL:
                raise MemoryError()
            self.blob, self.blob_cap = grown, cap
        return self.blob + self.blob_size

    cdef int _record(self, uint64_t job_id, int outcome, Py_ssize_t size) except -1:
        cdef unsigned char* grown
        cdef unsigned char* o
        if self.head_size + RESULT_BYTES > self.head_cap:
            grown = <unsigned char*>realloc(self.head, max(2 * self.head_cap, 64 * RESULT_BYTES))
            if grown == NULL:
                raise MemoryError()
            self.head, self.head_cap = grown, max(2 * self.head_cap, 64 * RESULT_BYTES)
        o = self.head + self.head_size
        put_le(o + RESULT_ID_AT, job_id, 8)
        o[RESULT_OUTCOME_AT] = <unsigned char>outcome
        put_le(o + RESULT_SIZE_AT, <unsigned long long>size, 4)
        self.head_size += RESULT_BYTES
        self.results += 1
        return 0

    cdef int _result(self, uint64_t job_id, int outcome, const unsigned char* reply, Py_ssize_t size) except -1:
        if size:
            memcpy(self._room_blob(size), reply, size)
            self.blob_size += size
        return self._record(job_id, outcome, size)

    def add(self, list results not None):
        """Python's (job id, outcome, reply bytes) results, in the same W_RESULTS message."""
        cdef bytes reply
        for job_id, outcome, reply in results:
            self._result(job_id, self.outcome_index.get(outcome, self.internal),
                         <const unsigned char*>PyBytes_AS_STRING(reply), PyBytes_GET_SIZE(reply))

    def send(self, sock) -> int:
        """Send the results as one W_RESULTS message (the replies' frame handed to libzmq, no copy),
        and start the next round; the number sent, or -1 when the socket's send timeout passed (the
        message is dropped, as workers/main.py's `_send` drops one). Nothing goes out for no result."""
        cdef void* s = handle_of(sock)
        cdef zmq_msg_t frame
        cdef int rc, sent = <int>self.results
        cdef const char* kind = self.results_kind
        try:
            if not self.results:
                return 0
            with nogil:
                rc = zmq_send(s, kind, 1, ZMQ_SNDMORE)
                if rc >= 0:
                    rc = zmq_send(s, self.head, self.head_size, ZMQ_SNDMORE)
                if rc >= 0:
                    if self.blob_size:
                        zmq_msg_init_data(&frame, self.blob, self.blob_size, _free_frame, NULL)
                        self.blob, self.blob_size, self.blob_cap = NULL, 0, 0  # libzmq's now, sent or not
                        rc = zmq_msg_send(&frame, s, 0)
                        if rc < 0:
                            zmq_msg_close(&frame)
                    else:
                        rc = zmq_send(s, kind, 0, 0)
            if rc < 0:
                if zmq_errno() == EAGAIN:
                    return -1
                raise zmq.ZMQError(zmq_errno(), zmq_error(zmq_errno()))
            return sent
        finally:
            self.count = self.head_size = self.blob_size = self.results = 0
            self.messages = []
