# The client's reader (_replies.pyx): a reply frame's bytes, wherever they are, settled.

from tokenbroker._calls cimport Call

cdef int settle_frame(const unsigned char* p, Py_ssize_t end, dict calls, list odd) except -1
