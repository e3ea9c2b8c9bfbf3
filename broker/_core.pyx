# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""The broker's per-request work, compiled: read a request's common fields off the frame, check
what routing needs, and derive its route key, without building a Python object for anything
routing does not read.

Why compiled: issue 22's profile showed the Python path tuned as far as it goes (about 35 small
Python calls per request, none above 15%), and the chat route key canonicalized every message in
Python (367 us per 12-message chat). Here a frame is walked once with the shared wire reader
(common/_wire.pxd): header fields are compared as bytes, every other value is jumped over by the
length in its header, and the route key's hash runs over the raw bytes in C.

What it gives Python (broker/loop.py, broker/frontend.py): a `Peek` per request, alone or per
element of a contract-1.2 array, with `op` (one of the interned op names), `model`, `deadline_ms`,
`affinity` decoded, `raw_id` (the id's bytes as they came) and `body` (the request's own bytes, a
view of the frame for an array element); or the `ProtocolError` that answers it.

Hostile bytes meet this code first. Every read is bounded by the frame's end (the wire reader's
contract); a value nested deeper than MAX_DEPTH anywhere in a request refuses the request
(bad_request) instead of forwarding it; a request map of more than MAX_FIELDS fields is refused
from its header alone (a 30 MB map of 3 million unknown keys is answered at once); str keys and
the str values the broker reads are checked as strict UTF-8, as msgpack would decode them.

