# The intake (broker/_intake.pyx): the loop's compiled hand on the job table and the dispatcher.

from tokenbroker.broker._dispatch cimport Dispatcher
from tokenbroker.broker._jobs cimport Job, JobTable
from tokenbroker.broker._peek cimport Peek
from tokenbroker.common._message cimport Message


cdef class Intake:
    cdef public JobTable jobs
    cdef public Dispatcher dispatcher
    cdef public dict models
    cdef public bint affinity
    cdef public bint stopping           # the broker is shutting down: every new request is refused
    cdef public double timeout_s        # a request's deadline when it sets none
    cdef public long long max_pending, max_pending_bytes, max_client_pending
    cdef dict outbox, requests, latency, model_requests
    cdef tuple bounds
    cdef object other, late
    cpdef Py_ssize_t take(self, envelope, peer, item, double now) except -1
    cdef Py_ssize_t _one(self, envelope, peer, item, double now) except -1
    cdef bint _fast(self, envelope, Peek peek, Py_ssize_t size, double now) except -1
    cpdef object refusal(self, bytes client, Py_ssize_t size)
    cpdef Job hold(self, envelope, Peek peek, double now, model, bint catalog)
    cdef int results(self, bytes wid, const unsigned char* header, Py_ssize_t n, Message blob, double now) except -1
