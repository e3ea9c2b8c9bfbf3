# The broker's request reader (broker/_peek.pyx): contract 1.4's bounds, the common fields by index,
# and the Peek the other cores read (broker/_routekey.pyx hashes the spans; broker/_jobs.pyx and
# broker/_intake.pyx hold it).

cdef enum:
    DEPTH = 100           # the deepest a request's values may nest (skipping included)
    FIELDS = 4096         # the most fields one request map may have
    ARRAY_REQUESTS = 4096 # the most requests one array frame may hold (contract 1.4)

cdef enum:  # fields, by index
    F_ID = 0
    F_OP = 1
    F_MODEL = 2
    F_DEADLINE = 3
    F_AFFINITY = 4
    F_FORMAT = 5
    F_TEXT = 6
    F_MESSAGES = 7
    F_TOOLS = 8
    F_KWARGS = 9
    F_BODY = 10
    NFIELDS = 11


cdef class Peek:
    cdef public object raw
    cdef public bytes raw_id
    cdef public str op
    cdef public object model
    cdef public object deadline_ms
    cdef public object affinity
    cdef public object body
    cdef public str code         # the error code that answers the request, None when it is readable
    cdef public str message
    cdef Py_ssize_t s[NFIELDS]   # where each field's value starts in raw (-1: absent)
    cdef Py_ssize_t e[NFIELDS]   # and ends


cpdef Peek peek_request(object raw)   # one request map (the ProtocolError that answers it otherwise)
cpdef list peek_array(object raw)     # an array frame's requests, each a Peek
