# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""The broker's reader of client requests, compiled: a request's common fields read off the frame in
one bounded pass, and where its inputs lie, without building a Python object for anything routing
does not read (`peek_request` for a map, `peek_array` for contract 1.2's array of them).

Why compiled: issue 22's profile showed the Python path tuned as far as it goes (about 35 small
Python calls per request, none above 15%). Here a frame is walked once with the shared wire reader
(common/_wire.pxd): header fields are compared as bytes, every other value is jumped over by the
length in its header.

What it gives Python (broker/loop.py, broker/frontend.py): a `Peek` per request, alone or per
element of an array, with `op` (one of the interned op names), `model`, `deadline_ms`, `affinity`
decoded, `raw_id` (the id's bytes as they came) and `body` (the request's own bytes, a view of the
frame for an array element); for a lone request the `ProtocolError` that answers it, for an
array's element a Peek with `code` and `message` set.

Hostile bytes meet this code first. Every read is bounded by the frame's end (the wire reader's
contract), and contract 1.4's bounds are checked in the same pass, before any work: an array of
more than ARRAY_REQUESTS requests is refused from its header (one reply, nothing served); a value
nested deeper than DEPTH refuses its request alone (stepped over by the unbounded skipper, so the
fields after it, and the array's other elements, are read); a map of more than FIELDS fields is
refused after one walk in C that finds its id (a 29 MB map of 3 million unknown keys costs ~30 ms,
where the worker's decode would cost seconds); a key given twice is refused naming it. str keys and
the str values the broker reads are checked as strict UTF-8, as msgpack would decode them.
"""

from cpython.buffer cimport PyObject_GetBuffer, PyBuffer_Release, PyBUF_SIMPLE
from cpython.bytes cimport PyBytes_FromStringAndSize
from cpython.mem cimport PyMem_Malloc, PyMem_Free
from cpython.unicode cimport PyUnicode_DecodeUTF8
from libc.string cimport memcmp, memcpy, memset

from tokenbroker.broker._hash cimport mix64, u64, uchar
from tokenbroker.common._wire cimport (Head, read_head, skip, skip_any, utf8_valid, utf8_fault, id_fault, is_map_head,
                           is_array_head, K_NIL, K_BOOL, K_INT, K_UINT, K_FLOAT, K_STR, K_BIN, K_ARRAY, K_MAP,
                           W_OK, W_TRUNCATED, W_INVALID, W_TOO_DEEP, W_TOO_LONG)

from os import urandom
from sys import intern as _intern

from tokenbroker.common.errors import ProtocolError
from tokenbroker.common.protocol import MAX_DEADLINE_MS, NIL, OPS, repeated_key

MAX_DEPTH = DEPTH
MAX_FIELDS = FIELDS
MAX_ARRAY_REQUESTS = ARRAY_REQUESTS


INPUT_FIELDS = ("text", "messages", "tools", "chat_template_kwargs", "body")
cdef int FIRST_INPUT = F_TEXT


cdef int _field_of(const uchar* k, Py_ssize_t n) noexcept nogil:
    """Which field a key names (its bytes), or -1."""
    if n == 2:
        return F_ID if memcmp(k, b"id", 2) == 0 else (F_OP if memcmp(k, b"op", 2) == 0 else -1)
    if n == 4:
        return F_TEXT if memcmp(k, b"text", 4) == 0 else (F_BODY if memcmp(k, b"body", 4) == 0 else -1)
    if n == 5:
        if memcmp(k, b"model", 5) == 0:
            return F_MODEL
        return F_TOOLS if memcmp(k, b"tools", 5) == 0 else -1
    if n == 8:
        if memcmp(k, b"affinity", 8) == 0:
            return F_AFFINITY
        return F_MESSAGES if memcmp(k, b"messages", 8) == 0 else -1
    if n == 11:
        return F_DEADLINE if memcmp(k, b"deadline_ms", 11) == 0 else -1
    if n == 13:
        return F_FORMAT if memcmp(k, b"tokens_format", 13) == 0 else -1
    if n == 20:
        return F_KWARGS if memcmp(k, b"chat_template_kwargs", 20) == 0 else -1
    return -1


# The ops, as the interned str each request's `op` is: common/protocol.py OPS is the one list.
cdef tuple _OP_NAMES = tuple(sorted([_intern(op) for op in OPS]))
cdef tuple _OP_BYTES = tuple([op.encode() for op in _OP_NAMES])


cdef str _op_of(const uchar* k, Py_ssize_t n):
    """The interned op a str names, or None when it names none."""
    cdef Py_ssize_t i
    cdef bytes name
    for i in range(len(_OP_BYTES)):
        name = <bytes>_OP_BYTES[i]
        if len(name) == n and memcmp(<const char*>name, k, n) == 0:
            return <str>_OP_NAMES[i]
    return None


cdef str _type_name(Head* h):
    """What msgpack would decode a value of this header as, named as common/protocol.type_name does."""
    cdef int k = h.kind
    if k == K_NIL:
        return "nil"
    if k == K_BOOL:
        return "bool"
    if k == K_INT or k == K_UINT:
        return "int"
    if k == K_FLOAT:
        return "float"
    if k == K_STR:
        return "str"
    if k == K_BIN:
        return "bin"
    if k == K_ARRAY:
        return "list"
    if k == K_MAP:
        return "map"
    return "ext"


def first_type(raw) -> str:
    """What the first MessagePack value of `raw` is, from its first byte (nothing decoded)."""
    if not raw:
        return "nothing (empty payload)"
    b = raw[0]
    if b <= 0x7F or 0xE0 <= b or 0xCC <= b <= 0xD3:
        return "int"
    if 0x90 <= b <= 0x9F or b in (0xDC, 0xDD):
        return "list"
    if 0x80 <= b <= 0x8F or b in (0xDE, 0xDF):
        return "map"
    if 0xA0 <= b <= 0xBF or b in (0xD9, 0xDA, 0xDB):
        return "str"
    names = {0xC0: "nil", 0xC2: "bool", 0xC3: "bool", 0xC4: "bin", 0xC5: "bin", 0xC6: "bin", 0xCA: "float", 0xCB: "float"}
    if b in names:
        return names[b]
    if b in (0xC7, 0xC8, 0xC9) or 0xD4 <= b <= 0xD8:
        return "ext"
    return f"bytes that are not MessagePack (starting 0x{bytes(raw[:1]).hex()})"


cdef str _fault_name(Py_ssize_t rc):
    if rc == W_TRUNCATED:
        return "truncated"
    if rc == W_INVALID:
        return "byte 0xc1 begins no MessagePack value"
    if rc == W_TOO_DEEP:
        return f"nested deeper than {DEPTH} levels"
    return "a container claims more items than the bytes left hold"


cdef str _broken(const uchar* p, Py_ssize_t start, Py_ssize_t end, Py_ssize_t rc):
    """Why a frame that is not one bounded MessagePack value is refused (bad_request)."""
    cdef str starting = f", starting 0x{p[start]:02x}" if start < end else ", empty"
    return f"payload is not valid MessagePack ({end - start} bytes{starting}): {_fault_name(rc)}"


cdef class Peek:
    """A request as the broker sees it: the common fields, checked, and where its inputs lie.

    `raw` is the frame it came in (bytes, or a view of ZeroMQ's buffer for a large one); `body` is
    the request's own bytes, what the worker gets: the frame itself for a lone map, a view of it
    for an element of an array (no copy until ZeroMQ takes it).

    An element of an array that the broker refuses is a Peek too, with `code` (bad_request or
    unknown_op) and `message` set and `op` None: an array of 4,096 refused elements costs 4,096
    small objects, never an exception raised or kept per element.
    """


    @property
    def spans(self) -> dict:
        """Input field -> (start, end) of its raw value in `raw`."""
        cdef int i
        return {INPUT_FIELDS[i - FIRST_INPUT]: (self.s[i], self.e[i]) for i in range(FIRST_INPUT, NFIELDS) if self.s[i] >= 0}

    def __repr__(self) -> str:
        if self.code is not None:
            return f"Peek(code={self.code!r}, message={self.message!r}, raw_id={self.raw_id!r})"
        return f"Peek(op={self.op!r}, model={self.model!r}, raw_id={self.raw_id!r}, {len(self.body)} bytes)"


cdef inline int _refuse(Peek out, str code, str message) except -1:
    """Keep the first fault found (the walk goes on to the map's end, to read its id)."""
    if out.code is None:
        out.code = code
        out.message = message
    return 0


cdef struct Key:
    u64 hash
    const uchar* at
    Py_ssize_t n


# The key hash's seed, drawn per process: which keys share a slot of `_repeated`'s table cannot be
# chosen by a client (a key of at most 8 bytes never shares a hash: one word through a bijection).
cdef u64 KEY_SEED = int.from_bytes(urandom(8), "little")


cdef inline u64 _key_hash(const uchar* k, Py_ssize_t n) noexcept nogil:
    """64 bits of a key's bytes, a word at a time (keys are short: a full digest would cost more)."""
    cdef u64 h = KEY_SEED ^ (<u64>n * 0x9E3779B97F4A7C15ULL), w
    while n >= 8:
        memcpy(&w, k, 8)
        h = mix64(h ^ w)
        k += 8
        n -= 8
    if n > 0:
        w = 0
        memcpy(&w, k, n)
        h = mix64(h ^ w ^ 0xA5A5A5A5A5A5A5A5ULL)
    return h


cdef inline bint _same(const Key* a, const Key* b) noexcept nogil:
    return a.hash == b.hash and a.n == b.n and memcmp(a.at, b.at, a.n) == 0


cdef Py_ssize_t _repeated(Key* keys, Py_ssize_t n) except -2:
    """The index of a key that equals an earlier one, or -1: each key hashed once (linear in its
    bytes), then a few pairs compared, or an open-addressed table of twice as many slots filled,
    so only keys of equal hash are compared byte by byte: one pass, however many keys (at most
    FIELDS)."""
    cdef Py_ssize_t i, j, size = 1, slot
    cdef Py_ssize_t* table
    if n <= SMALL_KEYS:
        for i in range(1, n):
            for j in range(i):
                if _same(&keys[i], &keys[j]):
                    return i
        return -1
    while size < 2 * n:
        size <<= 1
    table = <Py_ssize_t*>PyMem_Malloc(size * sizeof(Py_ssize_t))
    if table == NULL:
        raise MemoryError()
    memset(table, 0xFF, size * sizeof(Py_ssize_t))  # every slot -1: empty
    try:
        for i in range(n):
            slot = <Py_ssize_t>(keys[i].hash & <u64>(size - 1))
            while table[slot] >= 0:
                if _same(&keys[i], &keys[table[slot]]):
                    return i
                slot = (slot + 1) & (size - 1)
            table[slot] = i
        return -1
    finally:
        PyMem_Free(table)


cdef str _twice(const uchar* k, Py_ssize_t n):
    """A repeated key's bad_request, in common/protocol.py's words (the worker's too). Only a refusal
    pays for it; every key that gets here was checked UTF-8."""
    return repeated_key(PyUnicode_DecodeUTF8(<const char*>k, n, "replace")).message


cdef enum:
    SMALL_KEYS = 16   # unknown keys held on the stack; a larger map's are allocated


cdef Py_ssize_t _walk(const uchar* p, Py_ssize_t start, Py_ssize_t end, Peek out) except -9:
    """Read the map at `start` into `out` in one bounded pass: each key once, the fields checked as
    common/protocol.common_fields checks them, in its order. Returns where the map ends, with
    `out.code` set when the request is refused (by the first fault found: the walk still reads on
    to the end, so the refusal carries the id wherever it lies); or a Fault (negative) when the
    bytes are not one MessagePack map, `out.message` saying why (then nothing after it can be
    read, and `out.raw_id` is the id read so far).

    Contract 1.4's bounds: more than FIELDS fields, a value nested deeper than DEPTH (stepped over
    with the unbounded skipper, so the fields after it are read) and a key given twice are refused."""
    cdef Head h, kh, vh
    cdef Py_ssize_t pos = start, kat, vend, i, n, nkeys = 0, dup
    cdef int rc, f
    cdef unsigned int seen = 0
    cdef bint id_bad = False
    cdef const uchar* k
    cdef Key small[SMALL_KEYS]
    cdef Key* keys = small
    cdef str fault
    out.raw_id = NIL
    out.code = None
    for i in range(NFIELDS):
        out.s[i] = -1
    rc = read_head(p, end, &pos, &h)
    if rc != W_OK:
        out.message = _broken(p, start, end, rc)
        return rc
    if h.length > FIELDS:  # refused, but walked (in C, ~10 ns a field) so the answer carries its id
        _refuse(out, "bad_request", f"payload map has {h.length} fields; a request has at most {FIELDS}")
    elif h.length > SMALL_KEYS:
        keys = <Key*>PyMem_Malloc(h.length * sizeof(Key))
        if keys == NULL:
            raise MemoryError()
    try:
        for i in range(h.length):
            kat = pos
            rc = read_head(p, end, &pos, &kh)
            if rc != W_OK:
                out.message = _broken(p, start, end, rc)
                return rc
            f = -2
            if kh.kind != K_STR:
                _refuse(out, "bad_request", f"payload map keys must be str, got {_type_name(&kh)}")
                pos = skip_any(p, end, kat)
                if pos < 0:
                    out.message = _broken(p, start, end, pos)
                    return pos
            else:
                k = p + pos
                pos += kh.length
                f = _field_of(k, kh.length)
                if f >= 0:
                    if seen & (1u << f):  # a field given twice: refused, its second value not read
                        _refuse(out, "bad_request", _twice(k, kh.length))
                        if f == F_ID:
                            id_bad = True
                        f = -2
                    else:
                        seen |= 1u << f
                elif not utf8_valid(k, kh.length):
                    _refuse(out, "bad_request", utf8_fault(k, kh.length))
                elif h.length <= FIELDS:
                    keys[nkeys].hash = _key_hash(k, kh.length)
                    keys[nkeys].at = k
                    keys[nkeys].n = kh.length
                    nkeys += 1
            vend = skip(p, end, pos, DEPTH)
            if vend == W_TOO_DEEP:
                _refuse(out, "bad_request", f"payload holds a value nested deeper than {DEPTH} levels")
                vend = skip_any(p, end, pos)
            if vend < 0:
                out.message = _broken(p, start, end, vend)
                return vend
            if f == F_ID:
                fault = id_fault(p + pos, vend - pos)
                if fault is not None:
                    _refuse(out, "bad_request", fault)
                    id_bad = True
                elif not id_bad:
                    out.raw_id = NIL if vend - pos == 1 and p[pos] == 0xC0 else PyBytes_FromStringAndSize(
                        <const char*>(p + pos), vend - pos)
            elif f >= 0:
                if F_OP <= f <= F_FORMAT:  # a str the broker decodes: msgpack would refuse invalid UTF-8 here
                    n = pos
                    read_head(p, end, &n, &vh)
                    if vh.kind == K_STR and not utf8_valid(p + n, vh.length):
                        _refuse(out, "bad_request", utf8_fault(p + n, vh.length))
                out.s[f] = pos
                out.e[f] = vend
            pos = vend
        if out.code is None and nkeys > 1:
            dup = _repeated(keys, nkeys)
            if dup >= 0:
                _refuse(out, "bad_request", _twice(keys[dup].at, keys[dup].n))
    finally:
        if keys != small:
            PyMem_Free(keys)
    if id_bad:
        out.raw_id = NIL
    if out.code is None:
        _common(p, end, out)
    return pos


cdef int _common(const uchar* p, Py_ssize_t end, Peek out) except -1:
    """The checks of common/protocol.common_fields, on the raw values, in its order; the first
    that fails is the request's refusal."""
    cdef Head h
    cdef Py_ssize_t pos
    cdef long long v
    cdef str op
    # op
    pos = out.s[F_OP]
    if pos < 0:
        return _refuse(out, "bad_request", "field 'op' is required")
    read_head(p, end, &pos, &h)
    if h.kind == K_NIL:
        return _refuse(out, "bad_request", "field 'op' is required")
    if h.kind != K_STR:
        return _refuse(out, "bad_request", f"field 'op' must be str, got {_type_name(&h)}")
    op = _op_of(p + pos, h.length)
    if op is None:
        name = PyUnicode_DecodeUTF8(<const char*>(p + pos), h.length, NULL)
        return _refuse(out, "unknown_op", f"field 'op' is {name!r}; expected one of {', '.join(_OP_NAMES)}")
    out.op = op
    # deadline_ms
    out.deadline_ms = None
    pos = out.s[F_DEADLINE]
    if pos >= 0:
        read_head(p, end, &pos, &h)
        if h.kind == K_UINT:
            if h.uval == 0:
                return _refuse(out, "bad_request", "field 'deadline_ms' must be an int > 0, got 0")
            out.deadline_ms = MAX_DEADLINE_MS if h.uval > MAX_DEADLINE_MS else <long long>h.uval
        elif h.kind == K_INT:
            v = h.ival
            if v <= 0:
                return _refuse(out, "bad_request", f"field 'deadline_ms' must be an int > 0, got {v}")
            out.deadline_ms = MAX_DEADLINE_MS if v > MAX_DEADLINE_MS else v
        elif h.kind != K_NIL:
            return _refuse(out, "bad_request", f"field 'deadline_ms' must be int, got {_type_name(&h)}")
    # tokens_format
    pos = out.s[F_FORMAT]
    if pos >= 0:
        read_head(p, end, &pos, &h)
        if h.kind == K_STR:
            if not ((h.length == 4 and memcmp(p + pos, b"list", 4) == 0) or (h.length == 3 and memcmp(p + pos, b"u32", 3) == 0)):
                fmt = PyUnicode_DecodeUTF8(<const char*>(p + pos), h.length, NULL)
                return _refuse(out, "bad_request", f"field 'tokens_format' must be \"list\" or \"u32\", got {fmt!r}")
        elif h.kind != K_NIL:
            return _refuse(out, "bad_request", f"field 'tokens_format' must be str, got {_type_name(&h)}")
    # model, affinity
    if _opt_str(p, end, out.s[F_MODEL], "model", out) == 0:
        _opt_str(p, end, out.s[F_AFFINITY], "affinity", out)
    return 0


cdef int _opt_str(const uchar* p, Py_ssize_t end, Py_ssize_t pos, str name, Peek out) except -2:
    """An optional str field into `out` (model, affinity); -1 when it is refused."""
    cdef Head h
    value = None
    if pos >= 0:
        read_head(p, end, &pos, &h)
        if h.kind == K_STR:
            value = PyUnicode_DecodeUTF8(<const char*>(p + pos), h.length, NULL)
        elif h.kind != K_NIL:
            _refuse(out, "bad_request", f"field '{name}' must be str, got {_type_name(&h)}")
            return -1
    if name == "model":
        out.model = value
    else:
        out.affinity = value
    return 0


cdef inline void _unread(Peek out, object raw, bytes raw_id, str message):
    """A refused element that is not a map: no field of it is read."""
    cdef int i
    for i in range(NFIELDS):
        out.s[i] = -1
    out.raw = raw
    out.raw_id = raw_id
    out.code = "bad_request"
    out.message = message


# --- frames ------------------------------------------------------------------------------

cpdef Peek peek_request(object raw):
    """Read a payload frame that holds one request map (bytes, or a view of ZeroMQ's buffer: read
    in place, never copied); the ProtocolError that answers it otherwise."""
    cdef Py_buffer buf
    cdef const uchar* p
    cdef Py_ssize_t end, stop
    cdef Peek out
    PyObject_GetBuffer(raw, &buf, PyBUF_SIMPLE)
    try:
        p = <const uchar*>buf.buf
        end = buf.len
        if end == 0 or not is_map_head(p[0]):
            raise ProtocolError("bad_request", f"payload must be a map, got {first_type(memoryview(raw)[:9])}", NIL)
        out = Peek.__new__(Peek)
        stop = _walk(p, 0, end, out)
        if stop < 0:
            raise ProtocolError("bad_request", out.message, out.raw_id)
        if out.code is not None:
            raise ProtocolError(out.code, out.message, out.raw_id)
        if stop != end:
            raise ProtocolError("bad_request", "payload holds more than one MessagePack value: send one map", out.raw_id)
    finally:
        PyBuffer_Release(&buf)
    out.raw = raw
    out.body = raw
    return out


cpdef list peek_array(object raw):
    """The requests of a frame that is an array (contract 1.2, "Several requests in one frame"), in
    one bounded pass: each element a Peek, its `body` a view of the frame, or with `code` set when
    the broker refuses it (contract 1.4: that element alone). Raises ProtocolError (id nil) when the
    frame itself cannot be read or holds more than ARRAY_REQUESTS elements (checked from its
    header, before any element is read): then nothing in it is served and one reply answers it. So
    does an array with no map in it: that is a payload of the wrong type, answered as 1.1 answers
    one. An empty array is no request: [] (no reply)."""
    cdef Py_buffer buf
    cdef const uchar* p
    cdef Py_ssize_t end, pos = 0, start, stop, i, count
    cdef Head h
    cdef int rc
    cdef Peek peek
    cdef list out = []
    cdef int maps = 0
    view = memoryview(raw)
    PyObject_GetBuffer(raw, &buf, PyBUF_SIMPLE)
    try:
        p = <const uchar*>buf.buf
        end = buf.len
        rc = read_head(p, end, &pos, &h)
        if rc == W_TOO_LONG:
            raise ProtocolError("bad_request", f"payload is truncated: the array claims more requests than its "
                                f"{end} bytes hold", NIL)
        if rc != W_OK or h.kind != K_ARRAY:
            raise ProtocolError("bad_request", _broken(p, 0, end, rc if rc != W_OK else W_INVALID), NIL)
        count = h.length
        if count > ARRAY_REQUESTS:
            raise ProtocolError("bad_request", f"payload is an array of {count} requests; an array holds at most "
                                f"{ARRAY_REQUESTS}", NIL)
        for i in range(count):
            start = pos
            if start >= end:
                raise ProtocolError("bad_request", f"payload is truncated: the array says {count} requests, "
                                    f"the frame holds {i}", NIL)
            peek = Peek.__new__(Peek)
            if is_map_head(p[start]):
                maps += 1
                stop = _walk(p, start, end, peek)
                peek.raw = raw
            else:
                _unread(peek, raw, NIL, f"request [{i}] of the array must be a map, got {first_type(view[start:start + 9])}")
                stop = skip_any(p, end, start)
            if stop < 0:
                raise ProtocolError("bad_request", f"payload is not valid MessagePack from byte {start}: "
                                    f"{_fault_name(stop)}", NIL)
            peek.body = view[start:stop]
            out.append(peek)
            pos = stop
        if pos != end:
            raise ProtocolError("bad_request", "payload holds more than one MessagePack value: send one array", NIL)
    finally:
        PyBuffer_Release(&buf)
    if maps == 0 and out:
        raise ProtocolError("bad_request", "payload must be a map (or an array of request maps), got list", NIL)
    return out
