"""The opaque `state` of `detokenize_stream`: one sequence's options and what its next step needs.

The service keeps no memory of a sequence, so the state travels with the client. It is versioned,
small and authenticated:

    state = VERSION (1 byte) | MAC (16 bytes) | body (MessagePack array)
    MAC   = BLAKE2b-128(VERSION | body, key = SHA-256(DOMAIN | model fingerprint))

Any worker or broker serving the same model derives the same key, so any of them can serve any
step; a changed byte, a truncation or a state made for another model fails the MAC. The key is
derived from public data (the model's fingerprint), so the MAC detects corruption and foreign
states but is no secret against a client that knows the model: such a client can forge a
well-formed state. Decoding is therefore also safe on a forged state: every field is type-checked,
sizes are bounded and ids are checked against the vocabulary by the caller (workers/stream.py).
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from dataclasses import dataclass, field

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


@dataclass(frozen=True)
class Options:
    """What the first step sets for the whole sequence."""

    skip_special_tokens: bool = True
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    include_stop_str_in_output: bool = False


@dataclass
class SeqState:
    """One sequence between two steps: options, decode context and what is held back."""

    options: Options
    context: list[int] = field(default_factory=list)  # released ids kept as decode context
    pending: list[int] = field(default_factory=list)  # ids decoded but not released yet
    pending_bytes: bytes = b""  # bytes of an unfinished character (byte-table decoding)
    held: str = ""  # released text held back because it may start a stop string


def state_key(fingerprint: str) -> bytes:
    """The MAC key for a model: any process serving that model derives the same one."""
    return hashlib.sha256(DOMAIN + fingerprint.encode()).digest()


def _mac(key: bytes, body: bytes) -> bytes:
    return hashlib.blake2b(_VERSION_BYTE + body, key=key, digest_size=MAC_BYTES).digest()


def _u32(ids: list[int]) -> bytes:
    return struct.pack(f"<{len(ids)}I", *ids)


def pack_state(state: SeqState, key: bytes) -> bytes:
    """The wire state; the same state always packs to the same bytes (a step sent again matches)."""
    o = state.options
    flags = int(o.skip_special_tokens) | int(o.include_stop_str_in_output) << 1
    body = msgpack.packb(
        [flags, list(o.stop), _u32(sorted(o.stop_token_ids)), _u32(state.context), _u32(state.pending),
         state.pending_bytes, state.held],
        use_bin_type=True,
    )
    return _VERSION_BYTE + _mac(key, body) + body


def unpack_state(data: bytes, key: bytes, index: int) -> SeqState:
    """Check and read a state; anything wrong is an `invalid_input` naming sequence `index`."""

    def bad(why: str) -> ProtocolError:
        return ProtocolError(
            "invalid_input", f"field 'seqs[{index}].state': sequence {index}: {why}; send the state of its previous reply untouched"
        )

    if len(data) < HEADER_BYTES:
        raise bad(f"a state is at least {HEADER_BYTES} bytes, got {len(data)} (truncated?)")
    if data[0] != VERSION:
        raise bad(f"state version {data[0]} is not served here (this worker reads version {VERSION})")
    body = data[HEADER_BYTES:]
    if not hmac.compare_digest(data[1:HEADER_BYTES], _mac(key, body)):
        raise bad("the state was altered, truncated or made for another model (its MAC does not match this model's)")
    try:
        fields = msgpack.unpackb(body, raw=False, use_list=True, max_bin_len=1 << 20, max_str_len=1 << 24,
                                 max_array_len=1 << 16, max_map_len=0, max_ext_len=0)
    except Exception as e:
        raise bad(f"the state's body is not readable: {e}") from e
    try:
        return _read_fields(fields)
    except (TypeError, ValueError) as e:
        raise bad(str(e)) from e


def _read_fields(fields: object) -> SeqState:
    if not isinstance(fields, list) or len(fields) != 7:
        raise ValueError("the state's body has the wrong shape")
    flags, stop, stop_ids, context, pending, pending_bytes, held = fields
    if type(flags) is not int or not 0 <= flags <= 3:
        raise ValueError("the state's flags are out of range")
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise ValueError("the state's stop strings are not a list of non-empty str")
    if not all(isinstance(b, bytes) and len(b) % 4 == 0 for b in (stop_ids, context, pending)):
        raise ValueError("the state's id lists are not u32 bins")
    if not isinstance(pending_bytes, bytes) or len(pending_bytes) > MAX_PENDING_BYTES:
        raise ValueError("the state's pending bytes are not a bin of at most 3 bytes")
    if not isinstance(held, str):
        raise ValueError("the state's held text is not a str")
    ctx, pend = _ids(context), _ids(pending)
    if len(ctx) > MAX_CONTEXT_IDS or len(pend) > MAX_PENDING_IDS:
        raise ValueError("the state holds more ids than a state ever does")
    if len(held) > max((len(s) for s in stop), default=0):
        raise ValueError("the state holds more held-back text than its longest stop string")
    options = Options(
        skip_special_tokens=bool(flags & 1),
        stop=tuple(stop),
        stop_token_ids=frozenset(_ids(stop_ids)),
        include_stop_str_in_output=bool(flags & 2),
    )
    return SeqState(options=options, context=ctx, pending=pend, pending_bytes=pending_bytes, held=held)


def _ids(data: bytes) -> list[int]:
    return list(struct.unpack(f"<{len(data) // 4}I", data))