The route key (see broker/affinity.py for the design): prefix-block hashes at fixed byte offsets
and a rendezvous key, computed with a 128-bit streaming hash of our own (two multiply-xorshift
lanes, SplitMix64 finalizers): routing needs spread and prefix sharing, not a cryptographic
digest, and SHA-256 through hashlib cost a Python call per block.
"""

from cpython.buffer cimport PyObject_GetBuffer, PyBuffer_Release, PyBUF_SIMPLE
from cpython.bytes cimport PyBytes_FromStringAndSize
from cpython.mem cimport PyMem_Malloc, PyMem_Free
from cpython.unicode cimport PyUnicode_DecodeUTF8
from libc.stdlib cimport qsort
from libc.string cimport memcpy, memcmp

from common._wire cimport (Head, read_head, skip, utf8_valid, K_NIL, K_BOOL, K_INT, K_UINT, K_FLOAT, K_STR,
                           K_BIN, K_ARRAY, K_MAP, K_EXT, W_OK, W_TRUNCATED, W_INVALID, W_TOO_DEEP, W_TOO_LONG)

from collections import namedtuple

from tokenbroker.common.errors import ProtocolError

ctypedef unsigned char uchar
ctypedef unsigned long long u64

cdef enum:
    DEPTH = 100           # the deepest a request's values may nest (skipping included)
    FIELDS = 4096         # the most fields one request map may have
    NBLOCKS = 256         # prefix blocks per route key, at most
    DIGEST = 16

MAX_DEPTH = DEPTH
MAX_FIELDS = FIELDS
MAX_BLOCKS = NBLOCKS
DIGEST_BYTES = DIGEST
MIN_BLOCK = 256
MAX_BLOCK = 4096
GROWTH_DIVISOR = 8
NIL = b"\xc0"
MAX_DEADLINE_MS = 2**31 - 1

RouteKey = namedtuple("RouteKey", ["key", "blocks"])
RouteKey.__doc__ = ("Where a request would like to run: `key` the rendezvous key, `blocks` the prefix-block "
                    "hashes, shallow to deep (() when the client gave `affinity` or nothing was hashed).")

# --- block boundaries --------------------------------------------------------------------

cdef Py_ssize_t BOUND[NBLOCKS]


cdef void _init_bounds() noexcept:
    cdef Py_ssize_t pos = 0, step
    cdef int i
    for i in range(NBLOCKS):
        step = pos // GROWTH_DIVISOR
        if step < MIN_BLOCK:
            step = MIN_BLOCK
        if step > MAX_BLOCK:
            step = MAX_BLOCK
        pos += step
        BOUND[i] = pos


_init_bounds()
BOUNDARIES = tuple([BOUND[i] for i in range(NBLOCKS)])
MAX_HASHED_BYTES = BOUND[NBLOCKS - 1]
cdef Py_ssize_t MAXH = BOUND[NBLOCKS - 1]

# --- the hash ----------------------------------------------------------------------------

cdef struct Hash:
    u64 a
    u64 b
    u64 n       # bytes fed
    u64 tail    # bytes not yet a whole word, little end first
    int tn


cdef inline u64 _mix(u64 x) noexcept nogil:
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL
    return x ^ (x >> 31)


cdef inline void h_init(Hash* h) noexcept nogil:
    h.a = 0x243F6A8885A308D3ULL
    h.b = 0x13198A2E03707344ULL
    h.n = 0
    h.tail = 0
    h.tn = 0


cdef inline void _word(Hash* h, u64 w) noexcept nogil:
    h.a = (h.a ^ w) * 0x9E3779B97F4A7C15ULL
    h.a ^= h.a >> 29
    h.b = (h.b + (w ^ 0xC2B2AE3D27D4EB4FULL)) * 0xD6E8FEB86659FD93ULL
    h.b = (h.b << 23) | (h.b >> 41)


cdef void h_update(Hash* h, const uchar* p, Py_ssize_t n) noexcept nogil:
    cdef u64 w
    h.n += <u64>n
    while h.tn and n > 0:
        h.tail |= (<u64>p[0]) << (8 * h.tn)
        h.tn += 1
        p += 1
        n -= 1
        if h.tn == 8:
            _word(h, h.tail)
            h.tail = 0
            h.tn = 0
    while n >= 8:
        memcpy(&w, p, 8)
        _word(h, w)
        p += 8
        n -= 8
    while n > 0:
        h.tail |= (<u64>p[0]) << (8 * h.tn)
        h.tn += 1
        p += 1
        n -= 1


cdef inline void h_len(Hash* h, u64 n) noexcept nogil:
    """A length as 8 bytes (little endian): what frames each part fed, so parts cannot run together."""
    cdef uchar b[8]
    cdef int i
    for i in range(8):
        b[i] = (n >> (8 * i)) & 0xFF
    h_update(h, b, 8)


cdef void h_digest(const Hash* h, uchar* out) noexcept nogil:
    """16 bytes of the state (the state itself goes on: a digest is a copy's)."""
    cdef u64 x = h.a ^ _mix(h.tail ^ ((<u64>h.tn) << 56) ^ (h.n * 0x9FB21C651E98DF25ULL))
    cdef u64 y = h.b + _mix(h.n ^ (h.tail * 0xC13FA9A902A6328FULL))
    cdef u64 d1 = _mix(x ^ ((y << 31) | (y >> 33)))
    cdef u64 d2 = _mix(y ^ (d1 * 0x91E10DA5C79E7B1DULL))
    memcpy(out, &d1, 8)
    memcpy(out + 8, &d2, 8)


cdef bytes _digest_of(const uchar* p, Py_ssize_t n):
    cdef Hash h
    cdef uchar out[DIGEST]
    h_init(&h)
    h_update(&h, p, n)
    h_digest(&h, out)
    return PyBytes_FromStringAndSize(<char*>out, DIGEST)


def digest(data: bytes) -> bytes:
    """The route-key hash of `data` (16 bytes): for tests and tools that reason about keys."""
    cdef const uchar[::1] v = data
    if v.shape[0] == 0:
        return _digest_of(<const uchar*><const char*>b"", 0)
    return _digest_of(&v[0], v.shape[0])


# --- spans and the request ---------------------------------------------------------------

cdef enum:  # fields, by index
    F_ID = 0
    F_OP = 1
    F_MODEL = 2
    F_DEADLINE = 3
    F_AFFINITY = 4
    F_FORMAT = 5
    F_TEXT = 6
    F_MESSAGES = 7
    F_TOOLS = 8
    F_KWARGS = 9
    F_BODY = 10
    NFIELDS = 11

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


# The ops (common/protocol.py OPS), as the interned str each request's `op` is.
cdef str OP_TOKENIZE = "tokenize"
cdef str OP_DETOKENIZE = "detokenize"
cdef str OP_CHAT = "chat"
cdef str OP_COUNT = "count"
cdef str OP_MODELS = "models"
cdef str OP_PING = "ping"
cdef str OP_STREAM = "detokenize_stream"
cdef str OP_ADD = "add_model"
cdef str OP_REMOVE = "remove_model"
cdef tuple _OP_NAMES = (OP_TOKENIZE, OP_DETOKENIZE, OP_CHAT, OP_COUNT, OP_MODELS, OP_PING, OP_STREAM, OP_ADD, OP_REMOVE)
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


cdef inline bint _is_map(uchar b) noexcept nogil:
    return (0x80 <= b <= 0x8F) or b == 0xDE or b == 0xDF


cdef inline bint _is_array(uchar b) noexcept nogil:
    return (0x90 <= b <= 0x9F) or b == 0xDC or b == 0xDD


cdef str _fault_name(Py_ssize_t rc):
    if rc == W_TRUNCATED:
        return "truncated"
    if rc == W_INVALID:
        return "byte 0xc1 begins no MessagePack value"
    if rc == W_TOO_DEEP:
        return f"nested deeper than {DEPTH} levels"
    return "a container claims more items than the bytes left hold"


cdef object _broken(const uchar* p, Py_ssize_t start, Py_ssize_t end, Py_ssize_t rc, bytes raw_id):
    """The bad_request a frame that is not one bounded MessagePack value gets."""
    cdef str starting = f", starting 0x{p[start]:02x}" if start < end else ", empty"
    return ProtocolError("bad_request", f"payload is not valid MessagePack ({end - start} bytes{starting}): "
                         f"{_fault_name(rc)}", raw_id)


cdef object _not_utf8(const uchar* s, Py_ssize_t n, bytes raw_id):
    """The bad_request for a str msgpack would refuse to decode, with Python's own reason."""
    try:
        PyUnicode_DecodeUTF8(<const char*>s, n, NULL)
        reason = "invalid UTF-8"
    except UnicodeDecodeError as e:
        reason = e.reason
    return ProtocolError("bad_request", f"payload holds a str that is not valid UTF-8: {reason}", raw_id)


cdef str _str_at(const uchar* p, Py_ssize_t start, Py_ssize_t end):
    """The str at `start`, decoded (the caller checked it is a valid str)."""
    cdef Head h
    cdef Py_ssize_t pos = start
    read_head(p, end, &pos, &h)
    return PyUnicode_DecodeUTF8(<const char*>(p + pos), h.length, NULL)


cdef class Peek:
    """A request as the broker sees it: the common fields, checked, and where its inputs lie.

    `raw` is the frame it came in (bytes, or a view of ZeroMQ's buffer for a large one); `body` is
    the request's own bytes, what the worker gets: the frame itself for a lone map, a view of it
    for an element of an array (no copy until ZeroMQ takes it).
    """

    cdef public object raw
    cdef public bytes raw_id
    cdef public str op
    cdef public object model
    cdef public object deadline_ms
    cdef public object affinity
    cdef public object body
    cdef Py_ssize_t s[NFIELDS]   # where each field's value starts in raw (-1: absent)
    cdef Py_ssize_t e[NFIELDS]   # and ends

    @property
    def spans(self) -> dict:
        """Input field -> (start, end) of its raw value in `raw`."""
        cdef int i
        return {INPUT_FIELDS[i - FIRST_INPUT]: (self.s[i], self.e[i]) for i in range(FIRST_INPUT, NFIELDS) if self.s[i] >= 0}

    def value(self, name: str):
        """The raw MessagePack bytes of an input field, or None when absent."""
        span = self.spans.get(name)
        return None if span is None else self.raw[span[0]:span[1]]

    def __repr__(self) -> str:
        return f"Peek(op={self.op!r}, model={self.model!r}, raw_id={self.raw_id!r}, {len(self.body)} bytes)"


cdef Py_ssize_t _walk(const uchar* p, Py_ssize_t start, Py_ssize_t end, Peek out) except -2:
    """Read the map at `start` into `out` (fields checked as common/protocol.common_fields checks
    them, in its order); where the map ends. Raises the ProtocolError that answers it, carrying the
    id read so far."""
    cdef Head h, kh, vh
    cdef Py_ssize_t pos = start, kat, vend, i, n
    cdef int rc, f
    cdef const uchar* k
    cdef bytes raw_id = NIL
    for i in range(NFIELDS):
        out.s[i] = -1
    rc = read_head(p, end, &pos, &h)
    if rc != W_OK:
        raise _broken(p, start, end, rc, raw_id)
    if h.length > FIELDS:
        raise ProtocolError("bad_request", f"payload map has {h.length} fields; a request has at most {FIELDS}", raw_id)
    for i in range(h.length):
        kat = pos
        rc = read_head(p, end, &pos, &kh)
        if rc != W_OK:
            raise _broken(p, start, end, rc, raw_id)
        if kh.kind != K_STR:
            raise ProtocolError("bad_request", f"payload map keys must be str, got {_type_name(&kh)}", raw_id)
        k = p + pos
        pos += kh.length
        f = _field_of(k, kh.length)
        if f < 0 and not utf8_valid(k, kh.length):
            raise _not_utf8(k, kh.length, raw_id)
        vend = skip(p, end, pos, DEPTH)
        if vend < 0:
            raise _broken(p, start, end, vend, raw_id)
        if f == F_ID:
            raw_id = _checked_id(p, pos, vend)
        elif f >= 0:
            if F_OP <= f <= F_FORMAT:  # a str the broker decodes: msgpack would refuse invalid UTF-8 here
                n = pos
                read_head(p, end, &n, &vh)
                if vh.kind == K_STR and not utf8_valid(p + n, vh.length):
                    raise _not_utf8(p + n, vh.length, raw_id)
            out.s[f] = pos
            out.e[f] = vend
        pos = vend
    out.raw_id = raw_id
    _common(p, end, out)
    return pos


cdef bytes _checked_id(const uchar* p, Py_ssize_t a, Py_ssize_t b):
    """The id's bytes, or the bad_request (id nil) for an id that may not be echoed."""
    cdef uchar c = p[a]
    cdef Head h
    cdef Py_ssize_t pos = a
    cdef str kind
    if (0x90 <= c <= 0x9F) or c == 0xDC or c == 0xDD:
        kind = "list"
    elif _is_map(c):
        kind = "map"
    elif (0xC7 <= c <= 0xC9) or (0xD4 <= c <= 0xD8):
        kind = "ext"
    else:
        if (0xA0 <= c <= 0xBF) or (0xD9 <= c <= 0xDB):
            read_head(p, b, &pos, &h)
            if not utf8_valid(p + pos, h.length):
                raise _not_utf8(p + pos, h.length, NIL)
        if b - a == 1 and c == 0xC0:
            return NIL
        return PyBytes_FromStringAndSize(<const char*>(p + a), b - a)
    raise ProtocolError("bad_request", f"field 'id' must be nil, bool, int, float, str or bin, got {kind}", NIL)


cdef int _common(const uchar* p, Py_ssize_t end, Peek out) except -1:
    """The checks of common/protocol.common_fields, on the raw values, in its order."""
    cdef Head h
    cdef Py_ssize_t pos
    cdef long long v
    cdef str op
    raw_id = out.raw_id
    # op
    pos = out.s[F_OP]
    if pos < 0:
        raise ProtocolError("bad_request", "field 'op' is required", raw_id)
    read_head(p, end, &pos, &h)
    if h.kind == K_NIL:
        raise ProtocolError("bad_request", "field 'op' is required", raw_id)
    if h.kind != K_STR:
        raise ProtocolError("bad_request", f"field 'op' must be str, got {_type_name(&h)}", raw_id)
    op = _op_of(p + pos, h.length)
    if op is None:
        from tokenbroker.common.protocol import OPS
        name = PyUnicode_DecodeUTF8(<const char*>(p + pos), h.length, NULL)
        raise ProtocolError("unknown_op", f"field 'op' is {name!r}; expected one of {', '.join(sorted(OPS))}", raw_id)
    out.op = op
    # deadline_ms
    out.deadline_ms = None
    pos = out.s[F_DEADLINE]
    if pos >= 0:
        read_head(p, end, &pos, &h)
        if h.kind == K_UINT:
            if h.uval == 0:
                raise ProtocolError("bad_request", "field 'deadline_ms' must be an int > 0, got 0", raw_id)
            out.deadline_ms = MAX_DEADLINE_MS if h.uval > MAX_DEADLINE_MS else <long long>h.uval
        elif h.kind == K_INT:
            v = h.ival
            if v <= 0:
                raise ProtocolError("bad_request", f"field 'deadline_ms' must be an int > 0, got {v}", raw_id)
            out.deadline_ms = MAX_DEADLINE_MS if v > MAX_DEADLINE_MS else v
        elif h.kind != K_NIL:
            raise ProtocolError("bad_request", f"field 'deadline_ms' must be int, got {_type_name(&h)}", raw_id)
    # tokens_format
    pos = out.s[F_FORMAT]
    if pos >= 0:
        read_head(p, end, &pos, &h)
        if h.kind == K_STR:
            if not ((h.length == 4 and memcmp(p + pos, b"list", 4) == 0) or (h.length == 3 and memcmp(p + pos, b"u32", 3) == 0)):
                fmt = PyUnicode_DecodeUTF8(<const char*>(p + pos), h.length, NULL)
                raise ProtocolError("bad_request", f"field 'tokens_format' must be \"list\" or \"u32\", got {fmt!r}", raw_id)
        elif h.kind != K_NIL:
            raise ProtocolError("bad_request", f"field 'tokens_format' must be str, got {_type_name(&h)}", raw_id)
    # model, affinity
    out.model = _opt_str(p, end, out.s[F_MODEL], "model", raw_id)
    out.affinity = _opt_str(p, end, out.s[F_AFFINITY], "affinity", raw_id)
    return 0


cdef object _opt_str(const uchar* p, Py_ssize_t end, Py_ssize_t pos, str name, bytes raw_id):
    cdef Head h
    if pos < 0:
        return None
    read_head(p, end, &pos, &h)
    if h.kind == K_NIL:
        return None
    if h.kind != K_STR:
        raise ProtocolError("bad_request", f"field '{name}' must be str, got {_type_name(&h)}", raw_id)
    return PyUnicode_DecodeUTF8(<const char*>(p + pos), h.length, NULL)


# --- frames ------------------------------------------------------------------------------

def peek_request(raw) -> Peek:
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
        if end == 0 or not _is_map(p[0]):
            raise ProtocolError("bad_request", f"payload must be a map, got {first_type(raw[:9])}", NIL)
        out = Peek.__new__(Peek)
        stop = _walk(p, 0, end, out)
        if stop != end:
            raise ProtocolError("bad_request", "payload holds more than one MessagePack value: send one map", out.raw_id)
    finally:
        PyBuffer_Release(&buf)
    out.raw = raw
    out.body = raw
    return out


def peek_array(raw) -> list:
    """The requests of a frame that is an array (contract 1.2, "Several requests in one frame"), in
    one pass: each element a Peek (its `body` a view of the frame) or the ProtocolError that answers
    it. Raises ProtocolError (id nil) when the frame itself cannot be read: then nothing in it is
    served and one reply answers it. So does an array with no map in it: that is a payload of the
    wrong type, answered as 1.1 answers one. An empty array is no request: [] (no reply)."""
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
            raise _broken(p, 0, end, rc if rc != W_OK else W_INVALID, NIL)
        count = h.length
        for i in range(count):
            start = pos
            if start >= end:
                raise ProtocolError("bad_request", f"payload is truncated: the array says {count} requests, "
                                    f"the frame holds {i}", NIL)
            if not _is_map(p[start]):
                out.append(ProtocolError("bad_request", f"request [{i}] of the array must be a map, "
                                         f"got {first_type(raw[start:start + 9])}", NIL))
                pos = _skip_element(p, start, end)
                continue
            maps += 1
            peek = Peek.__new__(Peek)
            try:
                stop = _walk(p, start, end, peek)
            except ProtocolError as e:
                out.append(e)
                pos = _skip_element(p, start, end)
                continue
            peek.raw = raw
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


cdef Py_ssize_t _skip_element(const uchar* p, Py_ssize_t start, Py_ssize_t end) except -1:
    cdef Py_ssize_t at = skip(p, end, start, DEPTH)
    if at < 0:
        raise ProtocolError("bad_request", f"payload is not valid MessagePack from byte {start}: {_fault_name(at)}", NIL)
    return at


def is_array(raw) -> bool:
    """Whether a payload frame starts with an array header (several requests, contract 1.2)."""
    return len(raw) > 0 and _is_array(raw[0])


# --- route keys --------------------------------------------------------------------------

cdef struct Cutter:
    Hash h
    Py_ssize_t fed   # stream bytes fed
    int nb           # the next boundary
    int count        # blocks cut
    uchar out[NBLOCKS + 1][DIGEST]


cdef inline void cut_init(Cutter* c, const uchar* seed, Py_ssize_t n) noexcept nogil:
    h_init(&c.h)
    h_update(&c.h, seed, n)
    c.fed = 0
    c.nb = 0
    c.count = 0


cdef void cut_feed(Cutter* c, const uchar* data, Py_ssize_t n) noexcept nogil:
    """Feed stream bytes (at most MAX_HASHED_BYTES in all: the rest is dropped), digesting at
    every boundary reached."""
    cdef Py_ssize_t take
    if n > MAXH - c.fed:
        n = MAXH - c.fed
    while n > 0:
        take = BOUND[c.nb] - c.fed
        if take > n:
            take = n
        h_update(&c.h, data, take)
        c.fed += take
        data += take
        n -= take
        if c.fed == BOUND[c.nb]:
            h_digest(&c.h, c.out[c.count])
            c.count += 1
            c.nb += 1


cdef void cut_finish(Cutter* c) noexcept nogil:
    """The whole stream is a last block when it ends between two boundaries."""
    cdef Py_ssize_t last = BOUND[c.nb - 1] if c.nb > 0 else 0
    if c.fed > last:
        h_digest(&c.h, c.out[c.count])
        c.count += 1


cdef tuple _blocks(Cutter* c):
    cdef int i
    return tuple([PyBytes_FromStringAndSize(<char*>c.out[i], DIGEST) for i in range(c.count)])


cdef bytes _seed(bytes kind, const uchar* model, Py_ssize_t mlen):
    """tb1 NUL kind NUL len(model) model: the hash seed of a key kind and model."""
    cdef uchar n8[8]
    cdef int i
    for i in range(8):
        n8[i] = (<u64>mlen >> (8 * i)) & 0xFF
    return b"tb1\x00" + kind + b"\x00" + PyBytes_FromStringAndSize(<char*>n8, 8) + PyBytes_FromStringAndSize(<const char*>model, mlen)


cdef object _fallback(bytes seed):
    """A malformed or empty input: the model alone keys it; the worker will say what is wrong."""
    return RouteKey(_digest_of(<const uchar*><const char*>seed, len(seed)), ())


cdef inline bint _str_or_bin(const uchar* p, Py_ssize_t end, Py_ssize_t at, Head* h, Py_ssize_t* data) noexcept nogil:
    cdef Py_ssize_t pos = at
    if read_head(p, end, &pos, h) != W_OK:
        return False
    data[0] = pos
    return h.kind == K_STR or h.kind == K_BIN


cdef object _text_key(bytes kind, const uchar* model, Py_ssize_t mlen, const uchar* p, Py_ssize_t end,
                      Py_ssize_t a, Py_ssize_t b):
    """A str or bin is hashed as it is; a list of str as one stream, its texts joined by 0xFF (a
    byte UTF-8 never holds); anything else falls back to the model alone."""
    cdef bytes seed = _seed(kind, model, mlen)
    cdef Cutter c
    cdef Head h, ih
    cdef Py_ssize_t data, pos, i, at
    cdef uchar sep = 0xFF
    if a < 0:
        return _fallback(seed)
    cut_init(&c, <const uchar*><const char*>seed, len(seed))
    if _str_or_bin(p, b, a, &h, &data):
        cut_feed(&c, p + data, h.length)
    else:
        if h.kind != K_ARRAY:
            return _fallback(seed)
        pos = data
        for i in range(h.length):
            if c.fed >= MAXH:
                break
            at = pos
            if read_head(p, b, &pos, &ih) != W_OK or ih.kind != K_STR:
                return _fallback(seed)
            if i > 0:
                cut_feed(&c, &sep, 1)
            cut_feed(&c, p + pos, ih.length)
            pos += ih.length
    cut_finish(&c)
    if c.count == 0:
        return _fallback(seed)
    blocks = _blocks(&c)
    return RouteKey(blocks[0], blocks)


cdef void _feed_capped(Hash* h, const uchar* p, Py_ssize_t a, Py_ssize_t b) noexcept nogil:
    """A seed part: absent is empty; else its length, then at most MAX_HASHED_BYTES of it, framed by
    the part's own length."""
    cdef Py_ssize_t n
    if a < 0:
        h_len(h, 0)
        return
    n = b - a
    if n > MAXH:
        n = MAXH
    h_len(h, 8 + n)
    h_len(h, b - a)
    h_update(h, p + a, n)


cdef struct Entry:
    const uchar* key
    Py_ssize_t klen
    Py_ssize_t a
    Py_ssize_t b
    Py_ssize_t order


cdef int _entry_cmp(const void* x, const void* y) noexcept nogil:
    cdef const Entry* e = <const Entry*>x
    cdef const Entry* f = <const Entry*>y
    cdef Py_ssize_t n = e.klen if e.klen < f.klen else f.klen
    cdef int c = memcmp(e.key, f.key, n)
    if c != 0:
        return c
    if e.klen != f.klen:
        return -1 if e.klen < f.klen else 1
    return -1 if e.order < f.order else (1 if e.order > f.order else 0)


cdef int _message(Hash* h, const uchar* p, Py_ssize_t end, Py_ssize_t a, Py_ssize_t b, Py_ssize_t budget,
                  Py_ssize_t* used) except -1:
    """Feed one message: a map's entries sorted by key (so a client's key order does not matter),
    each key and value framed by its length; anything else as its bytes; at most `budget` bytes of
    that stream, framed by its length. Returns 1 when the message cannot be read as a map of str keys
    that are UTF-8 (then nothing is fed and the blocks so far stand)."""
    cdef Head mh, kh
    cdef Py_ssize_t pos = a, n, i, total, take, left, vend
    cdef Entry* entries
    cdef Entry* e
    cdef uchar l8[8]
    cdef int j
    read_head(p, b, &pos, &mh)
    if mh.kind != K_MAP:
        n = b - a if b - a < budget else budget
        h_len(h, n)
        h_update(h, p + a, n)
        used[0] = n
        return 0
    n = mh.length
    entries = <Entry*>PyMem_Malloc((n if n > 0 else 1) * sizeof(Entry))
    if entries == NULL:
        raise MemoryError()
    try:
        total = 0
        for i in range(n):
            if read_head(p, b, &pos, &kh) != W_OK:
                return 1
            if kh.kind != K_STR:  # not all str keys: the message's bytes as they came
                n = b - a if b - a < budget else budget
                h_len(h, n)
                h_update(h, p + a, n)
                used[0] = n
                return 0
            if not utf8_valid(p + pos, kh.length):
                return 1
            e = &entries[i]
            e.key = p + pos
            e.klen = kh.length
            e.order = i
            pos += kh.length
            vend = skip(p, b, pos, DEPTH)
            if vend < 0:
                return 1
            e.a = pos
            e.b = vend
            pos = vend
            total += 16 + e.klen + (e.b - e.a if e.b - e.a < budget else budget)
        if n > 1:
            qsort(entries, n, sizeof(Entry), _entry_cmp)
        if total > budget:
            total = budget
        h_len(h, total)
        left = total
        for i in range(n):
            if left <= 0:
                break
            e = &entries[i]
            for j in range(8):
                l8[j] = (<u64>e.klen >> (8 * j)) & 0xFF
            take = 8 if left > 8 else left
            h_update(h, l8, take)
            left -= take
            take = e.klen if left > e.klen else left
            h_update(h, e.key, take)
            left -= take
            for j in range(8):
                l8[j] = (<u64>(e.b - e.a) >> (8 * j)) & 0xFF
            take = 8 if left > 8 else left
            h_update(h, l8, take)
            left -= take
            take = e.b - e.a
            if take > budget:
                take = budget
            if take > left:
                take = left
            h_update(h, p + e.a, take)
            left -= take
        used[0] = total
        return 0
    finally:
        PyMem_Free(entries)


cdef object _messages_key(bytes kind, const uchar* model, Py_ssize_t mlen, const uchar* p, Py_ssize_t end,
                          Py_ssize_t* sa, Py_ssize_t* sb, int nextra, Py_ssize_t a, Py_ssize_t b):
    """One block per message, after a seed of the parts a template renders up front (tools, ...)."""
    cdef bytes seed = _seed(kind, model, mlen)
    cdef Hash h
    cdef Head lh
    cdef Py_ssize_t pos, i, at, vend, budget = MAXH, used
    cdef int x, count = 0
    cdef uchar out[NBLOCKS][DIGEST]
    if a < 0:
        return _fallback(seed)
    pos = a
    if read_head(p, b, &pos, &lh) != W_OK or lh.kind != K_ARRAY:
        return _fallback(seed)
    h_init(&h)
    h_update(&h, <const uchar*><const char*>seed, len(seed))
    for x in range(nextra):
        _feed_capped(&h, p, sa[x], sb[x])
    for i in range(lh.length if lh.length < NBLOCKS else NBLOCKS):
        if budget <= 0:
            break
        at = pos
        vend = skip(p, b, pos, DEPTH)
        if vend < 0 or _message(&h, p, end, at, vend, budget, &used) != 0:
            break
        budget -= used
        h_digest(&h, out[count])
        count += 1
        pos = vend
    if count == 0:
        h_digest(&h, out[0])
        return RouteKey(PyBytes_FromStringAndSize(<char*>out[0], DIGEST), ())
    blocks = tuple([PyBytes_FromStringAndSize(<char*>out[i], DIGEST) for i in range(count)])
    return RouteKey(blocks[0], blocks)


cdef enum:  # body fields of count, by index
    C_MODEL = 0
    C_MESSAGES = 1
    C_CONTENTS = 2
    C_INPUT = 3
    C_SYSTEM = 4
    C_SYSTEM_INSTRUCTION = 5
    C_SYSTEM_INSTRUCTION_CAMEL = 6
    C_INSTRUCTIONS = 7
    C_TOOLS = 8
    NCOUNT = 9

_COUNT_NAMES = (b"model", b"messages", b"contents", b"input", b"system", b"system_instruction",
                b"systemInstruction", b"instructions", b"tools")


cdef int _count_field(const uchar* k, Py_ssize_t n):
    cdef int i
    cdef bytes name
    for i in range(NCOUNT):
        name = _COUNT_NAMES[i]
        if len(name) == n and memcmp(<const char*>name, k, n) == 0:
            return i
    return -1


cdef object _count_key(const uchar* model, Py_ssize_t mlen, const uchar* p, Py_ssize_t end, Py_ssize_t a, Py_ssize_t b):
    """A provider request body: like chat when it holds a message list (`messages`, `contents` or
    `input`), its system/instructions/tools in the seed; a str body (or `input`) like text."""
    cdef Head bh, kh, vh
    cdef Py_ssize_t pos, i, vend, data
    cdef Py_ssize_t sa[NCOUNT]
    cdef Py_ssize_t sb[NCOUNT]
    cdef Py_ssize_t xa[5]
    cdef Py_ssize_t xb[5]
    cdef int f, m
    cdef Cutter c
    cdef bytes seed
    if a < 0:
        return _fallback(_seed(b"count", model, mlen))
    pos = a
    read_head(p, b, &pos, &bh)
    if bh.kind != K_MAP:
        return _text_key(b"count", model, mlen, p, end, a, b)
    for i in range(NCOUNT):
        sa[i] = -1
    for i in range(bh.length):
        if read_head(p, b, &pos, &kh) != W_OK:
            return _fallback(_seed(b"count", model, mlen))
        if kh.kind == K_STR:
            if not utf8_valid(p + pos, kh.length):
                return _fallback(_seed(b"count", model, mlen))
            f = _count_field(p + pos, kh.length)
            pos += kh.length
        else:
            f = -1
            pos = _skip_key(p, b, pos, &kh)
            if pos < 0:
                return _fallback(_seed(b"count", model, mlen))
        vend = skip(p, b, pos, DEPTH)
        if vend < 0:
            return _fallback(_seed(b"count", model, mlen))
        if f >= 0:
            sa[f] = pos
            sb[f] = vend
        pos = vend
    if mlen == 0 and sa[C_MODEL] >= 0:
        if read_head(p, b, &sa[C_MODEL], &vh) == W_OK and vh.kind == K_STR:
            model = p + sa[C_MODEL]
            mlen = vh.length if vh.length < 1024 else 1024
    m = -1
    for f in (C_MESSAGES, C_CONTENTS, C_INPUT):
        if sa[f] >= 0 and _is_array(p[sa[f]]):
            m = f
            break
    if m < 0:
        if sa[C_INPUT] >= 0 and _str_or_bin(p, b, sa[C_INPUT], &vh, &data):
            return _text_key(b"count", model, mlen, p, end, sa[C_INPUT], sb[C_INPUT])
        seed = _seed(b"count", model, mlen)
        cut_init(&c, <const uchar*><const char*>seed, len(seed))
        # the whole body, framed by its length: never empty, so at least one block
        _cut_capped(&c, p, a, b)
        cut_finish(&c)
        blocks = _blocks(&c)
        return RouteKey(blocks[0], blocks)
    for i in range(5):
        xa[i] = sa[C_SYSTEM + i]
        xb[i] = sb[C_SYSTEM + i]
    return _messages_key(b"count-messages", model, mlen, p, end, xa, xb, 5, sa[m], sb[m])


cdef Py_ssize_t _skip_key(const uchar* p, Py_ssize_t end, Py_ssize_t pos, Head* kh) noexcept nogil:
    """Past a key that is not a str (its header already read at pos's left)."""
    cdef Py_ssize_t n, i
    if kh.kind == K_BIN or kh.kind == K_EXT:
        return pos + kh.length
    if kh.kind == K_ARRAY or kh.kind == K_MAP:
        n = kh.length * 2 if kh.kind == K_MAP else kh.length
        for i in range(n):
            pos = skip(p, end, pos, DEPTH)
            if pos < 0:
                return pos
    return pos


cdef void _cut_capped(Cutter* c, const uchar* p, Py_ssize_t a, Py_ssize_t b) noexcept nogil:
    cdef uchar l8[8]
    cdef int j
    for j in range(8):
        l8[j] = (<u64>(b - a) >> (8 * j)) & 0xFF
    cut_feed(c, l8, 8)
    cut_feed(c, p + a, b - a)


cdef frozenset KEYLESS = frozenset({"detokenize", "detokenize_stream", "models", "ping", "add_model", "remove_model"})
KEYLESS_OPS = KEYLESS


def route_key(Peek peek):
    """The routing key of a request (a RouteKey), or None when its op needs no affinity. Reads the
    request's raw bytes in place and hashes at most MAX_HASHED_BYTES of its input, so its cost is
    bounded whatever the request's size. A malformed input never raises: the key falls back to
    the model alone and the worker answers the request with its `bad_request`."""
    cdef Py_buffer buf
    cdef const uchar* p
    cdef Py_ssize_t end, mlen = 0, pos
    cdef const uchar* model = <const uchar*><const char*>b""
    cdef Head h
    cdef str op = peek.op
    cdef Py_ssize_t xa[2]
    cdef Py_ssize_t xb[2]
    if op in KEYLESS:
        return None
    PyObject_GetBuffer(peek.raw, &buf, PyBUF_SIMPLE)
    try:
        p = <const uchar*>buf.buf
        end = buf.len
        if peek.s[F_AFFINITY] >= 0 and peek.affinity is not None:
            pos = peek.s[F_AFFINITY]
            read_head(p, end, &pos, &h)
            return RouteKey(_digest_of_parts(b"affinity\x00", p + pos, h.length), ())
        if peek.model is not None:
            pos = peek.s[F_MODEL]
            read_head(p, end, &pos, &h)
            model = p + pos
            mlen = h.length
        if op is OP_TOKENIZE:
            return _text_key(b"text", model, mlen, p, end, peek.s[F_TEXT], peek.e[F_TEXT])
        if op is OP_CHAT:
            xa[0], xb[0] = peek.s[F_TOOLS], peek.e[F_TOOLS]
            xa[1], xb[1] = peek.s[F_KWARGS], peek.e[F_KWARGS]
            return _messages_key(b"chat", model, mlen, p, end, xa, xb, 2, peek.s[F_MESSAGES], peek.e[F_MESSAGES])
        if op is OP_COUNT:
            return _count_key(model, mlen, p, end, peek.s[F_BODY], peek.e[F_BODY])
        return _fallback(_seed(b"op:" + op.encode(), model, mlen))
    finally:
        PyBuffer_Release(&buf)


cdef bytes _digest_of_parts(bytes head, const uchar* p, Py_ssize_t n):
    cdef Hash h
    cdef uchar out[DIGEST]
    h_init(&h)
    h_update(&h, <const uchar*><const char*>head, len(head))
    h_update(&h, p, n)
    h_digest(&h, out)
    return PyBytes_FromStringAndSize(<char*>out, DIGEST)


def text_blocks(seed: bytes, data: bytes) -> tuple:
    """Prefix hashes of `data` at BOUNDARIES after `seed`, plus the whole of it when it ends between
    two: the blocks a tokenize of that text gets (for tests and tools)."""
    cdef Cutter c
    cdef const uchar[::1] v = data
    cut_init(&c, <const uchar*><const char*>seed, len(seed))
    if v.shape[0]:
        cut_feed(&c, &v[0], v.shape[0])
    cut_finish(&c)
    return _blocks(&c)


def seed(kind: bytes, model: bytes) -> bytes:
    """The hash seed of a key kind and model (tb1 NUL kind NUL len(model) model)."""
    return _seed(kind, <const uchar*>model, len(model))
