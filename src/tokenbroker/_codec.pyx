# cython: language_level=3, boundscheck=False, wraparound=False
"""The client's per-call path in compiled code: requests packed, replies read and calls settled.

Python (`_client_core`) keeps the policy: which broker a call goes to, deadlines, liveness,
`overloaded` retries. What is done per call or per id is here:

- `pack` / `pack_entries`: MessagePack of plain values (exact str, bytes, int, bool, float, None,
  list, tuple, dict), byte for byte what `msgpack.Packer(use_bin_type=True)` writes; any other
  type raises TypeError and the caller packs that body with msgpack itself.
- A request is its op's fields packed once (`Call.head`) plus `id` and `deadline_ms`, written at
  each send (`request`): a re-send after failover or `overloaded` repacks nothing else.
- `heads`: the fields of many requests that differ in one value (a batch), in one call.
- `submit_batch`: a batch's calls made, registered and queued in one call.
- `frames`: one loop turn's requests cut into frames (contract 1.2 arrays, bounded in calls and bytes),
  each call's request written straight into its frame from its head (no bytes per call).
- `settle`: a reply frame read and every call it answers settled: a tokenize, detokenize or chat
  reply of the usual shape becomes its result (`Tokens`, `Text`, `ChatTokens`) straight from the
  bytes, ids as one `array('I')` copied from the u32 bin (no Python int per id unless the caller
  asked for lists); any other reply becomes the map msgpack would give. What needs policy (an id
  that is not pending, `overloaded`) is handed back.
- `unpack`: any MessagePack value, equal to `msgpack.unpackb(raw=False, strict_map_key=False)`.

Hostile bytes: every read is bounded by `common/_wire.read_head` (lengths checked against the
bytes left), nesting is bounded, and a frame that does not parse raises ValueError.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.unicode cimport PyUnicode_DecodeUTF8
from cpython.array cimport array, clone
from cpython.float cimport PyFloat_AS_DOUBLE
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from libc.string cimport memcmp, memcpy
from libc.stdint cimport uint32_t, uint64_t, int64_t

from tokenbroker.common._pack cimport (Buf, array_head_size, buf_array_head, buf_bin_head, buf_byte, buf_bytes, buf_f64, buf_free,
                           buf_grow, buf_int, buf_map_head, buf_put, buf_str_head, buf_take, buf_uint, put_array_head,
                           put_map_head, put_uint, uint_size)
from tokenbroker.common._wire cimport (Head, read_head, skip, K_NIL, K_BOOL, K_INT, K_UINT, K_FLOAT, K_STR, K_BIN, K_ARRAY,
                           K_MAP, K_EXT, W_OK)

import sys
from heapq import heappush

import msgpack

from ._client_results import CacheInfo, ChatTokens, Text, Tokens

cdef extern from "Python.h":
    ctypedef struct PyMemberDef:
        Py_ssize_t offset
    ctypedef struct PyMemberDescrObject:
        PyMemberDef* d_member
    ctypedef struct PyTypeObject:
        pass
    ctypedef struct PyObject:
        pass
    object PyType_GenericAlloc(PyTypeObject*, Py_ssize_t)  # a new reference, which Cython then owns
    void PyObject_GC_UnTrack(void*)
    void Py_INCREF(PyObject*)

    const char* PyUnicode_AsUTF8AndSize(object, Py_ssize_t*) except NULL
    object PyLong_FromUnsignedLongLong(unsigned long long)
    object PyLong_FromLongLong(long long)
    int64_t PyLong_AsLongLongAndOverflow(object, int*) except? -1
    uint64_t PyLong_AsUnsignedLongLong(object) except? -1
    object PyObject_CallMethodOneArg(object, object, object)

DEF MAX_DEPTH = 256  # containers nested deeper than this are refused (the contract sends depth <= 4)

cdef bint _BIG = sys.byteorder == "big"
cdef array _U32 = array("I")
cdef object _ExtType = msgpack.ExtType
cdef object _Timestamp = msgpack.Timestamp

# Call kinds: which result a reply of the usual shape becomes.
KIND_RAW = 0  # the reply map (request(), count, models, ...)
KIND_TOKENS = 1
KIND_TEXT = 2
KIND_CHAT = 3
KIND_TOKENS_LIST = 5  # as KIND_TOKENS, ids as a list of int
KIND_CHAT_LIST = 7

# --- packing (common/_pack.pxd writes the heads) ------------------------------------------


cdef int _int(Buf* b, object o) except -1:
    """A Python int as msgpack packs it: the smallest format that holds it; OverflowError past 64 bits."""
    cdef int overflow = 0
    cdef int64_t x = PyLong_AsLongLongAndOverflow(o, &overflow)
    if overflow > 0:
        return buf_uint(b, PyLong_AsUnsignedLongLong(o))  # OverflowError past 2**64 - 1, as msgpack
    if overflow < 0:
        raise OverflowError("int too big to convert")
    return buf_int(b, x)


cdef int _pack(Buf* b, object o, int depth) except -1:
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
        return _int(b, o)
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
            _pack(b, k, depth + 1)
            _pack(b, v, depth + 1)
        return 0
    if t is list or t is tuple:
        buf_array_head(b, len(o))
        for v in o:
            _pack(b, v, depth + 1)
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
        _pack(&b, value, 0)
    except BaseException:
        buf_free(&b)
        raise
    return buf_take(&b)


def pack_entries(dict fields) -> bytes:
    """A map's key/value pairs without its header: a request's `head` (its count is len(fields))."""
    cdef Buf b = Buf(NULL, 0, 0)
    try:
        for k, v in fields.items():
            _pack(&b, k, 1)
            _pack(&b, v, 1)
    except BaseException:
        buf_free(&b)
        raise
    return buf_take(&b)


cdef bytes _request(bytes head, Py_ssize_t nkeys, object rid, long long deadline_ms):
    cdef Buf b = Buf(NULL, 0, 0)
    cdef Py_ssize_t n = PyBytes_GET_SIZE(head)
    try:
        buf_grow(&b, n + 32)
        buf_map_head(&b, nkeys + 2)
        buf_put(&b, PyBytes_AS_STRING(head), n)
        buf_put(&b, "\xa2id", 3)
        _int(&b, rid)
        buf_put(&b, "\xabdeadline_ms", 12)
        buf_int(&b, deadline_ms)
    except BaseException:
        buf_free(&b)
        raise
    return buf_take(&b)


def request(bytes head, Py_ssize_t nkeys, object rid, long long deadline_ms) -> bytes:
    """One request map: the fields packed in `head` (`nkeys` of them), then `id`, then `deadline_ms`:
    the bytes msgpack writes for that dict in that order."""
    return _request(head, nkeys, rid, deadline_ms)


def tokenize_head(object text, object add_special_tokens, object model, object affinity) -> tuple:
    """The packed fields of a plain `tokenize` (`text`, `add_special_tokens`, u32 ids, `model` and
    `affinity` when not None), and how many: what pack_entries gives for that dict, in one call."""
    cdef Buf b = Buf(NULL, 0, 0)
    cdef Py_ssize_t n = 4
    try:
        buf_put(&b, "\xa2op\xa8tokenize\xa4text", 17)
        _pack(&b, text, 1)
        buf_put(&b, "\xb2add_special_tokens", 19)
        _pack(&b, add_special_tokens, 1)
        buf_put(&b, "\xadtokens_format\xa3u32", 18)
        if model is not None:
            buf_put(&b, "\xa5model", 6)
            _pack(&b, model, 1)
            n += 1
        if affinity is not None:
            buf_put(&b, "\xa8affinity", 9)
            _pack(&b, affinity, 1)
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
            _pack(&b, v, 1)
            buf_put(&b, PyBytes_AS_STRING(suffix), ns)
            out.append(buf_bytes(&b))
    finally:
        buf_free(&b)
    return out


# --- calls ------------------------------------------------------------------------------------


cdef class Batch:
    """One awaitable for many calls: `results[i]` is call i's result (or its reply map, or an
    exception), `future` gets this batch when the last one is in."""

    cdef public object future
    cdef public list results
    cdef public Py_ssize_t left
    cdef public Py_ssize_t odd  # results that are not the call's result type (maps, exceptions)
    cdef public object first  # the id of its first call (its calls' ids follow on)

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

    cdef public object id
    cdef public bytes head  # the op's fields, packed (pack_entries)
    cdef public Py_ssize_t nkeys
    cdef public int kind
    cdef public str op
    cdef public object future  # None for a call of a batch
    cdef public Batch batch
    cdef public Py_ssize_t index
    cdef public double deadline  # loop time
    cdef public double timeout
    cdef public object link
    cdef public object retry
    cdef public int attempts

    def __init__(self, object rid, bytes head, Py_ssize_t nkeys, int kind, str op, object future,
                 double deadline, double timeout, Batch batch=None, Py_ssize_t index=0):
        self.id = rid
        self.head = head
        self.nkeys = nkeys
        self.kind = kind
        self.op = op
        self.future = future
        self.batch = batch
        self.index = index
        self.deadline = deadline
        self.timeout = timeout
        self.link = None
        self.retry = None
        self.attempts = 0

    def done(self) -> bool:
        """Its awaiter has stopped waiting or it is settled (a cancelled future is done at once)."""
        if self.batch is not None:
            return self.batch.future.done()
        return self.future.done()

    def payload(self, double now) -> bytes:
        """The request as it goes now: its fields, its id and what is left of its deadline."""
        return _request(self.head, self.nkeys, self.id, _ms(self.deadline - now))

    cpdef settle(self, object reply):
        """Settle with a reply map as it came (an error the engine gave up retrying)."""
        if self.batch is not None:
            self.batch.put(self.index, reply, True)
        elif not self.future.done():
            self.future.set_result(reply)

    cpdef fail(self, object error):
        """Settle with an exception (expired, client closed)."""
        if self.batch is not None:
            self.batch.put(self.index, error, True)
        elif not self.future.done():
            self.future.set_exception(error)


cdef long long MAX_DEADLINE_MS = 0


def configure(long long max_deadline_ms) -> None:
    global MAX_DEADLINE_MS
    MAX_DEADLINE_MS = max_deadline_ms


cdef inline long long _ms(double left):
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
    call.id = rid
    call.head = head
    call.nkeys = nkeys
    call.kind = kind
    call.op = op
    call.future = future
    call.deadline = deadline
    call.timeout = timeout
    call.link = link
    calls[rid] = call
    if not outstanding:
        link.busy_since = now
    outstanding[rid] = call
    link.sent += 1
    (<list>link.outbox).append(None)  # its request is written at the flush, into its frame (`frames`)
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
        call.id = key
        call.head = <bytes>heads[i]
        call.nkeys = nkeys
        call.kind = kind
        call.op = op
        call.future = None
        call.batch = batch
        call.index = start + i
        call.deadline = deadline
        call.timeout = timeout
        call.link = link
        call.attempts = 0
        calls[key] = call
        outstanding[key] = call
        outbox.append(None)
        outbox_calls.append(call)
        added += PyBytes_GET_SIZE(call.head) + 32
        rid += 1
    link.outbox_bytes += added
    link.sent += len(heads)
    return rid


cdef inline Py_ssize_t _request_size(Call call, long long ms) except -1:
    """Bytes `_request` writes for this call sent with `ms` left: its map head, its fields, its id
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
            size = _request_size(<Call>calls_out[i], _ms((<Call>calls_out[i]).deadline - now)) if p is None \
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
            o = put_uint(o + 12, <uint64_t>_ms(call.deadline - now))
            if o != <unsigned char*>w + at + sizes[i]:  # pragma: no cover - _request_size and the writer disagree
                raise SystemError("a request's size was miscounted")
        at += sizes[i]
    return out


