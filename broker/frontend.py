"""The client side of the broker: envelopes in, checks before any work, replies out.

Everything a client can get wrong about framing, size or the common fields is caught here and
answered at once; what passes becomes a `Request` for the router, with the raw payload kept so
the worker receives the client's bytes untouched.
"""

from __future__ import annotations

from dataclasses import dataclass

import zmq

from tokenbroker.common.errors import ProtocolError
from tokenbroker.common.protocol import NIL, Envelope, Request, error_reply, parse_request, raw_id


@dataclass(frozen=True)
class Incoming:
    envelope: Envelope
    raw: bytes
    request: Request


def split_envelope(frames: list[bytes]) -> tuple[Envelope, bytes]:
    """[identity, payload] or [identity, b"", payload]; anything else is a bad_request."""
    identity = frames[0]
    if len(frames) == 2:
        return Envelope(identity, delimited=False), frames[1]
    if len(frames) == 3 and frames[1] == b"":
        return Envelope(identity, delimited=True), frames[2]
    delimited = len(frames) > 1 and frames[1] == b""
    raise _Malformed(Envelope(identity, delimited), len(frames) - 1)


class _Malformed(Exception):
    def __init__(self, envelope: Envelope, count: int) -> None:
        super().__init__(count)
        self.envelope = envelope
        self.count = count


class Frontend:
    """Wraps the ROUTER socket that clients talk to."""

    def __init__(self, sock: zmq.Socket, *, max_request_bytes: int) -> None:
        self.sock = sock
        self.max_request_bytes = max_request_bytes

    def receive(self) -> Incoming | None:
        """One message: a checked request, or None when it was answered here with an error."""
        frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=True)
        try:
            envelope, raw = split_envelope(frames)
        except _Malformed as e:
            self.fail(e.envelope, NIL, "bad_request",
                      f"a message is an optional empty delimiter then one payload frame; got {e.count} frames")
            return None
        if len(raw) > self.max_request_bytes:
            self.fail(envelope, raw_id(raw), "too_large",
                      f"payload is {len(raw)} bytes; this broker takes at most {self.max_request_bytes} (--max-request-bytes)")
            return None
        try:
            request = parse_request(raw)
        except ProtocolError as e:
            self.fail(envelope, raw_id(raw), e.code, e.message)
            return None
        return Incoming(envelope, raw, request)

    def reply(self, envelope: Envelope, payload: bytes) -> None:
        try:
            self.sock.send_multipart(envelope.frames(payload), zmq.NOBLOCK)
        except zmq.Again:  # the client is gone or not reading: drop, never block the loop
            pass

    def fail(self, envelope: Envelope, raw_request_id: bytes, code: str, message: str) -> None:
        self.reply(envelope, error_reply(raw_request_id, code, message))
