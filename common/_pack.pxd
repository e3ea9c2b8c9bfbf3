# The MessagePack writer the cores share (the reader is common/_wire.pxd): every header in the
# smallest format that holds its value, which is msgpack's own choice (msgpack.packb(use_bin_type=True)),
# so a core's bytes equal what Python's msgpack would write for the same value. Inline, like the
# reader: a C header in effect, nothing imported at run time.
#
# A file of its own, not the reader's: the reader meets hostile bytes and is all bounds checks; the
# writer writes our own values into room its caller made, and its growing buffer raises Python
# exceptions (MemoryError, ValueError), which the reader never does. A core that only reads need
# not cimport this.
#
# Two layers:
# - `put_*`: write at `o`, return the pointer past what was written; the caller made the room
#   (HEAD_MAX bytes for any header or scalar). nogil, for fixed buffers sized up front (the
#   worker's replies, the broker's batch records). A length must be below 2**32 (the caller's
#   bound; `buf_*` checks it).
# - `Buf` and `buf_*`: a growing buffer (PyMem) for values whose size is not known up front (the
#   client's requests); a head refuses a length of 2**32 or more with ValueError, as msgpack does.
#
# In a core: `from tokenbroker.common._pack cimport put_uint, put_array_head, Buf, buf_str_head, buf_take, ...`.

from cpython.bytes cimport PyBytes_FromStringAndSize
from cpython.mem cimport PyMem_Free
from libc.string cimport memcpy

from tokenbroker.common._wire cimport get_le

cdef enum:
    HEAD_MAX = 9  # the most bytes one header or scalar takes (0xcf/0xd3/0xcb and 8 bytes)


# --- fixed-width ints ----------------------------------------------------------------------

cdef inline unsigned char* put_be(unsigned char* o, unsigned char code, unsigned long long n, int width) noexcept nogil:
    """A MessagePack header byte, then n in `width` bytes big-endian."""
    cdef int i
    o[0] = code
    for i in range(width):
        o[width - i] = <unsigned char>(n >> (8 * i))
    return o + 1 + width


cdef inline unsigned char* put_le(unsigned char* o, unsigned long long n, int width) noexcept nogil:
    """n in `width` bytes little-endian (no header byte): the backend's batch records, the route
    key's length frames."""
    cdef int i
    for i in range(width):
        o[i] = <unsigned char>(n >> (8 * i))
    return o + width


# --- scalars -----------------------------------------------------------------------------

cdef inline unsigned char* put_uint(unsigned char* o, unsigned long long n) noexcept nogil:
    """n >= 0 in its shortest form: positive fixint, uint 8, 16, 32, 64 (as msgpack packs an int >= 0)."""
    if n < 128:
        o[0] = <unsigned char>n
        return o + 1
    if n < 256:
        return put_be(o, 0xcc, n, 1)
    if n < 65536:
        return put_be(o, 0xcd, n, 2)
    if (n >> 32) == 0:
        return put_be(o, 0xce, n, 4)
    return put_be(o, 0xcf, n, 8)


cdef inline unsigned char* put_int(unsigned char* o, long long x) noexcept nogil:
    """x in its shortest form: as put_uint when x >= 0 (msgpack packs those unsigned), else negative
    fixint (>= -32), int 8, 16, 32, 64."""
    if x >= 0:
        return put_uint(o, <unsigned long long>x)
    if x >= -32:
        o[0] = <unsigned char>(x & 0xff)
        return o + 1
    if x >= -128:
        return put_be(o, 0xd0, <unsigned long long>x, 1)
    if x >= -32768:
        return put_be(o, 0xd1, <unsigned long long>x, 2)
    if x >= -2147483648:
        return put_be(o, 0xd2, <unsigned long long>x, 4)
    return put_be(o, 0xd3, <unsigned long long>x, 8)


cdef inline unsigned char* put_f64(unsigned char* o, double d) noexcept nogil:
    """A float 64 (msgpack packs every Python float so)."""
    cdef unsigned long long u
    memcpy(&u, &d, 8)
    return put_be(o, 0xcb, u, 8)


cdef extern from *:  # GCC and Clang: one instruction each
    unsigned short __builtin_bswap16(unsigned short) noexcept nogil
    unsigned int __builtin_bswap32(unsigned int) noexcept nogil

cdef enum:
    UINTS_SLACK = 8  # put_uints_u32le stores 8 bytes an id: room it may write past the last one


