"""The wire protocol: client payloads (docs/protocol.md) and the broker<->worker frames.

Everything that both sides must agree on lives here as named constants and small typed
functions; `from_wire()`-style parsers validate and name the offending field.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeGuard, TypeVar

import msgpack

from ._wire import JOB_FIELDS, JOB_RECORD_BYTES, RESULT_FIELDS, RESULT_RECORD_BYTES, id_problem
from .errors import ERROR_CODES, ProtocolError

PROTOCOL_VERSION = 2  # of the broker<->worker frames: 2 carries a batch's payloads in one frame

# The ops (docs/protocol.md "Ops"): the one list, and what each group of them means to the broker.
# broker/_peek.pyx interns its names from here; broker/loop.py and the cores read the groups.
OPS = frozenset({"tokenize", "detokenize", "chat", "count", "models", "ping", "detokenize_stream",
                 "add_model", "remove_model"})
ADMIN_OPS = frozenset({"add_model", "remove_model"})  # allowed as docs/protocol.md "The model catalog" says
CATALOG_OPS = frozenset({"models", *ADMIN_OPS})  # answered by the broker from its catalog
MODEL_OPS = frozenset({"tokenize", "detokenize", "chat", "detokenize_stream"})  # `model` names a served model
KEYED_OPS = frozenset({"tokenize", "chat", "count"})  # the broker hashes their input into a route key
TOKENS_FORMATS = frozenset({"list", "u32"})

# --- broker <-> worker (backend) ---------------------------------------------------------
# worker -> broker: [kind, body...]; broker -> worker: [kind, body...]. Any frame is proof of life.
# Jobs travel in batches: one message carries up to a batch of client payloads for one worker, and
# one message carries back the replies of the jobs the worker finished together. The headers are
# fixed-size binary records, so neither side builds a Python object per job to frame it.
W_READY = b"R"  # [R, msgpack(Ready)]
W_HEARTBEAT = b"H"  # [H, msgpack(stats)]
W_RESULTS = b"D"  # [D, RESULT * n, the n reply payloads concatenated]: replies go to the clients as they are
W_BYE = b"B"  # [B]: the worker leaves on purpose (SIGTERM); it finishes what it holds, takes nothing new
B_JOBS = b"J"  # [J, JOB * n, the n client payloads concatenated]
B_HEARTBEAT = b"h"  # [h]
B_RESET = b"r"  # [r]: "I do not know you" (the broker forgot a silent worker): say READY again
# The model catalog (1.1): the broker decides which worker holds which model; a worker loads in
# the background (never on the thread that serves jobs) and says how it went.
B_LOAD = b"l"  # [l, msgpack(LoadSpec)]: load this model, then send LOADED
B_UNLOAD = b"u"  # [u, model name as UTF-8]: let this model go (the broker sends it no more of its jobs)
W_LOADED = b"L"  # [L, msgpack(Loaded)]: a load finished, or failed

HEARTBEAT_INTERVAL_S = 1.0
HEARTBEAT_LIVENESS = 5  # a worker silent for interval * liveness is gone

def _record(fields: tuple[tuple[int, int], ...], size: int) -> struct.Struct:
    """A batch record's struct, from its layout as common/_wire.pxd states it (offset, bytes)."""
    codes = {1: "B", 4: "I", 8: "Q"}
    assert [at for at, _ in fields] == [sum(n for _, n in fields[:i]) for i in range(len(fields))], fields
    record = struct.Struct("<" + "".join(codes[n] for _, n in fields))
    assert record.size == size, (fields, size)
    return record


JOB = _record(JOB_FIELDS, JOB_RECORD_BYTES)  # job id, budget in ms (the time left of the request's deadline), payload bytes
RESULT = _record(RESULT_FIELDS, RESULT_RECORD_BYTES)  # job id, outcome (an index into OUTCOMES), reply bytes

# What a worker says of each job, so the broker counts outcomes without decoding replies. A
# worker's byte is an index here; anything else reads as "internal", so no peer can invent labels.
OUTCOMES: tuple[str, ...] = ("ok", "skipped", *ERROR_CODES)
OUTCOME_INDEX = {name: i for i, name in enumerate(OUTCOMES)}
SKIPPED = "skipped"  # the worker did not run the job: its budget had passed (the broker answers timeout)

