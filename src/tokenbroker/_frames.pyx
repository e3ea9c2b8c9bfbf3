# cython: language_level=3, boundscheck=False, wraparound=False
"""The client's framer: one loop turn's requests cut into frames (contract 1.2 arrays, bounded in
calls and bytes), each call's request written straight into its frame from its packed fields
(`Call.head`) with its id and what is left of its deadline at the flush: no bytes per call.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from libc.string cimport memcpy
from libc.stdint cimport uint64_t

from tokenbroker.common._pack cimport array_head_size, put_array_head, put_map_head, put_uint, uint_size
from tokenbroker._calls cimport Call, deadline_ms

cdef extern from "Python.h":
    uint64_t PyLong_AsUnsignedLongLong(object) except? -1


cdef inline Py_ssize_t _request_size(Call call, long long ms) except -1:
    """Bytes `request_bytes` writes for this call sent with `ms` left: its map head, its fields, its id
    and deadline (ids are this client's counter: positive)."""
    cdef Py_ssize_t n = call.nkeys + 2
    return ((1 if n < 16 else 3 if n < 65536 else 5) + PyBytes_GET_SIZE(call.head)
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
    """The frames of one loop turn: the requests of calls still wanted (`_wanted`), a lone one as
    its map, several as one MessagePack array of at most `max_calls` and `max_bytes` (a larger one
    alone). A call's payload None is its request written here, straight into its frame, with what
    is left of its deadline at `now` (no bytes of its own per call); bytes (a probe) go as they are."""
    cdef list out = []
    cdef Py_ssize_t n = len(payloads), i, size, first = 0, count = 0, total = 0
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
                out.append(_frame(calls_out, payloads, sizes, first, i, count, total, now))
                first, count, total = i, 0, 0
            count += 1
            total += size
        if count:
            out.append(_frame(calls_out, payloads, sizes, first, n, count, total, now))
    finally:
        PyMem_Free(sizes)
    return out


cdef bytes _frame(list calls_out, list payloads, Py_ssize_t* sizes, Py_ssize_t first, Py_ssize_t stop,
                  Py_ssize_t count, Py_ssize_t total, double now):
    """Entries first..stop (those with a size) as one frame of the exact size: a lone one as
    itself, several under an array head."""
    cdef Py_ssize_t at = 0 if count == 1 else array_head_size(count), i
    cdef bytes out
    cdef char* w
    cdef unsigned char* o
    cdef Call call
    cdef object p
    if count == 1:
        for i in range(first, stop):
            if sizes[i] >= 0 and payloads[i] is not None:
                return <bytes>payloads[i]
    out = PyBytes_FromStringAndSize(NULL, total + at)
    w = PyBytes_AS_STRING(out)
    if count > 1:
        put_array_head(<unsigned char*>w, count)
    for i in range(first, stop):
        if sizes[i] < 0:
            continue
        p = payloads[i]
        if p is not None:
            memcpy(w + at, PyBytes_AS_STRING(p), sizes[i])
        else:  # the pointer writer, on the frame's own bytes, sized exactly by _request_size
            call = <Call>calls_out[i]
            o = put_map_head(<unsigned char*>w + at, call.nkeys + 2)
            memcpy(o, PyBytes_AS_STRING(call.head), PyBytes_GET_SIZE(call.head))
            o += PyBytes_GET_SIZE(call.head)
            memcpy(o, b"\xa2id", 3)
            o = put_uint(o + 3, PyLong_AsUnsignedLongLong(call.id))
            memcpy(o, b"\xabdeadline_ms", 12)
            o = put_uint(o + 12, <uint64_t>deadline_ms(call.deadline - now))
            if o != <unsigned char*>w + at + sizes[i]:  # pragma: no cover - _request_size and the writer disagree
                raise SystemError("a request's size was miscounted")
        at += sizes[i]
    return out
