# The broker's outgoing message buffers (broker/_buffers.pyx): a libzmq message of a given size for
# a core to write, its memory reused from one message to the next; or, for a payload that is all of
# a message received (`whole_message`), that message itself, passed on with Message.share.

from cpython.buffer cimport PyBuffer_Release, PyBUF_SIMPLE, PyObject_GetBuffer
from libc.string cimport memcpy

from tokenbroker.common._message cimport Message
from tokenbroker.common._zmq cimport zmq_msg_t

cdef extern from "Python.h":
    Py_buffer* PyMemoryView_GET_BUFFER(object view)

cdef int sized_message(zmq_msg_t* msg, size_t size) except -1


cdef inline Message whole_message(payload):
    """The Message `payload` is all of (itself, or a view of all its bytes), else None."""
    cdef Py_buffer* view
    cdef Message owner
    if type(payload) is Message:
        return <Message>payload
    if type(payload) is memoryview:
        view = PyMemoryView_GET_BUFFER(payload)
        if <void*>view.obj != NULL and type(view.obj) is Message:
            owner = <Message>view.obj
            if view.buf == <void*>owner.data and view.len == owner.size:
                return owner
    return None


cdef inline unsigned char* put_buffer(unsigned char* o, object payload) except NULL:
    """`payload`'s bytes (any buffer: bytes, a view, a Message) copied to `o`; returns the end."""
    cdef Py_buffer b
    PyObject_GetBuffer(payload, &b, PyBUF_SIMPLE)
    memcpy(o, b.buf, b.len)
    o += b.len
    PyBuffer_Release(&b)
    return o
