"""The opaque `state` of `detokenize_stream`: one sequence's options and what its next step needs.

The service keeps no memory of a sequence, so the state travels with the client. It is versioned,
small and authenticated:

    state = VERSION (1 byte) | MAC (16 bytes) | body (fixed header, ids, bytes, text, options)
    MAC   = BLAKE2b-128(VERSION | body, key = SHA-256(DOMAIN | model fingerprint))

Any worker or broker serving the same model derives the same key, so any of them can serve any
step; a changed byte, a truncation or a state made for another model fails the MAC. The key is
derived from public data (the model's fingerprint), so the MAC detects corruption and foreign
states but is no secret against a client that knows the model: such a client can forge a
well-formed state. Decoding is therefore also safe on a forged state: every field is type-checked,
sizes are bounded and ids are checked against the vocabulary by the caller (workers/stream/).
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from dataclasses import dataclass, field
from typing import Any

import msgpack

from tokenbroker.common.errors import ProtocolError

VERSION = 1
_VERSION_BYTE = bytes([VERSION])
DOMAIN = b"tokenbroker detokenize_stream state v1\x00"
MAC_BYTES = 16
HEADER_BYTES = 1 + MAC_BYTES

# Bounds on what a (possibly forged) state may hold beyond the held-back text and the options.
MAX_CONTEXT_IDS = 8  # ids of context before the pending ones (the decoder keeps 4)
MAX_PENDING_IDS = 64  # ids decoded but not yet released (an unfinished character or byte group)
MAX_PENDING_BYTES = 3  # bytes of an unfinished UTF-8 character (byte-level tokenizers)
# Bounds on stop strings, so that holding back a possible stop prefix stays cheap every step.
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1024


@dataclass(frozen=True)
class Options:
    """What the first step sets for the whole sequence."""

    skip_special_tokens: bool = True
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    include_stop_str_in_output: bool = False


@dataclass(slots=True)
class SeqState:
    """One sequence between two steps: options, decode context and what is held back."""

    options: Options
    context: list[int] = field(default_factory=list)  # released ids kept as decode context
    pending: list[int] = field(default_factory=list)  # ids decoded but not released yet
    pending_bytes: bytes = b""  # bytes of an unfinished character (byte-table decoding)
    held: str = ""  # released text held back because it may start a stop string
    base_len: int = -1  # length of the context's decoded text when known (saves a decode), else -1


def state_key(fingerprint: str) -> bytes:
    """The MAC key for a model: any process serving that model derives the same one."""
    return hashlib.sha256(DOMAIN + fingerprint.encode()).digest()


_keyed: dict[bytes, Any] = {}  # keyed hashlib.blake2b objects


def _mac(key: bytes, body: bytes | memoryview) -> bytes:
    base = _keyed.get(key)
    if base is None:  # keying BLAKE2b costs more than copying a keyed one; one per model
        base = _keyed[key] = hashlib.blake2b(_VERSION_BYTE, key=key, digest_size=MAC_BYTES)
    h = base.copy()
    h.update(body)
    return h.digest()


def _u32(ids: list[int]) -> bytes:
    return struct.pack(f"<{len(ids)}I", *ids)


# body = header | context ids | pending ids | pending bytes | held text (UTF-8) | options (MessagePack,
# only when there are stop strings or stop ids). Fixed fields first, so a step reads them with one
# struct call; the options, the same for every step of a sequence, are parsed once per process.
_HEADER = struct.Struct("<BHHBIII")  # flags, n context, n pending, n pending bytes, held bytes, options bytes, base_len + 1
STATE_HEADER_BYTES = _HEADER.size
_SKIP, _INCLUDE = 1, 2
_OPTIONS_CACHE_MAX = 4096
# Options are kept parsed (and states kept by the decoders) only when this small, so every cache of
# this module and of workers/stream/ stays within a few MiB whatever clients send.
CACHED_OPTIONS_BYTES = 512
_options_cache: dict[bytes, Options] = {}
_plain = {f: Options(skip_special_tokens=bool(f & _SKIP), include_stop_str_in_output=bool(f & _INCLUDE)) for f in range(4)}


def pack_state(state: SeqState, key: bytes) -> bytes:
    """The wire state; the same state always packs to the same bytes (a step sent again matches)."""
    o = state.options
    flags = (_SKIP if o.skip_special_tokens else 0) | (_INCLUDE if o.include_stop_str_in_output else 0)
    options = _options_blob(o) if (o.stop or o.stop_token_ids) else b""
    held = state.held.encode() if state.held else b""
    ctx, pend, pb = state.context, state.pending, state.pending_bytes
    n = len(ctx) + len(pend)
    body = (_HEADER.pack(flags, len(ctx), len(pend), len(pb), len(held), len(options), state.base_len + 1)
            + (_u32s(n).pack(*ctx, *pend) if n else b"") + pb + held + options)
    return _VERSION_BYTE + _mac(key, body) + body


_U32S: dict[int, struct.Struct] = {}


def _u32s(n: int) -> struct.Struct:
    """A compiled struct for n little-endian uint32s (n is small: at most the state's id bounds)."""
    s = _U32S.get(n)
    if s is None:
        s = _U32S[n] = struct.Struct(f"<{n}I")
    return s


_blobs: dict[Options, bytes] = {}


def _options_blob(o: Options) -> bytes:
    """The options' MessagePack (b"" when there are no stop strings or ids), packed once per options."""
    if not (o.stop or o.stop_token_ids):
        return b""
    blob = _blobs.get(o)
    if blob is None:
        blob = msgpack.packb([list(o.stop), _u32(sorted(o.stop_token_ids))], use_bin_type=True)
        if len(blob) <= CACHED_OPTIONS_BYTES:
            if len(_blobs) >= _OPTIONS_CACHE_MAX:
                _blobs.clear()
            _blobs[o] = blob
    return blob


def options_bytes(o: Options) -> int:
    """What the options take in a packed state (a reply's budget counts them)."""
    return len(_options_blob(o)) if (o.stop or o.stop_token_ids) else 0


def unpack_state(data: bytes, key: bytes, index: int, where: str | None = None) -> SeqState:
    """Check and read a state; anything wrong is an `invalid_input` naming sequence `index`.

    `where` is the field the message names (`seqs[i].state` by default; `columns.states` for the
    columnar form). The body is read through a memoryview: one copy per field that is kept, none
    for the MAC.
    """
    where = where or f"seqs[{index}].state"
    if len(data) < HEADER_BYTES + _HEADER.size:
        raise _bad(index, where, f"a state is at least {HEADER_BYTES + _HEADER.size} bytes, got {len(data)} (truncated?)")
    if data[0] != VERSION:
        raise _bad(index, where, f"state version {data[0]} is not served here (this worker reads version {VERSION})")
    body = memoryview(data)[HEADER_BYTES:]
    if not hmac.compare_digest(data[1:HEADER_BYTES], _mac(key, body)):
        raise _bad(index, where, "the state was altered, truncated or made for another model (its MAC does not match this model's)")
    # From here on the state is well-formed or forged by someone who knows the model: check everything.
    flags, n_ctx, n_pend, n_bytes, n_held, n_opts, base_len = _HEADER.unpack_from(body)
    if flags > 3 or n_ctx > MAX_CONTEXT_IDS or n_pend > MAX_PENDING_IDS or n_bytes > MAX_PENDING_BYTES:
        raise _bad(index, where, "the state's header is out of range")
    at = _HEADER.size
    ids_end = at + 4 * (n_ctx + n_pend)
    if ids_end + n_bytes + n_held + n_opts != len(body):
        raise _bad(index, where, "the state's lengths do not add up")
    ids = list(_u32s(n_ctx + n_pend).unpack_from(body, at)) if n_ctx + n_pend else []
    pending_bytes = bytes(body[ids_end:ids_end + n_bytes])
    try:
        held = str(body[ids_end + n_bytes:ids_end + n_bytes + n_held], "utf-8")
    except UnicodeDecodeError as e:
        raise _bad(index, where, "the state's held text is not UTF-8") from e
    options = _plain[flags] if not n_opts else _options(bytes(body[len(body) - n_opts:]), flags, index, where)
    if len(held) > max(map(len, options.stop), default=0):
        raise _bad(index, where, "the state holds more held-back text than its longest stop string")
    return SeqState(options, ids[:n_ctx], ids[n_ctx:], pending_bytes, held, base_len - 1)


def _options(blob: bytes, flags: int, index: int, where: str) -> Options:
    cache_key = bytes([flags]) + blob
    options = _options_cache.get(cache_key)
    if options is not None:
        return options
    try:
        stop, stop_ids = msgpack.unpackb(blob, raw=False, use_list=True, max_map_len=0, max_ext_len=0)
    except Exception as e:
        raise _bad(index, where, f"the state's options are not readable: {e}") from e
    if not isinstance(stop, list) or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stop):
        raise _bad(index, where, f"the state's stop strings are not a list of str of 1 to {MAX_STOP_CHARS} characters")
    if len(stop) > MAX_STOP_STRINGS:
        raise _bad(index, where, f"the state holds more than {MAX_STOP_STRINGS} stop strings")
    if not isinstance(stop_ids, bytes) or len(stop_ids) % 4:
        raise _bad(index, where, "the state's stop ids are not a u32 bin")
    options = Options(
        skip_special_tokens=bool(flags & _SKIP),
        stop=tuple(stop),
        stop_token_ids=frozenset(struct.unpack(f"<{len(stop_ids) // 4}I", stop_ids)),
        include_stop_str_in_output=bool(flags & _INCLUDE),
    )
    if len(blob) <= CACHED_OPTIONS_BYTES:
        if len(_options_cache) >= _OPTIONS_CACHE_MAX:
            _options_cache.clear()
        _options_cache[cache_key] = options
    return options


def _bad(index: int, where: str, why: str) -> ProtocolError:
    return ProtocolError(
        "invalid_input",
        f"field '{where}': sequence {index}: {why}; send the state of its previous reply untouched",
    )