# A `count` payload longer than this is counted on a worker's encode lane (workers/count_lane.py), and
# the broker lets a worker hold one such job at a time, outside its --worker-max-bytes (broker/_dispatch.pyx).
LANE_COUNT_BYTES = 16 * 1024

MAX_BATCH_JOBS = 64  # jobs in one backend message, at most
MAX_CAPACITY = 4096  # the most jobs a worker may ask to hold; a READY beyond it is refused
MAX_NAME_CHARS = 128  # a worker's name, as shown in replies and metric labels

# Deadlines beyond this (about 24.8 days) are taken as this: any int > 0 is valid on the wire.
MAX_DEADLINE_MS = 2**31 - 1


def pack_jobs(jobs: "list[tuple[int, int, bytes | memoryview]]") -> "list[bytes | memoryview]":
    """A B_JOBS message for (job id, budget ms, payload) triples: three frames however many jobs
    (a frame costs a send and a receive on each side; bytes are cheap to join). A lone payload is
    its own frame, so a large one goes without being copied.

    >>> frames = pack_jobs([(7, 100, b"a"), (8, 200, b"bc")])
    >>> len(frames), unpack_jobs(frames[1:])
    (3, [(7, 100, b'a'), (8, 200, b'bc')])
    """
    header = b"".join([JOB.pack(job_id, budget, len(payload)) for job_id, budget, payload in jobs])
    blob = jobs[0][2] if len(jobs) == 1 else b"".join([payload for _, _, payload in jobs])
    return [B_JOBS, header, blob]


def unpack_jobs(body: list[bytes]) -> list[tuple[int, int, bytes]]:
    """The jobs of a B_JOBS body; ValueError when the header and the payloads disagree."""
    records = _records(body, JOB, "job")
    blob = body[1]
    if len(records) == 1:
        job_id, budget, _ = records[0]
        return [(job_id, budget, blob)]
    out, at = [], 0
    for job_id, budget, size in records:
        out.append((job_id, budget, blob[at:at + size]))
        at += size
    return out


def pack_results(results: list[tuple[bytes, str, bytes]]) -> list[bytes]:
    """A W_RESULTS message for (job id as received, outcome, reply payload) triples: three frames."""
    index, internal = OUTCOME_INDEX, OUTCOME_INDEX["internal"]
    header = b"".join([RESULT.pack(job_id, index.get(outcome, internal), len(payload)) for job_id, outcome, payload in results])
    blob = results[0][2] if len(results) == 1 else b"".join([payload for _, _, payload in results])
    return [W_RESULTS, header, blob]


def unpack_results(body: list[bytes]) -> "list[tuple[int, str, memoryview]]":
    """The results of a W_RESULTS body, each reply a view of the frame (the broker forwards replies
    without copying them); ValueError when it is malformed. Unknown outcomes read "internal".

    >>> [(i, o, bytes(p)) for i, o, p in unpack_results(pack_results([(3, "ok", b"r"), (4, "nonsense", b"s")])[1:])]
    [(3, 'ok', b'r'), (4, 'internal', b's')]
    """
    records = _records(body, RESULT, "result")
    view = memoryview(body[1])
    out, at, n = [], 0, len(OUTCOMES)
    for job_id, code, size in records:
        out.append((job_id, OUTCOMES[code] if code < n else "internal", view[at:at + size]))
        at += size
    return out


def _records(body: list[bytes], record: struct.Struct, what: str) -> list[tuple]:
    """The fixed-size records of a batch header, checked against the payload bytes that follow."""
    if len(body) != 2:
        raise ValueError(f"a {what} batch must be a header and one payload frame, got {len(body)} frames")
    header, blob = body
    if not header or len(header) % record.size:
        raise ValueError(f"a {what} batch header of {len(header)} bytes is not a whole number of {record.size}-byte records")
    records = list(record.iter_unpack(header))
    if sum(r[-1] for r in records) != len(blob):
        raise ValueError(f"a {what} batch's records count {sum(r[-1] for r in records)} payload bytes, its frame has {len(blob)}")
    return records


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: "bytes | memoryview") -> Any:
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


_T = TypeVar("_T")


def _is(value: Any, kind: type[_T]) -> TypeGuard[_T]:
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


