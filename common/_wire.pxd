# The MessagePack wire reader, cimported by the broker's and the workers' cores: one header reader
# and one bounded skipper, so both sides read hostile bytes the same way. The functions are inline in
# this file (a C header, in effect): a core that cimports them needs no import of this module at run
# time.
#
# In a core: `from tokenbroker.common._wire cimport Head, read_head, skip, K_STR, W_OK` (setup.py's
# include tree maps the installed names to the sources). The writer is common/_pack.pxd.

from cpython.unicode cimport PyUnicode_DecodeUTF8
from libc.string cimport memcpy

cdef enum Kind:
    K_NIL = 0
    K_BOOL = 1
    K_INT = 2      # a signed int (negative fixint, int 8-64): Head.ival
    K_UINT = 3     # an unsigned int (positive fixint, uint 8-64): Head.uval
    K_FLOAT = 4
    K_STR = 5      # Head.length bytes follow
    K_BIN = 6      # Head.length bytes follow
    K_ARRAY = 7    # Head.length items follow
    K_MAP = 8      # Head.length key/value pairs follow
    K_EXT = 9      # Head.length bytes follow (the ext type byte already read)

cdef enum Fault:
    W_OK = 0
    W_TRUNCATED = -1   # the bytes end inside a value
    W_INVALID = -2     # 0xc1, the one byte MessagePack never uses
    W_TOO_DEEP = -3    # containers nested deeper than the bound
    W_TOO_LONG = -4    # a container claims more items than the bytes left could hold

cdef enum:
    WIRE_MAX_DEPTH = 1024  # the deepest bound a caller may ask for (the skipper's stack)

cdef struct Head:
    Kind kind
    Py_ssize_t length            # str/bin/ext bytes; array items; map pairs
    long long ival
    unsigned long long uval
    double fval


cdef inline unsigned long long _be(const unsigned char* p, int n) noexcept nogil:
    cdef unsigned long long v = 0
    cdef int i
    for i in range(n):
        v = (v << 8) | p[i]
    return v


cdef inline unsigned long long get_le(const unsigned char* p, int n) noexcept nogil:
    """An unsigned int of n bytes little-endian, whatever the host: the backend's batch records, the
    engine's id and offset buffers (common/_pack.pxd's put_le writes them)."""
    cdef unsigned long long v = 0
    cdef int i
    for i in range(n - 1, -1, -1):
        v = (v << 8) | p[i]
    return v


cdef inline int read_head(const unsigned char* p, Py_ssize_t end, Py_ssize_t* pos, Head* h) noexcept nogil:
    """Read the header at pos[0] into h and move pos[0] past it (not past a str's/bin's bytes).

    Returns W_OK or a Fault; on a fault pos[0] is unchanged. A str/bin/ext whose bytes run past
    `end` is W_TRUNCATED here, so a caller may take its bytes without checking again; an array or
    map claiming more items than bytes remain is W_TOO_LONG.
    """
    cdef Py_ssize_t at = pos[0]
    cdef unsigned char b
    cdef int width = 0
    cdef unsigned long long u
    cdef unsigned int f32
    cdef float f
    if at >= end:
        return W_TRUNCATED
    b = p[at]
    at += 1
    h.length = 0
    if b <= 0x7f:
        h.kind = K_UINT
        h.uval = b
        h.ival = b
    elif b >= 0xe0:
        h.kind = K_INT
        h.ival = <signed char>b
    elif b <= 0x8f:
        h.kind = K_MAP
        h.length = b & 0x0f
    elif b <= 0x9f:
        h.kind = K_ARRAY
        h.length = b & 0x0f
    elif b <= 0xbf:
        h.kind = K_STR
        h.length = b & 0x1f
    elif b == 0xc0:
        h.kind = K_NIL
    elif b == 0xc1:
        return W_INVALID
    elif b == 0xc2 or b == 0xc3:
        h.kind = K_BOOL
        h.ival = b - 0xc2
    elif b <= 0xc6:  # bin 8/16/32
        width = 1 << (b - 0xc4)
        if end - at < width:
            return W_TRUNCATED
        h.kind = K_BIN
        h.length = <Py_ssize_t>_be(p + at, width)
        at += width
    elif b <= 0xc9:  # ext 8/16/32: length, then the type byte
        width = 1 << (b - 0xc7)
        if end - at < width + 1:
            return W_TRUNCATED
        h.kind = K_EXT
        h.length = <Py_ssize_t>_be(p + at, width)
        at += width + 1
    elif b == 0xca:
        if end - at < 4:
            return W_TRUNCATED
        f32 = <unsigned int>_be(p + at, 4)
        memcpy(&f, &f32, 4)
        h.kind = K_FLOAT
        h.fval = f
        at += 4
    elif b == 0xcb:
        if end - at < 8:
            return W_TRUNCATED
        u = _be(p + at, 8)
        memcpy(&h.fval, &u, 8)
        h.kind = K_FLOAT
        at += 8
    elif b <= 0xcf:  # uint 8-64
        width = 1 << (b - 0xcc)
        if end - at < width:
            return W_TRUNCATED
        h.kind = K_UINT
        h.uval = _be(p + at, width)
        h.ival = <long long>h.uval
        at += width
    elif b <= 0xd3:  # int 8-64
        width = 1 << (b - 0xd0)
        if end - at < width:
            return W_TRUNCATED
        u = _be(p + at, width)
        if width == 1:
            h.ival = <signed char>u
        elif width == 2:
            h.ival = <short>u
        elif width == 4:
            h.ival = <int>u
        else:
            h.ival = <long long>u
        h.kind = K_INT
        at += width
    elif b <= 0xd8:  # fixext 1-16: type byte, then 2^(b-0xd4) bytes
        h.kind = K_EXT
        h.length = 1 << (b - 0xd4)
        if end - at < 1:
            return W_TRUNCATED
        at += 1
    elif b <= 0xdb:  # str 8/16/32
        width = 1 << (b - 0xd9)
        if end - at < width:
            return W_TRUNCATED
        h.kind = K_STR
        h.length = <Py_ssize_t>_be(p + at, width)
        at += width
    else:  # 0xdc-0xdf: array/map 16/32
        width = 2 if (b == 0xdc or b == 0xde) else 4
        if end - at < width:
            return W_TRUNCATED
        h.kind = K_ARRAY if b <= 0xdd else K_MAP
        h.length = <Py_ssize_t>_be(p + at, width)
        at += width
    if h.kind == K_STR or h.kind == K_BIN or h.kind == K_EXT:
        if h.length > end - at:
            return W_TRUNCATED
    elif h.kind == K_ARRAY:
        if h.length > end - at:
            return W_TOO_LONG
    elif h.kind == K_MAP:
        if h.length > (end - at) // 2:
            return W_TOO_LONG
    pos[0] = at
    return W_OK


