# The client's MessagePack packer (_packer.pyx): what the other client cores write requests with.

from tokenbroker.common._pack cimport Buf

cdef bytes request_bytes(bytes head, Py_ssize_t nkeys, object rid, long long deadline_ms)
