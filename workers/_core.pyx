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
from tokenbroker.common._wire cimport (ID_ECHOED, Head, K_ARRAY, K_BOOL, K_EXT, K_INT, K_MAP, K_NIL, K_STR, K_UINT, W_OK, get_le,
                                       id_kind, read_head, skip, utf8_valid)

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


cdef bint read_plain_at(const unsigned char* p, Py_ssize_t end, Plain* out) noexcept nogil:
    """Whether the n bytes at p are a plain tokenize (read_plain says which), and where its fields
    are. Builds nothing: the texts' UTF-8 is checked when they are decoded (`plain_text`), every
    other str here (the model, an id, affinity)."""
    cdef Py_ssize_t pos = 0, start, after, i, pairs
    cdef Head h, v
    cdef int seen = 0, key
    out.text_at = out.model_at = out.rid_at = -1
    out.n = out.model_len = out.rid_len = 0
    out.batch = out.u32 = False
    out.special = True
    if read_head(p, end, &pos, &h) != W_OK or h.kind != K_MAP:
        return False
    pairs = h.length
    while pairs > 0:
        pairs -= 1
        if read_head(p, end, &pos, &h) != W_OK or h.kind != K_STR:
            return False
        key = _key(p + pos, h.length)
        pos += h.length
        if key == 0 or seen & key:
            return False
        seen |= key
        start = pos
        if read_head(p, end, &pos, &v) != W_OK:
            return False
        if key == KEY_TEXT:
            out.text_at = start
            if v.kind == K_STR:
                out.n = 1
                pos += v.length
            elif v.kind == K_ARRAY:
                out.n, out.batch = v.length, True
                for i in range(v.length):
                    if read_head(p, end, &pos, &h) != W_OK or h.kind != K_STR:
                        return False
                    pos += h.length
            else:
                return False
        elif key == KEY_OP:
            if v.kind != K_STR or v.length != 8 or memcmp(p + pos, b"tokenize", 8) != 0:
                return False
            pos += 8
        elif key == KEY_ID:
            # An id the reply may not echo (common/_wire.pxd's rule: id_kind, id_fault) goes to the
            # general path, which answers it bad_request in the broker's words.
            if id_kind(p[start]) != ID_ECHOED and not (v.kind == K_STR and utf8_valid(p + pos, v.length)):
                return False
            after = skip(p, end, start, ID_DEPTH)
            if after < 0:
                return False
            out.rid_at, out.rid_len = start, after - start
            pos = after
        elif key == KEY_MODEL:
            if v.kind == K_STR:
                if not utf8_valid(p + pos, v.length):
                    return False
                out.model_at, out.model_len = pos, v.length
                pos += v.length
            elif v.kind != K_NIL:
                return False
        elif key == KEY_FORMAT:
            if v.kind == K_STR and v.length == 3 and memcmp(p + pos, b"u32", 3) == 0:
                out.u32 = True
            elif not (v.kind == K_NIL or (v.kind == K_STR and v.length == 4 and memcmp(p + pos, b"list", 4) == 0)):
                return False
            if v.kind == K_STR:
                pos += v.length
        elif key == KEY_SPECIAL:
            if v.kind == K_BOOL:
                out.special = v.ival != 0
            elif v.kind != K_NIL:
                return False
        elif key == KEY_DEADLINE:
            if not (v.kind == K_NIL or (v.kind == K_UINT and v.uval > 0) or (v.kind == K_INT and v.ival > 0)):
                return False
        elif key == KEY_AFFINITY:
            if v.kind == K_STR:
                if not utf8_valid(p + pos, v.length):
                    return False
                pos += v.length
            elif v.kind != K_NIL:
                return False
    return pos == end and (seen & KEY_OP) != 0 and out.text_at >= 0


cdef object plain_text(const unsigned char* p, Py_ssize_t end, Plain* plain):
    """The `text` of a payload read_plain_at took: a str, or a list of str for a batch; None when a
    text is not valid UTF-8 (the general path names the fault)."""
    cdef Py_ssize_t pos = plain.text_at, i
    cdef Head h
    cdef object item
    cdef list texts
    read_head(p, end, &pos, &h)
    if not plain.batch:
        return _utf8(p + pos, h.length)
    texts = []
    for i in range(plain.n):
        read_head(p, end, &pos, &h)
        item = _utf8(p + pos, h.length)
        if item is None:
            return None
        pos += h.length
        texts.append(item)
    return texts


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
    cdef Plain plain
    if not read_plain_at(p, end, &plain):
        return None
    text = plain_text(p, end, &plain)
    if text is None:
        return None
    model = None if plain.model_at < 0 else PyUnicode_DecodeUTF8(<const char*>p + plain.model_at, plain.model_len, NULL)
    rid = b"\xc0" if plain.rid_at < 0 else PyBytes_FromStringAndSize(<const char*>p + plain.rid_at, plain.rid_len)
    return text, model, plain.u32, plain.special, rid


# --- replies ---------------------------------------------------------------------------------------

# {"id": <raw>, "ok": true, "tokens": <tokens>, "count": <n>, <tail>}: the bytes ok_reply packs for
# the fields {"tokens", "count", "cache", "worker"} (the tail is the last two, packed once per model).
cdef enum:
    HEAD_LEN = 4        # fixmap of 6, "id"
    OK_TOKENS_LEN = 11  # "ok", true, "tokens"
    COUNT_LEN = 6       # "count"
    ITEM_OVERHEAD = 5   # workers/budget.py: what the reply budget charges per tokens value besides its ids
    NOGIL_IDS = 65536   # ids from which pack_tokens lets the GIL go while it writes (~0.1 ms of work)


