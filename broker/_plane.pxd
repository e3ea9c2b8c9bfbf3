# The broker's turns (broker/_plane.pyx): the poll and each turn's verbs, run in C until Python's
# control plane is needed.

from tokenbroker.broker._dispatch cimport Dispatcher
from tokenbroker.broker._frontend cimport Drain
from tokenbroker.broker._intake cimport Intake
from tokenbroker.broker._jobs cimport JobTable
from tokenbroker.common._zmq cimport zmq_pollitem_t


cdef class Plane:
    cdef zmq_pollitem_t items[3]     # backend, wake-up descriptor, frontend
    cdef object broker               # broker/loop.py Broker: what the cores hand back (control, deadlines, faults)
    cdef Drain front_drain           # the frontend's intake (broker/_frontend.pyx)
    cdef Py_ssize_t front_messages, front_bytes   # a turn's bounds on it
    cdef object back_sock            # the backend ROUTER, drained by broker/_batches.pyx `drain`
    cdef dict workers                # the backend's workers (wid -> WorkerState): whose results the drain finishes
    cdef Intake intake
    cdef double liveness_s           # a worker heard from is live this long
    cdef Py_ssize_t back_messages    # a turn's bound on the backend's messages
    cdef Py_ssize_t batch_jobs, batch_bytes   # a B_JOBS message's bounds
    cdef object used                 # placement's recency hook (None: it caps no models)
    cdef JobTable jobs
    cdef Dispatcher dispatcher
    cdef object front_sock           # the frontend ROUTER
    cdef dict outbox                 # the frontend's replies of this turn
    cdef set arrays                  # the frontend's connections that speak arrays
    cdef Py_ssize_t reply_frame_bytes   # coalesced replies in one frame, past its first
    cdef int _dispatch(self, double now) except -1