cdef inline unsigned char* put_uints_u32le(unsigned char* o, const unsigned char* flat, Py_ssize_t a,
                                           Py_ssize_t b) noexcept nogil:
    """Ids a..b of a little-endian u32 buffer, each as put_uint writes it; up to UINTS_SLACK bytes
    past the end may be written. On a little-endian host each id's bytes are made in a register
    without branches (the widths of token ids follow no pattern a branch predictor learns) and
    stored 8 at a time."""
    cdef Py_ssize_t k
    cdef unsigned long long t, w, n, m, c1, c2, c3
    cdef unsigned int v, one = 1
    if (<unsigned char*>&one)[0] != 1:  # a big-endian host (a constant to the compiler)
        for k in range(a, b):
            o = put_uint(o, get_le(flat + 4 * k, 4))
        return o
    for k in range(a, b):
        memcpy(&v, flat + 4 * k, 4)  # little-endian host: the id as it lies
        t = v
        # 0xce + 4 bytes big-endian; 0xcd + 2; 0xcc + 1; or the byte itself: chosen with masks
        c3 = t < 65536
        c2 = t < 256
        c1 = t < 128
        m = 0 - c3
        w = (m & (0xcd | (<unsigned long long>__builtin_bswap16(<unsigned short>t) << 8))) | (
            ~m & (0xce | (<unsigned long long>__builtin_bswap32(<unsigned int>t) << 8)))
        m = 0 - c2
        w = (m & (0xcc | (t << 8))) | (~m & w)
        m = 0 - c1
        w = (m & t) | (~m & w)
        n = 5 - 2 * c3 - c2 - c1
        memcpy(o, &w, 8)
        o += n
    return o


# --- heads: what precedes a str's or bin's bytes, an array's items, a map's pairs ----------------

cdef inline unsigned char* put_str_head(unsigned char* o, size_t n) noexcept nogil:
    """fixstr, str 8, 16, 32."""
    if n < 32:
        o[0] = 0xa0 | <unsigned char>n
        return o + 1
    if n < 256:
        return put_be(o, 0xd9, n, 1)
    return put_be(o, 0xda, n, 2) if n < 65536 else put_be(o, 0xdb, n, 4)


cdef inline unsigned char* put_bin_head(unsigned char* o, size_t n) noexcept nogil:
    """bin 8, 16, 32 (there is no fixbin)."""
    if n < 256:
        return put_be(o, 0xc4, n, 1)
    return put_be(o, 0xc5, n, 2) if n < 65536 else put_be(o, 0xc6, n, 4)


cdef inline unsigned char* _put_container(unsigned char* o, size_t n, unsigned char fix, unsigned char tag16) noexcept nogil:
    """An array's or a map's head: fix | n below 16, else tag16 (16-bit) or tag16 + 1 (32-bit)."""
    if n < 16:
        o[0] = fix | <unsigned char>n
        return o + 1
    return put_be(o, tag16, n, 2) if n < 65536 else put_be(o, tag16 + 1, n, 4)


cdef inline unsigned char* put_array_head(unsigned char* o, size_t n) noexcept nogil:
    """fixarray, array 16, 32."""
    return _put_container(o, n, 0x90, 0xdc)


cdef inline unsigned char* put_map_head(unsigned char* o, size_t n) noexcept nogil:
    """fixmap, map 16, 32 (n pairs)."""
    return _put_container(o, n, 0x80, 0xde)


# --- sizes, for a buffer made to measure before it is written -------------------------------

cdef inline Py_ssize_t uint_size(unsigned long long n) noexcept nogil:
    """The bytes put_uint(n) writes."""
    if n < 128:
        return 1
    if n < 256:
        return 2
    if n < 65536:
        return 3
    return 5 if (n >> 32) == 0 else 9


cdef inline Py_ssize_t bin_head_size(size_t n) noexcept nogil:
    """The bytes put_bin_head(n) writes."""
    return 2 if n < 256 else (3 if n < 65536 else 5)


cdef inline Py_ssize_t array_head_size(size_t n) noexcept nogil:
    """The bytes put_array_head(n) writes (put_map_head's too)."""
    return 1 if n < 16 else (3 if n < 65536 else 5)


# --- the growing buffer ------------------------------------------------------------------

cdef struct Buf:
    unsigned char* data  # PyMem; NULL until the first write
    Py_ssize_t size      # bytes written
    Py_ssize_t cap