# --- reading ----------------------------------------------------------------------------------


cdef object _value(const unsigned char* p, Py_ssize_t end, Py_ssize_t* pos, int depth):
    """One whole value at pos[0], as msgpack.unpackb(raw=False, strict_map_key=False) gives it."""
    cdef Head h
    cdef int r = read_head(p, end, pos, &h)
    cdef Py_ssize_t i, at
    cdef list items
    cdef dict m
    cdef object k
    if r != W_OK:
        raise ValueError(f"malformed MessagePack ({r}) at byte {pos[0]}")
    if h.kind == K_STR:
        at = pos[0]
        pos[0] = at + h.length
        return PyUnicode_DecodeUTF8(<const char*>p + at, h.length, NULL)
    if h.kind == K_UINT:
        return PyLong_FromUnsignedLongLong(h.uval)
    if h.kind == K_INT:
        return PyLong_FromLongLong(h.ival)
    if h.kind == K_NIL:
        return None
    if h.kind == K_BOOL:
        return h.ival != 0
    if h.kind == K_BIN:
        at = pos[0]
        pos[0] = at + h.length
        return PyBytes_FromStringAndSize(<const char*>p + at, h.length)
    if depth >= MAX_DEPTH:
        if h.kind == K_MAP or h.kind == K_ARRAY:
            raise ValueError("MessagePack nested too deep")
    if h.kind == K_MAP:
        m = {}
        for i in range(h.length):
            k = _value(p, end, pos, depth + 1)
            try:
                m[k] = _value(p, end, pos, depth + 1)
            except TypeError:  # a key Python cannot hash (a list): no reply has one
                raise ValueError(f"malformed MessagePack: an unhashable map key at byte {pos[0]}") from None
        if len(m) != h.length:  # msgpack keeps the last; a reply never repeats a key (contract 1.4 refuses it)
            raise ValueError("malformed MessagePack: a map with a repeated key")
        return m
    if h.kind == K_ARRAY:
        items = []
        for i in range(h.length):
            items.append(_value(p, end, pos, depth + 1))
        return items
    if h.kind == K_FLOAT:
        return h.fval
    if h.kind == K_EXT:
        at = pos[0]
        if end - at < h.length:
            raise ValueError("truncated ext")
        pos[0] = at + h.length
        data = PyBytes_FromStringAndSize(<const char*>p + at, h.length)
        code = <signed char>p[at - 1]
        if code == -1:
            return _Timestamp.from_bytes(data)
        return _ExtType(code, data)
    raise ValueError("malformed MessagePack")


