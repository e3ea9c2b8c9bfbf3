# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""The worker's cache core: L0 (exact input -> ids) and L1 (prefixes ending at added tokens), compiled.

Python keeps the policy (workers/cache/__init__.py: which layers, what the tokenizer allows,
workers/cache/segment.py: which added tokens are boundaries, proved exact at load); this module does
the per-request work, on the str's own buffer (latin-1, UCS-2 or UCS-4, as CPython holds it), never a
UTF-8 copy of it:

- one hash per input (`_stream_keys`: four 64-bit multiply-rotate lanes over 8-byte words, keyed by a
  per-process secret, the str's kind and the add_special_tokens flag). For L1 the same single pass
  yields the key of every prefix ending at a boundary, and each prefix's UTF-8 length (the reused-bytes
  metric) from word-wise counts;
- a hit is verified against the stored text, byte for byte: a hash collision is a miss, never wrong ids;
- boundaries are found in one pass (`Matcher`): the added tokens the tokenizer splits on first,
  compiled at load into a code-point trie; candidates come from memchr on one byte of each token's
  first code point (up to 4 distinct first code points, else a first-unit table), and the trie walk
  takes the leftmost-longest match, as the tokenizers do;
- ids are packed little-endian u32 throughout: engine buffer -> stored bytes -> reply, concatenated
  with memcpy; an L0 hit returns the stored bytes object itself;
- memory is charged as held: L0 an entry's str object (sys.getsizeof), 4 bytes per id and a fixed
  overhead; L1 one block per input (the text up to its deepest kept boundary in the str's own width,
  and its ids) shared by the boundaries kept, plus a fixed overhead per boundary; exact LRU in both.

All loops are bounded by the input's length (the trie walk by the longest added token); nothing reads
past a buffer whatever the text.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from cpython.buffer cimport PyBUF_SIMPLE, PyObject_GetBuffer, PyBuffer_Release
from libc.stdint cimport int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t
from libc.stdlib cimport free, malloc, realloc
from libc.string cimport memchr, memcmp, memcpy

import os
import sys
from sys import getsizeof

cdef extern from "Python.h":
    int PyUnicode_KIND(object o)
    void* PyUnicode_DATA(object o)
    Py_ssize_t PyUnicode_GET_LENGTH(object o)
    bint PyUnicode_IS_ASCII(object o)
    object PyUnicode_Substring(object s, Py_ssize_t start, Py_ssize_t end)

cdef bint LITTLE = sys.byteorder == "little"

# --- the hash ------------------------------------------------------------------------------------

cdef uint64_t KA = 0xA0761D6478BD642FULL
cdef uint64_t KB = 0xE7037ED1A0B428DBULL
cdef uint64_t KC = 0x8EBC6AF09C88C6E3ULL
cdef uint64_t KD = 0x589965CC75374CC3ULL
cdef uint64_t SECRET = int.from_bytes(os.urandom(8), "little") | 1


cdef inline uint64_t rotl(uint64_t x, int r) noexcept nogil:
    return (x << r) | (x >> (64 - r))


cdef inline uint64_t load64(const uint8_t* p) noexcept nogil:
    cdef uint64_t v
    memcpy(&v, p, 8)
    return v


cdef inline uint64_t step(uint64_t a, uint64_t w) noexcept nogil:
    return rotl(a + w * KA, 29) * KB


cdef inline uint64_t avalanche(uint64_t h) noexcept nogil:
    h ^= h >> 32
    h *= KC
    h ^= h >> 29
    h *= KD
    h ^= h >> 32
    return h


cdef inline uint64_t seed_of(int kind, bint flag) noexcept nogil:
    return avalanche(SECRET ^ (<uint64_t>kind * KC) ^ (KD if flag else 0))


cdef extern from *:
    """
    /* 64x64 -> 128-bit multiply, the halves folded: every input bit reaches every output bit. */
    static inline uint64_t tb_fold_mul(uint64_t a, uint64_t b) {
        __uint128_t r = (__uint128_t)a * b;
        return (uint64_t)r ^ (uint64_t)(r >> 64);
    }
    """
    uint64_t tb_fold_mul(uint64_t a, uint64_t b) noexcept nogil


cdef struct Secret:
    uint64_t s0, s1, s2, s3


cdef Secret SEC
SEC.s0 = avalanche(SECRET + KA)
SEC.s1 = avalanche(SECRET + KB)
SEC.s2 = avalanche(SECRET + KC)
SEC.s3 = avalanche(SECRET + KD)


cdef void _stream_keys(const uint8_t* data, int kind, uint64_t seed, const Py_ssize_t* ends, Py_ssize_t m,
                       uint64_t* keys) noexcept nogil:
    """The key of each prefix data[:ends[i] code points] (ends ascending), in one pass: two lanes,
    each folding 16 bytes a step (one 128-bit multiply with the per-process secret) into a rotated
    sum, so order matters; a prefix's key finishes the lanes with its last partial stripe and length."""
    cdef uint64_t a0 = seed, a1 = rotl(seed, 32) ^ KA, h
    cdef uint64_t b[4]
    cdef Py_ssize_t pos = 0, i, P, tail
    for i in range(m):
        P = ends[i] * kind
        while pos + 32 <= P:
            a0 = rotl(a0, 23) + tb_fold_mul(load64(data + pos) ^ SEC.s0, load64(data + pos + 8) ^ SEC.s1)
            a1 = rotl(a1, 23) + tb_fold_mul(load64(data + pos + 16) ^ SEC.s2, load64(data + pos + 24) ^ SEC.s3)
            pos += 32
        tail = P - pos
        h = a0 ^ rotl(a1, 31) ^ (<uint64_t>P * KC)
        if tail:
            b[0] = b[1] = b[2] = b[3] = 0
            memcpy(b, data + pos, tail)
            h = rotl(h, 23) + tb_fold_mul(b[0] ^ SEC.s0, b[1] ^ SEC.s1)
            h = rotl(h, 23) + tb_fold_mul(b[2] ^ SEC.s2, b[3] ^ SEC.s3)
        keys[i] = avalanche(h ^ tail)


