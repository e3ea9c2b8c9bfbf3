# The job table (broker/_jobs.pyx): Job and JobTable, read by the dispatcher, the batches and the intake.

from tokenbroker.broker._peek cimport Peek


cdef class Job:
    cdef public long long job_id
    cdef public object envelope
    cdef public bytes raw_id            # the id's MessagePack bytes, echoed as they came
    cdef public object raw              # the request's bytes (a view of its frame when it came in an array)
    cdef public str op
    cdef public object route            # RouteKey | None
    cdef public double received
    cdef public double deadline
    cdef public double queued           # when it last entered the queue
    cdef public int attempts
    cdef public object worker           # the worker holding it, while one does
    cdef public bint answered
    cdef public object model            # the served model it names (None: any worker's default will do)
    cdef public bint catalog            # `model` is a catalog entry's name: only its holders may take it
    cdef public bint off_loop           # a tokenize the worker encodes off its loop (set by the dispatcher)


cdef class JobTable:
    cdef public dict jobs
    cdef public long long held_bytes
    cdef public dict per_client          # jobs held per client connection (its identity)
    cdef list _deadlines                 # (deadline, job id) heap, answered jobs' entries included
    cdef long long _next_id
    cpdef Job admit(self, envelope, Peek peek, route, double now, double timeout_s, model, bint catalog)
    cpdef add(self, Job job)
    cpdef release(self, Job job)
    cdef double nearest(self)
