# The worker's per-item path in C: a plain tokenize request read in one pass over its MessagePack
# bytes (no dict, no object per field), and its reply written in one pass from the engine's u32
# buffer (no Python int per id, in either `tokens_format`). Everything else (which requests are
# plain, grouping, the engine call, the reply budget's errors) is policy in workers/ops.py.
#
# Hostile bytes: every header is read by common/_wire.pxd's bounded read_head/skip; a payload this
# reader does not fully understand is not an error here, it is handed to the general path
# (parse_request), which names what is wrong. So `read_plain` answers a tuple only for a map whose
# every key it knows and whose every value has the type the contract asks for.

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.unicode cimport PyUnicode_DecodeUTF8
from libc.stdlib cimport free, malloc
from libc.string cimport memcmp, memcpy

from tokenbroker.common._pack cimport (UINTS_SLACK, array_head_size, bin_head_size, put_array_head, put_bin_head, put_uint,
                           put_uints_u32le, uint_size)
from tokenbroker.common._wire cimport Head, K_ARRAY, K_BOOL, K_EXT, K_INT, K_MAP, K_NIL, K_STR, K_UINT, W_OK, get_le, read_head, skip

# The keys a plain tokenize may carry (the common fields and tokenize's own); any other key, or one
# twice, sends the payload to the general path.
cdef enum:
    KEY_ID = 1
    KEY_OP = 2
    KEY_MODEL = 4
    KEY_TEXT = 8
    KEY_FORMAT = 16
    KEY_SPECIAL = 32
    KEY_DEADLINE = 64
    KEY_AFFINITY = 128
    ID_DEPTH = 4  # an id is a scalar: skip() need not go deep


cdef inline int _key(const unsigned char* k, Py_ssize_t n) noexcept nogil:
    if n == 2 and memcmp(k, b"id", 2) == 0:
        return KEY_ID
    if n == 2 and memcmp(k, b"op", 2) == 0:
        return KEY_OP
    if n == 4 and memcmp(k, b"text", 4) == 0:
        return KEY_TEXT
    if n == 5 and memcmp(k, b"model", 5) == 0:
        return KEY_MODEL
    if n == 13 and memcmp(k, b"tokens_format", 13) == 0:
        return KEY_FORMAT
    if n == 18 and memcmp(k, b"add_special_tokens", 18) == 0:
        return KEY_SPECIAL
    if n == 11 and memcmp(k, b"deadline_ms", 11) == 0:
        return KEY_DEADLINE
    if n == 8 and memcmp(k, b"affinity", 8) == 0:
        return KEY_AFFINITY
    return 0


cdef object _utf8(const unsigned char* p, Py_ssize_t n):
    """The str of n UTF-8 bytes, or None when they are not valid UTF-8 (msgpack's strict decoding)."""
    try:
        return PyUnicode_DecodeUTF8(<const char*>p, n, NULL)
    except UnicodeDecodeError:
        return None


