"""The columnar form of `detokenize_stream` (contract 1.2): a step's buffers in, the reply's buffers out.

A scheduler stepping hundreds of sequences pays, in the row form, for one map per sequence on
both ends (building, packing, parsing). The columnar form carries the same step as a few byte
strings: every sequence's ids concatenated (u32), their counts, the states concatenated and their
lengths, and a final flag byte each. This module checks that the buffers agree and reads them
with C-speed calls (array, itertools), and packs the reply's buffers the same way; the decoding
itself is the row form's (workers/stream/), so the results are identical sequence by sequence.
"""

from __future__ import annotations

import sys
from array import array
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

from tokenbroker.common.errors import ProtocolError
from tokenbroker.common.protocol import type_name

_LITTLE = sys.byteorder == "little"
_U32 = "I" if array("I").itemsize == 4 else "L"
FIELDS = ("tokens", "lengths", "states", "state_lengths", "final")
FINISHED_CODE = {None: 0, "stop": 1, "final": 2}


@dataclass(slots=True)
class Columns:
    """A columnar step, checked against itself: n sequences, each with its ids, state and final flag."""

    n: int
    ids: list[int]  # every sequence's ids, concatenated
    id_starts: list[int] | None  # sequence i's ids are ids[id_starts[i]:id_starts[i + 1]]; None: one id each
    states: list[bytes]  # each sequence's state bytes (b"": a first step with default options)
    final: bytes | None  # one byte (0 or 1) per sequence, or None when no sequence ends


def _u32(value: bytes, name: str) -> array:
    if len(value) % 4:
        raise ProtocolError("invalid_input", f"field 'columns.{name}': a u32 bin must be a multiple of 4 bytes long, got {len(value)}")
    a = array(_U32)
    a.frombytes(value)
    if not _LITTLE:  # pragma: no cover
        a.byteswap()
    return a


def u32_bytes(values: Any) -> bytes:
    """Little-endian uint32 of an iterable of ints (C speed)."""
    a = array(_U32, values)
    if not _LITTLE:  # pragma: no cover
        a.byteswap()
    return a.tobytes()


def read_columns(cols: Any, max_items: int) -> Columns:
    """Check the buffers of `columns` against each other; a field that disagrees is named."""
    if type(cols) is not dict:
        raise ProtocolError("bad_request", f"field 'columns' must be map, got {type_name(cols)}")
    for name in FIELDS:
        value = cols.get(name)
        if value is None and name in ("final",):
            continue
        if value is None:
            raise ProtocolError("bad_request", f"field 'columns.{name}' is required")
        if type(value) is not bytes:
            raise ProtocolError("bad_request", f"field 'columns.{name}' must be bin, got {type_name(value)}")
    lengths = _u32(cols["lengths"], "lengths")
    n = len(lengths)
    if n > max_items:
        raise ProtocolError("too_large", f"field 'columns.lengths' holds {n} sequences; this worker takes at most "
                            f"{max_items} (--max-batch-items): split the step")
    state_lengths = _u32(cols["state_lengths"], "state_lengths")
    if len(state_lengths) != n:
        raise ProtocolError("invalid_input", f"field 'columns.state_lengths' has {len(state_lengths)} entries; "
                            f"'columns.lengths' has {n} (one per sequence)")
    ids = _u32(cols["tokens"], "tokens")
    total = sum(lengths)
    if total != len(ids):
        raise ProtocolError("invalid_input", f"field 'columns.tokens' holds {len(ids)} ids; 'columns.lengths' adds up to {total}")
    raw_states: bytes = cols["states"]
    ends = list(accumulate(state_lengths))
    if (ends[-1] if ends else 0) != len(raw_states):
        raise ProtocolError("invalid_input", f"field 'columns.states' is {len(raw_states)} bytes; "
                            f"'columns.state_lengths' adds up to {ends[-1] if ends else 0}")
    if n and state_lengths.count(state_lengths[0]) == n:  # one size for all: slice by stride
        size = state_lengths[0]
        states = [raw_states[a:a + size] for a in range(0, n * size, size)] if size else [b""] * n
    else:
        states = list(map(raw_states.__getitem__, map(slice, [0, *ends[:-1]], ends)))
    final = cols.get("final")
    if final is not None:
        if len(final) != n:
            raise ProtocolError("invalid_input", f"field 'columns.final' has {len(final)} bytes; 'columns.lengths' has {n} sequences")
        bad = final.translate(None, b"\x00\x01")
        if bad:
            i = next(i for i, b in enumerate(final) if b > 1)
            raise ProtocolError("invalid_input", f"field 'columns.final': sequence {i}: byte {final[i]}, expected 0 or 1")
        if final.count(0) == n:
            final = None
    one_each = total == n and lengths.count(1) == n
    return Columns(n, ids.tolist(), None if one_each else [0, *accumulate(lengths)], states, final)


def columns_reply(texts: list[bytes], states: list[bytes], finished: bytearray, stops: dict[int, Any]) -> dict:
    """The reply's `columns` from each sequence's text (UTF-8) and state (b"" once finished)."""
    return {"columns": {
        "text": b"".join(texts),
        "text_lengths": u32_bytes(map(len, texts)),
        "states": b"".join(states),
        "state_lengths": u32_bytes(map(len, states)),
        "finished": bytes(finished),
        "stops": stops,
    }}