class Envelope(NamedTuple):
    """How a client message arrived: the routing id and whether it carried the empty delimiter.
    (A NamedTuple: one is built per client message, and it keys the frontend's reply outbox.)"""

    identity: bytes
    delimited: bool


NIL = b"\xc0"  # MessagePack nil


class CommonFields(NamedTuple):
    """The fields every request shares, checked: what the broker routes by and the worker reads
    (a NamedTuple: one is built per request on both sides, cheaper than a dataclass)."""

    op: str
    model: str | None
    deadline_ms: int | None
    affinity: str | None
    tokens_format: str


def common_fields(fields: dict) -> CommonFields:
    """Check the common fields of a request (docs/protocol.md "Request fields common to every op").

    The one check both sides run: the broker on the fields it peeked, the worker on the map it
    decoded. ProtocolError names the field.

    >>> common_fields({"op": "tokenize", "deadline_ms": 2**40}).deadline_ms == MAX_DEADLINE_MS
    True
    """
    op = fields.get("op")
    if op is None:
        raise ProtocolError("bad_request", "field 'op' is required")
    if type(op) is not str:
        raise ProtocolError("bad_request", f"field 'op' must be str, got {type_name(op)}")
    if op not in OPS:
        raise ProtocolError("unknown_op", f"field 'op' is {op!r}; expected one of {', '.join(sorted(OPS))}")
    deadline_ms = fields.get("deadline_ms")
    if deadline_ms is not None:
        if type(deadline_ms) is not int:
            raise ProtocolError("bad_request", f"field 'deadline_ms' must be int, got {type_name(deadline_ms)}")
        if deadline_ms <= 0:
            raise ProtocolError("bad_request", f"field 'deadline_ms' must be an int > 0, got {deadline_ms}")
        deadline_ms = min(deadline_ms, MAX_DEADLINE_MS)
    tokens_format = fields.get("tokens_format")
    if tokens_format is None:
        tokens_format = "list"
    elif type(tokens_format) is not str:
        raise ProtocolError("bad_request", f"field 'tokens_format' must be str, got {type_name(tokens_format)}")
    elif tokens_format not in TOKENS_FORMATS:
        raise ProtocolError("bad_request", f"field 'tokens_format' must be \"list\" or \"u32\", got {tokens_format!r}")
    model, affinity = fields.get("model"), fields.get("affinity")
    if model is not None and type(model) is not str:
        raise ProtocolError("bad_request", f"field 'model' must be str, got {type_name(model)}")
    if affinity is not None and type(affinity) is not str:
        raise ProtocolError("bad_request", f"field 'affinity' must be str, got {type_name(affinity)}")
    return CommonFields(op, model, deadline_ms, affinity, tokens_format)


@dataclass(frozen=True)
class Request:
    """The common fields of a client request, validated; `payload` keeps the whole map (its `id`
    too: replies echo `raw_id`, the id's bytes as they came)."""

    op: str
    model: str | None
    deadline_ms: int | None
    affinity: str | None
    tokens_format: str
    payload: dict
    raw_id: bytes = NIL  # the id's MessagePack bytes as they came, for the reply


def raw_id(data: bytes) -> bytes:
    """The `id` value's own MessagePack bytes, to echo untouched (a float32 stays a float32).

    Nil when absent, unreadable, a list or a map. Other values are skipped in C, not decoded.
    """
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=max(len(data), 1))
    unpacker.feed(data)
    try:
        start = seek_key(unpacker, "id")
        if start is None:
            return NIL
        unpacker.skip()
        value = data[start:unpacker.tell()]
        return NIL if id_problem(value) is not None else value
    except Exception:
        return NIL


def seek_key(unpacker: msgpack.Unpacker, key: str) -> int | None:
    """Read the map header at the unpacker's position and its entries up to `key`: where `key`'s
    value starts (the unpacker is left there), or None when the map has no such key. The values
    before it are skipped in C, never decoded. Raises what the unpacker raises on a broken map."""
    for _ in range(unpacker.read_map_header()):
        if unpacker.unpack() == key:
            return unpacker.tell()
        unpacker.skip()
    return None


