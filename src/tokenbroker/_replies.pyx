# cython: language_level=3, boundscheck=False, wraparound=False
"""The client's reader: a reply frame read and every call it answers settled.

- `settle` / `settle_frame`: a frame (a reply map, or an array of them) read whole first, then
  its calls settled (`_calls.answered`): a tokenize, detokenize or chat reply of the usual shape
  becomes its result (`Tokens`, `Text`, `ChatTokens`) straight from the bytes, ids as one
  `array('I')` copied from the u32 bin (no Python int per id unless the caller asked for lists);
  any other reply becomes the map msgpack would give. What needs policy (an id that is not
  pending, `overloaded`) is handed back.
- `unpack`: any MessagePack value, equal to `msgpack.unpackb(raw=False, strict_map_key=False)`
  for a value without a repeated map key.

Hostile bytes: every read is bounded by `common/_wire.read_head` (lengths checked against the
bytes left), nesting is bounded, and a frame that does not parse raises ValueError having settled
nothing. A reply map with a key twice is malformed (msgpack keeps the last; the broker never sends
one, and contract 1.4 refuses one in a request).
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.unicode cimport PyUnicode_DecodeUTF8
from cpython.array cimport array, clone
from libc.string cimport memcmp, memcpy
from libc.stdint cimport uint32_t

from tokenbroker.common._wire cimport (Head, read_head, skip, K_NIL, K_BOOL, K_INT, K_UINT, K_FLOAT, K_STR, K_BIN, K_ARRAY,
                           K_MAP, K_EXT, W_OK)
from tokenbroker._calls cimport C_AS_LIST, C_CHAT, C_RAW, C_TEXT, Call, answered
from tokenbroker.common._zmq cimport (EAGAIN, EINTR, ZMQ_DONTWAIT, handle_of, load_libzmq, zmq_errno, zmq_error,
                                      zmq_msg_close, zmq_msg_data, zmq_msg_init, zmq_msg_recv, zmq_msg_size, zmq_msg_t)

import sys

import msgpack
from zmq import ZMQError

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
    object PyLong_FromUnsignedLongLong(unsigned long long)
    object PyLong_FromLongLong(long long)

DEF MAX_DEPTH = 256  # containers nested deeper than this are refused (the contract sends depth <= 4)

load_libzmq()

cdef bint _BIG = sys.byteorder == "big"
cdef array _U32 = array("I")
cdef object _ExtType = msgpack.ExtType
cdef object _Timestamp = msgpack.Timestamp


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
    cdef bint ok = False, as_list = (kind & C_AS_LIST) != 0
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
        elif base != C_TEXT and _key(p, at, h.length, "tokens", 6) and c.kind == K_BIN and (c.length & 3) == 0:
            tokens = _ids(p, pos[0], c.length, as_list)
            pos[0] += c.length
        elif base != C_TEXT and _key(p, at, h.length, "count", 5) and c.kind == K_UINT:
            count = PyLong_FromUnsignedLongLong(c.uval)
        elif base != C_TEXT and _key(p, at, h.length, "cache", 5) and c.kind == K_MAP and c.length == 2:
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
        elif base == C_CHAT and _key(p, at, h.length, "prompt", 6) and (c.kind == K_STR or c.kind == K_NIL):
            if c.kind == K_STR:
                prompt = PyUnicode_DecodeUTF8(<const char*>p + pos[0], c.length, NULL)
                pos[0] += c.length
        elif base == C_TEXT and _key(p, at, h.length, "text", 4) and c.kind == K_STR:
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
    if base == C_TEXT:
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


def drain(object sock, dict calls, list odd, object link) -> tuple:
    """Take in every frame waiting on `sock` (until libzmq says EAGAIN, which also leaves its
    edge-triggered descriptor armed for the next one) and settle every call they answer, each read
    straight from the message it arrived in (no bytes per frame): one event-loop wake-up settles a
    whole burst in one pass. What needs policy goes to `odd` (see `settle`); a frame that does not
    parse is counted in `link.dropped`, and settles nothing. Returns (frames received, calls settled)."""
    cdef void* handle = handle_of(sock)
    cdef zmq_msg_t msg
    cdef long long frames = 0, settled = 0, dropped = 0
    cdef size_t n
    cdef int err
    try:
        while True:
            zmq_msg_init(&msg)
            if zmq_msg_recv(&msg, handle, ZMQ_DONTWAIT) < 0:
                err = zmq_errno()
                zmq_msg_close(&msg)
                if err == EINTR:
                    continue
                if err == EAGAIN:
                    break
                raise ZMQError(err, zmq_error(err))
            frames += 1
            n = zmq_msg_size(&msg)
            try:
                if n:  # an empty frame (a delimiter) is not ours to send, yet harmless to skip
                    settled += settle_frame(<const unsigned char*>zmq_msg_data(&msg), n, calls, odd)
            except ValueError:  # not ours to judge: a reply we cannot read is dropped like a stray one
                dropped += 1
            finally:
                zmq_msg_close(&msg)
    finally:
        if dropped:
            link.dropped += dropped
    return frames, settled


def settle(bytes payload, dict calls, list odd) -> int:
    """Read a reply frame (a map, or an array of maps) and settle every call it answers with its
    result; how many it settled. Appended to `odd`, for the engine's policy: `(id, reply)` for a
    reply whose id is not pending (a probe's, a late one) and for an `overloaded` one, and
    `(None, element)` for an element that is not a map.

    The whole frame is read before anything is settled: ValueError when any of it does not parse
    (bad bytes, bad UTF-8, a key Python cannot hash, a map with a repeated key, a bad timestamp),
    and then nothing of it is settled and nothing is appended to `odd`."""
    return settle_frame(<const unsigned char*>PyBytes_AS_STRING(payload), PyBytes_GET_SIZE(payload), calls, odd)


cdef int settle_frame(const unsigned char* p, Py_ssize_t end, dict calls, list odd) except -1:
    """`settle` on a frame's bytes where they are (a received message's own buffer)."""
    cdef list values, found
    try:
        values, found = _read_frame(p, end, calls)
    except (ValueError, TypeError, OverflowError) as e:
        raise ValueError(f"malformed reply frame: {e}") from None
    return _settle_read(values, found, calls, odd)


cdef tuple _read_frame(const unsigned char* p, Py_ssize_t end, dict calls):
    """Every element of a reply frame read (a result, or the map or value msgpack gives) with the
    pending call its id names (None if none): nothing settled, so a frame that raises here costs
    no call its reply."""
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
        if call is not None and (<Call>call).kind != C_RAW:
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
        answered(call, calls, value, type(value) is dict)
        settled += 1
    return settled
