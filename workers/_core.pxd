# The worker's per-item C path (workers/_core.pyx), for the cores that read requests and write
# replies in place (workers/_round.pyx): the plain tokenize reader over a pointer, and the reply
# writer into room its caller made. read_plain and pack_tokens (Python) are their wrappers.

cdef struct Plain:
    # What read_plain_at found in a plain tokenize payload, as offsets into it.
    Py_ssize_t text_at    # the `text` value's head: a str, or an array of str (`batch`)
    Py_ssize_t n          # texts: 1 for a str
    Py_ssize_t model_at   # the model name's UTF-8 (checked); -1: nil or absent
    Py_ssize_t model_len
    Py_ssize_t rid_at     # the id value's own bytes, as they came; -1: absent (nil)
    Py_ssize_t rid_len
    bint batch
    bint u32
    bint special          # add_special_tokens


cdef bint read_plain_at(const unsigned char* p, Py_ssize_t end, Plain* out) noexcept nogil
cdef object plain_text(const unsigned char* p, Py_ssize_t end, Plain* plain)
cdef int check_ends(const unsigned char* e, Py_ssize_t ends_bytes, Py_ssize_t ids, Py_ssize_t first, Py_ssize_t n,
                    bint batch) except -1
cdef Py_ssize_t reply_bound(const unsigned char* e, Py_ssize_t first, Py_ssize_t n, bint batch, bint u32,
                            Py_ssize_t rid_len, Py_ssize_t tail_len, Py_ssize_t limit) noexcept nogil
cdef Py_ssize_t write_reply(unsigned char* o, const unsigned char* f, const unsigned char* e, Py_ssize_t first,
                            Py_ssize_t n, bint batch, bint u32, const unsigned char* rid, Py_ssize_t rid_len,
                            const unsigned char* tail, Py_ssize_t tail_len) noexcept nogil
