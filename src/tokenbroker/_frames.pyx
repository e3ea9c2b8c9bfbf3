# cython: language_level=3, boundscheck=False, wraparound=False
"""The client's framer: one loop turn's requests cut into frames (contract 1.2 arrays, bounded in
calls and bytes), each call's request written straight into its frame from its packed fields
(`Call.head`) with its id and what is left of its deadline at the flush: no bytes per call. `send`
writes each frame in place into the message libzmq sends (common/_zmq.pxd, on the socket pyzmq
opened): no bytes per frame either.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from libc.string cimport memcpy
from libc.stdint cimport uint64_t

from tokenbroker.common._pack cimport array_head_size, put_array_head, put_map_head, put_uint, uint_size
from tokenbroker._calls cimport Call, deadline_ms
from tokenbroker.common._zmq cimport (EAGAIN, EINTR, ZMQ_DONTWAIT, handle_of, load_libzmq, zmq_errno, zmq_error,
                                      zmq_msg_close, zmq_msg_data, zmq_msg_init_size, zmq_msg_send, zmq_msg_t)

from zmq import ZMQError

cdef extern from "Python.h":
    uint64_t PyLong_AsUnsignedLongLong(object) except? -1

load_libzmq()

cdef inline Py_ssize_t _request_size(Call call, long long ms) except -1:
    """Bytes `request_bytes` writes for this call sent with `ms` left: its map head, its fields, its id
    and deadline (ids are this client's counter: positive)."""
    return (array_head_size(call.nkeys + 2) + PyBytes_GET_SIZE(call.head)
            + 3 + uint_size(PyLong_AsUnsignedLongLong(call.id)) + 12 + uint_size(<uint64_t>ms))


cdef inline bint _wanted(object c, dict pending):
    """A queued call still to send: pending, its awaiter still waiting (None, a probe, always is)."""
    cdef Call call
    if c is None:
        return True
    call = <Call>c
    if call.id not in pending:
        return False
    if call.batch is not None:
        return not call.batch.future.done()
    return not call.future.done()


def frames(list calls_out, list payloads, dict pending, Py_ssize_t max_calls, Py_ssize_t max_bytes,
           double now) -> list:
    """The frames of one loop turn as bytes (what `send` hands libzmq, for tests and tools): the
    requests of calls still wanted (`_wanted`), a lone one as its map, several as one MessagePack
    array of at most `max_calls` and `max_bytes` (a larger one alone). A call's payload None is its
    request written here, straight into its frame, with what is left of its deadline at `now` (no
    bytes of its own per call); bytes (a probe) go as they are."""
    cdef list out = []
    _cut(calls_out, payloads, pending, max_calls, max_bytes, now, NULL, out)
    return out


def send(object sock, list calls_out, list payloads, dict pending, Py_ssize_t max_calls, Py_ssize_t max_bytes,
         double now) -> int:
    """The frames of one loop turn (as `frames` cuts them) sent on `sock` without blocking, each
    written in place into the message libzmq sends (`zmq_msg_init_size`): no bytes object per frame
    or call. How many frames went. A frame libzmq has no room for (not with a connected DEALER and
    SNDHWM 0) is dropped, like one the network lost: liveness re-sends its calls, or their
    deadlines fail them."""
    return _cut(calls_out, payloads, pending, max_calls, max_bytes, now, handle_of(sock), None)


cdef Py_ssize_t _cut(list calls_out, list payloads, dict pending, Py_ssize_t max_calls, Py_ssize_t max_bytes,
                     double now, void* handle, list out) except -1:
    """Cut the turn into frames and hand each to `_emit` (sent on `handle`, or appended to `out`)."""
    cdef Py_ssize_t n = len(payloads), i, size, first = 0, count = 0, total = 0, sent = 0
    cdef Py_ssize_t* sizes = <Py_ssize_t*>PyMem_Malloc(n * sizeof(Py_ssize_t) + 1)
    cdef object p
    if sizes == NULL:
        raise MemoryError()
    try:
        for i in range(n):
            if not _wanted(calls_out[i], pending):
                sizes[i] = -1
                continue
            p = payloads[i]
            size = _request_size(<Call>calls_out[i], deadline_ms((<Call>calls_out[i]).deadline - now)) if p is None \
                else PyBytes_GET_SIZE(p)
            sizes[i] = size
            if count and (count >= max_calls or total + size > max_bytes):
                sent += _emit(calls_out, payloads, sizes, first, i, count, total, now, handle, out)
                first, count, total = i, 0, 0
            count += 1
            total += size
        if count:
            sent += _emit(calls_out, payloads, sizes, first, n, count, total, now, handle, out)
    finally:
        PyMem_Free(sizes)
    return sent


cdef int _emit(list calls_out, list payloads, Py_ssize_t* sizes, Py_ssize_t first, Py_ssize_t stop,
               Py_ssize_t count, Py_ssize_t total, double now, void* handle, list out) except -1:
    """One frame of entries first..stop (those with a size), of its exact size: a lone one as
    itself, several under an array head; written into a bytes object for `out`, or into a libzmq
    message sent on `handle`. 1 if it went."""
    cdef Py_ssize_t size = total + (0 if count == 1 else array_head_size(count)), i
    cdef zmq_msg_t msg
    cdef bytes frame
    cdef int err
    if handle == NULL:
        if count == 1:
            for i in range(first, stop):
                if sizes[i] >= 0 and payloads[i] is not None:
                    out.append(payloads[i])
                    return 1
        frame = PyBytes_FromStringAndSize(NULL, size)
        _write(<unsigned char*>PyBytes_AS_STRING(frame), calls_out, payloads, sizes, first, stop, count, now)
        out.append(frame)
        return 1
    if zmq_msg_init_size(&msg, size) != 0:
        raise MemoryError()
    try:
        _write(<unsigned char*>zmq_msg_data(&msg), calls_out, payloads, sizes, first, stop, count, now)
    except BaseException:
        zmq_msg_close(&msg)
        raise
    while zmq_msg_send(&msg, handle, ZMQ_DONTWAIT) < 0:
        err = zmq_errno()
        if err == EINTR:
            continue
        zmq_msg_close(&msg)
        if err == EAGAIN:
            return 0
        raise ZMQError(err, zmq_error(err))
    return 1


cdef int _write(unsigned char* w, list calls_out, list payloads, Py_ssize_t* sizes, Py_ssize_t first, Py_ssize_t stop,
                Py_ssize_t count, double now) except -1:
    """The frame's bytes at `w` (exactly its size): the array head if several, then each request,
    a probe's bytes as they are, a call's written by the pointer writer, sized by _request_size."""
    cdef Py_ssize_t at = 0, i
    cdef unsigned char* o
    cdef Call call
    cdef object p
    if count > 1:
        at = put_array_head(w, count) - w
    for i in range(first, stop):
        if sizes[i] < 0:
            continue
        p = payloads[i]
        if p is not None:
            memcpy(w + at, PyBytes_AS_STRING(p), sizes[i])
        else:
            call = <Call>calls_out[i]
            o = put_map_head(w + at, call.nkeys + 2)
            memcpy(o, PyBytes_AS_STRING(call.head), PyBytes_GET_SIZE(call.head))
            o += PyBytes_GET_SIZE(call.head)
            memcpy(o, b"\xa2id", 3)
            o = put_uint(o + 3, PyLong_AsUnsignedLongLong(call.id))
            memcpy(o, b"\xabdeadline_ms", 12)
            o = put_uint(o + 12, <uint64_t>deadline_ms(call.deadline - now))
            if o != w + at + sizes[i]:  # pragma: no cover - _request_size and the writer disagree
                raise SystemError("a request's size was miscounted")
        at += sizes[i]
    return 0
