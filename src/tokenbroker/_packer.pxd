# The client's MessagePack packer (_packer.pyx): what the other client cores write requests with.

from tokenbroker.common._pack cimport Buf

cdef int pack_int(Buf* b, object o) except -1
cdef int pack_value(Buf* b, object o, int depth) except -1
cdef bytes request_bytes(bytes head, Py_ssize_t nkeys, object rid, long long deadline_ms)