cdef extern from *:
    """
    /* common/_pack.pxd: the growing buffer's slow path, out of line (a .pxd can only define inline
       functions, and this one inlined made every write that may grow too large to inline). */
    #if defined(__GNUC__)
    __attribute__((noinline, cold))
    #endif
    static int tokenbroker_pack_grow(unsigned char** data, Py_ssize_t* cap, Py_ssize_t size, Py_ssize_t need) {
        Py_ssize_t c = *cap ? *cap * 2 : 256;
        unsigned char* d;
        while (c < size + need)
            c *= 2;
        d = (unsigned char*)PyMem_Realloc(*data, (size_t)c);
        if (d == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        *data = d;
        *cap = c;
        return 0;
    }
    """
    int tokenbroker_pack_grow(unsigned char** data, Py_ssize_t* cap, Py_ssize_t size, Py_ssize_t need) except -1


cdef inline int buf_grow(Buf* b, Py_ssize_t need) except -1:
    """Room for `need` more bytes: the capacity doubles (from 256) until they fit (MemoryError when
    it cannot)."""
    return tokenbroker_pack_grow(&b.data, &b.cap, b.size, need)


cdef inline unsigned char* buf_room(Buf* b, Py_ssize_t need) except NULL:
    """Where the next bytes go, with room for `need` of them; buf_done says how far they went."""
    if b.size + need > b.cap:
        tokenbroker_pack_grow(&b.data, &b.cap, b.size, need)
    return b.data + b.size


cdef inline int buf_done(Buf* b, unsigned char* o) noexcept nogil:
    """The bytes up to `o` (a buf_room pointer moved on by put_*) are written."""
    b.size = o - b.data
    return 0


cdef inline int buf_put(Buf* b, const char* p, Py_ssize_t n) except -1:
    """n bytes as they are (a str's UTF-8, a bin's bytes, fields packed before)."""
    if b.size + n > b.cap:
        tokenbroker_pack_grow(&b.data, &b.cap, b.size, n)
    memcpy(b.data + b.size, p, n)
    b.size += n
    return 0


cdef inline int buf_byte(Buf* b, unsigned char c) except -1:
    """One byte: nil (0xc0), a bool (0xc2, 0xc3), a fixint."""
    if b.size + 1 > b.cap:
        tokenbroker_pack_grow(&b.data, &b.cap, b.size, 1)
    b.data[b.size] = c
    b.size += 1
    return 0


cdef inline int buf_uint(Buf* b, unsigned long long n) except -1:
    return buf_done(b, put_uint(buf_room(b, HEAD_MAX), n))


cdef inline int buf_int(Buf* b, long long x) except -1:
    return buf_done(b, put_int(buf_room(b, HEAD_MAX), x))


cdef inline int buf_f64(Buf* b, double d) except -1:
    return buf_done(b, put_f64(buf_room(b, HEAD_MAX), d))


cdef inline Py_ssize_t _fit(Py_ssize_t n, str what) except -1:
    """n, when a head can say it (below 2**32); ValueError, as msgpack's, when not."""
    if (<size_t>n) >> 32:  # (a shift: a literal past 2**31 would make Cython compare Python ints)
        raise ValueError(what + " is too large")
    return n


# One line each, so that the compiler inlines them where they are called (a single head function
# switching on its kind was not inlined: 60% more instructions a head in the client's packer).
cdef inline int buf_str_head(Buf* b, Py_ssize_t n) except -1:
    return buf_done(b, put_str_head(buf_room(b, HEAD_MAX), _fit(n, "str")))


cdef inline int buf_bin_head(Buf* b, Py_ssize_t n) except -1:
    return buf_done(b, put_bin_head(buf_room(b, HEAD_MAX), _fit(n, "bin")))


cdef inline int buf_array_head(Buf* b, Py_ssize_t n) except -1:
    return buf_done(b, put_array_head(buf_room(b, HEAD_MAX), _fit(n, "container")))


cdef inline int buf_map_head(Buf* b, Py_ssize_t n) except -1:
    return buf_done(b, put_map_head(buf_room(b, HEAD_MAX), _fit(n, "container")))


cdef inline bytes buf_bytes(Buf* b):
    """The bytes written so far, copied (the buffer stays, for reuse after `b.size = 0`)."""
    return PyBytes_FromStringAndSize(<const char*>b.data, b.size)


cdef inline void buf_free(Buf* b) noexcept:
    PyMem_Free(b.data)
    b.data = NULL
    b.size = b.cap = 0


cdef inline bytes buf_take(Buf* b):
    """The bytes written, and the buffer freed (also when the copy fails)."""
    try:
        return buf_bytes(b)
    finally:
        buf_free(b)