def unpack(bytes data) -> object:
    """One MessagePack value filling `data`, as msgpack.unpackb(raw=False, strict_map_key=False);
    ValueError where msgpack would keep the last of a map's repeated keys (no reply repeats one) or
    cannot hash a key."""
    cdef Py_ssize_t pos = 0
    cdef Py_ssize_t end = PyBytes_GET_SIZE(data)
    cdef object out = _value(<const unsigned char*>PyBytes_AS_STRING(data), end, &pos, 0)
    if pos != end:
        raise ValueError("extra bytes after the value")
    return out


# The results are frozen slots dataclasses: their `__init__` sets each field through
# `object.__setattr__`, which costs more than reading the whole reply. They are built here as
# Python would build them, with every slot stored directly at its offset (taken from the class's
# own member descriptors at import), every field set.
cdef struct Layout:
    PyTypeObject* cls
    Py_ssize_t n
    Py_ssize_t offsets[16]


cdef Layout _layout(type cls) except *:
    cdef Layout out
    cdef tuple names = cls.__slots__
    cdef Py_ssize_t i
    if len(names) > 16:
        raise TypeError(f"{cls.__name__} has more than 16 fields")
    out.cls = <PyTypeObject*>cls
    out.n = len(names)
    for i in range(out.n):
        descriptor = cls.__dict__[names[i]]
        if type(descriptor).__name__ != "member_descriptor":
            raise TypeError(f"{cls.__name__}.{names[i]} is not a slot")
        out.offsets[i] = (<PyMemberDescrObject*><PyObject*>descriptor).d_member.offset
    return out


