# cython: language_level=3, boundscheck=False, wraparound=False
"""The client's packer: a request's fields as MessagePack, byte for byte what
`msgpack.Packer(use_bin_type=True)` writes, for plain values (exact str, bytes, bytearray, int,
bool, float, None, list, tuple, dict); any other type raises TypeError and the caller packs that
body with msgpack itself.

A request is its op's fields packed once (`Call.head`, `pack_entries`) plus `id` and
`deadline_ms`, written at each send (`request`; `_frames` writes them straight into a frame): a
re-send after failover or `overloaded` repacks nothing else. `tokenize_head` is the hot call's
fields in one call; `heads` a batch's fields, which differ in one value.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE
from cpython.float cimport PyFloat_AS_DOUBLE
from libc.stdint cimport uint64_t, int64_t

from tokenbroker.common._pack cimport (Buf, buf_array_head, buf_bin_head, buf_byte, buf_bytes, buf_f64, buf_free,
                           buf_grow, buf_int, buf_map_head, buf_put, buf_str_head, buf_take, buf_uint)

cdef extern from "Python.h":
    const char* PyUnicode_AsUTF8AndSize(object, Py_ssize_t*) except NULL
    int64_t PyLong_AsLongLongAndOverflow(object, int*) except? -1
    uint64_t PyLong_AsUnsignedLongLong(object) except? -1

DEF MAX_DEPTH = 256  # containers nested deeper than this are refused (the contract sends depth <= 4)


cdef int pack_int(Buf* b, object o) except -1:
    """A Python int as msgpack packs it: the smallest format that holds it; OverflowError past 64 bits."""
    cdef int overflow = 0
    cdef int64_t x = PyLong_AsLongLongAndOverflow(o, &overflow)
    if overflow > 0:
        return buf_uint(b, PyLong_AsUnsignedLongLong(o))  # OverflowError past 2**64 - 1, as msgpack
    if overflow < 0:
        raise OverflowError("int too big to convert")
    return buf_int(b, x)


cdef int pack_value(Buf* b, object o, int depth) except -1:
    cdef type t = type(o)
    cdef Py_ssize_t n
    cdef const char* p
    if depth > MAX_DEPTH:
        raise ValueError("nested too deep")
    if t is str:
        p = PyUnicode_AsUTF8AndSize(o, &n)
        buf_str_head(b, n)
        return buf_put(b, p, n)
    if t is int:
        return pack_int(b, o)
    if t is bool:
        return buf_byte(b, 0xc3 if o else 0xc2)
    if o is None:
        return buf_byte(b, 0xc0)
    if t is bytes:
        n = PyBytes_GET_SIZE(o)
        buf_bin_head(b, n)
        return buf_put(b, PyBytes_AS_STRING(o), n)
    if t is dict:
        buf_map_head(b, len(<dict>o))
        for k, v in (<dict>o).items():
            pack_value(b, k, depth + 1)
            pack_value(b, v, depth + 1)
        return 0
    if t is list or t is tuple:
        buf_array_head(b, len(o))
        for v in o:
            pack_value(b, v, depth + 1)
        return 0
    if t is float:
        return buf_f64(b, PyFloat_AS_DOUBLE(o))
    if t is bytearray:
        n = len(o)
        buf_bin_head(b, n)
        return buf_put(b, <const char*>(<bytearray>o), n)
    raise TypeError(f"not a plain value: {t.__name__}")


def pack(object value) -> bytes:
    """`value` as msgpack.Packer(use_bin_type=True) packs it; TypeError for a type not listed above."""
    cdef Buf b = Buf(NULL, 0, 0)
    try:
        pack_value(&b, value, 0)
    except BaseException:
        buf_free(&b)
        raise
    return buf_take(&b)


def pack_entries(dict fields) -> bytes:
    """A map's key/value pairs without its header: a request's `head` (its count is len(fields))."""
    cdef Buf b = Buf(NULL, 0, 0)
    try:
        for k, v in fields.items():
            pack_value(&b, k, 1)
            pack_value(&b, v, 1)
    except BaseException:
        buf_free(&b)
        raise
    return buf_take(&b)


cdef bytes request_bytes(bytes head, Py_ssize_t nkeys, object rid, long long deadline_ms):
    cdef Buf b = Buf(NULL, 0, 0)
    cdef Py_ssize_t n = PyBytes_GET_SIZE(head)
    try:
        buf_grow(&b, n + 32)
        buf_map_head(&b, nkeys + 2)
        buf_put(&b, PyBytes_AS_STRING(head), n)
        buf_put(&b, "\xa2id", 3)
        pack_int(&b, rid)
        buf_put(&b, "\xabdeadline_ms", 12)
        buf_int(&b, deadline_ms)
    except BaseException:
        buf_free(&b)
        raise
    return buf_take(&b)


def request(bytes head, Py_ssize_t nkeys, object rid, long long deadline_ms) -> bytes:
    """One request map: the fields packed in `head` (`nkeys` of them), then `id`, then `deadline_ms`:
    the bytes msgpack writes for that dict in that order."""
    return request_bytes(head, nkeys, rid, deadline_ms)


def tokenize_head(object text, object add_special_tokens, object model, object affinity) -> tuple:
    """The packed fields of a plain `tokenize` (`text`, `add_special_tokens`, u32 ids, `model` and
    `affinity` when not None), and how many: what pack_entries gives for that dict, in one call."""
    cdef Buf b = Buf(NULL, 0, 0)
    cdef Py_ssize_t n = 4
    try:
        buf_put(&b, "\xa2op\xa8tokenize\xa4text", 17)
        pack_value(&b, text, 1)
        buf_put(&b, "\xb2add_special_tokens", 19)
        pack_value(&b, add_special_tokens, 1)
        buf_put(&b, "\xadtokens_format\xa3u32", 18)
        if model is not None:
            buf_put(&b, "\xa5model", 6)
            pack_value(&b, model, 1)
            n += 1
        if affinity is not None:
            buf_put(&b, "\xa8affinity", 9)
            pack_value(&b, affinity, 1)
            n += 1
    except BaseException:
        buf_free(&b)
        raise
    return buf_take(&b), n


def heads(bytes prefix, list values, bytes suffix) -> list:
    """`prefix + pack(v) + suffix` for each value: the heads of a batch's requests, which differ in one field."""
    cdef Buf b = Buf(NULL, 0, 0)
    cdef list out = []
    cdef Py_ssize_t np = PyBytes_GET_SIZE(prefix), ns = PyBytes_GET_SIZE(suffix)
    try:
        for v in values:
            b.size = 0
            buf_put(&b, PyBytes_AS_STRING(prefix), np)
            pack_value(&b, v, 1)
            buf_put(&b, PyBytes_AS_STRING(suffix), ns)
            out.append(buf_bytes(&b))
    finally:
        buf_free(&b)
    return out