cdef extern from *:
    """
    #include <stdint.h>
    #include <stddef.h>
    #if defined(__SSE2__)
    #include <emmintrin.h>
    #endif
    /* UTF-8 bytes beyond one per code point of n units of a str buffer of `kind` (1, 2 or 4). */
    static int64_t tb_utf8_extra(const void* data, int kind, Py_ssize_t n) {
        int64_t extra = 0;
        Py_ssize_t i = 0;
        if (kind == 1) {
            const uint8_t* u = (const uint8_t*)data;
    #if defined(__SSE2__)
            while (i + 16 <= n) {  /* a byte from 0x80 on has its top bit set: movemask counts them */
                Py_ssize_t stop = i + 16 * 255 < n ? i + 16 * 255 : n;
                for (; i + 16 <= stop; i += 16)
                    extra += __builtin_popcount(_mm_movemask_epi8(_mm_loadu_si128((const __m128i*)(u + i))));
            }
    #endif
            for (; i < n; i++) extra += u[i] >= 0x80;
        } else if (kind == 2) {
            const uint16_t* u = (const uint16_t*)data;
    #if defined(__SSE2__)
            const __m128i zero = _mm_setzero_si128(), m80 = _mm_set1_epi16((short)0xFF80), m800 = _mm_set1_epi16((short)0xF800);
            while (i + 8 <= n) {  /* per 8 units: lanes below 0x80, below 0x800 (16-bit sums, flushed in time) */
                Py_ssize_t stop = i + 8 * 4096 < n ? i + 8 * 4096 : n;
                __m128i lt80 = zero, lt800 = zero;
                Py_ssize_t start = i;
                for (; i + 8 <= stop; i += 8) {
                    __m128i v = _mm_loadu_si128((const __m128i*)(u + i));
                    lt80 = _mm_sub_epi16(lt80, _mm_cmpeq_epi16(_mm_and_si128(v, m80), zero));
                    lt800 = _mm_sub_epi16(lt800, _mm_cmpeq_epi16(_mm_and_si128(v, m800), zero));
                }
                uint16_t a[8], b[8];
                _mm_storeu_si128((__m128i*)a, lt80);
                _mm_storeu_si128((__m128i*)b, lt800);
                int64_t units = i - start, below80 = 0, below800 = 0;
                for (int k = 0; k < 8; k++) { below80 += a[k]; below800 += b[k]; }
                extra += 2 * units - below80 - below800;
            }
    #endif
            for (; i < n; i++) extra += (u[i] >= 0x80) + (u[i] >= 0x800);
        } else {
            const uint32_t* u = (const uint32_t*)data;
            for (; i < n; i++) extra += (u[i] >= 0x80) + (u[i] >= 0x800) + (u[i] >= 0x10000);
        }
        return extra;
    }
    """
    int64_t tb_utf8_extra(const void* data, int kind, Py_ssize_t n) noexcept nogil


cdef void _utf8_lengths(const uint8_t* data, int kind, const Py_ssize_t* ends, Py_ssize_t m, int64_t* out) noexcept nogil:
    """The UTF-8 length of each prefix data[:ends[i] code points] (ends ascending)."""
    cdef Py_ssize_t i, prev = 0
    cdef int64_t total = 0
    for i in range(m):
        total += ends[i] - prev + tb_utf8_extra(data + prev * kind, kind, ends[i] - prev)
        out[i] = total
        prev = ends[i]


def hash_text(str text, bint flag=False) -> int:
    """The 64-bit key L0 files `text` under (for tests: equal texts, equal keys)."""
    cdef Py_ssize_t n = PyUnicode_GET_LENGTH(text)
    cdef uint64_t key
    _stream_keys(<const uint8_t*>PyUnicode_DATA(text), PyUnicode_KIND(text),
                 seed_of(PyUnicode_KIND(text), flag), &n, 1, &key)
    return key


cdef inline uint32_t unit(const uint8_t* data, int kind, Py_ssize_t i) noexcept nogil:
    if kind == 1:
        return data[i]
    if kind == 2:
        return (<const uint16_t*>data)[i]
    return (<const uint32_t*>data)[i]


# --- the boundary matcher ---------------------------------------------------------------------------


cdef struct Found:
    Py_ssize_t* start
    Py_ssize_t* end
    int32_t* tok
    Py_ssize_t n
    Py_ssize_t cap


cdef int found_add(Found* f, Py_ssize_t s, Py_ssize_t e, int32_t t) except -1 nogil:
    cdef Py_ssize_t cap
    cdef void* p
    if f.n == f.cap:
        cap = f.cap * 2 if f.cap else 64
        p = realloc(f.start, cap * sizeof(Py_ssize_t))
        if p == NULL:
            with gil:
                raise MemoryError()
        f.start = <Py_ssize_t*>p
        p = realloc(f.end, cap * sizeof(Py_ssize_t))
        if p == NULL:
            with gil:
                raise MemoryError()
        f.end = <Py_ssize_t*>p
        p = realloc(f.tok, cap * sizeof(int32_t))
        if p == NULL:
            with gil:
                raise MemoryError()
        f.tok = <int32_t*>p
        f.cap = cap
    f.start[f.n] = s
    f.end[f.n] = e
    f.tok[f.n] = t
    f.n += 1
    return 0