def parse_request(data: bytes) -> Request:
    """A client payload as the worker serves it: decoded once (in C), the common fields checked
    by `common_fields`, the id's bytes found without walking the payload again (`_echo_id`)."""
    payload = unpack(data)
    if not isinstance(payload, dict):
        raise ProtocolError("bad_request", f"payload must be a map, got {type_name(payload)}")
    for k in payload:
        if type(k) is not str:
            raise ProtocolError("bad_request", "payload map keys must be str")
    if len(payload) != map_length(data):  # the decoder kept one value per key: a key came twice (1.4)
        raise repeated_key(first_repeated_key(data))
    rid = payload.get("id")
    packed = None if rid is None else _ID_PACKER.pack(rid)
    problem = None if packed is None else id_problem(packed)  # the rule common/_wire.pxd states
    if problem is not None:
        raise ProtocolError("bad_request", problem)
    common = common_fields(payload)
    return Request(raw_id=_echo_id(data, packed), op=common.op, model=common.model,
                   deadline_ms=common.deadline_ms, affinity=common.affinity, tokens_format=common.tokens_format,
                   payload=payload)


def map_length(data: bytes) -> int:
    """The entry count in the header of the MessagePack map `data` starts with (-1 for no map
    header): what a decoded dict holds fewer entries than when a key came twice.

    >>> map_length(pack({"op": "ping", "id": 1})), map_length(b"\\xde\\x01\\x00"), map_length(b"\\x90")
    (2, 256, -1)
    """
    head = data[0] if data else 0
    if 0x80 <= head <= 0x8F:
        return head & 0x0F
    if head in (0xDE, 0xDF):
        return int.from_bytes(data[1:3 if head == 0xDE else 5], "big")
    return -1


def first_repeated_key(data: bytes) -> str:
    """The first key the map `data` holds a second time, read key by key (values skipped in C);
    only called once a decode has shown a repeat (`map_length`)."""
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=max(len(data), 1))
    unpacker.feed(data)
    seen: set[str] = set()
    for _ in range(unpacker.read_map_header()):
        key = unpacker.unpack()
        if key in seen:
            return key
        seen.add(key)
        unpacker.skip()
    raise ValueError("the map holds no key twice")


MAX_KEY_SHOWN = 200  # bytes of a repeated key named in its bad_request (client data)


def repeated_key(key: str) -> ProtocolError:
    """The bad_request of a request map that holds `key` twice (1.4, "Bounds on a request"), in the
    same words at the broker (broker/_peek.pyx `_twice` calls it) and the worker, so a client reads
    the same answer from whichever side found it.

    >>> repeated_key("text").message
    "payload map holds the key 'text' twice; a request names each field once"
    """
    shown = key.encode()[:MAX_KEY_SHOWN].decode("utf-8", "replace")
    return ProtocolError("bad_request", f"payload map holds the key {shown!r} twice; a request names each field once")


_ID_PACKER = msgpack.Packer(use_bin_type=True)  # packb makes a Packer per call (~1 us); pack() holds the GIL throughout


def _echo_id(data: bytes, packed: bytes | None) -> bytes:
    """The id's bytes as the client sent them, from `packed`, the decoded id packed again (None for
    no id). Clients encode an id in its shortest form (every MessagePack library does), so that gives
    those bytes: checked by finding `"id"` followed by them in the payload (a C scan). When they are
    not there (a float32, a wider int than needed), the payload is walked for them (`raw_id`)."""
    if packed is None:
        return NIL
    key = b"\xa2id" + packed
    # `id` first or last (what clients do) is checked at once; a scan of the payload otherwise.
    return key[3:] if data.endswith(key) or data.startswith(key, 1) or key in data else raw_id(data)


LOGGED_ID_BYTES = 64  # a request id in a log line is cut to this many bytes


def logged_id(raw_id: bytes) -> str:
    """A request id for a log line: its MessagePack bytes in hex, cut short (ids are client data).

    >>> logged_id(b"\\x05"), logged_id(b"x" * 100)[-13:]
    ('05', '...(100 bytes)')
    """
    head = raw_id[:LOGGED_ID_BYTES].hex()
    return head + (f"...({len(raw_id)} bytes)" if len(raw_id) > LOGGED_ID_BYTES else "")


