"""Fuzz target: contract 1.4's bounds at the broker's compiled reader (broker/_peek.pyx
`peek_array`, `peek_request`; PROTOCOL.md "Version 1.4 additions"), on frames built to be
expensive to walk. Every input runs under the harness's bound of CPU and memory
(tests/fuzz/_harness.py `bounded`), so a path that walks, allocates or raises per element is a
finding as a crash is.

Each input is read as decisions (Choices) into one of three shapes:

- many small invalid elements: an array of up to twice ARRAY bound elements, each a few bytes that
  are no request (nil, an int, an empty map or array, a map without `op`, a str, a bool). Over
  the bound: one ProtocolError (bad_request, id nil) naming the limit; at or under it: one Peek
  per element, each refused (`code` set);
- deep elements among valid ones: up to 12 elements, valid requests and requests holding a value
  nested a fuzzed depth (around the bound, or far past it) under an unknown key, before or after
  their id. The valid ones are served with their op; a deep one is refused naming the depth, with
  its id, exactly when it nests deeper than MAX_DEPTH;
- repeated keys: a valid request with one key written twice (a known field or one of up to 300
  unknown keys, the second value of any type, at a fuzzed place), or with a key that differs from
  another by one byte. A repeat is bad_request naming the key (id nil when the key is `id`), alone
  and as an element of an array beside a valid request, which is served; a near-repeat is
  accepted.

Run by hand: .venv/bin/python tests/fuzz/fuzz_broker_bounds.py -max_total_time=300
(tests/test_fuzz.py replays the seeds and runs it for a bounded number of inputs in the suite.)
"""

from __future__ import annotations

import sys
from pathlib import Path

import msgpack

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import Choices, run  # noqa: E402

from tokenbroker.broker._peek import MAX_ARRAY_REQUESTS, MAX_DEPTH, Peek, peek_array, peek_request  # noqa: E402
from tokenbroker.common.errors import ProtocolError  # noqa: E402

pack = msgpack.packb
SMALL_INVALID = (b"\xc0", b"\x00", b"\x7f", b"\xff", b"\x80", b"\x90", b"\xa0", b"\xc2", b"\x81\xa2id\x01",
                 b"\x81\xa1k\x80", b"\x91\x80", b"\xd4\x01\x00")
VALID = (
    {"id": 1, "op": "tokenize", "text": "Hello"},
    {"id": "c", "op": "chat", "messages": [{"role": "user", "content": "hi"}]},
    {"op": "ping"},
    {"id": b"\x01", "op": "count", "body": {"messages": [{"role": "user", "content": "x"}]}},
)
KNOWN = ("id", "op", "model", "deadline_ms", "affinity", "tokens_format", "text", "messages", "tools",
         "chat_template_kwargs", "body")
VALUES = (None, 7, -3, 1.5, "s", b"b", [1, [2]], {"a": {"b": 1}}, msgpack.ExtType(5, b"x"), True)
SHAPES = 3


def array_of(elements: list[bytes]) -> bytes:
    n = len(elements)
    head = bytes([0x90 | n]) if n < 16 else (b"\xdc" + n.to_bytes(2, "big") if n < 1 << 16 else b"\xdd" + n.to_bytes(4, "big"))
    return head + b"".join(elements)


def many_invalid(c: Choices) -> None:
    n = c.below(2 * MAX_ARRAY_REQUESTS + 2) if c.below(2) else MAX_ARRAY_REQUESTS + c.below(3) - 1
    pattern = [SMALL_INVALID[c.below(len(SMALL_INVALID))] for _ in range(1 + c.below(4))]
    frame = array_of([pattern[i % len(pattern)] for i in range(n)])
    maps = any(p[0] & 0xF0 == 0x80 for p in pattern[:n])
    try:
        out = peek_array(frame)
    except ProtocolError as e:
        assert e.code == "bad_request" and e.raw_id == b"\xc0", e
        if n > MAX_ARRAY_REQUESTS:  # refused from the header: one reply
            assert f"at most {MAX_ARRAY_REQUESTS}" in e.message, e.message
        else:  # no map at all: a payload of the wrong type
            assert n and not maps and "must be a map" in e.message, (n, e.message)
        return
    assert n <= MAX_ARRAY_REQUESTS and (maps or n == 0) and len(out) == n
    assert all(isinstance(p, Peek) and p.code == "bad_request" and p.message for p in out), out[:3]


