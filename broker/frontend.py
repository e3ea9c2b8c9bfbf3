"""The client side of the broker: envelopes in, the few checks routing needs, replies out.

The broker reads only what it routes by: the common fields (`id`, `op`, `model`, `deadline_ms`,
`affinity`, `tokens_format`) and where the op's input lies in the payload, so a routing key can
hash its first bytes. The compiled reader (broker/_peek.pyx: `peek_request`, `peek_array`) walks
the frame in place, jumping over every other value by its length, so a 32 MiB text costs the loop
neither a copy nor a decode; the worker validates the rest and answers `bad_request` itself. The
raw payload goes to the worker untouched.

Several requests in one frame (contract 1.2): a frame that is an array of maps is that many
requests, peeked in one pass over the frame; each element's bytes go to its worker as a view of
the frame (ZeroMQ copies them once, into the backend message). A connection that has sent an
array gets its replies coalesced: `reply` holds them and `flush`, once per loop turn, sends each
such connection one frame, an array header followed by the replies' bytes as the workers built
them. A connection that never sent an array gets each reply alone, as in 1.1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Container, cast

import zmq

from tokenbroker.common.errors import ProtocolError
from tokenbroker.common.protocol import NIL, Envelope, error_reply

from ._outbox import add_reply, send_replies
from ._peek import Peek, peek_array, peek_request
from .oversized import id_in_place

__all__ = ["Frontend", "Peek", "Peer", "peek_array", "peek_request", "split_envelope"]

LARGE_PAYLOAD = 1024 * 1024  # a payload at least this long is received as a view of ZeroMQ's buffer, never copied


_NOBLOCK = int(zmq.NOBLOCK)
_RCVMORE = int(zmq.RCVMORE)  # a plain int: `sock.rcvmore` costs an enum lookup per frame
REPLY_FRAME_BYTES = 4 * 1024 * 1024  # replies coalesced in one frame, past its first
_ARRAYS = frozenset(range(0x90, 0xA0)) | {0xDC, 0xDD}


def split_envelope(frames: list[bytes]) -> tuple[Envelope, bytes | None]:
    """[identity, payload] or [identity, b"", payload]; anything else has no payload (None), and
    is answered bad_request on the envelope it came with."""
    identity = frames[0]
    if len(frames) == 2:
        return Envelope(identity, delimited=False), frames[1]
    if len(frames) == 3 and frames[1] == b"":
        return Envelope(identity, delimited=True), frames[2]
    delimited = len(frames) > 1 and frames[1] == b""
    return Envelope(identity, delimited), None


@dataclass(frozen=True, slots=True)
class Peer:
    """What ZeroMQ says of a message's connection: the CURVE key (ZAP user id) and the address."""

    user_id: str | None
    address: str | None

    @classmethod
    def of(cls, frame: zmq.Frame) -> "Peer":
        def prop(name: str) -> str | None:
            try:
                return cast(str, frame.get(name))  # User-Id and Peer-Address are str
            except zmq.ZMQError:  # no such property on this connection (no ZAP user id without CURVE)
                return None

        return cls(prop("User-Id"), prop("Peer-Address"))


