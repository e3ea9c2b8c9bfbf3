"""The client side of the broker: envelopes in, the few checks routing needs, replies out.

The broker reads only what it routes by: the common fields (`id`, `op`, `model`, `deadline_ms`,
`affinity`, `tokens_format`) and where the op's input lies in the payload, so a routing key can
hash its first bytes. Values are walked over in C (`Unpacker.skip`), never decoded, so a 32 MiB
text costs the loop a copy, not a decode; the worker validates the rest and answers
`bad_request` itself. The raw payload goes to the worker untouched.

Several requests in one frame (contract 1.2): a frame that is an array of maps is that many
requests, peeked in one pass over the frame; each element's bytes go to its worker as a view of
the frame (ZeroMQ copies them once, into the backend message). A connection that has sent an
array gets its replies coalesced: `reply` holds them and `flush`, once per loop turn, sends each
such connection one frame, an array header followed by the replies' bytes as the workers built
them. A connection that never sent an array gets each reply alone, as in 1.1.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from typing import Any, Callable, Container, cast

import msgpack
import zmq

from tokenbroker.common.errors import ProtocolError
from tokenbroker.common.protocol import NIL, Envelope, common_fields, error_reply, id_problem, type_name

from .oversized import id_in_place

# Fields whose value a routing key reads (as raw MessagePack bytes), by op.
INPUT_FIELDS = frozenset({"text", "messages", "tools", "chat_template_kwargs", "body"})
_HEADER_FIELDS = frozenset({"op", "model", "deadline_ms", "affinity", "tokens_format"})


@dataclass(slots=True)
class Peek:
    """A request as the broker sees it: the common fields, checked, and where its inputs lie.

    `raw` is the frame it came in and `spans` are offsets into it; `body` is the request's own
    bytes, what the worker gets: the frame itself for a lone map, a view of it for an element of
    an array (no copy until ZeroMQ takes it).
    """

    raw: bytes
    raw_id: bytes  # the id's MessagePack bytes as they came, echoed in the reply
    op: str
    model: str | None = None
    deadline_ms: int | None = None
    affinity: str | None = None
    spans: dict[str, tuple[int, int]] = field(default_factory=dict)  # input field -> (start, end) in raw
    body: "bytes | memoryview" = b""

    def value(self, name: str) -> bytes | None:
        """The raw MessagePack bytes of an input field, or None when absent."""
        span = self.spans.get(name)
        return None if span is None else self.raw[span[0]:span[1]]


def peek_request(raw: bytes) -> Peek:
    """Check the common fields of a payload; raise ProtocolError (with the id to echo) otherwise.

    >>> p = peek_request(msgpack.packb({"op": "tokenize", "text": "hi", "id": 5}))
    >>> p.op, p.raw_id, p.value("text")
    ('tokenize', b'\\x05', b'\\xa2hi')
    """
    unpacker = _unpacker(raw)
    if not raw or raw[0] not in _MAPS:
        raise ProtocolError("bad_request", f"payload must be a map, got {_first_type(raw)}", raw_id=NIL)
    peek = _peek_map(unpacker, raw, 0, 0)
    if unpacker.tell() != len(raw):
        raise ProtocolError("bad_request", "payload holds more than one MessagePack value: send one map", raw_id=peek.raw_id)
    peek.body = raw
    return peek


def peek_array(raw: bytes) -> list[Peek | ProtocolError]:
    """The requests of a frame that is an array (contract 1.2, "Several requests in one frame"), in
    one pass over the frame: each element a Peek (its `body` a view of the frame) or the
    ProtocolError that answers it. Raises ProtocolError (id nil) when the frame itself cannot be read: then nothing in
    it is served and one reply answers it, as for any unreadable payload. So does an array with no
    map in it: that is not an array of requests but a payload of the wrong type, answered as 1.1
    answers one (a 1.1 client that sends a list gets its one `bad_request`).

    >>> [p.op if isinstance(p, Peek) else p.code for p in peek_array(msgpack.packb([{"op": "ping"}, 3]))]
    ['ping', 'bad_request']
    """
    out: list[Peek | ProtocolError] = []
    view = memoryview(raw)
    unpacker = _unpacker(raw)
    base = 0  # where `unpacker` started reading: its tell() counts from here
    try:
        count = unpacker.read_array_header()
    except Exception as e:
        raise ProtocolError("bad_request", f"payload is not valid MessagePack ({len(raw)} bytes{_starting(raw)}): {e}",
                            raw_id=NIL) from None
    maps = 0
    for i in range(count):
        start = base + unpacker.tell()
        if start >= len(raw):
            raise ProtocolError("bad_request", f"payload is truncated: the array says {count} requests, "
                                f"the frame holds {i}", raw_id=NIL)
        try:
            if raw[start] not in _MAPS:
                raise ProtocolError("bad_request", f"request [{i}] of the array must be a map, "
                                    f"got {_first_type(raw[start:start + 9])}", raw_id=NIL)
            maps += 1
            peek = _peek_map(unpacker, raw, base, start)
            peek.body = view[start:base + unpacker.tell()]
            out.append(peek)
        except ProtocolError as e:  # this element only: find where it ends (its bytes are skipped, never decoded)
            out.append(e)
            base, unpacker = _resume_after(raw, start)
    if base + unpacker.tell() != len(raw):
        raise ProtocolError("bad_request", "payload holds more than one MessagePack value: send one array", raw_id=NIL)
    if maps == 0 and out:
        raise ProtocolError("bad_request", "payload must be a map (or an array of request maps), got list", raw_id=NIL)
    return out


def _unpacker(raw: bytes) -> msgpack.Unpacker:
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=max(len(raw), 1))
    unpacker.feed(raw)
    return unpacker


def _resume_after(raw: bytes, start: int) -> tuple[int, msgpack.Unpacker]:
    """An unpacker just past the value at `start`, and its base; ProtocolError when the frame is broken there."""
    f = io.BytesIO(raw)
    f.seek(start)
    size = max(len(raw), 1)
    walker = msgpack.Unpacker(f, raw=False, strict_map_key=False, read_size=min(64 * 1024, size), max_buffer_size=size)
    try:
        walker.skip()
    except Exception as e:
        raise ProtocolError("bad_request", f"payload is not valid MessagePack from byte {start}: "
                            f"{str(e) or type(e).__name__}", raw_id=NIL) from None
    end = start + walker.tell()
    f.seek(end)
    return end, msgpack.Unpacker(f, raw=False, strict_map_key=False, read_size=min(64 * 1024, size), max_buffer_size=size)


def _peek_map(unpacker: msgpack.Unpacker, raw: bytes, base: int, start: int) -> Peek:
    """Read the map at the unpacker's position (`start` in raw): the common fields checked (one
    shared check with the worker, common/protocol.py), the inputs' spans noted, the rest skipped."""
    raw_id = NIL
    fields: dict[str, object] = {}
    spans: dict[str, tuple[int, int]] = {}
    try:
        size = unpacker.read_map_header()
        for _ in range(size):
            key = unpacker.unpack()
            if not isinstance(key, str):
                raise ProtocolError("bad_request", f"payload map keys must be str, got {type_name(key)}", raw_id=raw_id)
            at = base + unpacker.tell()
            if key == "id":
                unpacker.skip()
                raw_id = raw[at:base + unpacker.tell()]
                why = id_problem(raw_id)
                if why is not None:
                    raw_id = NIL
                    raise ProtocolError("bad_request", why, raw_id=NIL)
            elif key in _HEADER_FIELDS:
                fields[key] = unpacker.unpack()
            else:
                unpacker.skip()
                if key in INPUT_FIELDS:
                    spans[key] = (at, base + unpacker.tell())
        common = common_fields(fields)
    except ProtocolError as e:  # raised above (its id set), or by common_fields (the id read so far)
        if e.raw_id is None:
            e.raw_id = raw_id
        raise
    except UnicodeDecodeError as e:
        raise ProtocolError("bad_request", f"payload holds a str that is not valid UTF-8: {e.reason}",
                            raw_id=raw_id) from None
    except Exception as e:  # truncated, not MessagePack, nested too deep, ...
        detail = str(e) or type(e).__name__
        raise ProtocolError("bad_request", f"payload is not valid MessagePack ({len(raw) - start} bytes"
                            f"{_starting(raw[start:start + 1])}): {detail}", raw_id=raw_id) from None
    return Peek(raw, raw_id, common.op, common.model, common.deadline_ms, common.affinity, spans)


