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

OPS = frozenset({"tokenize", "detokenize", "chat", "count", "models", "ping"})
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
    except (msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, ValueError) as e:
        raise ProtocolError("bad_request", f"payload is not one MessagePack value: {e}") from e
    except Exception as e:  # msgpack raises a few other types on truncated input
        raise ProtocolError("bad_request", f"payload is not valid MessagePack: {e}") from e


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


def peek_id(data: bytes) -> Any:
    """The request id, read without decoding the rest (values are skipped in C); nil if unreadable.

    Used where the payload is refused whole (too large, or malformed elsewhere), so that a
    pipelining client can still match the error to its request.
    """
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=max(len(data), 1))
    unpacker.feed(data)
    try:
        for _ in range(unpacker.read_map_header()):
            key = unpacker.unpack()
            if key == "id":
                value = unpacker.unpack()
                return None if isinstance(value, (list, dict)) else value
            unpacker.skip()
    except Exception:
        return None
    return None


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
    tokens_format = opt(payload, "tokens_format", str, "list")
    if tokens_format not in TOKENS_FORMATS:
        raise ProtocolError("bad_request", f"field 'tokens_format' must be \"list\" or \"u32\", got {tokens_format!r}")
    return Request(
        id=payload.get("id"),
        op=op,
        model=opt(payload, "model", str, None),
        deadline_ms=deadline_ms,
        affinity=opt(payload, "affinity", str, None),
        tokens_format=tokens_format,
        payload=payload,
    )


def error_reply(request_id: Any, code: str, message: str) -> bytes:
    return pack({"id": request_id, "ok": False, "error": {"code": code, "message": message}})


def ok_reply(request_id: Any, fields: dict) -> bytes:
    return pack({"id": request_id, "ok": True, **fields})


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
