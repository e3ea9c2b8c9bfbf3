# A libzmq message held as it came, lent to Python as a read-only buffer (common/_message.pyx):
# the broker's and the worker's cores receive into one, read it in place, and pass it on with
# zmq_msg_copy (libzmq shares the data of a large message by reference count: no copy).

from tokenbroker.common._zmq cimport zmq_msg_t


cdef class Message:
    cdef zmq_msg_t msg
    cdef const unsigned char* data   # zmq_msg_data, read once the message is filled
    cdef Py_ssize_t size
    cdef int fill(self) except -1    # data and size from msg (after a receive into msg)
    cdef int share(self, zmq_msg_t* out) except -1   # out: a new message with the same data (zmq_msg_copy)
