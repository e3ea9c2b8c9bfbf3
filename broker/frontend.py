"""The client side of the broker: envelopes in, the few checks routing needs, replies out.

The broker reads only what it routes by: the common fields (`id`, `op`, `model`, `deadline_ms`,
`affinity`, `tokens_format`) and where the op's input lies in the payload, so a routing key can
hash its first bytes. Values are walked over in C (`Unpacker.skip`), never decoded, so a 32 MiB
text costs the loop a copy, not a decode; the worker validates the rest and answers
`bad_request` itself. The raw payload goes to the worker untouched.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgpack
import zmq

from tokenbroker.common.protocol import MAX_DEADLINE_MS, NIL, OPS, TOKENS_FORMATS, Envelope, error_reply, type_name

from .oversized import id_in_place

# Fields whose value a routing key reads (as raw MessagePack bytes), by op.
INPUT_FIELDS = frozenset({"text", "messages", "tools", "chat_template_kwargs", "body"})
_HEADER_FIELDS = frozenset({"op", "model", "deadline_ms", "affinity", "tokens_format"})
_ID_TYPES = (type(None), bool, int, float, str, bytes)


@dataclass(slots=True)
class Peek:
    """A request as the broker sees it: the common fields, checked, and where its inputs lie."""

    raw: bytes
    raw_id: bytes  # the id's MessagePack bytes as they came, echoed in the reply
    op: str
    model: str | None = None
    deadline_ms: int | None = None
    affinity: str | None = None
    spans: dict[str, tuple[int, int]] = field(default_factory=dict)  # input field -> (start, end) in raw

    def value(self, name: str) -> bytes | None:
        """The raw MessagePack bytes of an input field, or None when absent."""
        span = self.spans.get(name)
        return None if span is None else self.raw[span[0]:span[1]]


class Rejected(Exception):
    """A request answered at the frontend: the error and the id to echo."""

    def __init__(self, raw_id: bytes, code: str, message: str) -> None:
        super().__init__(message)
        self.raw_id, self.code, self.message = raw_id, code, message


def peek_request(raw: bytes) -> Peek:
    """Check the common fields of a payload; raise Rejected with the protocol's code otherwise.

    >>> p = peek_request(msgpack.packb({"op": "tokenize", "text": "hi", "id": 5}))
    >>> p.op, p.raw_id, p.value("text")
    ('tokenize', b'\\x05', b'\\xa2hi')
    """
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=max(len(raw), 1))
    unpacker.feed(raw)
    raw_id = NIL
    fields: dict[str, object] = {}
    spans: dict[str, tuple[int, int]] = {}
    try:
        try:
            size = unpacker.read_map_header()
        except Exception:
            raise Rejected(NIL, "bad_request", f"payload must be a map, got {_first_type(raw)}") from None
        for _ in range(size):
            key = unpacker.unpack()
            if not isinstance(key, str):
                raise Rejected(raw_id, "bad_request", f"payload map keys must be str, got {type_name(key)}")
            start = unpacker.tell()
            if key == "id":
                unpacker.skip()
                raw_id = raw[start:unpacker.tell()]
                value = msgpack.unpackb(raw_id, raw=False) if raw_id[0] not in _CONTAINERS else []
                if type(value) not in _ID_TYPES:
                    raw_id = NIL
                    raise Rejected(NIL, "bad_request",
                                   f"field 'id' must be nil, bool, int, float, str or bin, got {type_name(value)}")
            elif key in _HEADER_FIELDS:
                fields[key] = unpacker.unpack()
            else:
                unpacker.skip()
                if key in INPUT_FIELDS:
                    spans[key] = (start, unpacker.tell())
        if unpacker.tell() != len(raw):
            raise Rejected(raw_id, "bad_request", "payload holds more than one MessagePack value: send one map")
    except Rejected:
        raise
    except UnicodeDecodeError as e:
        raise Rejected(raw_id, "bad_request", f"payload holds a str that is not valid UTF-8: {e.reason}") from None
    except Exception as e:  # truncated, not MessagePack, nested too deep, ...
        detail = str(e) or type(e).__name__
        raise Rejected(raw_id, "bad_request", f"payload is not valid MessagePack ({len(raw)} bytes{_starting(raw)}): {detail}") from None
    return _checked(raw, raw_id, fields, spans)


_NOBLOCK = int(zmq.NOBLOCK)
_NOBLOCK_MORE = int(zmq.NOBLOCK | zmq.SNDMORE)
_CONTAINERS = frozenset(range(0x80, 0xA0)) | {0xDC, 0xDD, 0xDE, 0xDF}


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


def _checked(raw: bytes, raw_id: bytes, fields: dict[str, object], spans: dict[str, tuple[int, int]]) -> Peek:
    def opt(name: str, kind: type) -> object:
        value = fields.get(name)
        if value is not None and type(value) is not kind:
            raise Rejected(raw_id, "bad_request", f"field '{name}' must be {type_name(kind())}, got {type_name(value)}")
        return value

    op = opt("op", str)
    if op is None:
        raise Rejected(raw_id, "bad_request", "field 'op' is required")
    if op not in OPS:
        raise Rejected(raw_id, "unknown_op", f"field 'op' is {op!r}; expected one of {', '.join(sorted(OPS))}")
    deadline_ms = opt("deadline_ms", int)
    if deadline_ms is not None:
        if deadline_ms <= 0:
            raise Rejected(raw_id, "bad_request", f"field 'deadline_ms' must be an int > 0, got {deadline_ms}")
        deadline_ms = min(deadline_ms, MAX_DEADLINE_MS)
    tokens_format = opt("tokens_format", str)
    if tokens_format is not None and tokens_format not in TOKENS_FORMATS:
        raise Rejected(raw_id, "bad_request", f"field 'tokens_format' must be \"list\" or \"u32\", got {tokens_format!r}")
    return Peek(raw, raw_id, op, opt("model", str), deadline_ms, opt("affinity", str), spans)  # type: ignore[arg-type]


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
                return frame.get(name)
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

    def receive(self) -> Incoming | None:
        """One message: a checked request, or None when it was answered here with an error.

        Raises zmq.Again when nothing is waiting.
        """
        sock = self.sock
        frames: list = [sock.recv(_NOBLOCK)]
        peer = oversized = None
        while sock.rcvmore:  # the frames of one message are all there once its first is
            # Not copied yet: a frame over the limit is answered from ZeroMQ's own buffer, then freed.
            frame = sock.recv(_NOBLOCK, copy=False)
            if self.tell_peer:
                peer = Peer.of(frame)
            if len(frame) > self.max_request_bytes:
                oversized = frame
                frames.append(b"\x00")  # a placeholder for split_envelope: the frame is never copied
            else:
                frames.append(frame.bytes)
        try:
            envelope, raw = split_envelope(frames)
        except _Malformed as e:
            self.fail(e.envelope, NIL, "bad_request",
                      f"a message is an optional empty delimiter then one payload frame; got {e.count} frames")
            return None
        if oversized is not None:
            self.fail(envelope, id_in_place(oversized.buffer), "too_large", f"payload is {len(oversized)} bytes; "
                      f"this broker takes at most {self.max_request_bytes} (--max-request-bytes)")
            return None
        try:
            return Incoming(envelope, peek_request(raw), peer)
        except Rejected as e:
            self.fail(envelope, e.raw_id, e.code, e.message)
            return None

    def reply(self, envelope: Envelope, payload: bytes) -> None:
        """Frame by frame with plain int flags: pyzmq's send_multipart costs more than the sends."""
        send = self.sock.send
        try:
            send(envelope.identity, _NOBLOCK_MORE)
            if envelope.delimited:
                send(b"", _NOBLOCK_MORE)
            send(payload, _NOBLOCK)
        except zmq.ZMQError:  # the client is gone (a ROUTER drops what a full queue cannot take): never block the loop
            pass

    def fail(self, envelope: Envelope, raw_request_id: bytes, code: str, message: str) -> None:
        self.reply(envelope, error_reply(raw_request_id, code, message))