cdef void found_free(Found* f) noexcept nogil:
    free(f.start)
    free(f.end)
    free(f.tok)
    f.start = NULL
    f.end = NULL
    f.tok = NULL
    f.n = f.cap = 0


DEF MAX_STREAMS = 4


cdef class Matcher:
    """Leftmost-longest matcher of literal tokens over a str, in one or two passes (Hugging Face
    matches `normalized=False` tokens on the raw text, then `normalized=True` ones in the gaps).
    Built from (token, id) pairs per pass; id -1 marks a token that is matched (it takes its text
    away from other tokens) but is no boundary."""

    cdef int32_t* node_edge      # first edge of each node
    cdef int32_t* node_nedges
    cdef int32_t* node_token     # token index ending at the node, -1 none
    cdef uint32_t* edge_cp
    cdef int32_t* edge_child
    cdef int32_t* token_id       # per token: its id when a boundary, else -1
    cdef int32_t roots[2]
    cdef int npasses
    cdef uint8_t table[2][256]   # first units below 256 per pass
    cdef uint32_t* big[2]        # first code points from 256 on per pass, sorted
    cdef int nbig[2]
    cdef uint32_t firsts[MAX_STREAMS]
    cdef int nfirsts             # pass one's distinct first code points when <= MAX_STREAMS, else -1
    cdef readonly int tokens

    def __cinit__(self):
        self.node_edge = self.node_nedges = self.node_token = self.edge_child = self.token_id = NULL
        self.edge_cp = NULL
        self.big[0] = self.big[1] = NULL

    def __init__(self, list first, list second):
        """`first`, `second`: lists of (token text, id or -1); empty tokens are ignored."""
        cdef list nodes = [{}]  # code point -> child node index
        cdef list ends = [-1]
        ids = []
        self.npasses = 2 if second else 1
        for p, words in enumerate((first, second)):
            if p == 1 and not second:
                self.roots[1] = -1
                break
            root = len(nodes)
            nodes.append({})
            ends.append(-1)
            self.roots[p] = root
            for text, tid in words:
                if not text:
                    continue
                node = root
                for ch in text:
                    kids = nodes[node]
                    c = ord(ch)
                    if c not in kids:
                        kids[c] = len(nodes)
                        nodes.append({})
                        ends.append(-1)
                    node = kids[c]
                if ends[node] < 0:
                    ends[node] = len(ids)
                    ids.append(tid)
        cdef Py_ssize_t nn = len(nodes), ne = sum(len(k) for k in nodes), i, e = 0
        self.tokens = len(ids)
        self.node_edge = <int32_t*>malloc(nn * sizeof(int32_t))
        self.node_nedges = <int32_t*>malloc(nn * sizeof(int32_t))
        self.node_token = <int32_t*>malloc(nn * sizeof(int32_t))
        self.edge_cp = <uint32_t*>malloc((ne + 1) * sizeof(uint32_t))
        self.edge_child = <int32_t*>malloc((ne + 1) * sizeof(int32_t))
        self.token_id = <int32_t*>malloc((len(ids) + 1) * sizeof(int32_t))
        if not (self.node_edge and self.node_nedges and self.node_token and self.edge_cp and self.edge_child
                and self.token_id):
            raise MemoryError()
        for i in range(nn):
            kids = nodes[i]
            self.node_edge[i] = e
            self.node_nedges[i] = len(kids)
            self.node_token[i] = ends[i]
            for c in sorted(kids):
                self.edge_cp[e] = c
                self.edge_child[e] = kids[c]
                e += 1
        for i in range(len(ids)):
            self.token_id[i] = ids[i]
        for p in range(2):
            for i in range(256):
                self.table[p][i] = 0
            self.nbig[p] = 0
            if p >= self.npasses:
                continue
            kids = nodes[self.roots[p]]
            big = sorted(c for c in kids if c >= 256)
            for c in kids:
                if c < 256:
                    self.table[p][c] = 1
            self.big[p] = <uint32_t*>malloc((len(big) + 1) * sizeof(uint32_t))
            if self.big[p] == NULL:
                raise MemoryError()
            for i in range(len(big)):
                self.big[p][i] = big[i]
            self.nbig[p] = len(big)
        root_kids = sorted(nodes[self.roots[0]])
        self.nfirsts = len(root_kids) if len(root_kids) <= MAX_STREAMS and LITTLE else -1
        for i in range(min(len(root_kids), MAX_STREAMS)):
            self.firsts[i] = root_kids[i]

    def __dealloc__(self):
        free(self.node_edge)
        free(self.node_nedges)
        free(self.node_token)
        free(self.edge_cp)
        free(self.edge_child)
        free(self.token_id)
        free(self.big[0])
        free(self.big[1])

    cdef inline bint is_first(self, int p, uint32_t c) noexcept nogil:
        cdef int lo = 0, hi, mid
        if c < 256:
            return self.table[p][c]
        hi = self.nbig[p]
        while lo < hi:
            mid = (lo + hi) >> 1
            if self.big[p][mid] < c:
                lo = mid + 1
            else:
                hi = mid
        return lo < self.nbig[p] and self.big[p][lo] == c

    cdef inline Py_ssize_t walk(self, int32_t root, const uint8_t* data, int kind, Py_ssize_t i, Py_ssize_t hi,
                                int32_t* tok) noexcept nogil:
        """End of the longest token starting at i and ending by hi (its index in *tok), or -1."""
        cdef int32_t node = root, e, stop
        cdef Py_ssize_t best = -1
        cdef uint32_t c
        while i < hi:
            c = unit(data, kind, i)
            e = self.node_edge[node]
            stop = e + self.node_nedges[node]
            while e < stop and self.edge_cp[e] < c:
                e += 1
            if e == stop or self.edge_cp[e] != c:
                break
            node = self.edge_child[e]
            i += 1
            if self.node_token[node] >= 0:
                best = i
                tok[0] = self.node_token[node]
        return best

    cdef int scan(self, int p, const uint8_t* data, int kind, Py_ssize_t lo, Py_ssize_t hi, Found* out,
                  bint all_matches) except -1 nogil:
        """Matches of pass p in data[lo:hi], leftmost-longest, appended to out (only boundaries unless
        all_matches)."""
        cdef Py_ssize_t i = lo, e
        cdef Py_ssize_t nxt[MAX_STREAMS]
        cdef int32_t tok = -1
        cdef int s, k = self.nfirsts if p == 0 else -1
        cdef uint8_t byte[MAX_STREAMS]
        cdef int off[MAX_STREAMS]
        cdef uint32_t f
        cdef const uint8_t* q
        cdef const uint8_t* stop = data + hi * kind
        if k > 0:  # memchr on one byte of each first code point (the high one where it is not latin-1)
            for s in range(k):
                f = self.firsts[s]
                nxt[s] = lo - 1
                if (kind == 1 and f > 0xFF) or (kind == 2 and f > 0xFFFF):
                    nxt[s] = hi  # cannot occur in this str
                    byte[s] = 0
                    off[s] = 0
                elif f <= 0xFF:
                    byte[s] = <uint8_t>f
                    off[s] = 0
                elif f <= 0xFFFF:
                    byte[s] = <uint8_t>(f >> 8)
                    off[s] = 1
                else:
                    byte[s] = <uint8_t>(f >> 16)
                    off[s] = 2
        while i < hi:
            if k > 0:
                e = hi
                for s in range(k):
                    if nxt[s] < i:  # the next unit >= i equal to firsts[s]
                        q = data + i * kind + off[s]
                        nxt[s] = hi
                        while q < stop:
                            q = <const uint8_t*>memchr(q, byte[s], stop - q)
                            if q == NULL:
                                break
                            if (q - data - off[s]) % kind == 0 and unit(data, kind, (q - data - off[s]) // kind) == self.firsts[s]:
                                nxt[s] = (q - data - off[s]) // kind
                                break
                            q += 1
                    if nxt[s] < e:
                        e = nxt[s]
                i = e
                if i >= hi:
                    break
            elif k == 0:
                break
            else:
                while i < hi and not self.is_first(p, unit(data, kind, i)):
                    i += 1
                if i >= hi:
                    break
            e = self.walk(self.roots[p], data, kind, i, hi, &tok)
            if e > i:
                if all_matches or self.token_id[tok] >= 0:
                    found_add(out, i, e, tok)
                i = e
            else:
                i += 1
        return 0

    cdef int find(self, const uint8_t* data, int kind, Py_ssize_t n, Found* out) except -1 nogil:
        """The boundaries of data[:n], in order: out.start/end in code points, out.tok token indices."""
        cdef Found whole
        cdef Py_ssize_t j, gap
        if self.npasses == 1:
            return self.scan(0, data, kind, 0, n, out, False)
        whole.start = whole.end = NULL
        whole.tok = NULL
        whole.n = whole.cap = 0
        try:
            self.scan(0, data, kind, 0, n, &whole, True)
            gap = 0
            for j in range(whole.n + 1):
                self.scan(1, data, kind, gap, whole.start[j] if j < whole.n else n, out, False)
                if j < whole.n:
                    if self.token_id[whole.tok[j]] >= 0:
                        found_add(out, whole.start[j], whole.end[j], whole.tok[j])
                    gap = whole.end[j]
        finally:
            found_free(&whole)
        return 0

    def boundaries(self, str text) -> list:
        """[(start, end, id)] of the boundaries in `text`, in code points (for tests)."""
        cdef Found f
        f.start = f.end = NULL
        f.tok = NULL
        f.n = f.cap = 0
        try:
            self.find(<const uint8_t*>PyUnicode_DATA(text), PyUnicode_KIND(text), PyUnicode_GET_LENGTH(text), &f)
            return [(f.start[i], f.end[i], self.token_id[f.tok[i]]) for i in range(f.n)]
        finally:
            found_free(&f)


# --- exact LRU ------------------------------------------------------------------------------------


cdef class Node:
    cdef Node prev
    cdef Node next
    cdef object key
    cdef int64_t charge


cdef class Lru:
    """key -> entry, least recently used first out; counts the bytes charged and the evictions."""

    cdef dict map
    cdef Node head  # sentinel: head.next is the oldest, head.prev the newest
    cdef public int64_t bytes
    cdef public int64_t evictions

    def __cinit__(self):
        self.map = {}
        self.head = Node()
        self.head.prev = self.head.next = self.head
        self.bytes = 0
        self.evictions = 0

    cdef inline void touch(self, Node e):
        e.prev.next = e.next
        e.next.prev = e.prev
        self.link(e)

    cdef inline void link(self, Node e):
        e.prev = self.head.prev
        e.next = self.head
        self.head.prev.next = e
        self.head.prev = e

    cdef void unlink(self, Node e):
        e.prev.next = e.next
        e.next.prev = e.prev
        e.prev = e.next = None
        del self.map[e.key]
        self.bytes -= e.charge

    cdef Node oldest(self):
        return None if self.head.next is self.head else self.head.next

    cdef void clear(self):
        cdef Node e = self.head.next, nxt
        while e is not self.head:
            nxt = e.next
            e.prev = e.next = None
            e = nxt
        self.head.prev = self.head.next = self.head
        self.map.clear()
        self.bytes = 0  # every entry's charge went with it

    cdef dict stats(self, int64_t hits, int64_t misses, int64_t reused_bytes):
        """A store's counters with this LRU's: the series both L0 and L1 export."""
        return {"hits": hits, "misses": misses, "evictions": self.evictions, "reused_bytes": reused_bytes,
                "entries": len(self.map), "bytes": self.bytes}


# --- L0 -------------------------------------------------------------------------------------------


cdef class L0Entry(Node):
    cdef str text
    cdef bint flag
    cdef bytes packed
    cdef int64_t utf8


cdef class L0Store:
    """Exact (text, add_special_tokens) -> packed ids. Bounded by entries and by charged bytes; an
    entry charged above a quarter of the byte budget is not kept."""

    cdef Lru lru
    cdef public Py_ssize_t max_entries
    cdef public int64_t max_bytes
    cdef public int64_t overhead
    cdef public int64_t hits, misses, reused_bytes
    cdef object _last_text  # the text of the last miss and its key: its put needs no second hash
    cdef uint64_t _last_key
    cdef bint _last_flag

    def __init__(self, Py_ssize_t max_entries, int64_t max_bytes, int64_t overhead):
        self.lru = Lru()
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.overhead = overhead
        self.hits = self.misses = self.reused_bytes = 0
        self._last_text = None

    cdef uint64_t key_of(self, str text, bint flag):
        cdef Py_ssize_t n = PyUnicode_GET_LENGTH(text)
        cdef uint64_t key
        cdef int kind = PyUnicode_KIND(text)
        _stream_keys(<const uint8_t*>PyUnicode_DATA(text), kind, seed_of(kind, flag), &n, 1, &key)
        return key

    cpdef bytes get(self, str text, bint flag):
        """The packed ids of `text`, made most recent (a hit), or None (a miss); both counted."""
        return self.get_keyed(text, flag, self.key_of(text, flag))

    cdef bytes get_keyed(self, str text, bint flag, uint64_t key):
        """`get` with the key computed already (L1's pass keys the whole input with its prefixes)."""
        cdef L0Entry e = self.lru.map.get(key)
        cdef Py_ssize_t n
        if e is not None and e.flag == flag and (e.text is text or e.text == text):
            self.lru.touch(e)
            self.hits += 1
            if e.utf8 < 0:  # counted at the first hit, not at every put: most entries are never hit
                n = PyUnicode_GET_LENGTH(text)
                _utf8_lengths(<const uint8_t*>PyUnicode_DATA(text), PyUnicode_KIND(text), &n, 1, &e.utf8)
            self.reused_bytes += e.utf8
            return e.packed
        self.misses += 1
        self._last_text, self._last_key, self._last_flag = text, key, flag
        return None

    cpdef void put(self, str text, bint flag, bytes packed):
        """Keep `packed` (held, not copied) for `text`, evicting the least recently used to stay in bounds."""
        cdef uint64_t key
        if self._last_text is text and self._last_flag == flag:
            key = self._last_key
        else:
            key = self.key_of(text, flag)
        self._last_text = None
        self.put_keyed(text, flag, packed, key)

    cdef void put_keyed(self, str text, bint flag, bytes packed, uint64_t key):
        cdef int64_t utf8 = 0, charge
        cdef L0Entry e, old
        cdef Node gone
        cdef Py_ssize_t n = PyUnicode_GET_LENGTH(text)
        charge = getsizeof(text) + len(packed) + self.overhead
        if charge > self.max_bytes // 4:
            return
        utf8 = n if PyUnicode_KIND(text) == 1 and PyUnicode_IS_ASCII(text) else -1
        old = self.lru.map.get(key)
        if old is not None:  # the same text (encoded twice in one batch), or a hash collision: replaced
            self.lru.unlink(old)
        while True:
            gone = self.lru.oldest()
            if gone is None or (len(self.lru.map) < self.max_entries and self.lru.bytes + charge <= self.max_bytes):
                break
            self.lru.unlink(gone)
            self.lru.evictions += 1
        e = L0Entry()
        e.key, e.text, e.flag, e.packed, e.utf8, e.charge = key, text, flag, packed, utf8, charge
        self.lru.map[key] = e
        self.lru.link(e)
        self.lru.bytes += charge

    def stats(self) -> dict:
        return self.lru.stats(self.hits, self.misses, self.reused_bytes)

    def clear(self) -> None:
        self.lru.clear()
        self._last_text = None


# --- L1 -------------------------------------------------------------------------------------------


cdef class Block:
    """What one input added to L1: its text from where its hit ended (`base_chars`; 0 on a miss) to
    its deepest kept boundary, in the str's own width, and those ids (from `base_ids`); the prefix
    before lies in `parent`'s chain. Shared by the boundaries kept from the input and by the blocks
    chained to it (`refs`); charged once, its bytes freed with the last of them."""
    cdef Block parent
    cdef Py_ssize_t base_chars
    cdef Py_ssize_t base_ids
    cdef bytes text
    cdef bytes ids
    cdef int kind
    cdef int refs
    cdef int64_t charge


cdef class L1Entry(Node):
    cdef Block block
    cdef Py_ssize_t chars
    cdef Py_ssize_t nids
    cdef int64_t utf8
    cdef bint flag


cpdef list plan_cuts(Py_ssize_t n, Py_ssize_t depth, Py_ssize_t deepest=4):
    """Boundaries after `depth` (of `n`) a lookup cuts at, most worth keeping first: the `deepest`
    deepest, then 2^k - 1 from the start and n - 1 - 2^k from the end alternately; all of them when
    there are no more than 2 x deepest. At most deepest + 2 log2(n) + 2, whatever the input.

    >>> plan_cuts(20, -1)
    [19, 18, 17, 16, 0, 1, 3, 15, 7, 11]
    """
    cdef list picks = []
    cdef Py_ssize_t i, k
    cdef set seen
    if n - depth <= 2 * deepest:
        return list(range(n - 1, depth, -1))
    picks = list(range(n - 1, max(depth, n - 1 - deepest), -1))
    k = 1
    while k <= n:
        picks.append(k - 1)
        picks.append(n - 1 - k)
        k <<= 1
    seen = set()
    out = []
    for i in picks:
        if depth < i < n and i not in seen:
            seen.add(i)
            out.append(i)
    return out


cdef class L1Store:
    """Prefix lookups, encodes and inserts for one tokenizer (see workers/cache/l1.py for the policy).

    `encode_flat(texts, add_special_tokens=False)` -> (u32 byte view, ends in ids) encodes the pieces,
    `encode_whole(text, add_special_tokens)` -> packed bytes the inputs L1 does not serve."""

    cdef Matcher matcher
    cdef object encode_flat
    cdef object encode_whole
    cdef bytes head, tail
    cdef Lru lru
    cdef public int64_t budget
    cdef public int64_t share
    cdef public int64_t overhead
    cdef public Py_ssize_t min_prefix
    cdef public int deepest
    cdef public int64_t hits, misses, reused_bytes, fallbacks, skipped
    cdef public Py_ssize_t last_reused  # ids the last encode took from L1
    cdef public int last_l0  # the last encode's L0 lookup: 0 none, 1 a hit, 2 a miss

    def __init__(self, Matcher matcher, encode_flat, encode_whole, bytes head, bytes tail, int64_t budget,
                 int64_t share, int64_t overhead, Py_ssize_t min_prefix, int deepest):
        self.matcher = matcher
        self.encode_flat = encode_flat
        self.encode_whole = encode_whole
        self.head, self.tail = head, tail
        self.lru = Lru()
        self.budget, self.share, self.overhead = budget, share, overhead
        self.min_prefix = min_prefix
        self.deepest = deepest
        self.hits = self.misses = self.reused_bytes = self.fallbacks = self.skipped = 0
        self.last_reused = 0
        self.last_l0 = 0

    def stats(self) -> dict:
        return self.lru.stats(self.hits, self.misses, self.reused_bytes)

    def clear(self) -> None:
        self.lru.clear()

    def __len__(self) -> int:
        return len(self.lru.map)

    cdef bytes _whole(self, str text, bint flag):
        self.misses += 1
        self.last_reused = 0
        return self.encode_whole(text, flag)

    cdef void _drop(self, L1Entry e):
        self.lru.unlink(e)
        self._release(e.block)
        e.block = None

    cdef void _release(self, Block b):
        """One holder of `b` fewer: a block nobody holds gives its bytes back, and lets go of its parent."""
        while b is not None:
            b.refs -= 1
            if b.refs > 0:
                return
            self.lru.bytes -= b.charge
            b = b.parent

    cdef bint _verify(self, L1Entry e, const uint8_t* data, int kind):
        """Whether `data` starts with the prefix `e` keeps, byte for byte, along its block chain."""
        cdef Block b = e.block
        cdef Py_ssize_t end = e.chars, nbytes
        if b is None or b.kind != kind:
            return False
        while b is not None:
            nbytes = (end - b.base_chars) * kind
            if nbytes < 0 or nbytes > len(b.text):
                return False
            if memcmp(PyBytes_AS_STRING(b.text), data + b.base_chars * kind, nbytes) != 0:
                return False
            end = b.base_chars
            b = b.parent
        return end == 0

    cdef void _copy_ids(self, L1Entry e, uint32_t* out):
        """The prefix's ids (e.nids of them) into out, each block's part at its place."""
        cdef Block b = e.block
        cdef Py_ssize_t end = e.nids
        while b is not None:
            memcpy(out + b.base_ids, PyBytes_AS_STRING(b.ids), 4 * (end - b.base_ids))
            end = b.base_ids
            b = b.parent

    cpdef bytes encode(self, str text, bint flag, bint store=True, L0Store l0=None):
        """The packed ids of `text` (add_special_tokens=`flag`), its cached prefix reused and its
        deepest prefixes kept; `last_reused` says how many ids came from L1. With `l0`, L0 is
        looked up first (`last_l0`: 1 a hit, 2 a miss), keyed in the same pass as the prefixes, and
        a miss's ids are kept there."""
        cdef int kind = PyUnicode_KIND(text)
        cdef const uint8_t* data = <const uint8_t*>PyUnicode_DATA(text)
        cdef Py_ssize_t n = PyUnicode_GET_LENGTH(text)
        cdef Found f
        cdef uint64_t* keys = NULL
        cdef bint serve
        cdef bytes packed
        f.start = f.end = NULL
        f.tok = NULL
        f.n = f.cap = 0
        self.last_l0 = 0
        try:
            self.matcher.find(data, kind, n, &f)
            serve = f.n > 0 and f.end[f.n - 1] >= self.min_prefix
            if l0 is not None:
                if serve:
                    found_add(&f, n, n, -1)  # the whole input, keyed last in the same pass
                keys = <uint64_t*>malloc(f.n * sizeof(uint64_t) if serve else sizeof(uint64_t))
                if keys == NULL:
                    raise MemoryError()
                if serve:
                    _stream_keys(data, kind, seed_of(kind, flag), f.end, f.n, keys)
                    f.n -= 1
                else:
                    _stream_keys(data, kind, seed_of(kind, flag), &n, 1, keys)
                packed = l0.get_keyed(text, flag, keys[f.n] if serve else keys[0])
                if packed is not None:
                    self.last_l0 = 1
                    self.last_reused = 0
                    return packed
                self.last_l0 = 2
            if not serve:
                if f.n:
                    self.skipped += 1
                packed = self._whole(text, flag)
            else:
                if keys == NULL:
                    keys = <uint64_t*>malloc(f.n * sizeof(uint64_t))
                    if keys == NULL:
                        raise MemoryError()
                    _stream_keys(data, kind, seed_of(kind, flag), f.end, f.n, keys)
                packed = self._serve(text, flag, store, kind, data, n, &f, keys)
            if l0 is not None:
                l0.put_keyed(text, flag, packed, keys[f.n] if serve else keys[0])
            return packed
        finally:
            found_free(&f)
            free(keys)

    cdef bytes _serve(self, str text, bint flag, bint store, int kind, const uint8_t* data, Py_ssize_t n,
                      Found* f, uint64_t* keys):
        cdef Py_ssize_t nb = f.n, depth = -1, i, k, prev, cut, a, b, s, e, total, at, hn, tn
        cdef L1Entry hit = None, entry
        cdef Py_buffer view
        cdef const uint32_t* ids
        cdef uint32_t* out
        cdef int32_t* bid = self.matcher.token_id
        cdef bytes result
        cdef list order, cuts, texts, spans
        cdef Py_ssize_t nspans
        cdef Py_ssize_t* starts = NULL
        cdef Py_ssize_t* stops = NULL
        cdef Py_ssize_t* marks = NULL
        cdef Py_ssize_t prefix_ids
        # the deepest stored prefix, verified byte for byte
        for i in range(nb - 1, -1, -1):
            entry = self.lru.map.get(keys[i])
            if entry is not None and entry.flag == flag and entry.chars == f.end[i] and self._verify(entry, data, kind):
                hit, depth = entry, i
                self.lru.touch(entry)
                break
        if hit is None and kind > 1:  # stored from a narrower str? (a conversation whose new turn brought a wider character)
            hit, depth = self._narrow_hit(text, flag, kind, data, f)
        order = plan_cuts(nb, depth, self.deepest)
        cuts = sorted(order)
        cuts.append(nb)
        texts, spans = [], []
        prev = depth
        for cut in cuts:
            a = f.start[prev] if prev >= 0 else 0
            b = f.end[cut] if cut < nb else n
            if cut == nb and prev >= 0 and f.end[prev] == n:
                spans.append(-1)  # nothing after the last boundary
            else:
                spans.append(len(texts))
                texts.append(PyUnicode_Substring(text, a, b))
            prev = cut
        nspans = len(cuts)
        prefix_ids = hit.nids if hit is not None else 0
        flat, ends = self.encode_flat(texts, add_special_tokens=False) if texts else (b"", [0])
        PyObject_GetBuffer(flat, &view, PyBUF_SIMPLE)
        try:
            ids = <const uint32_t*>view.buf
            starts = <Py_ssize_t*>malloc(nspans * sizeof(Py_ssize_t))
            stops = <Py_ssize_t*>malloc(nspans * sizeof(Py_ssize_t))
            marks = <Py_ssize_t*>malloc(nspans * sizeof(Py_ssize_t))
            if starts == NULL or stops == NULL or marks == NULL:
                raise MemoryError()
            total = prefix_ids
            prev = depth
            for k in range(nspans):
                cut = cuts[k]
                if spans[k] < 0:
                    starts[k] = stops[k] = 0
                else:
                    s = ends[spans[k]]
                    e = ends[spans[k] + 1]
                    if e * 4 > view.len or s > e or s < 0:
                        raise ValueError("the engine's ends run past its buffer")
                    if prev >= 0:  # the left context token comes first: dropped
                        if e - s < 1 or ids[s] != <uint32_t>bid[f.tok[prev]]:
                            return self._fallback(text, flag)
                        s += 1
                    if cut < nb and (e - s < 1 or ids[e - 1] != <uint32_t>bid[f.tok[cut]]):
                        return self._fallback(text, flag)
                    starts[k], stops[k] = s, e
                total += stops[k] - starts[k]
                marks[k] = total
                prev = cut
            hn = len(self.head) >> 2 if flag else 0
            tn = len(self.tail) >> 2 if flag else 0
            result = PyBytes_FromStringAndSize(NULL, 4 * (hn + total + tn))
            out = <uint32_t*>PyBytes_AS_STRING(result)
            if hn:
                memcpy(out, PyBytes_AS_STRING(self.head), 4 * hn)
            at = hn
            if prefix_ids:
                self._copy_ids(hit, out + at)
                at += prefix_ids
            for k in range(nspans):
                memcpy(out + at, ids + starts[k], 4 * (stops[k] - starts[k]))
                at += stops[k] - starts[k]
            if tn:
                memcpy(out + at, PyBytes_AS_STRING(self.tail), 4 * tn)
            if store and nspans > 1:
                self._keep(flag, kind, data, f, keys, order, cuts, marks, out + hn, hit)
        finally:
            PyBuffer_Release(&view)
            free(starts)
            free(stops)
            free(marks)
        if hit is not None:
            self.hits += 1
            self.reused_bytes += hit.utf8
            self.last_reused = prefix_ids
        else:
            self.misses += 1
            self.last_reused = 0
        return result

    cdef tuple _narrow_hit(self, str text, bint flag, int kind, const uint8_t* data, Found* f):
        """(entry, boundary) of the deepest prefix stored from a narrower str, or (None, -1). Keys
        follow the str's width, so the prefix before the first character this str needs its width
        for is keyed again as CPython would hold it alone (one copy, only on a miss)."""
        cdef uint32_t limit = 0x100 if kind == 2 else 0x10000
        cdef Py_ssize_t p = 0, j, i, stop = f.end[f.n - 1]
        cdef uint64_t* keys
        cdef L1Entry entry
        while p < stop and unit(data, kind, p) < limit:
            p += 1
        j = f.n - 1
        while j >= 0 and f.end[j] > p:
            j -= 1
        if j < 0:
            return None, -1
        narrow = PyUnicode_Substring(text, 0, f.end[j])
        cdef int nk = PyUnicode_KIND(narrow)
        cdef const uint8_t* nd = <const uint8_t*>PyUnicode_DATA(narrow)
        if nk >= kind:
            return None, -1
        keys = <uint64_t*>malloc((j + 1) * sizeof(uint64_t))
        if keys == NULL:
            raise MemoryError()
        try:
            _stream_keys(nd, nk, seed_of(nk, flag), f.end, j + 1, keys)
            for i in range(j, -1, -1):
                entry = self.lru.map.get(keys[i])
                if entry is not None and entry.flag == flag and entry.chars == f.end[i] and self._verify(entry, nd, nk):
                    self.lru.touch(entry)
                    return entry, i
        finally:
            free(keys)
        return None, -1

    cdef bytes _fallback(self, str text, bint flag):
        self.fallbacks += 1
        return self._whole(text, flag)

    cdef int _keep(self, bint flag, int kind, const uint8_t* data, Found* f, uint64_t* keys,
                   list order, list cuts, Py_ssize_t* marks, const uint32_t* ids, L1Entry hit) except -1:
        """Store the planned cuts that fit one input's share, most worth keeping first, in one block
        chained to the hit's (only the text and ids past the hit are copied)."""
        cdef dict mark_of = {}, utf8_of = {}
        cdef Py_ssize_t k, cut, far = -1, nk, base_chars = 0, base_ids = 0
        cdef Py_ssize_t* at
        cdef int64_t* u8
        cdef int64_t charge, total = 0, block_charge = 0, base_utf8 = 0
        cdef list keep = []
        cdef L1Entry e, old
        cdef Node gone
        cdef Block block, parent = None
        if hit is not None and hit.block.kind == kind:  # a hit from a narrower str is copied whole, not chained
            parent, base_chars, base_ids, base_utf8 = hit.block, hit.chars, hit.nids, hit.utf8
        for k in range(len(cuts) - 1):
            mark_of[cuts[k]] = marks[k]
        for cut in order:
            old = self.lru.map.get(keys[cut])
            if old is not None and old.flag == flag and old.chars == f.end[cut]:
                continue  # stored already (verified when it is hit)
            k = max(cut, far)
            charge = (f.end[k] - base_chars) * kind + 4 * (mark_of[k] - base_ids) + self.overhead * (len(keep) + 1)
            if charge <= self.share and charge <= self.budget:
                keep.append(cut)
                far = k
                total = charge
        if not keep:
            return 0
        block_charge = (f.end[far] - base_chars) * kind + 4 * (mark_of[far] - base_ids)
        if parent is not None:
            parent.refs += 1  # held from now: evicting the hit below must not give back its chain's bytes
        while self.lru.bytes + total > self.budget:
            gone = self.lru.oldest()
            if gone is None:
                if parent is not None:
                    self._release(parent)
                return 0
            self._drop(<L1Entry>gone)
            self.lru.evictions += 1
        block = Block()
        block.parent, block.base_chars, block.base_ids = parent, base_chars, base_ids
        block.text = PyBytes_FromStringAndSize(<const char*>data + base_chars * kind, (f.end[far] - base_chars) * kind)
        block.ids = PyBytes_FromStringAndSize(<const char*>(ids + base_ids), 4 * (mark_of[far] - base_ids))
        block.kind = kind
        block.charge = block_charge
        block.refs = 0
        self.lru.bytes += block_charge
        keep.sort()
        nk = len(keep)
        at = <Py_ssize_t*>malloc(nk * sizeof(Py_ssize_t))
        u8 = <int64_t*>malloc(nk * sizeof(int64_t))
        if at == NULL or u8 == NULL:
            free(at)
            free(u8)
            raise MemoryError()
        for k in range(nk):
            at[k] = f.end[<Py_ssize_t>keep[k]] - base_chars
        _utf8_lengths(data + base_chars * kind, kind, at, nk, u8)  # the reused-bytes metric, past the hit only
        for k in range(nk):
            utf8_of[keep[k]] = base_utf8 + u8[k]
        free(at)
        free(u8)
        for cut in keep:  # ascending: the deepest linked last, most recent
            old = self.lru.map.get(keys[cut])
            if old is not None:
                self._drop(old)
            e = L1Entry()
            e.key, e.block, e.chars, e.nids, e.utf8, e.flag = keys[cut], block, f.end[cut], mark_of[cut], utf8_of[cut], flag
            e.charge = self.overhead
            block.refs += 1
            self.lru.map[e.key] = e
            self.lru.link(e)
            self.lru.bytes += e.charge
        return 0
