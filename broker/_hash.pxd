# The route key's hash, cimported by the broker's cores (broker/_routekey.pyx; its finalizer mix64
# also by broker/_router.pyx and broker/_peek.pyx): a 128-bit streaming hash of our own. Routing
# needs spread and prefix sharing, not a cryptographic digest (SHA-256 through hashlib cost a Python
# call per block: 367 us of broker CPU per 12-message chat), and keys are never compared across
# processes. Inline, as common/_wire.pxd is: a header in effect, no module behind it.
#
# Design (xxHash64's published layout, written here from its description): four 64-bit lanes take
# the input in 32-byte stripes, lane i the stripe's word i, each by `acc = rotl(acc + w * P2, 31) *
# P1`. The lanes never wait on each other, so a core runs four rounds at once: about 14 GB/s, bound
# by the multiplier (the hash before issue 38 ran two lanes over every word, one serial chain, at
# 4.5 GB/s; it was the largest user-space cost of a 64 KB request's broker CPU; `scripts/bench_routing
# --hash` runs both). The round is a bijection of the lane for a fixed word and of the word for a
# fixed lane, so two inputs of one length that differ in a single word leave different lanes,
# whatever follows. A digest runs the unfinished stripe, zero-padded, through copies of the lanes
# (the state goes on: block digests are taken mid-stream) and folds the four lanes and the length
# two ways, a xor of rotations and a sum of other rotations, each through the SplitMix64 finalizer,
# into 16 bytes: either fold is one lane's bijection combined with the others', so a change in one
# lane changes both halves.
#
# In a core: `from tokenbroker.broker._hash cimport Hash, h_init, h_update, h_digest, DIGEST`.

from libc.string cimport memcpy, memset

from tokenbroker.common._pack cimport put_le

ctypedef unsigned char uchar
ctypedef unsigned long long u64

cdef enum:
    DIGEST = 16  # bytes of a digest
    STRIPE = 32  # bytes a round of the four lanes takes


cdef struct Hash:
    u64 v0      # the lanes: stripe words 0..3
    u64 v1
    u64 v2
    u64 v3
    u64 n       # bytes fed
    uchar buf[STRIPE]  # the stripe not yet whole: bn bytes, zeros after them (a digest's padding)
    int bn


cdef inline u64 mix64(u64 x) noexcept nogil:
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL
    return x ^ (x >> 31)


cdef inline u64 _rotl(u64 x, int r) noexcept nogil:
    return (x << r) | (x >> (64 - r))


cdef inline u64 _round(u64 acc, u64 w) noexcept nogil:
    """One lane takes one word; the multipliers are xxHash64's primes P2 and P1 (odd: bijections)."""
    return _rotl(acc + w * 0xC2B2AE3D27D4EB4FULL, 31) * 0x9E3779B185EBCA87ULL


cdef inline u64 _word(const uchar* p) noexcept nogil:
    """8 bytes as a word in the host's order (digests never leave the process)."""
    cdef u64 w
    memcpy(&w, p, 8)
    return w


cdef inline void h_init(Hash* h) noexcept nogil:
    # four distinct odd starts (hex digits of pi), so no lane starts at a fixed point of the round
    h.v0 = 0x243F6A8885A308D3ULL
    h.v1 = 0x13198A2E03707345ULL
    h.v2 = 0xA4093822299F31D1ULL
    h.v3 = 0x082EFA98EC4E6C89ULL
    h.n = 0
    memset(h.buf, 0, STRIPE)
    h.bn = 0


cdef inline const uchar* _stripes(Hash* h, const uchar* p, Py_ssize_t k) noexcept nogil:
    """k whole stripes at p into the lanes; returns the end. The lanes live in locals meanwhile: a
    store through h could alias the input (a uchar pointer), which would force a reload per word."""
    cdef u64 v0 = h.v0, v1 = h.v1, v2 = h.v2, v3 = h.v3
    while k > 0:
        v0 = _round(v0, _word(p))
        v1 = _round(v1, _word(p + 8))
        v2 = _round(v2, _word(p + 16))
        v3 = _round(v3, _word(p + 24))
        p += STRIPE
        k -= 1
    h.v0 = v0
    h.v1 = v1
    h.v2 = v2
    h.v3 = v3
    return p


cdef inline void h_update(Hash* h, const uchar* p, Py_ssize_t n) noexcept nogil:
    """Feed n bytes; any split of a stream into calls gives the digest of one call."""
    cdef Py_ssize_t take
    h.n += <u64>n
    if h.bn > 0:
        take = STRIPE - h.bn
        if take > n:
            take = n
        memcpy(h.buf + h.bn, p, take)
        h.bn += <int>take
        p += take
        n -= take
        if h.bn < STRIPE:
            return
        _stripes(h, h.buf, 1)
        memset(h.buf, 0, STRIPE)
        h.bn = 0
    if n >= STRIPE:  # whole stripes (a shift and a mask: STRIPE is 32, and no module's cdivision matters)
        p = _stripes(h, p, n >> 5)
        n &= STRIPE - 1
    if n > 0:
        memcpy(h.buf, p, n)
        h.bn = <int>n


cdef inline void h_len(Hash* h, u64 n) noexcept nogil:
    """A length as 8 bytes (little endian): what frames each part fed, so parts cannot run together."""
    cdef uchar b[8]
    put_le(b, n, 8)
    h_update(h, b, 8)


cdef inline void h_digest(const Hash* h, uchar* out) noexcept nogil:
    """16 bytes of the state so far (the state itself goes on: a digest is a copy's). The unfinished
    stripe, zero-padded, goes through copies of the lanes; the length tells it from real zeros."""
    cdef u64 v0 = h.v0, v1 = h.v1, v2 = h.v2, v3 = h.v3
    cdef u64 d1, d2
    if h.bn > 0:
        v0 = _round(v0, _word(h.buf))
        v1 = _round(v1, _word(h.buf + 8))
        v2 = _round(v2, _word(h.buf + 16))
        v3 = _round(v3, _word(h.buf + 24))
    d1 = mix64(v0 ^ _rotl(v1, 16) ^ _rotl(v2, 32) ^ _rotl(v3, 48) ^ (h.n * 0x9FB21C651E98DF25ULL))
    d2 = mix64(_rotl(v0, 23) + _rotl(v1, 47) + v2 + _rotl(v3, 7) + (h.n ^ 0xC13FA9A902A6328FULL))
    memcpy(out, &d1, 8)
    memcpy(out + 8, &d2, 8)
