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
(bad_request) instead of forwarding it; a request map of more than MAX_FIELDS fields is refused,
after one walk in C that finds its id (a 29 MB map of 3 million unknown keys costs ~30 ms, where the
worker's decode would cost seconds); str keys and
the str values the broker reads are checked as strict UTF-8, as msgpack would decode them.

The route key (docs/routing.md, "Route keys", holds the design): prefix-block hashes at fixed byte offsets
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

from tokenbroker.common._pack cimport put_le
from tokenbroker.common._wire cimport (Head, get_le, read_head, skip, skip_any, utf8_valid, K_NIL, K_BOOL, K_INT, K_UINT, K_FLOAT, K_STR,
                           K_BIN, K_ARRAY, K_MAP, K_EXT, W_OK, W_TRUNCATED, W_INVALID, W_TOO_DEEP, W_TOO_LONG)

from heapq import heapify, heappop, heappush

from zmq import ZMQError

from tokenbroker.common.errors import ProtocolError
from tokenbroker.common.protocol import LANE_COUNT_BYTES as _LANE_COUNT_BYTES, OUTCOMES as _OUTCOMES, SKIPPED as _SKIPPED

assert _OUTCOMES[1] == _SKIPPED  # Intake.results reads outcome 1 as skipped

ctypedef unsigned char uchar
ctypedef unsigned long long u64

cdef enum:
    DEPTH = 100           # the deepest a request's values may nest (skipping included)
    FIELDS = 4096         # the most fields one request map may have
    ARRAY_REQUESTS = 4096 # the most requests one array frame may hold (contract 1.4)
    NBLOCKS = 256         # prefix blocks per route key, at most
    DIGEST = 16

MAX_DEPTH = DEPTH
MAX_FIELDS = FIELDS
MAX_ARRAY_REQUESTS = ARRAY_REQUESTS
MAX_BLOCKS = NBLOCKS
DIGEST_BYTES = DIGEST
MIN_BLOCK = 256
MAX_BLOCK = 4096
GROWTH_DIVISOR = 8
NIL = b"\xc0"
MAX_DEADLINE_MS = 2**31 - 1



cdef class RouteKey:
    """Where a request would like to run: `key` the rendezvous key, `blocks` the prefix-block hashes,
    shallow to deep (() when the client gave `affinity` or nothing was hashed). Immutable, compared
    and hashed by value (a dispatcher turn keeps a set of the keys that wait)."""

    cdef readonly bytes key
    cdef readonly tuple blocks

    def __init__(self, bytes key, tuple blocks=()):
        self.key = key
        self.blocks = blocks

    def __eq__(self, other):
        if not isinstance(other, RouteKey):
            return NotImplemented
        return self.key == (<RouteKey>other).key and self.blocks == (<RouteKey>other).blocks

    def __hash__(self):
        return hash(self.key) ^ len(self.blocks)

    def __repr__(self):
        return f"RouteKey(key={self.key!r}, blocks=<{len(self.blocks)} blocks>)"


cdef inline RouteKey _rk(bytes key, tuple blocks):
    cdef RouteKey k = RouteKey.__new__(RouteKey)
    k.key = key
    k.blocks = blocks
    return k

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
    put_le(b, n, 8)
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


cdef str _broken(const uchar* p, Py_ssize_t start, Py_ssize_t end, Py_ssize_t rc):
    """Why a frame that is not one bounded MessagePack value is refused (bad_request)."""
    cdef str starting = f", starting 0x{p[start]:02x}" if start < end else ", empty"
    return f"payload is not valid MessagePack ({end - start} bytes{starting}): {_fault_name(rc)}"


cdef str _not_utf8(const uchar* s, Py_ssize_t n):
    """Why a str msgpack would refuse to decode is refused, in Python's own words."""
    try:
        PyUnicode_DecodeUTF8(<const char*>s, n, NULL)
        reason = "invalid UTF-8"
    except UnicodeDecodeError as e:
        reason = e.reason
    return f"payload holds a str that is not valid UTF-8: {reason}"


cdef class Peek:
    """A request as the broker sees it: the common fields, checked, and where its inputs lie.

    `raw` is the frame it came in (bytes, or a view of ZeroMQ's buffer for a large one); `body` is
    the request's own bytes, what the worker gets: the frame itself for a lone map, a view of it
    for an element of an array (no copy until ZeroMQ takes it).

    An element of an array that the broker refuses is a Peek too, with `code` (bad_request or
    unknown_op) and `message` set and `op` None: an array of 4,096 refused elements costs 4,096
    small objects, never an exception raised or kept per element.
    """

    cdef public object raw
    cdef public bytes raw_id
    cdef public str op
    cdef public object model
    cdef public object deadline_ms
    cdef public object affinity
    cdef public object body
    cdef public str code         # the error code that answers the request, None when it is readable
    cdef public str message
    cdef Py_ssize_t s[NFIELDS]   # where each field's value starts in raw (-1: absent)
    cdef Py_ssize_t e[NFIELDS]   # and ends

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


cdef int _key_cmp(const void* x, const void* y) noexcept nogil:
    cdef u64 a = (<const Key*>x).hash, b = (<const Key*>y).hash
    return -1 if a < b else (1 if a > b else 0)


cdef inline u64 _key_hash(const uchar* k, Py_ssize_t n) noexcept nogil:
    cdef Hash h
    cdef uchar out[DIGEST]
    cdef u64 v
    h_init(&h)
    h_update(&h, k, n)
    h_digest(&h, out)
    memcpy(&v, out, 8)
    return v


cdef Py_ssize_t _repeated(Key* keys, Py_ssize_t n) noexcept nogil:
    """The index of a key that equals another, or -1: hashed once each (linear in their bytes),
    then sorted by hash, so only keys of equal hash are compared byte by byte."""
    cdef Py_ssize_t i, j
    if n < 2:
        return -1
    qsort(keys, n, sizeof(Key), _key_cmp)
    for i in range(n - 1):
        j = i + 1
        while j < n and keys[j].hash == keys[i].hash:
            if keys[j].n == keys[i].n and memcmp(keys[j].at, keys[i].at, keys[i].n) == 0:
                return i
            j += 1
    return -1


cdef str _twice(const uchar* k, Py_ssize_t n):
    cdef str name = PyUnicode_DecodeUTF8(<const char*>k, n if n < 200 else 200, "replace")
    return f"payload map holds the key {name!r} twice; a request names each field once"


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
                    _refuse(out, "bad_request", _not_utf8(k, kh.length))
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
                fault = _id_fault(p, pos, vend)
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
                        _refuse(out, "bad_request", _not_utf8(p + n, vh.length))
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


cdef str _id_fault(const uchar* p, Py_ssize_t a, Py_ssize_t b):
    """Why an id may not be echoed (the request is answered bad_request, id nil), or None."""
    cdef uchar c = p[a]
    cdef Head h
    cdef Py_ssize_t pos = a
    cdef str kind
    if _is_array(c):
        kind = "list"
    elif _is_map(c):
        kind = "map"
    elif (0xC7 <= c <= 0xC9) or (0xD4 <= c <= 0xD8):
        kind = "ext"
    else:
        if (0xA0 <= c <= 0xBF) or (0xD9 <= c <= 0xDB):
            read_head(p, b, &pos, &h)
            if not utf8_valid(p + pos, h.length):
                return _not_utf8(p + pos, h.length)
        return None
    return f"field 'id' must be nil, bool, int, float, str or bin, got {kind}"


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
        return _refuse(out, "unknown_op", f"field 'op' is {name!r}; expected one of {', '.join(sorted(_OP_NAMES))}")
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


def peek_array(raw) -> list:
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
            if _is_map(p[start]):
                maps += 1
                stop = _walk(p, start, end, peek)
                peek.raw = raw
            else:
                _unread(peek, raw, NIL, f"request [{i}] of the array must be a map, got {first_type(raw[start:start + 9])}")
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


# --- route keys --------------------------------------------------------------------------

cdef struct Cutter:
    Hash h
    Py_ssize_t fed   # stream bytes fed
    int nb           # the next boundary
    int count        # blocks cut
    uchar out[NBLOCKS + 1][DIGEST]


cdef inline void cut_init(Cutter* c, bytes kind, const uchar* model, Py_ssize_t mlen):
    _seed_into(&c.h, kind, model, mlen)
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
    put_le(n8, <u64>mlen, 8)
    return b"tb1\x00" + kind + b"\x00" + PyBytes_FromStringAndSize(<char*>n8, 8) + PyBytes_FromStringAndSize(<const char*>model, mlen)


cdef void _seed_into(Hash* h, bytes kind, const uchar* model, Py_ssize_t mlen):
    """Start a hash with the seed of a key kind and model, fed in parts (the stream is the same)."""
    h_init(h)
    h_update(h, <const uchar*>b"tb1\x00", 4)
    h_update(h, <const uchar*><const char*>kind, len(kind))
    h_update(h, <const uchar*>b"\x00", 1)
    h_len(h, mlen)
    h_update(h, model, mlen)


cdef object _fallback(bytes kind, const uchar* model, Py_ssize_t mlen):
    """A malformed or empty input: the model alone keys it; the worker will say what is wrong."""
    cdef Hash h
    cdef uchar out[DIGEST]
    _seed_into(&h, kind, model, mlen)
    h_digest(&h, out)
    return _rk(PyBytes_FromStringAndSize(<char*>out, DIGEST), ())


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
    cdef Cutter c
    cdef Head h, ih
    cdef Py_ssize_t data, pos, i, at
    cdef uchar sep = 0xFF
    if a < 0:
        return _fallback(kind, model, mlen)
    cut_init(&c, kind, model, mlen)
    if _str_or_bin(p, b, a, &h, &data):
        cut_feed(&c, p + data, h.length)
    else:
        if h.kind != K_ARRAY:
            return _fallback(kind, model, mlen)
        pos = data
        for i in range(h.length):
            if c.fed >= MAXH:
                break
            at = pos
            if read_head(p, b, &pos, &ih) != W_OK or ih.kind != K_STR:
                return _fallback(kind, model, mlen)
            if i > 0:
                cut_feed(&c, &sep, 1)
            cut_feed(&c, p + pos, ih.length)
            pos += ih.length
    cut_finish(&c)
    if c.count == 0:
        return _fallback(kind, model, mlen)
    blocks = _blocks(&c)
    return _rk(blocks[0], blocks)


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
            put_le(l8, <u64>e.klen, 8)
            take = 8 if left > 8 else left
            h_update(h, l8, take)
            left -= take
            take = e.klen if left > e.klen else left
            h_update(h, e.key, take)
            left -= take
            put_le(l8, <u64>(e.b - e.a), 8)
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
    cdef Hash h
    cdef Head lh
    cdef Py_ssize_t pos, i, at, vend, budget = MAXH, used
    cdef int x, count = 0
    cdef uchar out[NBLOCKS][DIGEST]
    if a < 0:
        return _fallback(kind, model, mlen)
    pos = a
    if read_head(p, b, &pos, &lh) != W_OK or lh.kind != K_ARRAY:
        return _fallback(kind, model, mlen)
    _seed_into(&h, kind, model, mlen)
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
        return _rk(PyBytes_FromStringAndSize(<char*>out[0], DIGEST), ())
    blocks = tuple([PyBytes_FromStringAndSize(<char*>out[i], DIGEST) for i in range(count)])
    return _rk(blocks[0], blocks)


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
    if a < 0:
        return _fallback(b"count", model, mlen)
    pos = a
    read_head(p, b, &pos, &bh)
    if bh.kind != K_MAP:
        return _text_key(b"count", model, mlen, p, end, a, b)
    for i in range(NCOUNT):
        sa[i] = -1
    for i in range(bh.length):
        if read_head(p, b, &pos, &kh) != W_OK:
            return _fallback(b"count", model, mlen)
        if kh.kind == K_STR:
            if not utf8_valid(p + pos, kh.length):
                return _fallback(b"count", model, mlen)
            f = _count_field(p + pos, kh.length)
            pos += kh.length
        else:
            f = -1
            pos = _skip_key(p, b, pos, &kh)
            if pos < 0:
                return _fallback(b"count", model, mlen)
        vend = skip(p, b, pos, DEPTH)
        if vend < 0:
            return _fallback(b"count", model, mlen)
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
        cut_init(&c, b"count", model, mlen)
        # the whole body, framed by its length: never empty, so at least one block
        _cut_capped(&c, p, a, b)
        cut_finish(&c)
        blocks = _blocks(&c)
        return _rk(blocks[0], blocks)
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
    put_le(l8, <u64>(b - a), 8)
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
            return _rk(_digest_of_parts(b"affinity\x00", p + pos, h.length), ())
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
        return _fallback(b"op:" + op.encode(), model, mlen)
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
    h_init(&c.h)
    h_update(&c.h, <const uchar*><const char*>seed, len(seed))
    c.fed = 0
    c.nb = 0
    c.count = 0
    if v.shape[0]:
        cut_feed(&c, &v[0], v.shape[0])
    cut_finish(&c)
    return _blocks(&c)


def seed(kind: bytes, model: bytes) -> bytes:
    """The hash seed of a key kind and model (tb1 NUL kind NUL len(model) model)."""
    return _seed(kind, <const uchar*>model, len(model))


# --- the job table -----------------------------------------------------------------------

cdef class Job:
    """One client request held by the broker, from receipt to reply (compiled: one is built per
    request, and the dispatcher and the loop read its fields many times)."""

    cdef public long long job_id
    cdef public object envelope
    cdef public bytes raw_id            # the id's MessagePack bytes, echoed as they came
    cdef public object raw              # the request's bytes (a view of its frame when it came in an array)
    cdef public str op
    cdef public object route            # RouteKey | None
    cdef public double received
    cdef public double deadline
    cdef public double queued           # when it last entered the queue
    cdef public int attempts
    cdef public object worker           # the worker holding it, while one does
    cdef public bint answered
    cdef public object model            # the served model it names (None: any worker's default will do)
    cdef public bint catalog            # `model` is a catalog entry's name: only its holders may take it
    cdef public bint off_loop           # a tokenize the worker encodes off its loop (set by the dispatcher)

    def __init__(self, long long job_id, envelope, bytes raw_id, raw, str op, route, double received,
                 double deadline, double queued, int attempts=0, worker=None, bint answered=False, model=None,
                 bint catalog=False, bint off_loop=False):
        self.job_id = job_id
        self.envelope = envelope
        self.raw_id = raw_id
        self.raw = raw
        self.op = op
        self.route = route
        self.received = received
        self.deadline = deadline
        self.queued = queued
        self.attempts = attempts
        self.worker = worker
        self.answered = answered
        self.model = model
        self.catalog = catalog
        self.off_loop = off_loop

    def __repr__(self) -> str:
        return f"Job({self.job_id}, op={self.op!r}, model={self.model!r}, worker={self.worker!r}, answered={self.answered})"


cdef class JobTable:
    """Every request held, from receipt to reply: the jobs by id, their payload bytes, how many each
    client connection holds (`--max-pending-bytes`, `--max-client-pending`) and the deadline heap.
    No socket, no clock. The loop admits a job with `admit` and releases it when it is answered or
    dropped; where the job is (queued, at a worker) is the dispatcher's (docs/routing.md)."""

    cdef public dict jobs
    cdef public long long held_bytes
    cdef public dict per_client          # jobs held per client connection (its identity)
    cdef list _deadlines                 # (deadline, job id) heap, answered jobs' entries included
    cdef long long _next_id

    def __init__(self):
        self.jobs = {}
        self.held_bytes = 0
        self.per_client = {}
        self._deadlines = []
        self._next_id = 1

    def __len__(self) -> int:
        return len(self.jobs)

    def __bool__(self) -> bool:
        return len(self.jobs) > 0

    cpdef Job admit(self, envelope, Peek peek, route, double now, double timeout_s, model, bint catalog):
        """A new job for an admitted request, held from now on (one call per request)."""
        cdef Job job = Job.__new__(Job)
        job.job_id = self._next_id
        self._next_id += 1
        job.envelope = envelope
        job.raw_id = peek.raw_id
        job.raw = peek.body
        job.op = peek.op
        job.route = route
        job.received = now
        job.deadline = now + timeout_s
        job.queued = now
        job.model = model
        job.catalog = catalog
        self.add(job)
        return job

    cpdef add(self, Job job):
        self.jobs[job.job_id] = job
        self.held_bytes += len(job.raw)
        client = job.envelope[0]
        self.per_client[client] = self.per_client.get(client, 0) + 1
        heappush(self._deadlines, (job.deadline, job.job_id))

    cpdef release(self, Job job):
        """The job is no longer held (answered, or failed for good); a second release is a no-op."""
        if self.jobs.pop(job.job_id, None) is not None:
            self.held_bytes -= len(job.raw)
            client = job.envelope[0]
            left = self.per_client[client] - 1
            if left:
                self.per_client[client] = left
            else:
                del self.per_client[client]

    def held_by(self, client: bytes) -> int:
        return self.per_client.get(client, 0)

    def nearest_deadline(self):
        return self._deadlines[0][0] if self._deadlines else None

    def due(self, double now) -> list:
        """The unanswered jobs whose deadline has passed, each once, earliest first."""
        cdef list out = []
        cdef list deadlines = self._deadlines
        cdef Job job
        while deadlines and deadlines[0][0] <= now:
            _, job_id = heappop(deadlines)
            found = self.jobs.get(job_id)
            if found is not None and not (<Job>found).answered:
                out.append(found)
        if len(deadlines) > 2 * len(self.jobs) + 1024:  # entries of answered jobs: drop them
            self._deadlines = [(job.deadline, job.job_id) for job in self.jobs.values() if not job.answered]
            heapify(self._deadlines)
        return out

    def unanswered(self) -> list:
        return [job for job in self.jobs.values() if not (<Job>job).answered]

    def clear(self) -> None:
        self.jobs.clear()
        self.per_client.clear()
        self.held_bytes = 0


# --- the backend's batches (common/protocol.py: B_JOBS = [J, JOB * n, payloads]; W_RESULTS = [D, RESULT * n, replies]) ---

def job_batch(list jobs, double now, Py_ssize_t start, Py_ssize_t max_jobs, Py_ssize_t max_bytes) -> tuple:
    """The B_JOBS body for jobs[start:end], at most `max_jobs` jobs and `max_bytes` payload bytes past
    its first: (end, header of JOB records, the payloads). Each job's budget is the time left of its
    deadline in ms (at least 1, at most 2**31-1). A lone payload is its own frame (never copied)."""
    cdef Py_ssize_t end = start, size = 0, n, i, length
    cdef Job job
    cdef double left
    cdef long long budget
    cdef bytearray header
    cdef uchar* h
    while end < len(jobs) and end - start < max_jobs:
        length = len((<Job>jobs[end]).raw)
        if end > start and size + length > max_bytes:
            break
        size += length
        end += 1
    n = end - start
    header = bytearray(16 * n)
    h = <uchar*>(<char*>header)
    for i in range(n):
        job = <Job>jobs[start + i]
        left = (job.deadline - now) * 1000
        budget = <long long>left if left < 2147483647.0 else 2147483647
        if budget < 1:
            budget = 1
        put_le(h + 16 * i, <u64>job.job_id, 8)
        put_le(h + 16 * i + 8, <u64>budget, 4)
        put_le(h + 16 * i + 12, <u64>len(job.raw), 4)
    if n == 1:
        return end, bytes(header), (<Job>jobs[start]).raw
    return end, bytes(header), b"".join([(<Job>jobs[i]).raw for i in range(start, end)])


def check_results(list body) -> tuple:
    """The (header, replies) of a W_RESULTS body once its records and its payload frame agree
    (`Intake.results` walks them); ValueError otherwise, and the backend drops the message."""
    cdef Py_buffer hb
    cdef Py_ssize_t n, i, total = 0
    if len(body) != 2:
        raise ValueError(f"a result batch must be a header and one payload frame, got {len(body)} frames")
    header, blob = body
    if not header or len(header) % 13:
        raise ValueError(f"a result batch header of {len(header)} bytes is not a whole number of 13-byte records")
    PyObject_GetBuffer(header, &hb, PyBUF_SIMPLE)
    try:
        n = hb.len // 13
        for i in range(n):
            total += <Py_ssize_t>get_le(<const uchar*>hb.buf + 13 * i + 9, 4)
    finally:
        PyBuffer_Release(&hb)
    if total != len(blob):
        raise ValueError(f"a result batch's records count {total} payload bytes, its frame has {len(blob)}")
    return header, blob


# --- the router's policy for one pick (docs/routing.md, "The router", holds its design) ---

cdef class Slots:
    """What one worker holds: its load, as the router reads it. The dispatcher owns it; compiled
    so the router reads the counts as C fields."""

    cdef public int capacity
    cdef public dict jobs
    cdef public long long bytes          # payload bytes of the jobs held (not counting off-loop ones)
    cdef public int long_jobs            # long tokenize jobs held: encoded off the worker's loop, one at a time
    cdef public bint draining            # said BYE: finishes what it holds, gets nothing new
    cdef public bint blocked             # no room by payload bytes (or count): set when that changes

    def __init__(self, int capacity, dict jobs=None, long long bytes=0, int long_jobs=0, bint draining=False,
                 bint blocked=False):
        self.capacity = capacity
        self.jobs = {} if jobs is None else jobs
        self.bytes = bytes
        self.long_jobs = long_jobs
        self.draining = draining
        self.blocked = blocked

    @property
    def held(self) -> int:
        return len(self.jobs)


cdef inline Py_ssize_t _load_held(Slots load):
    return len(load.jobs)


cdef inline bint _load_free(Slots load):
    """Room for one more job: under capacity and not blocked."""
    return len(load.jobs) < load.capacity and not load.blocked


cdef class RouterWorker:
    """One incarnation of a worker: a re-added id gets a new record, so old index entries stay dead."""

    cdef public bytes wid
    cdef public Slots load
    cdef public u64 salt       # this id's rendezvous salt, hashed once
    cdef public bint alive

    def __init__(self, bytes wid, Slots load, u64 salt, bint alive=True):
        self.wid = wid
        self.load = load
        self.salt = salt
        self.alive = alive


cdef u64 _key_int(bytes key):
    cdef const uchar* p = <const uchar*><const char*>key
    if len(key) < 8:
        from hashlib import sha256
        return <u64>int.from_bytes(sha256(key).digest()[:8], "little")
    return get_le(p, 8)


def salt_of(bytes wid) -> int:
    """A worker id's rendezvous salt: the first 8 bytes (little end first) of SHA-256 of a tag and the id."""
    from hashlib import sha256
    return int.from_bytes(sha256(b"tb-rendezvous\x00" + wid).digest()[:8], "little")


def mix(u64 x) -> int:
    """SplitMix64's finalizer (the rendezvous weight of salt ^ key)."""
    return _mix(x)


cdef class Router:
    """Prefix affinity with rendezvous fallback, under a bounded-load rule (docs/routing.md)."""

    cdef public double balance_factor
    cdef public int balance_margin
    cdef public Py_ssize_t index_max_entries
    cdef public dict _workers
    cdef public object _index
    cdef long long n_picks, n_hits, n_rendezvous, n_spills, n_overflows, n_unkeyed, n_full

    def __init__(self, *, double balance_factor=1.25, int balance_margin=2, Py_ssize_t index_max_entries=1 << 20):
        from collections import OrderedDict
        if balance_factor < 1.0:
            raise ValueError(f"balance_factor must be >= 1.0, got {balance_factor}")
        if balance_margin < 0:
            raise ValueError(f"balance_margin must be >= 0, got {balance_margin}")
        if index_max_entries < 1:
            raise ValueError(f"index_max_entries must be >= 1, got {index_max_entries}")
        self.balance_factor = balance_factor
        self.balance_margin = balance_margin
        self.index_max_entries = index_max_entries
        self._workers = {}
        self._index = OrderedDict()

    # --- worker events

    def add_worker(self, bytes wid, Slots load) -> None:
        """A worker is ready; `load` is where its owner counts what it holds. A known id takes the new load."""
        if load.capacity < 1:
            raise ValueError(f"worker capacity must be >= 1, got {load.capacity}")
        known = self._workers.get(wid)
        if known is not None:
            (<RouterWorker>known).load = load
            return
        self._workers[wid] = RouterWorker(wid, load, salt_of(wid))

    def remove_worker(self, bytes wid) -> None:
        """The worker is gone (or takes nothing new): its load stops counting, its index entries too."""
        w = self._workers.pop(wid, None)
        if w is not None:
            (<RouterWorker>w).alive = False

    # --- the policy

    def pick(self, key, *, bint overflow=True, allowed=None):
        """A worker with a free slot for this request; None when all are full (docs/routing.md)."""
        cdef list free = []
        cdef RouterWorker w, chosen = None
        cdef Py_ssize_t best = -1, h
        for v in self._workers.values():
            w = <RouterWorker>v
            if _load_free(w.load) and (allowed is None or w.wid in allowed):
                free.append(w)
        if not free:
            self.n_full += 1
            return None
        if key is None:
            for v in free:
                w = <RouterWorker>v
                h = _load_held(w.load)
                if chosen is None or h < best or (h == best and w.wid < chosen.wid):
                    chosen, best = w, h
            self.n_unkeyed += 1
        else:
            chosen = self._choose(<RouteKey>key, free, overflow, allowed)
            if chosen is None:
                return None
        self.n_picks += 1
        return chosen.wid

    def record(self, RouteKey key, bytes wid) -> None:
        """`wid` has tokenized `key`'s input: its prefixes are in that worker's L1 now."""
        w = self._workers.get(wid)
        if w is not None:
            self._record(key, <RouterWorker>w)

    cdef Py_ssize_t _held_sum(self):
        cdef Py_ssize_t total = 0
        for v in self._workers.values():
            total += _load_held((<RouterWorker>v).load)
        return total

    cpdef double bound(self, int extra=1):
        """The most in-flight jobs a worker may reach when `extra` more jobs are placed."""
        cdef Py_ssize_t n = len(self._workers)
        cdef double mean, a, b
        if n == 0:
            return 0.0
        mean = (self._held_sum() + extra) / <double>n
        a = self.balance_factor * mean
        b = mean + self.balance_margin
        return a if a > b else b

    def stats(self) -> dict:
        """Counters since start and gauges, for metrics (broker/metrics.py)."""
        return {"picks": self.n_picks, "affinity_hits": self.n_hits, "rendezvous": self.n_rendezvous,
                "spills": self.n_spills, "overflows": self.n_overflows, "unkeyed": self.n_unkeyed, "full": self.n_full,
                "workers": len(self._workers), "in_flight": self._held_sum(), "index_entries": len(self._index)}

    cdef RouterWorker _choose(self, RouteKey key, list free, bint overflow, allowed):
        found = self._lookup(key) if len(self._index) else None
        cdef RouterWorker hit = <RouterWorker>found if found is not None else None
        cdef RouterWorker home, w, best = None
        cdef bint within
        cdef Py_ssize_t h, bh = 0
        cdef u64 k, wt, bw = 0
        if allowed is not None and hit is not None and hit.wid not in allowed:
            hit = None
        if hit is not None:
            home = hit
        else:
            home = <RouterWorker>self._rendezvous(key.key, self._workers.values() if allowed is None
                                    else [v for v in self._workers.values() if (<RouterWorker>v).wid in allowed])
        h = _load_held(home.load)
        within = h + 1 <= self.bound(1)
        if within and _load_free(home.load):
            if hit is not None:
                self.n_hits += 1
            else:
                self.n_rendezvous += 1
            return home
        if within and not overflow:
            return None
        # Spilled: over the bound, or merely full (an overflow). Least loaded, ties by rendezvous.
        if not within:
            self.n_spills += 1
        else:
            self.n_overflows += 1
        k = _key_int(key.key)
        for v in free:
            w = <RouterWorker>v
            h = _load_held(w.load)
            wt = _mix(w.salt ^ k)
            if best is None or h < bh or (h == bh and wt > bw):
                best, bh, bw = w, h, wt
        return best

    cpdef object _lookup(self, RouteKey key):
        """The live worker of the deepest indexed block, else of the key; drops stale entries met."""
        cdef Py_ssize_t i
        index = self._index
        blocks = key.blocks
        for i in range(len(blocks) - 1, -2, -1):
            h = blocks[i] if i >= 0 else key.key
            w = index.get(h)
            if w is None:
                continue
            if (<RouterWorker>w).alive:
                return w
            del index[h]
        return None

    cdef _record(self, RouteKey key, RouterWorker w):
        index = self._index
        blocks = key.blocks
        if not blocks or key.key != blocks[0]:
            index[key.key] = w
            index.move_to_end(key.key)
        for h in blocks:
            index[h] = w
            index.move_to_end(h)
        while len(index) > self.index_max_entries:
            index.popitem(last=False)

    cpdef object _rendezvous(self, bytes key, workers):
        """Highest weight wins; weights are per (worker, key), so a leaving worker moves only its keys."""
        cdef u64 k = _key_int(key), wt, bw = 0
        cdef RouterWorker w, best = None
        for v in workers:
            w = <RouterWorker>v
            wt = _mix(w.salt ^ k)
            if best is None or wt > bw or (wt == bw and w.wid > best.wid):
                best, bw = w, wt
        return best


# --- the dispatcher (docs/routing.md, "The dispatcher", holds its design) -------------------

def _unplaced(model, *, catalog):
    """With no placement (a dispatcher on its own): a catalog model has no holders, any other goes anywhere."""
    return frozenset() if catalog else None


cdef class Dispatcher:
    """Which queued job goes to which worker, and when (docs/routing.md)."""

    cdef public Router router
    cdef public bint long_off_loop
    cdef public object eligible
    cdef public double spill_wait
    cdef public long long worker_bytes
    cdef public int lookahead
    cdef public dict workers
    cdef public object pending
    cdef public long long waiting
    cdef public dict demand
    cdef long long _stale
    cdef long long _free
    cdef int passed_over_max

    def __init__(self, Router router, *, double spill_wait, long long worker_bytes, int lookahead=64,
                 eligible=_unplaced, bint long_off_loop=False, int passed_over_max=1024):
        from collections import deque
        self.router = router
        self.long_off_loop = long_off_loop
        self.eligible = eligible
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


# --- the request counters the exporter reads (broker/metrics.py: plain dicts, copied per scrape) ---

def count_request(dict requests, dict latency, tuple bounds, str op, str outcome, double seconds) -> None:
    """One request answered: its (op, outcome) count and its latency in the op's plain histogram
    (per-bucket counts, not cumulative, then the sum). Called once per request, so compiled."""
    _count(requests, latency, bounds, op, outcome, seconds)


cdef void _count(dict requests, dict latency, tuple bounds, str op, str outcome, double seconds) except *:
    cdef Py_ssize_t i = 0, n = len(bounds)
    cdef list counts
    key = (op, outcome)
    requests[key] = requests.get(key, 0) + 1
    found = latency.get(op)
    if found is None:
        counts = [0.0] * (n + 1)
        latency[op] = counts
    else:
        counts = <list>found
    if seconds < 0.0:
        seconds = 0.0
    while i < n and <double>bounds[i] < seconds:
        i += 1
    counts[i] = <double>counts[i] + 1.0
    counts[n] = <double>counts[n] + seconds


# --- the loop's per-frame and per-batch work (broker/loop.py keeps the policy, per turn) ----

cdef object _UNSEEN = object()  # a `model` the intake's table does not know yet


cdef inline void _add_reply(dict outbox, object envelope, object payload) except *:
    held = outbox.get(envelope)
    if held is None:
        outbox[envelope] = [payload]
    else:
        (<list>held).append(payload)


def send_replies(sock, dict outbox, set arrays, holding, send, array_header, Py_ssize_t frame_bytes, int more,
                 int last, Py_ssize_t copy_below) -> None:
    """Send a turn's held replies (broker/frontend.py `Frontend.flush` holds the design): to a
    connection that speaks arrays, its replies in frames of at most `frame_bytes` past the
    first, each an array header (`array_header(n)`) then the replies' bytes as the workers built them (a lone reply
    goes as its map); to any other, each reply alone. `send` is pyzmq's Cython send, given int
    flags (`more` for the envelope's frames, `last` for the payload); a payload under
    `copy_below` bytes is copied into its message, a larger one leaves without a copy. A
    connection not in `holding` stops being an array speaker. A send that fails (the client is
    gone) costs only that reply: never the loop."""
    cdef list payloads
    cdef Py_ssize_t start, end, size, n
    for envelope, found in outbox.items():
        payloads = <list>found
        identity = (<tuple>envelope)[0]
        n = len(payloads)
        if n == 1 or identity not in arrays:
            for payload in payloads:
                _send_reply(sock, send, envelope, identity, payload, more, last, copy_below)
        else:
            start = 0
            while start < n:
                end, size = start, 0
                while end < n and (end == start or size + len(payloads[end]) <= frame_bytes):
                    size += len(payloads[end])
                    end += 1
                if end - start == 1:
                    _send_reply(sock, send, envelope, identity, payloads[start], more, last, copy_below)
                else:
                    _send_reply(sock, send, envelope, identity, array_header(end - start) + b"".join(payloads[start:end]),
                                more, last, copy_below)
                start = end
        if identity in arrays and identity not in holding:
            arrays.discard(identity)
    outbox.clear()


cdef void _send_reply(sock, send, envelope, identity, payload, int more, int last, Py_ssize_t copy_below) except *:
    try:
        send(sock, identity, more)
        if (<tuple>envelope)[1]:
            send(sock, b"", more)
        send(sock, payload, last, len(payload) < copy_below)
    except ZMQError:  # the client is gone (a ROUTER drops what a full queue cannot take)
        pass


def add_reply(dict outbox, envelope, payload) -> None:
    """Hold a reply in a frontend's outbox (broker/frontend.py `Frontend.reply`, and the intake)."""
    _add_reply(outbox, envelope, payload)


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

    cdef public JobTable jobs
    cdef public Dispatcher dispatcher
    cdef public dict models
    cdef public bint affinity
    cdef public bint stopping           # the broker is shutting down: every new request is refused
    cdef public double timeout_s        # a request's deadline when it sets none
    cdef public long long max_pending, max_pending_bytes, max_client_pending
    cdef dict outbox, requests, latency, model_requests
    cdef tuple bounds
    cdef object other, late

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

    def take(self, envelope, peer, item, double now) -> int:
        """One client message (broker/frontend.py `Frontend.receive`): `item` a Peek, an array's
        Peeks (`peek_array`: the refused ones go to `other`), or None for a message the frontend
        answered itself. Returns the payload bytes of its requests (the loop bounds a turn by them)."""
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
        if op is OP_TOKENIZE or op is OP_DETOKENIZE or op is OP_CHAT or op is OP_STREAM or (
                op is OP_COUNT and peek.model is not None):
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

    def results(self, bytes wid, header, blob, double now) -> None:
        """A worker's W_RESULTS batch (checked by `check_results`): each job it held is finished
        and let go, and its reply, a view of the frame, goes to the outbox and the counters. A
        job answered skipped or empty goes to `late` (the broker answers timeout)."""
        cdef Py_buffer hb
        cdef const uchar* p
        cdef Py_ssize_t n, i, at = 0, size, known = len(_OUTCOMES)
        cdef int code
        cdef Job job
        cdef JobTable jobs = self.jobs
        cdef Dispatcher dispatcher = self.dispatcher
        view = memoryview(blob)
        PyObject_GetBuffer(header, &hb, PyBUF_SIMPLE)
        try:
            p = <const uchar*>hb.buf
            n = hb.len // 13
            for i in range(n):
                size = <Py_ssize_t>get_le(p + 13 * i + 9, 4)
                code = p[13 * i + 8]
                found = dispatcher.finish(wid, <long long>get_le(p + 13 * i, 8), code == 0)
                if found is not None:
                    job = <Job>found
                    jobs.release(job)
                    if job.answered:
                        pass
                    elif code == 1 or size == 0:  # skipped: the worker saw the budget run out a moment before the broker
                        self.late(job, now)
                    else:
                        job.answered = True
                        _add_reply(self.outbox, job.envelope, view[at:at + size])
                        _count(self.requests, self.latency, self.bounds, job.op,
                               <str>_OUTCOMES[code] if code < known else "internal", now - job.received)
                at += size
        finally:
            PyBuffer_Release(&hb)