def reply(raw_request_id: bytes, fields: dict) -> bytes:
    """A reply map: `id` with the request's id bytes as they came, then `fields`."""
    packer = msgpack.Packer(use_bin_type=True)
    parts = [packer.pack_map_header(len(fields) + 1), packer.pack("id"), raw_request_id]
    for key, value in fields.items():
        parts.append(packer.pack(key))
        parts.append(packer.pack(value))
    return b"".join(parts)


def error_reply(raw_request_id: bytes, code: str, message: str) -> bytes:
    """The error reply map; built in one place per side (the broker's Frontend.fail, workers/ops.py)."""
    return reply(raw_request_id, {"ok": False, "error": {"code": code, "message": message}})


def ok_reply(raw_request_id: bytes, fields: dict) -> bytes:
    return reply(raw_request_id, {"ok": True, **fields})


# --- worker handshake --------------------------------------------------------------------


@dataclass(frozen=True)
class Ready:
    """What a worker says once its tokenizers are loaded. Untrusted: `from_wire` checks every field."""

    version: int
    capacity: int
    name: str
    pid: int
    host: str
    models: list[str]
    incarnation: str = ""  # random per worker process: a reconnect of the same process keeps it
    fingerprints: dict[str, str] = field(default_factory=dict)  # model name -> its fingerprint (admission)
    names: list[str] = field(default_factory=list)  # every model name and alias it answers to (routing)
    maps: list[str] = field(default_factory=list)  # its --tokenizer-map globs (only `*`, anchored)
    infos: dict[str, dict] = field(default_factory=dict)  # model name -> ModelInfo.to_wire() of each loaded model
    engine_limit: int = 0  # distinct fast engines one serving thread holds (measured; 0: no fast engine)

    def to_wire(self) -> bytes:
        return pack(self.__dict__)

    @classmethod
    def from_wire(cls, data: bytes) -> "Ready":
        """ValueError naming the field when anything is missing, mistyped or out of range."""
        d = msgpack.unpackb(data, raw=False, strict_map_key=False)
        if not isinstance(d, dict):
            raise ValueError(f"READY must be a map, got {type_name(d)}")

        def field(name: str, kind: type, check: Any = lambda v: True, why: str = "") -> Any:
            value = d.get(name)
            if not _is(value, kind) or not check(value):
                raise ValueError(f"READY field {name!r} must be {_TYPE_NAMES[kind]}{why}, got {value!r:.80}")
            return value

        return cls(
            version=field("version", int),
            capacity=field("capacity", int, lambda v: 1 <= v <= MAX_CAPACITY, f" in 1..{MAX_CAPACITY}"),
            name=field("name", str, lambda v: 0 < len(v) <= MAX_NAME_CHARS and v.isprintable(),
                       f" of 1..{MAX_NAME_CHARS} printable characters"),
            pid=field("pid", int, lambda v: 0 <= v < 2**63),
            host=field("host", str, lambda v: len(v) <= 255 and v.isprintable(), " of at most 255 printable characters"),
            models=_names(d, "models", required=True),
            incarnation=field("incarnation", str, lambda v: len(v) <= 64, " of at most 64 characters")
            if d.get("incarnation") is not None else "",
            fingerprints=dict(field("fingerprints", dict, lambda v: len(v) <= 4096 and all(
                isinstance(k, str) and isinstance(x, str) and len(x) <= 128 for k, x in v.items()),
                " of model names to fingerprints")) if d.get("fingerprints") is not None else {},
            names=_names(d, "names"),
            maps=_names(d, "maps"),
            infos=_infos(d.get("infos")),
            engine_limit=field("engine_limit", int, lambda v: 0 <= v <= 4096, " in 0..4096")
            if d.get("engine_limit") is not None else 0,
        )


def _infos(value: Any) -> dict[str, dict]:
    """READY's `infos`: model name -> a checked ModelInfo map (ValueError naming the field)."""
    if value is None:
        return {}
    if not isinstance(value, dict) or len(value) > 4096 or not all(isinstance(k, str) for k in value):
        raise ValueError(f"READY field 'infos' must be a map of model names to maps, got {value!r:.80}")
    return {name: ModelInfo.from_wire(info).to_wire() for name, info in value.items()}


