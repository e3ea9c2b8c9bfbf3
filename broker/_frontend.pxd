# The frontend's intake (broker/_frontend.pyx): a turn's client messages from libzmq into the intake.

from tokenbroker.broker._intake cimport Intake
from tokenbroker.common._message cimport Message
from tokenbroker.common._zmq cimport zmq_msg_t


cdef class Peer:
    cdef Message message                # a frame of the message: its metadata names the connection


cdef class Drain:
    cdef object sock                    # the frontend ROUTER (pyzmq's, kept open by the Frontend)
    cdef Intake intake
    cdef Py_ssize_t max_request_bytes
    cdef bint tell_peer                 # give each message a Peer (the admin ops' gate reads it)
    cdef set arrays                     # the Frontend's connections that speak arrays
    cdef object misframed, too_large, fail   # the Frontend's answers to the rare cases
    cdef object envelope                # the last message's Envelope, reused while its connection sends
    cpdef Py_ssize_t drain(self, double now, Py_ssize_t messages, Py_ssize_t budget) except -1
    cdef Py_ssize_t _message(self, void* handle, zmq_msg_t* identity, double now) except -1
    cdef object _envelope(self, zmq_msg_t* identity, bint delimited)