cdef inline Py_ssize_t skip(const unsigned char* p, Py_ssize_t end, Py_ssize_t pos, int max_depth) noexcept nogil:
    """The position just past the value at `pos`, or a Fault (negative).

    Iterative: `left[d]` counts the values still to skip at depth d, so a value nested a million
    deep costs at most `max_depth` levels before it is refused (W_TOO_DEEP), never the C stack.
    """
    cdef Py_ssize_t left[WIRE_MAX_DEPTH + 1]
    cdef int depth = 0
    cdef int rc
    cdef Head h
    if max_depth > WIRE_MAX_DEPTH:
        max_depth = WIRE_MAX_DEPTH
    left[0] = 1
    while True:
        while depth > 0 and left[depth] == 0:
            depth -= 1
        if left[depth] == 0:
            return pos
        rc = read_head(p, end, &pos, &h)
        if rc != W_OK:
            return rc
        left[depth] -= 1
        if h.kind == K_STR or h.kind == K_BIN or h.kind == K_EXT:
            pos += h.length
        elif (h.kind == K_ARRAY or h.kind == K_MAP) and h.length > 0:
            if depth >= max_depth:
                return W_TOO_DEEP
            depth += 1
            left[depth] = h.length * 2 if h.kind == K_MAP else h.length
        if depth == 0 and left[0] == 0:
            return pos


cdef inline Py_ssize_t skip_any(const unsigned char* p, Py_ssize_t end, Py_ssize_t pos) noexcept nogil:
    """The position just past the value at `pos` however deep it nests, or a Fault (never W_TOO_DEEP).

    Finding where a value ends needs only how many values are still to read, not at which depth:
    one counter, so a value too deep for `skip`'s bound can still be stepped over (an array element
    refused alone, the fields after a refused one) in one pass and O(1) memory. The counter cannot
    overflow: read_head refuses a container claiming more items than bytes remain, so it stays
    below the frame's length squared.
    """
    cdef Py_ssize_t left = 1
    cdef int rc
    cdef Head h
    while left > 0:
        rc = read_head(p, end, &pos, &h)
        if rc != W_OK:
            return rc
        left -= 1
        if h.kind == K_STR or h.kind == K_BIN or h.kind == K_EXT:
            pos += h.length
        elif h.kind == K_ARRAY:
            left += h.length
        elif h.kind == K_MAP:
            left += 2 * h.length
    return pos


