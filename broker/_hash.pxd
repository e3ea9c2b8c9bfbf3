# The route key's hash, cimported by the broker's cores (broker/_routekey.pyx; its finalizer mix64
# also by broker/_router.pyx and broker/_peek.pyx): a 128-bit streaming hash of our own, two
# multiply-xorshift lanes with SplitMix64 finalizers. Routing needs spread and prefix sharing, not a
# cryptographic digest (SHA-256 through hashlib cost a Python call per block: 367 us of broker CPU
# per 12-message chat), and keys are never compared across processes. Inline, as common/_wire.pxd
# is: a header in effect, no module behind it.
#
# In a core: `from tokenbroker.broker._hash cimport Hash, h_init, h_update, h_digest, DIGEST`.

from libc.string cimport memcpy

from tokenbroker.common._pack cimport put_le

ctypedef unsigned char uchar
ctypedef unsigned long long u64

cdef enum:
    DIGEST = 16  # bytes of a digest


cdef struct Hash:
    u64 a
    u64 b
    u64 n       # bytes fed
    u64 tail    # bytes not yet a whole word, little end first
    int tn


cdef inline u64 mix64(u64 x) noexcept nogil:
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


cdef inline void h_update(Hash* h, const uchar* p, Py_ssize_t n) noexcept nogil:
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


cdef inline void h_digest(const Hash* h, uchar* out) noexcept nogil:
    """16 bytes of the state (the state itself goes on: a digest is a copy's)."""
    cdef u64 x = h.a ^ mix64(h.tail ^ ((<u64>h.tn) << 56) ^ (h.n * 0x9FB21C651E98DF25ULL))
    cdef u64 y = h.b + mix64(h.n ^ (h.tail * 0xC13FA9A902A6328FULL))
    cdef u64 d1 = mix64(x ^ ((y << 31) | (y >> 33)))
    cdef u64 d2 = mix64(y ^ (d1 * 0x91E10DA5C79E7B1DULL))
    memcpy(out, &d1, 8)
    memcpy(out + 8, &d2, 8)