def deep_element(c: Choices, rid: int) -> tuple[bytes, int]:
    """A ping holding, under an unknown key, one value nested `depth` containers deep."""
    depth = MAX_DEPTH - 3 + c.below(8) if c.below(3) else c.below(3 * MAX_DEPTH + 1)
    opener = b"\x91" if c.below(2) else b"\x81\xa1k"
    junk = b"\xa4junk" + opener * depth + b"\xc0"
    ident = b"\xa2id" + pack(rid)
    body = junk + ident + b"\xa2op\xa4ping" if c.below(2) else ident + b"\xa2op\xa4ping" + junk
    return b"\x83" + body, depth


def deep_among_valid(c: Choices) -> None:
    elements, want = [], []
    for i in range(1 + c.below(12)):
        if c.below(2):
            request = dict(VALID[c.below(len(VALID))], id=i)
            elements.append(pack(request))
            want.append(("ok", request["op"]))
        else:
            element, depth = deep_element(c, i)
            elements.append(element)
            want.append(("deep", depth))
    out = peek_array(array_of(elements))
    assert len(out) == len(want)
    for i, (peek, (kind, what)) in enumerate(zip(out, want)):
        assert peek.raw_id == pack(i), (i, peek)  # every element's own id, wherever it lies
        if kind == "ok" or what <= MAX_DEPTH:
            assert peek.code is None and peek.op == ("ping" if kind == "deep" else what), (i, peek)
        else:
            assert peek.code == "bad_request" and f"nested deeper than {MAX_DEPTH} levels" in peek.message, (i, peek)


def repeated(c: Choices) -> None:
    base = dict(VALID[c.below(len(VALID))])
    pairs = [(k, v) for k, v in base.items()]
    pairs += [(f"k{i}", i) for i in range(c.below(301) if c.below(4) == 0 else c.below(4))]
    near = c.below(4) == 0
    if near:  # a key one byte away from one present: no repeat
        key, value = pairs[c.below(len(pairs))]
        twin = key[:-1] + chr(ord(key[-1]) + 1 + c.below(20))
        if twin in dict(pairs) or twin in KNOWN:
            return
        pairs.insert(c.below(len(pairs) + 1), (twin, value))
    else:
        key = KNOWN[c.below(len(KNOWN))] if c.below(2) else pairs[c.below(len(pairs))][0]
        if key not in dict(pairs):
            pairs.append((key, None))
        pairs.insert(c.below(len(pairs) + 1), (key, VALUES[c.below(len(VALUES))]))
    head = bytes([0x80 | len(pairs)]) if len(pairs) < 16 else b"\xde" + len(pairs).to_bytes(2, "big")
    frame = head + b"".join(pack(k) + pack(v) for k, v in pairs)
    if near:
        keys = [k for k, _ in pairs]
        assert len(set(keys)) == len(keys)
        peek = peek_request(frame)  # a near-repeat is no repeat (a bad value would be the worker's to say)
        assert peek.code is None
        return
    try:
        peek_request(frame)
        raise AssertionError(f"a map with {key!r} twice was accepted: {frame[:80]!r}")
    except ProtocolError as e:
        assert e.code == "bad_request", e
        assert f"key {key!r} twice" in e.message or e.message.startswith("field 'id'"), (key, e.message)
        if key == "id":
            assert e.raw_id == b"\xc0", e.raw_id
    first, second = peek_array(array_of([frame, pack({"id": "fine", "op": "ping"})]))
    assert first.code == "bad_request" and second.code is None and second.raw_id == pack("fine")


def fuzz_one(data: bytes) -> None:
    c = Choices(data)
    shape = c.below(SHAPES)
    if shape == 0:
        many_invalid(c)
    elif shape == 1:
        deep_among_valid(c)
    else:
        repeated(c)


def seeds() -> list[bytes]:
    """Each shape with a few choice patterns; the array bound and the depth bound themselves."""
    out = [bytes([shape]) + bytes(pattern * 40) for shape in range(SHAPES)
           for pattern in (b"\x00", b"\x01\x02\x03", b"\x07\x05\x03\x02", b"\xff\x10\x40\x09")]
    out += [b"\x00\x01" + bytes([k]) for k in (0, 1, 2)]  # arrays of bound - 1, bound, bound + 1 elements
    out += [b"\x01\x01" + bytes([0x01, 0x01, 0x01, d, 0x00]) for d in (2, 3, 4)]  # one element at depth 99-101
    return out


if __name__ == "__main__":
    run(fuzz_one, seeds)
