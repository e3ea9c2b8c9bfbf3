"""The wire protocol: client payloads (docs/protocol.md) and the broker<->worker frames.

Everything that both sides must agree on lives here as named constants and small typed
functions; `from_wire()`-style parsers validate and name the offending field.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import msgpack

from .errors import ProtocolError

PROTOCOL_VERSION = 1

OPS = frozenset({"tokenize", "detokenize", "chat", "count", "models", "ping", "detokenize_stream"})
TOKENS_FORMATS = frozenset({"list", "u32"})

# --- broker <-> worker (backend) ---------------------------------------------------------
# worker -> broker: [kind, body...]; broker -> worker: [kind, body...]. Any frame is proof of life.
W_READY = b"R"  # [R, msgpack(Ready)]
W_HEARTBEAT = b"H"  # [H, msgpack(stats)]
W_RESULT = b"D"  # [D, job_id(8 bytes), reply payload (msgpack, sent to the client as is), outcome code or b""]
W_BYE = b"B"  # [B]: the worker leaves on purpose (SIGTERM); its held jobs are requeued
B_JOB = b"J"  # [J, job_id, msgpack({"budget_ms": int}), client payload]
B_HEARTBEAT = b"h"  # [h]

HEARTBEAT_INTERVAL_S = 1.0
HEARTBEAT_LIVENESS = 5  # a worker silent for interval * liveness is gone

JOB_ID = struct.Struct("<Q")

# Deadlines beyond this (about 24.8 days) are taken as this: any int > 0 is valid on the wire.
MAX_DEADLINE_MS = 2**31 - 1

# Set by the supervisor for local workers: the broker's pid, so a worker whose broker died leaves.
PARENT_PID_ENV = "TOKENBROKER_PARENT_PID"

# Worker process exit code when its tokenizers cannot be loaded: not a crash, never respawned.
EXIT_BOOT_ERROR = 3


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: bytes) -> Any:
    """Decode MessagePack with str kept apart from bin; invalid UTF-8 in a str is a bad_request."""
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=False)
    except UnicodeDecodeError as e:
        raise ProtocolError("bad_request", f"payload holds a str that is not valid UTF-8: {e.reason}") from e
    except msgpack.ExtraData as e:
        raise ProtocolError("bad_request", "payload holds more than one MessagePack value: send one map") from e
    except Exception as e:  # FormatError, StackError, ValueError on truncated input, ...
        start = f"starting 0x{data[:1].hex()}" if data else "empty"
        detail = str(e) or f"byte 0x{data[:1].hex()} begins no MessagePack value"
        raise ProtocolError("bad_request", f"payload is not valid MessagePack ({len(data)} bytes, {start}): {detail}") from e


# --- typed field access ------------------------------------------------------------------

_TYPE_NAMES = {bool: "bool", int: "int", float: "float", str: "str", bytes: "bin", list: "list", dict: "map"}


def type_name(value: Any) -> str:
    if value is None:
        return "nil"
    return _TYPE_NAMES.get(type(value), type(value).__name__)


def _is(value: Any, kind: type) -> bool:
    # MessagePack's own types: a bool is not an int, an int is not a bool.
    if kind is int:
        return type(value) is int
    return isinstance(value, kind) and not (kind is not bool and type(value) is bool)


def opt(payload: dict, name: str, kind: type | tuple[type, ...], default: Any) -> Any:
    """An optional field: nil or absent takes the default; a wrong type names the field."""
    value = payload.get(name)
    if value is None:
        return default
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not any(_is(value, k) for k in kinds):
        want = " or ".join(_TYPE_NAMES[k] for k in kinds)
        raise ProtocolError("bad_request", f"field '{name}' must be {want}, got {type_name(value)}")
    return value


def req(payload: dict, name: str, kind: type | tuple[type, ...]) -> Any:
    """A required field: absent or nil is missing."""
    if payload.get(name) is None:
        raise ProtocolError("bad_request", f"field '{name}' is required")
    return opt(payload, name, kind, None)


# --- client requests ---------------------------------------------------------------------


@dataclass(frozen=True)
class Envelope:
    """How a client message arrived: the routing id and whether it carried the empty delimiter."""

    identity: bytes
    delimited: bool

    def frames(self, payload: bytes) -> list[bytes]:
        return [self.identity, b"", payload] if self.delimited else [self.identity, payload]


NIL = b"\xc0"  # MessagePack nil


@dataclass(frozen=True)
class Request:
    """The common fields of a client request, validated; `payload` keeps the whole map."""

    id: Any
    op: str
    model: str | None
    deadline_ms: int | None
    affinity: str | None
    tokens_format: str
    payload: dict
    raw_id: bytes = NIL  # the id's MessagePack bytes as they came, for the reply


_CONTAINER_TYPES = frozenset(range(0x80, 0xA0)) | {0xDC, 0xDD, 0xDE, 0xDF}  # fixmap, fixarray, array/map 16/32


def raw_id(data: bytes) -> bytes:
    """The `id` value's own MessagePack bytes, to echo untouched (a float32 stays a float32).

    Nil when absent, unreadable, a list or a map. Other values are skipped in C, not decoded.
    """
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=max(len(data), 1))
    unpacker.feed(data)
    try:
        for _ in range(unpacker.read_map_header()):
            if unpacker.unpack() != "id":
                unpacker.skip()
                continue
            start = unpacker.tell()
            unpacker.skip()
            value = data[start:unpacker.tell()]
            if value[0] in _CONTAINER_TYPES:
                return NIL
            msgpack.unpackb(value, raw=False)  # a str id must be valid UTF-8 to be echoed
            return value
    except Exception:
        return NIL
    return NIL


def parse_request(data: bytes) -> Request:
    payload = unpack(data)
    if not isinstance(payload, dict):
        raise ProtocolError("bad_request", f"payload must be a map, got {type_name(payload)}")
    if any(not isinstance(k, str) for k in payload):
        raise ProtocolError("bad_request", "payload map keys must be str")
    if isinstance(payload.get("id"), (list, dict)):
        raise ProtocolError("bad_request", f"field 'id' must be nil, bool, int, float, str or bin, got {type_name(payload['id'])}")
    op = req(payload, "op", str)
    if op not in OPS:
        raise ProtocolError("unknown_op", f"field 'op' is {op!r}; expected one of {', '.join(sorted(OPS))}")
    deadline_ms = opt(payload, "deadline_ms", int, None)
    if deadline_ms is not None and deadline_ms <= 0:
        raise ProtocolError("bad_request", f"field 'deadline_ms' must be an int > 0, got {deadline_ms}")
    if deadline_ms is not None:
        deadline_ms = min(deadline_ms, MAX_DEADLINE_MS)
    tokens_format = opt(payload, "tokens_format", str, "list")
    if tokens_format not in TOKENS_FORMATS:
        raise ProtocolError("bad_request", f"field 'tokens_format' must be \"list\" or \"u32\", got {tokens_format!r}")
    return Request(
        id=payload.get("id"),
        raw_id=raw_id(data),
        op=op,
        model=opt(payload, "model", str, None),
        deadline_ms=deadline_ms,
        affinity=opt(payload, "affinity", str, None),
        tokens_format=tokens_format,
        payload=payload,
    )


def reply(raw_request_id: bytes, fields: dict) -> bytes:
    """A reply map: `id` with the request's id bytes as they came, then `fields`."""
    packer = msgpack.Packer(use_bin_type=True)
    parts = [packer.pack_map_header(len(fields) + 1), packer.pack("id"), raw_request_id]
    for key, value in fields.items():
        parts.append(packer.pack(key))
        parts.append(packer.pack(value))
    return b"".join(parts)


def error_reply(raw_request_id: bytes, code: str, message: str) -> bytes:
    return reply(raw_request_id, {"ok": False, "error": {"code": code, "message": message}})


def ok_reply(raw_request_id: bytes, fields: dict) -> bytes:
    return reply(raw_request_id, {"ok": True, **fields})


# --- worker handshake --------------------------------------------------------------------


@dataclass(frozen=True)
class Ready:
    """What a worker says once its tokenizers are loaded."""

    version: int
    capacity: int
    name: str
    pid: int
    host: str
    models: list[str]

    def to_wire(self) -> bytes:
        return pack(self.__dict__)

    @classmethod
    def from_wire(cls, data: bytes) -> "Ready":
        d = unpack(data)
        return cls(
            version=int(d["version"]),
            capacity=int(d["capacity"]),
            name=str(d["name"]),
            pid=int(d["pid"]),
            host=str(d["host"]),
            models=list(d.get("models", [])),
        )