cdef inline bint utf8_valid(const unsigned char* s, Py_ssize_t n) noexcept nogil:
    """Whether n bytes are strict UTF-8 as Python decodes it (no overlongs, no surrogates, nothing
    past U+10FFFF): a str value's bytes must be, and a reader that does not build the str checks
    here. ASCII runs go eight bytes at a time."""
    cdef Py_ssize_t i = 0
    cdef unsigned char c, c1
    cdef unsigned long long w
    while i < n:
        if i + 8 <= n:
            memcpy(&w, s + i, 8)
            if (w & 0x8080808080808080ULL) == 0:
                i += 8
                continue
        c = s[i]
        if c < 0x80:
            i += 1
        elif c < 0xC2:
            return False
        elif c < 0xE0:
            if i + 1 >= n or (s[i + 1] & 0xC0) != 0x80:
                return False
            i += 2
        elif c < 0xF0:
            if i + 2 >= n or (s[i + 1] & 0xC0) != 0x80 or (s[i + 2] & 0xC0) != 0x80:
                return False
            c1 = s[i + 1]
            if (c == 0xE0 and c1 < 0xA0) or (c == 0xED and c1 >= 0xA0):
                return False
            i += 3
        elif c < 0xF5:
            if (i + 3 >= n or (s[i + 1] & 0xC0) != 0x80 or (s[i + 2] & 0xC0) != 0x80
                    or (s[i + 3] & 0xC0) != 0x80):
                return False
            c1 = s[i + 1]
            if (c == 0xF0 and c1 < 0x90) or (c == 0xF4 and c1 >= 0x90):
                return False
            i += 4
        else:
            return False
    return True


# --- the backend's batch records -------------------------------------------------------------------
# B_JOBS and W_RESULTS (common/protocol.py) carry one fixed record per job, little-endian, packed,
# then the payloads concatenated. This is the one statement of their layout: the cores read and
# write records at these offsets (get_le, put_le), and common/protocol.py builds its struct.Struct
# from the fields _wire.pyx exports (JOB_FIELDS, RESULT_FIELDS).
cdef enum:
    JOB_ID_AT = 0          # u64: the broker's job id
    JOB_BUDGET_AT = 8      # u32: the time left of the request's deadline, in ms
    JOB_SIZE_AT = 12       # u32: the request's payload bytes
    JOB_BYTES = 16
    RESULT_ID_AT = 0       # u64: the job id, as received
    RESULT_OUTCOME_AT = 8  # u8: an index into common/protocol.py OUTCOMES
    RESULT_SIZE_AT = 9     # u32: the reply's bytes
    RESULT_BYTES = 13


# --- which request ids a reply echoes --------------------------------------------------------------
# Contract, "Request fields": an `id` is nil, bool, int, float, str or bin, echoed untouched; a
# list, a map or an ext is a bad_request, answered with id nil (and a str must be valid UTF-8, as
# everywhere). Told from the id value's first byte, with only a str's bytes checked. The one
# statement of the rule: the broker's core cimports `id_fault`, common/protocol.py and
# broker/oversized.py call _wire.pyx's `id_problem`, and a worker's core cimports `id_fault` too.
cdef enum IdKind:
    ID_ECHOED = 0  # nil, bool, int, float, bin: echoed as they came
    ID_STR = 1     # echoed when its bytes are valid UTF-8
    ID_LIST = 2
    ID_MAP = 3
    ID_EXT = 4


cdef inline bint is_map_head(unsigned char b) noexcept nogil:
    """Whether a value that starts with this byte is a map (fixmap, map 16/32)."""
    return (0x80 <= b <= 0x8F) or b == 0xDE or b == 0xDF


cdef inline bint is_array_head(unsigned char b) noexcept nogil:
    """Whether a value that starts with this byte is an array (fixarray, array 16/32)."""
    return (0x90 <= b <= 0x9F) or b == 0xDC or b == 0xDD


cdef inline IdKind id_kind(unsigned char b) noexcept nogil:
    """What kind of id a value is, from its first byte (the value is known to be well formed)."""
    if is_array_head(b):
        return ID_LIST
    if is_map_head(b):
        return ID_MAP
    if (0xC7 <= b <= 0xC9) or (0xD4 <= b <= 0xD8):
        return ID_EXT
    if (0xA0 <= b <= 0xBF) or (0xD9 <= b <= 0xDB):
        return ID_STR
    return ID_ECHOED


cdef inline str utf8_fault(const unsigned char* s, Py_ssize_t n):
    """The bad_request message for a str whose n bytes are not valid UTF-8, in Python's own words
    (as msgpack's decode would say it)."""
    try:
        PyUnicode_DecodeUTF8(<const char*>s, n, NULL)
        reason = "invalid UTF-8"
    except UnicodeDecodeError as e:
        reason = e.reason
    return f"payload holds a str that is not valid UTF-8: {reason}"


cdef inline str id_fault(const unsigned char* p, Py_ssize_t n):
    """Why the id value in p[0:n] (one whole value) may not be echoed, or None when it is."""
    cdef Head h
    cdef Py_ssize_t pos = 0
    cdef IdKind kind
    if n <= 0:
        return None
    kind = id_kind(p[0])
    if kind == ID_ECHOED:
        return None
    if kind == ID_STR:
        if read_head(p, n, &pos, &h) != W_OK or utf8_valid(p + pos, h.length):
            return None
        return utf8_fault(p + pos, h.length)
    return ("field 'id' must be nil, bool, int, float, str or bin, got "
            + ("list" if kind == ID_LIST else "map" if kind == ID_MAP else "ext"))