cdef inline Py_ssize_t _end_of(const unsigned char* e, Py_ssize_t i) noexcept nogil:
    return <Py_ssize_t>get_le(e + 8 * i, 8)


cdef int check_ends(const unsigned char* e, Py_ssize_t ends_bytes, Py_ssize_t ids, Py_ssize_t first, Py_ssize_t n,
                    bint batch) except -1:
    """ValueError unless texts first..first+n lie in `ends` and their ends in a buffer of `ids` ids."""
    cdef Py_ssize_t i
    cdef unsigned long long at, prev = 0
    if n < 0 or first < 0 or (first + n + 1) * 8 > ends_bytes or (not batch and n != 1):
        raise ValueError("pack_tokens: texts out of range")
    for i in range(first, first + n + 1):
        at = get_le(e + 8 * i, 8)
        if at > <unsigned long long>ids or at < prev:
            raise ValueError("pack_tokens: ends out of range")
        prev = at
    return 0


cdef Py_ssize_t reply_bound(const unsigned char* e, Py_ssize_t first, Py_ssize_t n, bint batch, bint u32,
                            Py_ssize_t rid_len, Py_ssize_t tail_len, Py_ssize_t limit) noexcept nogil:
    """Room write_reply needs for texts first..first+n (exact for u32; for a list 5 bytes an id and
    UINTS_SLACK); -1 when the reply budget (--max-reply-bytes, `limit`) might refuse the reply (what
    workers/budget.py charges first passes it, or a u32 reply's exact size does)."""
    cdef Py_ssize_t i, count = _end_of(e, first + n) - _end_of(e, first), size
    if (4 if u32 else 5) * count + ITEM_OVERHEAD * n > limit:
        return -1
    size = HEAD_LEN + rid_len + OK_TOKENS_LEN + COUNT_LEN + uint_size(count) + tail_len
    if not u32:
        return size + 5 * (count + n + 1) + UINTS_SLACK
    size += array_head_size(n) * batch + 4 * count
    for i in range(first, first + n):
        size += bin_head_size(4 * (_end_of(e, i + 1) - _end_of(e, i)))
    return size if size <= limit else -1


cdef Py_ssize_t write_reply(unsigned char* o, const unsigned char* f, const unsigned char* e, Py_ssize_t first,
                            Py_ssize_t n, bint batch, bint u32, const unsigned char* rid, Py_ssize_t rid_len,
                            const unsigned char* tail, Py_ssize_t tail_len) noexcept nogil:
    """The reply of one tokenize served from a batch encode (texts first..first+n of the engine's u32
    ids `f`, ends `e`) at o, which has reply_bound's room; its size. `rid`: the id's bytes."""
    cdef unsigned char* start = o
    cdef Py_ssize_t i, a, b
    memcpy(o, b"\x86\xa2id", HEAD_LEN)
    o += HEAD_LEN
    memcpy(o, rid, rid_len)
    o += rid_len
    memcpy(o, b"\xa2ok\xc3\xa6tokens", OK_TOKENS_LEN)
    o += OK_TOKENS_LEN
    if batch:
        o = put_array_head(o, n)
    for i in range(first, first + n):
        a, b = _end_of(e, i), _end_of(e, i + 1)
        if u32:
            o = put_bin_head(o, 4 * (b - a))
            if b > a:
                memcpy(o, f + 4 * a, 4 * (b - a))
            o += 4 * (b - a)
        else:
            o = put_array_head(o, b - a)
            o = put_uints_u32le(o, f, a, b)
    memcpy(o, b"\xa5count", COUNT_LEN)
    o = put_uint(o + COUNT_LEN, _end_of(e, first + n) - _end_of(e, first))
    memcpy(o, tail, tail_len)
    return o + tail_len - start


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
    cdef const unsigned char* r = <const unsigned char*>PyBytes_AS_STRING(rid)
    cdef const unsigned char* t = <const unsigned char*>PyBytes_AS_STRING(tail)
    cdef Py_ssize_t bound, size, rlen = PyBytes_GET_SIZE(rid), tlen = PyBytes_GET_SIZE(tail)
    cdef bint free_gil
    cdef unsigned char* o
    cdef object reply
    check_ends(e, PyBytes_GET_SIZE(ends), PyBytes_GET_SIZE(flat) // 4, first, n, batch)
    bound = reply_bound(e, first, n, batch, u32, rlen, tlen, limit)
    if bound < 0:
        return None
    free_gil = _end_of(e, first + n) - _end_of(e, first) >= NOGIL_IDS
    if u32:  # the size is known: written in place (the bytes object is this call's alone until it returns)
        reply = PyBytes_FromStringAndSize(NULL, bound)
        o = <unsigned char*>PyBytes_AS_STRING(reply)
        if free_gil:
            with nogil:
                write_reply(o, f, e, first, n, batch, True, r, rlen, t, tlen)
        else:
            write_reply(o, f, e, first, n, batch, True, r, rlen, t, tlen)
        return reply
    o = <unsigned char*>malloc(bound)  # a list: written to scratch, then copied at its size
    if o == NULL:
        raise MemoryError()
    try:
        if free_gil:
            with nogil:
                size = write_reply(o, f, e, first, n, batch, False, r, rlen, t, tlen)
        else:
            size = write_reply(o, f, e, first, n, batch, False, r, rlen, t, tlen)
        return None if size > limit else PyBytes_FromStringAndSize(<const char*>o, size)
    finally:
        free(o)