_NOBLOCK = int(zmq.NOBLOCK)
_RCVMORE = int(zmq.RCVMORE)  # a plain int: `sock.rcvmore` costs an enum lookup per frame
REPLY_FRAME_BYTES = 4 * 1024 * 1024  # replies coalesced in one frame, past its first
_PACKER = msgpack.Packer()
_NOBLOCK_MORE = int(zmq.NOBLOCK | zmq.SNDMORE)
_raw_send: Callable[..., Any] = zmq.backend.Socket.send  # the Cython method under pyzmq's Python `Socket.send`
_COPY_THRESHOLD = zmq.COPY_THRESHOLD
_MAPS = frozenset(range(0x80, 0x90)) | {0xDE, 0xDF}
_ARRAYS = frozenset(range(0x90, 0xA0)) | {0xDC, 0xDD}


def _first_type(raw: bytes) -> str:
    """What the first MessagePack value is, from its first byte (nothing decoded)."""
    if not raw:
        return "nothing (empty payload)"
    b = raw[0]
    if b <= 0x7F or 0xE0 <= b or b in (0xCC, 0xCD, 0xCE, 0xCF, 0xD0, 0xD1, 0xD2, 0xD3):
        return "int"
    if 0x90 <= b <= 0x9F or b in (0xDC, 0xDD):
        return "list"
    if 0xA0 <= b <= 0xBF or b in (0xD9, 0xDA, 0xDB):
        return "str"
    names = {0xC0: "nil", 0xC2: "bool", 0xC3: "bool", 0xC4: "bin", 0xC5: "bin", 0xC6: "bin", 0xCA: "float", 0xCB: "float"}
    if b in names:
        return names[b]
    if b in (0xC7, 0xC8, 0xC9) or 0xD4 <= b <= 0xD8:
        return "ext"
    return f"bytes that are not MessagePack (starting 0x{raw[:1].hex()})"


