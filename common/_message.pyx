# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""A libzmq message held as it came, lent to Python as a read-only buffer.

Why: a payload received by libzmq is already in memory libzmq owns (a large one reference counted,
a small one inside the message itself). Holding that message, rather than a bytes copy of it, lets a
core read the payload in place, hand a view of it to Python where Python must see it (memoryview,
msgpack, bytes.join all take the buffer), and send it on with `share`: zmq_msg_copy, which for a
large message only takes a reference. Python objects never move, so the data of a small message
(held inside the zmq_msg_t itself) stays where `data` says for the object's life.

The message is closed when the last reference to the object (or to a buffer of it) is gone, on
whatever thread that is: libzmq's reference counts are atomic.
"""

from cpython.buffer cimport PyBuffer_FillInfo

from tokenbroker.common._zmq cimport load_libzmq, zmq_errno, zmq_error, zmq_msg_close, zmq_msg_copy, zmq_msg_data, zmq_msg_init, zmq_msg_size

load_libzmq()


cdef class Message:
    """A received libzmq message (its cores fill `msg`, then call `fill`); len() and the buffer
    protocol give its bytes."""

    def __cinit__(self):
        zmq_msg_init(&self.msg)
        self.data = NULL
        self.size = 0

    def __dealloc__(self):
        zmq_msg_close(&self.msg)

    cdef int fill(self) except -1:
        self.data = <const unsigned char*>zmq_msg_data(&self.msg)
        self.size = <Py_ssize_t>zmq_msg_size(&self.msg)
        return 0

    cdef int share(self, zmq_msg_t* out) except -1:
        zmq_msg_init(out)
        if zmq_msg_copy(out, &self.msg) < 0:
            raise OSError(zmq_errno(), f"zmq_msg_copy: {zmq_error(zmq_errno())}")
        return 0

    def __len__(self) -> int:
        return self.size

    def __getbuffer__(self, Py_buffer* buffer, int flags):
        PyBuffer_FillInfo(buffer, self, <void*>self.data, self.size, 1, flags)

    def __releasebuffer__(self, Py_buffer* buffer):
        pass

    def __bytes__(self) -> bytes:
        return (<char*>self.data)[:self.size] if self.size else b""

    def __repr__(self) -> str:
        return f"<Message {self.size} bytes>"