cdef Layout _TOKENS = _layout(Tokens)
cdef Layout _TEXT = _layout(Text)
cdef Layout _CHAT = _layout(ChatTokens)


cdef object _build(Layout* layout, PyObject** values):
    """An instance of the layout's class with its fields, in order, set to `values` (as many as it has)."""
    # Declared as returning `object`, the allocation's own reference is the one returned: a cast of
    # a `PyObject*` to `object` adds one, and every result (with its ids) would never be freed.
    cdef object out = PyType_GenericAlloc(layout.cls, 0)
    cdef PyObject* obj = <PyObject*>out
    cdef Py_ssize_t i
    for i in range(layout.n):
        Py_INCREF(values[i])
        (<PyObject**>((<char*>obj) + layout.offsets[i]))[0] = values[i]
    return out


def build(type cls, tuple values) -> object:
    """`cls(*values)` for a result class, built as `settle` builds it (for tests)."""
    cdef Layout layout
    if cls is Tokens:
        layout = _TOKENS
    elif cls is Text:
        layout = _TEXT
    elif cls is ChatTokens:
        layout = _CHAT
    else:
        raise TypeError(cls)
    cdef PyObject* slots[16]
    cdef Py_ssize_t i
    if len(values) != layout.n:
        raise TypeError("give every field")
    for i in range(layout.n):
        slots[i] = <PyObject*>values[i]
    return _build(&layout, slots)


