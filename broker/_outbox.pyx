# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""The turn's replies, sent over libzmq: held per connection (`add_reply`, and the intake's
`hold_reply`), then sent once a turn (`send_replies`; broker/frontend.py `Frontend.flush` holds
the design).

Why libzmq directly: a reply is a view of a worker's W_RESULTS frame (or bytes the broker built).
It is copied once, into the message that carries it, and an array's replies are written back to
back into one message made to measure (broker/_buffers.pyx): no Python bytes are built for a
frame, no Python call is made per frame.
"""

from tokenbroker.broker._buffers cimport put_buffer, sized_message, whole_message
from tokenbroker.common._message cimport Message
from tokenbroker.common._pack cimport array_head_size, put_array_head
from tokenbroker.common._zmq cimport (ZMQ_DONTWAIT, ZMQ_SNDMORE, handle_of, load_libzmq, zmq_msg_close, zmq_msg_data,
                                      zmq_msg_send, zmq_msg_t, zmq_send)

load_libzmq()

ctypedef unsigned char uchar


def add_reply(dict outbox, envelope, payload) -> None:
    """Hold a reply in a frontend's outbox (broker/frontend.py `Frontend.reply`)."""
    hold_reply(outbox, envelope, payload)


cpdef send_replies(sock, dict outbox, set arrays, holding, Py_ssize_t frame_bytes):
    """Send a turn's held replies: to a connection that speaks arrays (in `arrays`), its replies in
    frames of at most `frame_bytes` past the first, each a MessagePack array header then the
    replies' bytes as the workers built them (a lone reply goes as its map); to any other, each
    reply alone. A connection in `arrays` but not in `holding` stops being an array speaker.
    A send that fails (the client is gone) costs only that reply: never the loop."""
    cdef void* s = handle_of(sock)
    cdef list payloads
    cdef Py_ssize_t start, end, size, n
    cdef bytes identity
    cdef bint delimited, speaks
    for envelope, found in outbox.items():
        payloads = <list>found
        identity = <bytes>(<tuple>envelope)[0]
        delimited = (<tuple>envelope)[1]
        n = len(payloads)
        speaks = identity in arrays
        if n == 1 or not speaks:
            for payload in payloads:
                _send_alone(s, identity, delimited, payload)
        else:
            start = 0
            while start < n:
                end, size = start, 0
                while end < n and (end == start or size + len(payloads[end]) <= frame_bytes):
                    size += len(payloads[end])
                    end += 1
                if end - start == 1:
                    _send_alone(s, identity, delimited, payloads[start])
                else:
                    _send_array(s, identity, delimited, payloads, start, end, size)
                start = end
        if speaks and identity not in holding:
            arrays.discard(identity)
    outbox.clear()


cdef bint _send_envelope(void* s, bytes identity, bint delimited) noexcept:
    """The identity frame (and the empty delimiter when the request had one); False when it failed."""
    if zmq_send(s, <const char*>identity, len(identity), ZMQ_DONTWAIT | ZMQ_SNDMORE) < 0:
        return False
    return not delimited or zmq_send(s, b"", 0, ZMQ_DONTWAIT | ZMQ_SNDMORE) >= 0


cdef int _send_alone(void* s, bytes identity, bint delimited, payload) except -1:
    """One reply as its own frame: a worker's whole W_RESULTS payload frame (its only reply) goes on
    as that libzmq message (`share`: no copy of a large one); any other is copied into its message."""
    cdef zmq_msg_t msg
    cdef Message whole = whole_message(payload)
    if whole is not None:
        whole.share(&msg)
    else:
        sized_message(&msg, <size_t>len(payload))
        put_buffer(<uchar*>zmq_msg_data(&msg), payload)
    try:
        if _send_envelope(s, identity, delimited):
            zmq_msg_send(&msg, s, ZMQ_DONTWAIT)  # a failure (the client is gone) costs this reply
    finally:
        zmq_msg_close(&msg)  # after a send, an empty message: closing it is a no-op
    return 0


cdef int _send_array(void* s, bytes identity, bint delimited, list payloads, Py_ssize_t start, Py_ssize_t end,
                     Py_ssize_t size) except -1:
    """payloads[start:end] (`size` bytes) as one frame: an array header, then each reply's bytes."""
    cdef zmq_msg_t msg
    cdef uchar* o
    cdef Py_ssize_t i
    sized_message(&msg, <size_t>(array_head_size(end - start) + size))
    try:
        o = put_array_head(<uchar*>zmq_msg_data(&msg), end - start)
        for i in range(start, end):
            o = put_buffer(o, payloads[i])
        if _send_envelope(s, identity, delimited):
            zmq_msg_send(&msg, s, ZMQ_DONTWAIT)  # libzmq's once sent; a failure costs this frame
    finally:
        zmq_msg_close(&msg)  # after a send, an empty message: closing it is a no-op
    return 0