def read_plain(object payload):
    """(text, model, u32, add_special_tokens, raw id bytes) of a plain tokenize payload, or None.

    Plain: one MessagePack map of str keys, nothing after it, every key one of the common fields or
    `text`/`add_special_tokens`, each at most once, `op` "tokenize", `text` a str or a list of str,
    and every value valid as the contract says (so parse_request would accept it and the general
    path would serve it through the batch encode). `text` is a list for a batch. The raw id is the
    id value's own bytes, as they came (nil when absent). Anything else is None: the general path
    reads it and names any fault. Never raises on any bytes.
    """
    if type(payload) is not bytes:
        return None
    cdef const unsigned char* p = <const unsigned char*>PyBytes_AS_STRING(payload)
    cdef Py_ssize_t end = PyBytes_GET_SIZE(payload)
    cdef Py_ssize_t pos = 0, start, after, i
    cdef Head h, v
    cdef int seen = 0, key
    cdef Py_ssize_t pairs
    cdef bint u32 = False, special = True
    cdef object text = None, model = None, rid = b"\xc0", item
    cdef list texts
    if read_head(p, end, &pos, &h) != W_OK or h.kind != K_MAP:
        return None
    pairs = h.length
    while pairs > 0:
        pairs -= 1
        if read_head(p, end, &pos, &h) != W_OK or h.kind != K_STR:
            return None
        key = _key(p + pos, h.length)
        pos += h.length
        if key == 0 or seen & key:
            return None
        seen |= key
        start = pos
        if read_head(p, end, &pos, &v) != W_OK:
            return None
        if key == KEY_TEXT:
            if v.kind == K_STR:
                text = _utf8(p + pos, v.length)
                if text is None:
                    return None
                pos += v.length
            elif v.kind == K_ARRAY:
                texts = []
                for i in range(v.length):
                    if read_head(p, end, &pos, &h) != W_OK or h.kind != K_STR:
                        return None
                    item = _utf8(p + pos, h.length)
                    if item is None:
                        return None
                    pos += h.length
                    texts.append(item)
                text = texts
            else:
                return None
        elif key == KEY_OP:
            if v.kind != K_STR or v.length != 8 or memcmp(p + pos, b"tokenize", 8) != 0:
                return None
            pos += 8
        elif key == KEY_ID:
            if v.kind == K_ARRAY or v.kind == K_MAP or v.kind == K_EXT:
                return None
            if v.kind == K_STR and _utf8(p + pos, v.length) is None:
                return None
            after = skip(p, end, start, ID_DEPTH)
            if after < 0:
                return None
            rid = PyBytes_FromStringAndSize(<const char*>p + start, after - start)
            pos = after
        elif key == KEY_MODEL:
            if v.kind == K_STR:
                model = _utf8(p + pos, v.length)
                if model is None:
                    return None
                pos += v.length
            elif v.kind != K_NIL:
                return None
        elif key == KEY_FORMAT:
            if v.kind == K_STR and v.length == 3 and memcmp(p + pos, b"u32", 3) == 0:
                u32 = True
            elif not (v.kind == K_NIL or (v.kind == K_STR and v.length == 4 and memcmp(p + pos, b"list", 4) == 0)):
                return None
            if v.kind == K_STR:
                pos += v.length
        elif key == KEY_SPECIAL:
            if v.kind == K_BOOL:
                special = v.ival != 0
            elif v.kind != K_NIL:
                return None
        elif key == KEY_DEADLINE:
            if not (v.kind == K_NIL or (v.kind == K_UINT and v.uval > 0) or (v.kind == K_INT and v.ival > 0)):
                return None
        elif key == KEY_AFFINITY:
            if v.kind == K_STR:
                if _utf8(p + pos, v.length) is None:
                    return None
                pos += v.length
            elif v.kind != K_NIL:
                return None
    if pos != end or not (seen & KEY_OP) or text is None:
        return None
    return text, model, u32, special, rid


# --- replies ---------------------------------------------------------------------------------------

# {"id": <raw>, "ok": true, "tokens": <tokens>, "count": <n>, <tail>}: the bytes ok_reply packs for
# the fields {"tokens", "count", "cache", "worker"} (the tail is the last two, packed once per model).
cdef enum:
    HEAD_LEN = 4        # fixmap of 6, "id"
    OK_TOKENS_LEN = 11  # "ok", true, "tokens"
    COUNT_LEN = 6       # "count"
    ITEM_OVERHEAD = 5   # workers/budget.py: what the reply budget charges per tokens value besides its ids
    NOGIL_IDS = 65536   # ids from which pack_tokens lets the GIL go while it writes (~0.1 ms of work)

cdef Py_ssize_t _write(unsigned char* o, const unsigned char* f, const unsigned char* e, Py_ssize_t first, Py_ssize_t n,
                       bint batch, bint u32) noexcept nogil:
    """The `tokens` value of texts first..first+n into o; its size. For a list, o has room for 5 bytes
    an id, the headers and UINTS_SLACK; for u32, exactly."""
    cdef unsigned char* start = o
    cdef Py_ssize_t i, a, b
    if batch:
        o = put_array_head(o, n)
    for i in range(first, first + n):
        a, b = <Py_ssize_t>get_le(e + 8 * i, 8), <Py_ssize_t>get_le(e + 8 * (i + 1), 8)
        if u32:
            o = put_bin_head(o, 4 * (b - a))
            if b > a:
                memcpy(o, f + 4 * a, 4 * (b - a))
            o += 4 * (b - a)
        else:
            o = put_array_head(o, b - a)
            o = put_uints_u32le(o, f, a, b)
    return o - start


