# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Routing keys, compiled: which cached prefix a request is likely to extend, derived from its raw
bytes without tokenizing (docs/routing.md, "Route keys", holds the design).

A `RouteKey` holds prefix-block hashes at fixed byte offsets (BOUNDARIES) and a rendezvous key,
computed with the broker's streaming hash (broker/_hash.pxd) over at most MAX_HASHED_BYTES of the
request's input, read in place through the spans broker/_peek.pyx found: a request's key costs one
bounded pass, whatever its size. A malformed input never raises here: the key falls back to the
model alone and the worker answers the request with its `bad_request`.
"""

from cpython.buffer cimport PyObject_GetBuffer, PyBuffer_Release, PyBUF_SIMPLE
from cpython.bytes cimport PyBytes_FromStringAndSize
from cpython.mem cimport PyMem_Malloc, PyMem_Free
from libc.stdlib cimport qsort
from libc.string cimport memcmp

from tokenbroker.broker._hash cimport DIGEST, Hash, h_digest, h_init, h_len, h_update, u64, uchar
from tokenbroker.broker._peek cimport (Peek, DEPTH, F_AFFINITY, F_BODY, F_KWARGS, F_MESSAGES, F_MODEL, F_TEXT,
                                       F_TOOLS)
from tokenbroker.common._pack cimport put_le
from tokenbroker.common._wire cimport (Head, read_head, skip, utf8_valid, is_array_head, K_STR, K_BIN, K_ARRAY, K_MAP,
                           K_EXT, W_OK)

from sys import intern as _intern

from tokenbroker.common.protocol import KEYED_OPS, OPS

cdef enum:
    NBLOCKS = 256         # prefix blocks per route key, at most

MAX_BLOCKS = NBLOCKS
DIGEST_BYTES = DIGEST
MIN_BLOCK = 256
MAX_BLOCK = 4096
GROWTH_DIVISOR = 8

# The ops whose input is hashed, as the interned str a Peek's `op` is (common/protocol.py OPS).
cdef str OP_TOKENIZE = _intern("tokenize")
cdef str OP_CHAT = _intern("chat")
cdef str OP_COUNT = _intern("count")
assert {OP_TOKENIZE, OP_CHAT, OP_COUNT} == KEYED_OPS


cdef class RouteKey:
    """Where a request would like to run: `key` the rendezvous key, `blocks` the prefix-block hashes,
    shallow to deep (() when the client gave `affinity` or nothing was hashed). Immutable, compared
    and hashed by value (a dispatcher turn keeps a set of the keys that wait)."""


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
        if sa[f] >= 0 and is_array_head(p[sa[f]]):
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


cdef frozenset KEYLESS = OPS - KEYED_OPS  # no input to hash: any worker serves them equally well


cpdef object route_key(Peek peek):
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


def seed(kind: bytes, model: bytes) -> bytes:
    """The hash seed of a key kind and model (tb1 NUL kind NUL len(model) model)."""
    return _seed(kind, <const uchar*>model, len(model))
