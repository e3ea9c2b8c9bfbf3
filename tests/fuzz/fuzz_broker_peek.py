"""Fuzz target: the broker's compiled request parser, broker/_peek.pyx `peek_request`, `peek_array`
and `route_key`, the first code hostile bytes reach, against msgpack's own reading.

Each input is read as decisions (tests/fuzz/_harness.py's Choices) into one frame: the raw bytes
themselves; a valid request map with one field's value replaced by fuzzed bytes; a valid frame
(a map or an array of two) cut at a fuzzed point; a value nested a fuzzed depth (up to three
times the broker's bound) under an unknown key; an array of valid and fuzzed elements; a valid
frame with fuzzed bytes spliced in. Each frame is parsed as bytes and as a memoryview. What must
hold:

- nothing but ProtocolError (code bad_request or unknown_op) is ever raised (no crash, no other
  exception, no hang);
- a frame the parser accepts is one MessagePack value msgpack reads too (a map, or an array whose
  accepted elements are maps; refused elements are Peeks with their `code` set), a single request's `body` is
  exactly the frame, and the common fields read (op, model, affinity, deadline_ms clamped to
  int32) are what msgpack decodes;
- every accepted request has a route key (or None for keyless ops) of 16-byte digests.

Run by hand: .venv/bin/python tests/fuzz/fuzz_broker_peek.py -max_total_time=300
(tests/test_fuzz.py replays the seeds and runs it for a bounded number of inputs in the suite.)
"""

from __future__ import annotations

import sys
from pathlib import Path

import msgpack

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import Choices, run  # noqa: E402

from tokenbroker.broker._peek import MAX_DEPTH, Peek, peek_array, peek_request  # noqa: E402
from tokenbroker.broker._routekey import route_key  # noqa: E402
from tokenbroker.common.errors import ProtocolError  # noqa: E402

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
SHAPES = 6


def frame(c: Choices) -> bytes:
    """One frame built from the input's decisions (see the module's docstring for the shapes)."""
    shape = c.below(SHAPES)
    if shape == 0:
        return c.take(c.left())
    base = dict(VALID[c.below(len(VALID))])
    if shape == 1:  # one field's value replaced by fuzzed bytes
        field = FIELDS[c.below(len(FIELDS))]
        base.pop(field, None)
        head = msgpack.packb(base)
        value = c.take(c.below(65)) or b"\xc0"
        return bytes([head[0] + 1]) + head[1:] + msgpack.packb(field) + value if len(base) < 15 else head
    if shape == 2:  # a valid frame cut short
        raw = msgpack.packb(base if c.below(2) else [base, VALID[0]])
        return raw[:c.below(len(raw) + 1)]
    if shape == 3:  # nesting under an unknown key
        depth = c.below(MAX_DEPTH * 3 + 1)
        opener = b"\x91" if c.below(2) else b"\x81\xa1k"
        return b"\x82\xa2op\xa4ping\xa7unknown" + opener * depth + b"\xc0"
    if shape == 4:  # an array of valid and fuzzed elements
        parts = []
        for _ in range(c.below(7)):
            parts.append(msgpack.packb(VALID[c.below(len(VALID))]) if c.below(2) else c.take(c.below(17)))
        return bytes([0x90 + len(parts)]) + b"".join(parts)
    raw = msgpack.packb(base)  # a valid frame with fuzzed bytes spliced in
    at = c.below(len(raw) + 1)
    return raw[:at] + c.take(8) + raw[at:]


_NEVER_DECODED = ("imestamp", "seconds", "code must be", "unhashable")  # msgpack's words for what it refuses to build


def decoded(data: bytes | memoryview) -> object | None:
    """msgpack's reading of the bytes; None where msgpack refuses something the broker never decodes
    (invalid UTF-8, a malformed timestamp, a reserved ext type or a map used as a map key, inside a
    value it jumps over: the worker answers those bad_request)."""
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=False)
    except (UnicodeDecodeError, ValueError, TypeError) as e:
        if isinstance(e, UnicodeDecodeError) or any(w in str(e) for w in _NEVER_DECODED):
            return None
        raise AssertionError(f"the broker accepted what msgpack refuses: {e!r} for {bytes(data)[:80]!r}") from None


def check(peek: Peek) -> None:
    """One accepted request against msgpack's reading of its body, and its route key's shape."""
    got = decoded(bytes(peek.body))
    if got is not None:
        assert isinstance(got, dict), got
        assert got.get("op") == peek.op, (got, peek.op)
        assert got.get("model") == peek.model and got.get("affinity") == peek.affinity
        want_deadline = got.get("deadline_ms")
        assert peek.deadline_ms == (None if want_deadline is None else min(want_deadline, 2**31 - 1))
    key = route_key(peek)
    if key is not None:
        assert len(key.key) == 16 and all(len(b) == 16 for b in key.blocks)


def fuzz_one(data: bytes) -> None:
    whole = frame(Choices(data))
    for raw in (whole, memoryview(whole)):
        try:
            if raw and 0x90 <= raw[0] <= 0x9F or raw[:1] in (b"\xdc", b"\xdd"):
                out = peek_array(raw)
                if decoded(whole) is not None:
                    assert isinstance(decoded(whole), list)
                for item in out:
                    assert isinstance(item, Peek)
                    if item.code is None:
                        check(item)
                    else:
                        assert item.code in ("bad_request", "unknown_op") and item.message, item
            else:
                peek = peek_request(raw)
                assert bytes(peek.body) == whole
                check(peek)
        except ProtocolError as e:
            assert e.code in ("bad_request", "unknown_op"), e.code


def seeds() -> list[bytes]:
    """Starting inputs: each shape with a few choice patterns, so the first runs already reach
    every shape and every valid request; then each valid request as raw bytes, alone and as an
    array."""
    out = [bytes([shape]) + bytes(pattern * 40) for shape in range(SHAPES)
           for pattern in (b"\x00", b"\x01\x02\x03", b"\x07\x05\x03\x02", b"\xff\x10\x40\x09")]
    out += [b"\x00" + msgpack.packb(request) for request in VALID]
    out.append(b"\x00" + msgpack.packb(VALID))
    return out


if __name__ == "__main__":
    run(fuzz_one, seeds)