def pack_tokens(bytes flat not None, bytes ends not None, Py_ssize_t first, Py_ssize_t n, bint batch, bint u32,
                bytes rid not None, bytes tail not None, Py_ssize_t limit):
    """The reply of one tokenize served from a batch encode: texts first..first+n, whose ids are
    `ends[i]:ends[i + 1]` (little-endian u64s) of the little-endian u32 ids `flat`; `batch`: `tokens`
    is a list of n values, else the one text's. None when the reply budget (--max-reply-bytes,
    `limit`) might refuse it: the caller builds that reply (or its error) the general way, byte for
    byte what this would have written. ValueError when `ends` does not fit `flat`.
    """
    cdef const unsigned char* f = <const unsigned char*>PyBytes_AS_STRING(flat)
    cdef const unsigned char* e = <const unsigned char*>PyBytes_AS_STRING(ends)
    cdef Py_ssize_t i, a, count, bound, size, fixed
    cdef unsigned long long at, prev = 0, ids = <unsigned long long>(PyBytes_GET_SIZE(flat) // 4)
    cdef unsigned char* o
    cdef unsigned char* scratch = NULL
    cdef object reply
    if n < 0 or first < 0 or (first + n + 1) * 8 > PyBytes_GET_SIZE(ends) or (not batch and n != 1):
        raise ValueError("pack_tokens: texts out of range")
    for i in range(first, first + n + 1):
        at = get_le(e + 8 * i, 8)
        if at > ids or at < prev:
            raise ValueError("pack_tokens: ends out of range")
        prev = at
    count = <Py_ssize_t>(get_le(e + 8 * (first + n), 8) - get_le(e + 8 * first, 8))
    if (4 if u32 else 5) * count + ITEM_OVERHEAD * n > limit:  # what workers/budget.py charges first
        return None
    fixed = HEAD_LEN + PyBytes_GET_SIZE(rid) + OK_TOKENS_LEN + COUNT_LEN + uint_size(count) + PyBytes_GET_SIZE(tail)
    if u32:  # the size is known: written in place
        size = fixed + array_head_size(n) * batch + 4 * count
        for i in range(first, first + n):
            a = <Py_ssize_t>(get_le(e + 8 * (i + 1), 8) - get_le(e + 8 * i, 8))
            size += bin_head_size(4 * a)
        if size > limit:
            return None
        reply = PyBytes_FromStringAndSize(NULL, size)
        o = <unsigned char*>PyBytes_AS_STRING(reply)
        o = _head(o, rid)
        if count >= NOGIL_IDS:
            with nogil:  # the bytes object is this call's alone until it returns
                o += _write(o, f, e, first, n, batch, True)
        else:
            o += _write(o, f, e, first, n, batch, True)
        _end(o, count, tail)
        return reply
    bound = 5 * (count + n + 1) + UINTS_SLACK  # a list: written to scratch, then copied at its size
    scratch = <unsigned char*>malloc(bound)
    if scratch == NULL:
        raise MemoryError()
    try:
        if count >= NOGIL_IDS:
            with nogil:
                size = _write(scratch, f, e, first, n, batch, False)
        else:
            size = _write(scratch, f, e, first, n, batch, False)
        if fixed + size > limit:
            return None
        reply = PyBytes_FromStringAndSize(NULL, fixed + size)
        o = _head(<unsigned char*>PyBytes_AS_STRING(reply), rid)
        memcpy(o, scratch, size)
        _end(o + size, count, tail)
        return reply
    finally:
        free(scratch)


cdef inline unsigned char* _head(unsigned char* o, bytes rid) noexcept:
    memcpy(o, b"\x86\xa2id", HEAD_LEN)
    o += HEAD_LEN
    memcpy(o, PyBytes_AS_STRING(rid), PyBytes_GET_SIZE(rid))
    o += PyBytes_GET_SIZE(rid)
    memcpy(o, b"\xa2ok\xc3\xa6tokens", OK_TOKENS_LEN)
    return o + OK_TOKENS_LEN


cdef inline void _end(unsigned char* o, Py_ssize_t count, bytes tail) noexcept:
    memcpy(o, b"\xa5count", COUNT_LEN)
    o = put_uint(o + COUNT_LEN, count)
    memcpy(o, PyBytes_AS_STRING(tail), PyBytes_GET_SIZE(tail))