cdef dict _CACHE_INFOS = {}
cdef char _worker_raw[64]
cdef Py_ssize_t _worker_len = -1
cdef str _worker_str = ""


cdef inline str _worker(const unsigned char* p, Py_ssize_t n):
    """A worker's name: the same few recur on every reply, so the last one is kept."""
    global _worker_len, _worker_str
    if n == _worker_len and memcmp(p, _worker_raw, n) == 0:
        return _worker_str
    name = PyUnicode_DecodeUTF8(<const char*>p, n, NULL)
    if n <= 64:
        memcpy(_worker_raw, p, n)
        _worker_len, _worker_str = n, name
    return name


cdef str _L0_HIT = "hit", _L0_MISS = "miss", _L0_OFF = "off"


cdef inline str _l0(const unsigned char* p, Py_ssize_t n):
    if n == 3 and memcmp(p, b"off", 3) == 0:
        return _L0_OFF
    if n == 3 and memcmp(p, b"hit", 3) == 0:
        return _L0_HIT
    if n == 4 and memcmp(p, b"miss", 4) == 0:
        return _L0_MISS
    return PyUnicode_DecodeUTF8(<const char*>p, n, NULL)


cdef object _cache_info(object l0, object l1):
    key = (l0, l1)
    info = _CACHE_INFOS.get(key)
    if info is None:
        info = CacheInfo(l0, l1)
        if len(_CACHE_INFOS) < 4096:
            _CACHE_INFOS[key] = info
    return info


cdef inline bint _key(const unsigned char* p, Py_ssize_t at, Py_ssize_t n, const char* name, Py_ssize_t m):
    return n == m and memcmp(p + at, name, m) == 0


cdef object _ids(const unsigned char* p, Py_ssize_t at, Py_ssize_t n, bint as_list):
    cdef array a = clone(_U32, n >> 2, False)
    cdef uint32_t* w
    cdef Py_ssize_t i
    memcpy(a.data.as_voidptr, p + at, n)
    if _BIG:
        w = <uint32_t*>a.data.as_voidptr
        for i in range(n >> 2):
            w[i] = ((w[i] & 0xff) << 24) | ((w[i] & 0xff00) << 8) | ((w[i] >> 8) & 0xff00) | (w[i] >> 24)
    return a.tolist() if as_list else a


cdef inline unsigned int _field_bit(const unsigned char* k, Py_ssize_t n):
    """A bit per field `_typed` reads (0 for any other key: those send the map to the generic reader)."""
    if n == 2:
        return 1 if k[0] == b"i" else 2 if k[0] == b"o" else 0
    if n == 6:
        return 4 if k[0] == b"w" else 8 if k[0] == b"t" else 16 if k[0] == b"p" else 0
    if n == 5:
        return 32 if k[1] == b"o" else 64 if k[1] == b"a" else 0
    if n == 4:
        return 128
    return 0


