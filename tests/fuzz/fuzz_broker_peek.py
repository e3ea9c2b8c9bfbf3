#!/usr/bin/env python3
"""Fuzz target (atheris) for the broker's compiled request parser: broker/_core.pyx `peek_request`,
`peek_array` and `route_key`, the first code hostile bytes reach.

Each input is turned, by its first bytes, into one of: the raw bytes as a frame; a valid request
map with one field's value replaced by fuzzed bytes; a valid frame cut at a fuzzed point; a value
nested a fuzzed depth under an unknown key; an array of fuzzed and valid elements. What must hold:

- nothing but ProtocolError is ever raised (no crash, no other exception, no hang);
- a frame the parser accepts is one MessagePack value msgpack reads too (a map, or an array whose
  accepted elements are maps), each request's `body` is exactly its map's bytes, and the common
  fields read are what msgpack decodes;
- every accepted request has a route key (or None for keyless ops) of 16-byte digests.

Run: .venv/bin/python tests/fuzz/fuzz_broker_peek.py [-atheris_runs=N] [corpus dir]
(tests/test_fuzz_broker.py runs it for a bounded number of inputs in the suite.)
"""

from __future__ import annotations

import sys

import atheris

with atheris.instrument_imports():
    import msgpack

from tokenbroker.broker._core import MAX_DEPTH, Peek, peek_array, peek_request, route_key
from tokenbroker.common.errors import ProtocolError

VALID = [
    {"id": 1, "op": "tokenize", "text": "Hello, world!", "tokens_format": "u32"},
    {"id": "a", "op": "chat", "model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [{"x": 1}]},
    {"op": "count", "body": {"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}], "system": "s"}},
    {"op": "detokenize", "tokens": [1, 2, 3], "deadline_ms": 50, "affinity": "conv"},
    {"id": b"\x00", "op": "tokenize", "text": ["a", "b"], "model": None},
    {"op": "ping"},
]
FIELDS = ["id", "op", "model", "deadline_ms", "affinity", "tokens_format", "text", "messages", "tools",
          "chat_template_kwargs", "body", "unknown"]


def _frame(fdp: atheris.FuzzedDataProvider) -> bytes:
    shape = fdp.ConsumeIntInRange(0, 5)
    if shape == 0:
        return fdp.ConsumeBytes(fdp.remaining_bytes())
    base = dict(VALID[fdp.ConsumeIntInRange(0, len(VALID) - 1)])
    if shape == 1:  # one field's value replaced by fuzzed bytes
        field = FIELDS[fdp.ConsumeIntInRange(0, len(FIELDS) - 1)]
        base.pop(field, None)
        head = msgpack.packb(base)
        value = fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 64)) or b"\xc0"
        return bytes([head[0] + 1]) + head[1:] + msgpack.packb(field) + value if len(base) < 15 else head
    if shape == 2:  # a valid frame cut short
        raw = msgpack.packb(base if fdp.ConsumeBool() else [base, VALID[0]])
        return raw[:fdp.ConsumeIntInRange(0, len(raw))]
    if shape == 3:  # nesting under an unknown key
        depth = fdp.ConsumeIntInRange(0, MAX_DEPTH * 3)
        opener = b"\x91" if fdp.ConsumeBool() else b"\x81\xa1k"
        return b"\x82\xa2op\xa4ping\xa7unknown" + opener * depth + b"\xc0"
    if shape == 4:  # an array of valid and fuzzed elements
        parts = []
        for _ in range(fdp.ConsumeIntInRange(0, 6)):
            parts.append(msgpack.packb(VALID[fdp.ConsumeIntInRange(0, len(VALID) - 1)]) if fdp.ConsumeBool()
                         else fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 16)))
        return bytes([0x90 + len(parts)]) + b"".join(parts)
    raw = msgpack.packb(base)  # a valid frame with fuzzed bytes spliced in
    at = fdp.ConsumeIntInRange(0, len(raw))
    return raw[:at] + fdp.ConsumeBytes(8) + raw[at:]


_NEVER_DECODED = ("imestamp", "seconds", "code must be", "unhashable")  # msgpack's words for what it refuses to build


def _decoded(data: "bytes | memoryview") -> object | None:
    """msgpack's reading of the bytes; None where msgpack refuses something the broker never decodes
    (invalid UTF-8, a malformed timestamp, a reserved ext type or a map used as a map key, inside a
    value it jumps over: the worker answers those bad_request)."""
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=False)
    except (UnicodeDecodeError, ValueError, TypeError) as e:
        if isinstance(e, UnicodeDecodeError) or any(w in str(e) for w in _NEVER_DECODED):
            return None
        raise AssertionError(f"the broker accepted what msgpack refuses: {e!r} for {bytes(data)[:80]!r}") from None


def _check(peek: Peek) -> None:
    body = bytes(peek.body)
    got = _decoded(body)
    if got is not None:
        assert isinstance(got, dict), got
        assert got.get("op") == peek.op, (got, peek.op)
        assert got.get("model") == peek.model and got.get("affinity") == peek.affinity
        want_deadline = got.get("deadline_ms")
        assert peek.deadline_ms == (None if want_deadline is None else min(want_deadline, 2**31 - 1))
    key = route_key(peek)
    if key is not None:
        assert len(key.key) == 16 and all(len(b) == 16 for b in key.blocks)


@atheris.instrument_func
def TestOneInput(data: bytes) -> None:
    frame = _frame(atheris.FuzzedDataProvider(data))
    for raw in (frame, memoryview(frame)):
        try:
            if raw and 0x90 <= raw[0] <= 0x9F or raw[:1] in (b"\xdc", b"\xdd"):
                out = peek_array(raw)
                if _decoded(frame) is not None:
                    assert isinstance(_decoded(frame), list)
                for item in out:
                    if isinstance(item, Peek):
                        _check(item)
                    else:
                        assert isinstance(item, ProtocolError)
            else:
                peek = peek_request(raw)
                assert bytes(peek.body) == frame
                _check(peek)
        except ProtocolError as e:
            assert e.code in ("bad_request", "unknown_op"), e.code


def main() -> None:
    atheris.Setup(sys.argv, TestOneInput)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