class Frontend:
    """Wraps the ROUTER socket that clients talk to."""

    def __init__(self, sock: zmq.Socket, *, max_request_bytes: int, tell_peer: bool = False) -> None:
        self.sock = sock
        self.max_request_bytes = max_request_bytes
        # Read who sent each message (its CURVE key, its address): needed for the admin ops only
        # when CURVE is on or the frontend is reachable from other hosts; it costs a Frame per message.
        self.tell_peer = tell_peer
        self.arrays: set[bytes] = set()  # connections that sent an array and still hold requests
        self.outbox: dict[Envelope, list[bytes | memoryview]] = {}  # their replies of this turn, sent by flush()

    def receive(self) -> "tuple[Envelope, Peer | None, Peek | list[Peek] | None] | None":
        """One message: (its envelope, who sent it when asked, what it holds): a Peek, or an
        array's Peeks, those the broker refuses with their `code` set (the loop answers those
        first); None when the frontend answered the message here with an error.
        An empty array is nothing, and gets no reply. The loop hands it to its compiled intake
        (broker/_intake.pyx `Intake.take`) as it is: no object per request is built here.

        None when nothing is waiting.
        """
        sock = self.sock
        try:
            frames: list = [sock.recv(_NOBLOCK)]
        except zmq.Again:
            return None
        peer = oversized = None
        # A ROUTER message is its identity and at least one frame; the frames after it come as
        # Frames, whose `more` says whether another follows (sock.get(RCVMORE) costs an enum
        # lookup and a getpid per call, more than the Frame).
        more = True
        while more:  # the frames of one message are all there once its first is
            # Not copied yet: a frame over the limit is answered from ZeroMQ's own buffer, then freed.
            frame = sock.recv(_NOBLOCK, copy=False)
            more = frame.more
            if self.tell_peer:
                peer = Peer.of(frame)
            size = len(frame)
            if size > self.max_request_bytes:
                oversized = frame
                frames.append(b"\x00")  # a placeholder for split_envelope: the frame is never copied
            elif size >= LARGE_PAYLOAD:
                frames.append(frame.buffer)  # peeked in place, sent on to the worker from ZeroMQ's buffer
            else:
                frames.append(frame.bytes)
        envelope, raw = split_envelope(frames)
        if raw is None:
            self.fail(envelope, NIL, ProtocolError("bad_request", "a message is an optional empty delimiter then "
                                                   f"one payload frame; got {len(frames) - 1} frames"))
            return envelope, peer, None
        if oversized is not None:
            self.fail(envelope, id_in_place(oversized.buffer), ProtocolError(
                "too_large", f"payload is {len(oversized)} bytes; "
                f"this broker takes at most {self.max_request_bytes} (--max-request-bytes)"))
            return envelope, peer, None
        try:
            if raw and raw[0] in _ARRAYS:
                return envelope, peer, self._array(envelope, peek_array(raw))
            return envelope, peer, peek_request(raw)
        except ProtocolError as e:
            self.fail(envelope, NIL, e)
            return envelope, peer, None

    def _array(self, envelope: Envelope, peeks: list[Peek]) -> list[Peek]:
        if peeks:
            self.arrays.add(envelope.identity)  # before any reply: this connection's replies are coalesced
        return peeks

    def reply(self, envelope: Envelope, payload: "bytes | memoryview") -> None:
        """Hold a reply for `flush`, which sends the turn's replies together (the compiled intake
        adds the workers' replies to the same outbox)."""
        add_reply(self.outbox, envelope, payload)

    def flush(self, holding: "Container[bytes]") -> None:
        """End of a turn: send what the turn answered, back to back (ZeroMQ's I/O thread is woken
        once for a run of sends, not per reply). A connection that speaks arrays gets its replies
        in one frame, a MessagePack array of them built from their bytes (never decoded; a lone
        reply goes as its map); any other gets each reply alone, as in 1.1.
        `holding`: the connections that still have requests held; the others stop being array
        speakers here (they say so again with their next array), so the set stays small."""
        if self.outbox:  # sent over libzmq from compiled code (broker/_outbox.pyx `send_replies`)
            send_replies(self.sock, self.outbox, self.arrays, holding, REPLY_FRAME_BYTES)

    def refuse(self, envelope: Envelope, peek: Peek) -> None:
        """Answer a request the core refused (an array's element: its `code` and `message` set,
        no exception built for it)."""
        assert peek.code is not None and peek.message is not None, peek
        self.reply(envelope, error_reply(peek.raw_id, peek.code, peek.message))

    def fail(self, envelope: Envelope, raw_id: bytes, error: ProtocolError) -> None:
        """Answer `error`, the broker's one way to build an error reply: it echoes the id the error
        carries (what the frontend read of the request) or else `raw_id` (the caller's)."""
        self.reply(envelope, error_reply(raw_id if error.raw_id is None else error.raw_id, error.code, error.message))