def _starting(raw: bytes) -> str:
    return f", starting 0x{raw[:1].hex()}" if raw else ", empty"


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


@dataclass(slots=True)
class Incoming:
    envelope: Envelope
    peek: Peek
    peer: "Peer | None" = None  # who sent it, when the frontend was asked to tell (admin ops)


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

    def receive(self) -> list[Incoming | None] | None:
        """One message: its requests checked (one, or each element of an array), None for each one
        answered here with an error. An empty array is nothing, and gets no reply.

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
            if len(frame) > self.max_request_bytes:
                oversized = frame
                frames.append(b"\x00")  # a placeholder for split_envelope: the frame is never copied
            else:
                frames.append(frame.bytes)
        envelope, raw = split_envelope(frames)
        if raw is None:
            self.fail(envelope, NIL, ProtocolError("bad_request", "a message is an optional empty delimiter then "
                                                   f"one payload frame; got {len(frames) - 1} frames"))
            return [None]
        if oversized is not None:
            self.fail(envelope, id_in_place(oversized.buffer), ProtocolError(
                "too_large", f"payload is {len(oversized)} bytes; "
                f"this broker takes at most {self.max_request_bytes} (--max-request-bytes)"))
            return [None]
        if raw and raw[0] in _ARRAYS:
            return self._receive_array(envelope, raw, peer)
        try:
            return [Incoming(envelope, peek_request(raw), peer)]
        except ProtocolError as e:
            self.fail(envelope, NIL, e)
            return [None]

    def _receive_array(self, envelope: Envelope, raw: bytes, peer: "Peer | None") -> list[Incoming | None]:
        try:
            peeks = peek_array(raw)
        except ProtocolError as e:
            self.fail(envelope, NIL, e)
            return [None]
        if peeks:
            self.arrays.add(envelope.identity)  # before any reply: this connection's replies are coalesced
        out: list[Incoming | None] = []
        for p in peeks:
            if isinstance(p, ProtocolError):
                self.fail(envelope, NIL, p)
                out.append(None)
            else:
                out.append(Incoming(envelope, p, peer))
        return out

    def reply(self, envelope: Envelope, payload: "bytes | memoryview") -> None:
        """Hold a reply for `flush`, which sends the turn's replies together."""
        held = self.outbox.get(envelope)
        if held is None:
            self.outbox[envelope] = [payload]
        else:
            held.append(payload)

    def flush(self, holding: "Container[bytes]") -> None:
        """End of a turn: send what the turn answered, back to back (ZeroMQ's I/O thread is woken
        once for a run of sends, not per reply). A connection that speaks arrays gets its replies
        in one frame, a MessagePack array of them built from their bytes (never decoded; a lone
        reply goes as its map); any other gets each reply alone, as in 1.1.
        `holding`: the connections that still have requests held; the others stop being array
        speakers here (they say so again with their next array), so the set stays small."""
        if not self.outbox:
            return
        arrays, send = self.arrays, self._send
        for envelope, payloads in self.outbox.items():
            if envelope.identity not in arrays:
                for payload in payloads:
                    send(envelope, payload)
                continue
            if len(payloads) == 1:
                send(envelope, payloads[0])
            else:
                start = 0
                while start < len(payloads):
                    end, size = start, 0
                    while end < len(payloads) and (end == start or size + len(payloads[end]) <= REPLY_FRAME_BYTES):
                        size += len(payloads[end])
                        end += 1
                    if end - start == 1:
                        send(envelope, payloads[start])
                    else:
                        send(envelope, _PACKER.pack_array_header(end - start) + b"".join(payloads[start:end]))
                    start = end
            if envelope.identity not in holding:
                arrays.discard(envelope.identity)
        self.outbox.clear()

    def _send(self, envelope: Envelope, payload: "bytes | memoryview") -> None:
        """Frame by frame, through pyzmq's Cython send with plain int flags (its Python wrapper
        and send_multipart cost more than the sends); a payload under ZeroMQ's copy threshold is
        copied into the message, a larger one leaves without a copy."""
        sock = self.sock
        try:
            _raw_send(sock, envelope.identity, _NOBLOCK_MORE)
            if envelope.delimited:
                _raw_send(sock, b"", _NOBLOCK_MORE)
            _raw_send(sock, payload, _NOBLOCK, len(payload) < _COPY_THRESHOLD)
        except zmq.ZMQError:  # the client is gone (a ROUTER drops what a full queue cannot take): never block the loop
            pass

    def fail(self, envelope: Envelope, raw_id: bytes, error: ProtocolError) -> None:
        """Answer `error`, the broker's one way to build an error reply: it echoes the id the error
        carries (what the frontend read of the request) or else `raw_id` (the caller's)."""
        self.reply(envelope, error_reply(raw_id if error.raw_id is None else error.raw_id, error.code, error.message))
