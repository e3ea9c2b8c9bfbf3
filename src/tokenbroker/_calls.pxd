# The client's call registry (_calls.pyx): a pending call, a batch of them, and how they are settled.

cdef class Batch:
    cdef public object future
    cdef public list results
    cdef public Py_ssize_t left
    cdef public Py_ssize_t odd  # results that are not the call's result type (maps, exceptions)
    cdef public object first  # the id of its first call (its calls' ids follow on)

    cpdef put(self, Py_ssize_t index, object value, bint odd)


cdef class Call:
    cdef public object id
    cdef public bytes head  # the op's fields, packed (pack_entries)
    cdef public Py_ssize_t nkeys
    cdef public int kind
    cdef public str op
    cdef public object future  # None for a call of a batch
    cdef public Batch batch
    cdef public Py_ssize_t index
    cdef public double deadline  # loop time
    cdef public double timeout
    cdef public object link
    cdef public object retry
    cdef public int attempts

    cpdef settle(self, object reply)
    cpdef fail(self, object error)


# Call kinds: which result a reply of the usual shape becomes (bit 2: ids as a list of int).
cdef enum:
    C_RAW = 0  # the reply map (request(), count, models, ...)
    C_TOKENS = 1
    C_TEXT = 2
    C_CHAT = 3
    C_AS_LIST = 4

cdef long long deadline_ms(double left) noexcept
cdef int answered(Call call, dict calls, object value, bint odd) except -1