cdef object _typed(const unsigned char* p, Py_ssize_t end, Py_ssize_t* pos, Py_ssize_t pairs, int kind):
    """A reply map of the usual shape for `kind`, read straight into its result; None (pos[0] left
    where it was) when it is anything else, for the caller to read as a map."""
    cdef Py_ssize_t start = pos[0], i, at, j
    cdef Head h, c
    cdef object tokens = None, count = None, worker = "", cache = None, prompt = None, text = None
    cdef object l0, l1
    cdef bint ok = False, as_list = kind >= 4
    cdef int base = kind & 3
    cdef unsigned int seen = 0, bit  # the fields read so far: one twice makes the map the generic reader's to refuse
    for i in range(pairs):
        if read_head(p, end, pos, &h) != W_OK or h.kind != K_STR:
            pos[0] = start
            return None
        at = pos[0]
        pos[0] = at + h.length
        if read_head(p, end, pos, &c) != W_OK:
            pos[0] = start
            return None
        bit = _field_bit(p + at, h.length)
        if seen & bit:
            pos[0] = start
            return None
        seen |= bit
        if _key(p, at, h.length, "id", 2):
            if c.kind == K_STR or c.kind == K_BIN:
                pos[0] += c.length
            elif c.kind not in (K_UINT, K_INT, K_NIL, K_BOOL, K_FLOAT):
                pos[0] = start
                return None
        elif _key(p, at, h.length, "ok", 2) and c.kind == K_BOOL:
            ok = c.ival != 0
        elif _key(p, at, h.length, "worker", 6) and c.kind == K_STR:
            worker = _worker(p + pos[0], c.length)
            pos[0] += c.length
        elif base != 2 and _key(p, at, h.length, "tokens", 6) and c.kind == K_BIN and (c.length & 3) == 0:
            tokens = _ids(p, pos[0], c.length, as_list)
            pos[0] += c.length
        elif base != 2 and _key(p, at, h.length, "count", 5) and c.kind == K_UINT:
            count = PyLong_FromUnsignedLongLong(c.uval)
        elif base != 2 and _key(p, at, h.length, "cache", 5) and c.kind == K_MAP and c.length == 2:
            l0 = l1 = None
            for j in range(2):
                if read_head(p, end, pos, &h) != W_OK or h.kind != K_STR:
                    pos[0] = start
                    return None
                at = pos[0]
                pos[0] = at + h.length
                if _key(p, at, h.length, "l0", 2):
                    if read_head(p, end, pos, &c) != W_OK or c.kind != K_STR:
                        pos[0] = start
                        return None
                    l0 = _l0(p + pos[0], c.length)
                    pos[0] += c.length
                elif _key(p, at, h.length, "l1_reused_tokens", 16):
                    if read_head(p, end, pos, &c) != W_OK or c.kind != K_UINT:
                        pos[0] = start
                        return None
                    l1 = PyLong_FromUnsignedLongLong(c.uval)
                else:
                    pos[0] = start
                    return None
            if l0 is None or l1 is None:
                pos[0] = start
                return None
            cache = _cache_info(l0, l1)
        elif base == 3 and _key(p, at, h.length, "prompt", 6) and (c.kind == K_STR or c.kind == K_NIL):
            if c.kind == K_STR:
                prompt = PyUnicode_DecodeUTF8(<const char*>p + pos[0], c.length, NULL)
                pos[0] += c.length
        elif base == 2 and _key(p, at, h.length, "text", 4) and c.kind == K_STR:
            text = PyUnicode_DecodeUTF8(<const char*>p + pos[0], c.length, NULL)
            pos[0] += c.length
        else:  # a field this shape has not, or one of another type: read it as a map
            pos[0] = start
            return None
    if not ok:
        pos[0] = start
        return None
    cdef PyObject* f[9]
    cdef PyObject* none = <PyObject*>None
    cdef object out
    if base == 2:
        if text is None:
            pos[0] = start
            return None
        f[0], f[1] = <PyObject*>text, <PyObject*>worker
        out = _build(&_TEXT, f)
        PyObject_GC_UnTrack(<PyObject*>out)  # two str: atomic (see below)
        return out
    if tokens is None or count is None:
        pos[0] = start
        return None
    f[0], f[1] = <PyObject*>tokens, <PyObject*>count
    if base == 1:
        f[2], f[3] = <PyObject*>worker, <PyObject*>cache
        f[4] = f[5] = f[6] = f[7] = none
        out = _build(&_TOKENS, f)
    else:
        f[2], f[3], f[4] = <PyObject*>prompt, <PyObject*>worker, <PyObject*>cache
        f[5] = f[6] = f[7] = f[8] = none
        out = _build(&_CHAT, f)
    if not as_list:
        # Every field is atomic (an array of ints, an int, str, None, an interned CacheInfo of a str
        # and an int): no cycle can go through it, so the collector need not track it, as CPython
        # untracks tuples of atoms. It saves the collector's visits to every result held.
        PyObject_GC_UnTrack(<PyObject*>out)
    return out


cdef object _reply_id(const unsigned char* p, Py_ssize_t end, Py_ssize_t pos, Py_ssize_t pairs):
    """The `id` of the reply map whose pairs start at pos, when it is an int; None otherwise."""
    cdef Py_ssize_t i, at
    cdef Head h, v
    cdef object rid = None
    for i in range(pairs):
        if read_head(p, end, &pos, &h) != W_OK:
            return None
        if h.kind == K_STR:
            at = pos
            pos += h.length
            if read_head(p, end, &pos, &v) != W_OK:
                return None
            if _key(p, at, h.length, "id", 2):
                if rid is not None:
                    return _NEED_FULL  # `id` twice: the generic reader refuses the map
                if v.kind == K_UINT:
                    rid = PyLong_FromUnsignedLongLong(v.uval)
                elif v.kind == K_INT:
                    rid = PyLong_FromLongLong(v.ival)
                else:
                    return None
                continue
        elif h.kind in (K_BIN,):
            pos += h.length
            if read_head(p, end, &pos, &v) != W_OK:
                return None
        else:
            return None  # a key of another type: let the generic reader judge
        if v.kind == K_STR or v.kind == K_BIN or v.kind == K_EXT:
            pos += v.length
        elif v.kind == K_MAP or v.kind == K_ARRAY:
            return rid if rid is not None else _NEED_FULL
    return rid


