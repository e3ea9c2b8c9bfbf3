# The dispatcher (broker/_dispatch.pyx): the queue and each worker's slots, which the intake feeds.

from tokenbroker.broker._jobs cimport Job
from tokenbroker.broker._router cimport Router, Slots


cdef class Dispatcher:
    cdef public Router router
    cdef public bint long_off_loop
    cdef public object eligible
    cdef public dict holders            # Placement.holders_of (catalog model -> the workers that may take it), or None
    cdef public double spill_wait
    cdef public long long worker_bytes
    cdef public int lookahead
    cdef public dict workers
    cdef public object pending
    cdef public long long waiting
    cdef public dict demand
    cdef long long _stale
    cdef long long _free
    cdef int passed_over_max
    cpdef enqueue(self, Job job)
    cpdef object finish(self, bytes wid, long long job_id, bint served=*)
    cdef object _allowed(self, Job job)
    cdef void _demand(self, model, long long change)
    cdef void _hand(self, Job job, bytes wid, dict out)
    cdef long long _room(self, Slots slots)
    cdef void _set_room(self, Slots slots, long long before)