def _names(d: dict, name: str, *, required: bool = False) -> list[str]:
    """A READY list of model names or globs, checked (ValueError naming the field)."""
    value = d.get(name)
    if value is None and not required:
        return []
    if not isinstance(value, list) or len(value) > 4096 or not all(isinstance(v, str) and 0 < len(v) <= 1024 for v in value):
        raise ValueError(f"READY field {name!r} must be a list of at most 4096 non-empty str, got {value!r:.80}")
    return list(value)


def glob_pattern(glob: str) -> "re.Pattern[str]":
    """`--tokenizer-map` glob semantics, shared by the worker (which resolves names) and the broker
    (which routes by them): anchored, `*` matches any run of characters, nothing else is special.

    >>> bool(glob_pattern("gpt-4o*").fullmatch("gpt-4o-mini")), bool(glob_pattern("gpt-4o*").fullmatch("xgpt-4o"))
    (True, False)
    """
    return re.compile(".*".join(re.escape(part) for part in glob.split("*")), re.DOTALL)


# --- the model catalog (1.1) -------------------------------------------------------------

MAX_SPECIAL_TOKENS = 1 << 16  # special tokens a worker may list for one model
MAX_TEXT_FIELD = 1 << 20  # a chat template's text, an error message, at most


def _checked_str(d: dict, name: str, what: str, *, limit: int = 1024, optional: bool = False) -> Any:
    value = d.get(name)
    if value is None and optional:
        return None
    if not isinstance(value, str) or len(value) > limit:
        raise ValueError(f"{what} field {name!r} must be str of at most {limit} characters, got {value!r:.80}")
    return value


@dataclass(frozen=True)
class ModelInfo:
    """What a worker tells of a loaded model, for the catalog's `models` reply (the broker never
    loads a tokenizer). Untrusted: `from_wire` checks every field."""

    kind: str
    vocab_size: int
    special_tokens: list[str]
    chat_template: bool
    cached: bool
    source: str = ""
    bos_token: str | None = None  # (1.2) these four: the model's own files, workers/registry.py model_facts
    eos_token: str | None = None
    model_max_length: int | None = None
    added_tokens: int = 0
    backend: str = ""  # the library that encodes it when this was sent: fastokens, tokenizers, tiktoken
    chat_renderer: str = ""  # the engine that renders its chat template: minijinja, jinja2 ("" without one)
    tokenizer: str = ""  # its tokenizer's fingerprint: models that share it share one engine (placement counts these)

    def to_wire(self) -> dict:
        return dict(self.__dict__)

    @classmethod
    def from_wire(cls, d: Any) -> "ModelInfo":
        """
        >>> ModelInfo.from_wire({"kind": "bpe", "vocab_size": 5, "special_tokens": ["<s>"],
        ...                      "chat_template": True, "cached": False}).vocab_size
        5
        """
        if not isinstance(d, dict):
            raise ValueError(f"a model info must be a map, got {type_name(d)}")
        specials = d.get("special_tokens")
        if not isinstance(specials, list) or len(specials) > MAX_SPECIAL_TOKENS or not all(
                isinstance(t, str) and len(t) <= 1024 for t in specials):
            raise ValueError(f"model info field 'special_tokens' must be a list of at most {MAX_SPECIAL_TOKENS} str")
        vocab = d.get("vocab_size")
        if not _is(vocab, int) or not 0 <= vocab < 2**32:
            raise ValueError(f"model info field 'vocab_size' must be an int in 0..2**32-1, got {vocab!r:.40}")
        for name in ("chat_template", "cached"):
            if not _is(d.get(name), bool):
                raise ValueError(f"model info field {name!r} must be bool, got {d.get(name)!r:.40}")
        max_length, added = d.get("model_max_length"), d.get("added_tokens", 0)
        if max_length is not None and (not _is(max_length, int) or not 0 < max_length < 2**63):
            raise ValueError(f"model info field 'model_max_length' must be nil or an int in 1..2**63-1, got {max_length!r:.40}")
        if not _is(added, int) or not 0 <= added < 2**32:
            raise ValueError(f"model info field 'added_tokens' must be an int in 0..2**32-1, got {added!r:.40}")
        return cls(kind=_checked_str(d, "kind", "model info", limit=64), vocab_size=vocab, special_tokens=list(specials),
                   chat_template=d["chat_template"], cached=d["cached"],
                   source=_checked_str(d, "source", "model info", optional=True) or "",
                   bos_token=_checked_str(d, "bos_token", "model info", optional=True),
                   eos_token=_checked_str(d, "eos_token", "model info", optional=True),
                   model_max_length=max_length, added_tokens=added,
                   backend=_checked_str(d, "backend", "model info", optional=True, limit=64) or "",
                   chat_renderer=_checked_str(d, "chat_renderer", "model info", optional=True, limit=256) or "",
                   tokenizer=_checked_str(d, "tokenizer", "model info", optional=True, limit=128) or "")


