"""The client side of the broker: envelopes in, the few checks routing needs, replies out.

The broker reads only what it routes by: the common fields (`id`, `op`, `model`, `deadline_ms`,
`affinity`, `tokens_format`) and where the op's input lies in the payload, so a routing key can
hash its first bytes. The compiled reader (broker/_peek.pyx: `peek_request`, `peek_array`) walks
the frame in place, jumping over every other value by its length, so a 32 MiB text costs the loop
neither a copy nor a decode; the worker validates the rest and answers `bad_request` itself. The
raw payload goes to the worker untouched. Messages come in through the compiled drain
(broker/_frontend.pyx `Drain`): received from libzmq, each payload held as the message libzmq
filled and read there, never copied into a Python object.

Several requests in one frame (contract 1.2): a frame that is an array of maps is that many
requests, peeked in one pass over the frame; each element's bytes go to its worker as a view of
the frame (ZeroMQ copies them once, into the backend message). A connection that has sent an
array gets its replies coalesced: `reply` holds them and `flush`, once per loop turn, sends each
such connection one frame, an array header followed by the replies' bytes as the workers built
them. A connection that never sent an array gets each reply alone, as in 1.1.
"""

from __future__ import annotations

from typing import Container

import zmq

from tokenbroker.common._message import Message
from tokenbroker.common.errors import ProtocolError
from tokenbroker.common.protocol import NIL, Envelope, error_reply

from ._frontend import Peer
from ._outbox import add_reply, send_replies
from ._peek import Peek, peek_array, peek_request
from .oversized import id_in_place

__all__ = ["Frontend", "Peek", "Peer", "peek_array", "peek_request"]

REPLY_FRAME_BYTES = 4 * 1024 * 1024  # replies coalesced in one frame, past its first


class Frontend:
    """Wraps the ROUTER socket that clients talk to. Its messages are read by the compiled drain
    (broker/_frontend.pyx `Drain`), which hands the rare ones back here: `misframed`, `too_large`,
    and `fail` for a payload the readers refuse."""

    def __init__(self, sock: zmq.Socket, *, max_request_bytes: int, tell_peer: bool = False) -> None:
        self.sock = sock
        self.max_request_bytes = max_request_bytes
        # Read who sent each message (its CURVE key, its address): needed for the admin ops only
        # when CURVE is on or the frontend is reachable from other hosts; it costs a Peer per message.
        self.tell_peer = tell_peer
        self.arrays: set[bytes] = set()  # connections that sent an array and still hold requests
        self.outbox: dict[Envelope, list[bytes | memoryview]] = {}  # their replies of this turn, sent by flush()

    def misframed(self, envelope: Envelope, frames: int) -> None:
        """A message that is not [identity, payload] or [identity, b"", payload]: bad_request on the
        envelope it came with (`frames`: how many came after the identity)."""
        self.fail(envelope, NIL, ProtocolError("bad_request", "a message is an optional empty delimiter then "
                                               f"one payload frame; got {frames} frames"))

    def too_large(self, envelope: Envelope, payload: Message) -> None:
        """A payload over --max-request-bytes, answered with its id read from libzmq's buffer (never
        copied: it may be many times the limit), then let go."""
        self.fail(envelope, id_in_place(memoryview(payload)), ProtocolError(
            "too_large", f"payload is {len(payload)} bytes; "
            f"this broker takes at most {self.max_request_bytes} (--max-request-bytes)"))

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
