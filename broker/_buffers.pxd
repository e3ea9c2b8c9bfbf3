# The broker's outgoing message buffers (broker/_buffers.pyx): a libzmq message of a given size for
# a core to write, its memory reused from one message to the next.

from tokenbroker.common._zmq cimport zmq_msg_t

cdef int sized_message(zmq_msg_t* msg, size_t size) except -1