@dataclass(frozen=True)
class LoadSpec:
    """B_LOAD's body: a model to load, as `add_model` or the broker's flags give it.

    `chat_template` is the template's text (add_model); `chat_template_file` a path on the worker's
    host (a flag); `tokenizer_path` overrides where the tokenizer itself loads from. `share` names a
    model the worker holds with the same fingerprint (the same tokenizer, template and options, as
    the broker learned from earlier loads): the worker serves this name with that model's tokenizer
    and caches, at no cost in memory, instead of loading it again.
    """

    name: str
    source: str
    aliases: list[str] = field(default_factory=list)
    chat_template: str | None = None
    chat_template_file: str | None = None
    tokenizer_path: str | None = None
    share: str | None = None

    def to_wire(self) -> bytes:
        return pack(self.__dict__)

    @classmethod
    def from_wire(cls, data: bytes) -> "LoadSpec":
        """ValueError naming the field.

        >>> LoadSpec.from_wire(LoadSpec("m", "/models/m", ["alias"]).to_wire()).aliases
        ['alias']
        """
        d = msgpack.unpackb(data, raw=False, strict_map_key=False)
        if not isinstance(d, dict):
            raise ValueError(f"LOAD must be a map, got {type_name(d)}")
        aliases = _names(d, "aliases")
        return cls(
            name=_checked_str(d, "name", "LOAD"),
            source=_checked_str(d, "source", "LOAD", limit=4096),
            aliases=aliases,
            chat_template=_checked_str(d, "chat_template", "LOAD", limit=MAX_TEXT_FIELD, optional=True),
            chat_template_file=_checked_str(d, "chat_template_file", "LOAD", limit=4096, optional=True),
            tokenizer_path=_checked_str(d, "tokenizer_path", "LOAD", limit=4096, optional=True),
            share=_checked_str(d, "share", "LOAD", optional=True),
        )


@dataclass(frozen=True)
class Loaded:
    """W_LOADED's body: how a load went. `retry`: the worker could not try (it was full or leaving),
    so the model itself is not at fault; otherwise a failure is the source's and `error` says why."""

    name: str
    ok: bool
    error: str = ""
    fingerprint: str = ""
    info: dict = field(default_factory=dict)  # ModelInfo.to_wire() when ok
    seconds: float = 0.0  # how long the load took
    retry: bool = False

    def to_wire(self) -> bytes:
        return pack(self.__dict__)

    @classmethod
    def from_wire(cls, data: bytes) -> "Loaded":
        """ValueError naming the field.

        >>> Loaded.from_wire(Loaded("m", False, "no such file").to_wire()).error
        'no such file'
        """
        d = msgpack.unpackb(data, raw=False, strict_map_key=False)
        if not isinstance(d, dict):
            raise ValueError(f"LOADED must be a map, got {type_name(d)}")
        ok = d.get("ok")
        if not _is(ok, bool):
            raise ValueError(f"LOADED field 'ok' must be bool, got {ok!r:.40}")
        seconds = d.get("seconds", 0.0)
        if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or not 0 <= seconds < 1e7:
            raise ValueError(f"LOADED field 'seconds' must be a number >= 0, got {seconds!r:.40}")
        return cls(
            name=_checked_str(d, "name", "LOADED"),
            ok=ok,
            error=_checked_str(d, "error", "LOADED", limit=4096, optional=True) or "",
            fingerprint=_checked_str(d, "fingerprint", "LOADED", limit=128, optional=True) or "",
            info=ModelInfo.from_wire(d.get("info")).to_wire() if ok else {},
            seconds=float(seconds),
            retry=d.get("retry") is True,
        )
