# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""The frontend's intake, compiled: a turn's client messages received straight from libzmq, read in
place and admitted, in one call per loop turn (broker/_plane.pyx, the compiled turns).

Why: through pyzmq each message cost Python calls per frame, a Frame object, and a copy of its
payload into bytes (a 256 KB array of 4 KB texts copied whole; malloc and page faults were a fifth of
the broker's CPU). Here each frame is received with zmq_msg_recv on the ROUTER's own handle
(common/_zmq.pxd); the identity becomes bytes (the envelope keys the outbox), and the payload stays
the message libzmq filled, held in a `Message` (common/_message.pxd) that lends it as a read-only
buffer: the request readers (broker/_peek.pyx) walk it in place, a lone request's job holds it and an
array element's job holds a view of it, and it is closed when the last of them is let go. Nothing
of a payload is copied on the way in.

Only the rare cases go to Python, to the one place that answers them (broker/frontend.py
`Frontend`): a message with the wrong number of frames (`misframed`), a payload over
--max-request-bytes (`too_large`, which reads the id from libzmq's buffer), and a frame the readers
refuse (`fail`, with the ProtocolError they raised). Who sent a message (for the admin ops) is a
`Peer` that reads the message's own metadata only when asked.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from libc.string cimport memcmp

from tokenbroker.broker._intake cimport Intake
from tokenbroker.broker._peek cimport peek_array, peek_request
from tokenbroker.common._message cimport Message
from tokenbroker.common._wire cimport is_array_head
from tokenbroker.common._zmq cimport (EAGAIN, EINTR, ZMQ_DONTWAIT, handle_of, load_libzmq, zmq_errno, zmq_error,
                                      zmq_msg_close, zmq_msg_data, zmq_msg_gets, zmq_msg_init, zmq_msg_more,
                                      zmq_msg_recv, zmq_msg_size, zmq_msg_t)

from tokenbroker.common.errors import ProtocolError
from tokenbroker.common.protocol import NIL, Envelope

load_libzmq()


cdef class Peer:
    """What libzmq says of a message's connection: its CURVE key (the ZAP user id) and its address,
    read from the message's metadata when asked (only the admin ops ask), so telling the peer costs
    a message one small object."""

    @property
    def user_id(self) -> "str | None":
        return _property(self.message, b"User-Id")

    @property
    def address(self) -> "str | None":
        return _property(self.message, b"Peer-Address")

    def __repr__(self) -> str:
        return f"Peer(user_id={self.user_id!r}, address={self.address!r})"


cdef object _property(Message message, const char* name):
    """A metadata property of the message's connection, or None when it has none (no ZAP user id
    without CURVE)."""
    cdef const char* value = zmq_msg_gets(&message.msg, name)
    return None if value is NULL else value.decode("utf-8", "replace")


cdef inline int _next_frame(zmq_msg_t* msg, void* handle) except -1:
    """The next frame of a message whose first frame has come (libzmq delivers a message whole),
    again when a signal interrupts the call: a message is never left half read."""
    cdef int err
    while zmq_msg_recv(msg, handle, ZMQ_DONTWAIT) < 0:
        err = zmq_errno()
        if err != EINTR:
            raise OSError(err, f"zmq_msg_recv: {zmq_error(err)}")
    return 0


cdef inline Message _receive(void* handle):
    """The next frame, held as libzmq filled it."""
    cdef Message frame = Message.__new__(Message)
    _next_frame(&frame.msg, handle)
    frame.fill()
    return frame


cdef class Drain:
    """The frontend ROUTER's reader, one `drain` a turn (cpdef: the compiled turns may call it C to
    C), each message into the intake (`Intake.take`, C to C)."""

    def __init__(self, frontend, Intake intake):
        """`frontend`: broker/frontend.py `Frontend` (its socket, its limit, whether to tell the peer,
        its set of array speakers, and its answers to the rare cases)."""
        self.sock = frontend.sock
        self.intake = intake
        self.max_request_bytes = frontend.max_request_bytes
        self.tell_peer = frontend.tell_peer
        self.arrays = frontend.arrays
        self.misframed = frontend.misframed
        self.too_large = frontend.too_large
        self.fail = frontend.fail
        self.envelope = None

    cpdef Py_ssize_t drain(self, double now, Py_ssize_t messages, Py_ssize_t budget) except -1:
        """Read and admit every message waiting, up to `messages` messages and `budget` payload
        bytes (a turn's bounds, so the backend is never starved); how many it read."""
        cdef void* handle = handle_of(self.sock)
        cdef Py_ssize_t taken = 0
        cdef zmq_msg_t identity
        cdef int err
        while taken < messages and budget > 0:
            zmq_msg_init(&identity)
            if zmq_msg_recv(&identity, handle, ZMQ_DONTWAIT) < 0:
                err = zmq_errno()
                zmq_msg_close(&identity)
                if err == EAGAIN or err == EINTR:  # nothing more this turn (a signal: the poll sees it)
                    break
                raise OSError(err, f"zmq_msg_recv: {zmq_error(err)}")
            try:
                budget -= self._message(handle, &identity, now)
            finally:
                zmq_msg_close(&identity)
            taken += 1
        return taken

    cdef Py_ssize_t _message(self, void* handle, zmq_msg_t* identity, double now) except -1:
        """One message, its identity received: [identity, payload] or [identity, b"", payload]."""
        cdef Message first, payload
        cdef Py_ssize_t frames = 1
        cdef bint delimited = False
        cdef int more
        cdef zmq_msg_t rest
        if not zmq_msg_more(identity):  # a ROUTER hands on at least one frame past the identity
            envelope = self._envelope(identity, False)
            self.misframed(envelope, 0)
            return self.intake.take(envelope, None, None, now)
        first = payload = _receive(handle)
        if zmq_msg_more(&first.msg):
            payload = _receive(handle)
            frames = 2
            delimited = first.size == 0
            more = zmq_msg_more(&payload.msg)
            while more:  # more frames than a request has: read to the end, then refused
                zmq_msg_init(&rest)
                try:
                    _next_frame(&rest, handle)
                    more = zmq_msg_more(&rest)
                finally:
                    zmq_msg_close(&rest)
                frames += 1
        envelope = self._envelope(identity, delimited)
        peer = None
        if self.tell_peer:
            peer = Peer.__new__(Peer)
            (<Peer>peer).message = first
        if frames > 2 or (frames == 2 and not delimited):
            self.misframed(envelope, frames)
            return self.intake.take(envelope, peer, None, now)
        if payload.size > self.max_request_bytes:
            self.too_large(envelope, payload)
            return self.intake.take(envelope, peer, None, now)
        try:
            if payload.size and is_array_head(payload.data[0]):
                item = peek_array(payload)
                if item:
                    self.arrays.add(envelope[0])  # before any reply: this connection's replies are coalesced
            else:
                item = peek_request(payload)
        except ProtocolError as e:
            self.fail(envelope, NIL, e)
            item = None
        return self.intake.take(envelope, peer, item, now)

    cdef object _envelope(self, zmq_msg_t* identity, bint delimited):
        """The message's Envelope: the last one again while the same connection sends (an array
        speaker's and a pipelining client's messages come in runs), else a new one."""
        cdef const char* data = <const char*>zmq_msg_data(identity)
        cdef Py_ssize_t size = <Py_ssize_t>zmq_msg_size(identity)
        last = self.envelope
        if last is not None:
            known = <bytes>(<tuple>last)[0]
            if (PyBytes_GET_SIZE(known) == size and memcmp(PyBytes_AS_STRING(known), data, size) == 0
                    and <bint>(<tuple>last)[1] == delimited):
                return last
        self.envelope = Envelope(PyBytes_FromStringAndSize(data, size), delimited)
        return self.envelope