cdef object _NEED_FULL = object()


def settle(bytes payload, dict calls, list odd) -> int:
    """Read a reply frame (a map, or an array of maps) and settle every call it answers with its
    result; how many it settled. Appended to `odd`, for the engine's policy: `(id, reply)` for a
    reply whose id is not pending (a probe's, a late one) and for an `overloaded` one, and
    `(None, element)` for an element that is not a map.

    The whole frame is read before anything is settled: ValueError when any of it does not parse
    (bad bytes, bad UTF-8, a key Python cannot hash, a map with a repeated key, a bad timestamp),
    and then nothing of it is settled and nothing is appended to `odd`."""
    cdef list values, found
    try:
        values, found = _read_frame(payload, calls)
    except (ValueError, TypeError, OverflowError) as e:
        raise ValueError(f"malformed reply frame: {e}") from None
    return _settle_read(values, found, calls, odd)


cdef tuple _read_frame(bytes payload, dict calls):
    """Every element of a reply frame read (a result, or the map or value msgpack gives) with the
    pending call its id names (None if none): nothing settled, so a frame that raises here costs
    no call its reply."""
    cdef const unsigned char* p = <const unsigned char*>PyBytes_AS_STRING(payload)
    cdef Py_ssize_t end = PyBytes_GET_SIZE(payload)
    cdef Py_ssize_t pos = 0, n, i, start
    cdef Head h
    cdef object rid, value, call
    cdef list values = [], found = []
    if skip(p, end, 0, MAX_DEPTH) != end:
        raise ValueError("not one MessagePack value")
    read_head(p, end, &pos, &h)
    if h.kind == K_ARRAY:
        n = h.length
    else:
        n = 1
        pos = 0
    for i in range(n):
        start = pos
        read_head(p, end, &pos, &h)
        if h.kind != K_MAP:
            pos = start
            values.append(_value(p, end, &pos, 1))
            found.append(None)
            continue
        rid = _reply_id(p, end, pos, h.length)
        call = None
        if rid is not None and rid is not _NEED_FULL:
            call = calls.get(rid)
        value = None
        if call is not None and (<Call>call).kind != 0:
            value = _typed(p, end, &pos, h.length, (<Call>call).kind)
        if value is None:
            pos = start
            value = _value(p, end, &pos, 1)
            if call is None:
                rid = (<dict>value).get("id")
                if type(rid) is int:  # only an int names a call (not True, nor 1.0)
                    call = calls.get(rid)
        values.append(value)
        found.append(call)
    return values, found


cdef int _settle_read(list values, list found, dict calls, list odd) except -1:
    """Settle the calls a read frame answers (`_read_frame`), in order; what needs policy goes to `odd`."""
    cdef Py_ssize_t i
    cdef object value, f
    cdef Call call
    cdef int settled = 0
    for i in range(len(values)):
        value = values[i]
        f = found[i]
        if type(value) is not dict and f is None:
            odd.append((None, value))
            continue
        if f is None or (<Call>f).id not in calls:  # not pending, or answered earlier in this frame
            odd.append(((<dict>value).get("id") if type(value) is dict else (<Call>f).id, value))
            continue
        call = <Call>f
        if type(value) is dict and (<dict>value).get("ok") is not True:
            err = (<dict>value).get("error")
            if type(err) is dict and (<dict>err).get("code") == "overloaded":
                odd.append((call.id, value))
                continue
        del calls[call.id]
        link = call.link
        if link is not None:
            (<dict>link.outstanding).pop(call.id, None)
        if call.retry is not None:
            call.retry.cancel()
        if call.batch is not None:
            call.batch.put(call.index, value, type(value) is dict)
        elif not call.future.done():
            call.future.set_result(value)
        settled += 1
    return settled
