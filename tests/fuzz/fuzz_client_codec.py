"""Fuzz target: the client's compiled reply reader, `tokenbroker._codec.settle` (a reply frame read
and every call it answers settled), against msgpack's own reading.

Each input is read as decisions (tests/fuzz/_harness.py's Choices) into one frame: a lone element
or an array of up to 12, each element one of: a good reply of the usual shape for a pending call
(tokenize, detokenize, chat: read straight into its result), a reply with extra fields (read as a
map), an `overloaded` error, a reply for an id that is not pending, a reply map with a key twice
(`id`, a typed field, any key), a malformed element (bad UTF-8, a list as a map key, a timestamp
ext of a wrong length, a cut value), or any value at all (tests/fuzz/_msgpack_values.py). Then
sometimes one byte is changed or the frame is cut. Seven calls are pending, of every kind.

What must hold (the codec's promise: a malformed frame settles nothing):

- settle raises nothing but ValueError and never crashes (the process is the check);
- where msgpack refuses the frame, or it holds a map with a repeated key (msgpack keeps the last;
  the codec refuses it: no reply repeats a key), settle raises ValueError, every call is still
  pending with its future not done, and nothing is handed back in `odd`;
- where msgpack reads it, each pending call named by an int `id` is settled by the first map
  naming it, unless that map is `overloaded` (handed back in `odd` with its id, the call still
  pending); its result is the map msgpack gives or, for a reply of the usual shape, the result
  `_client_results` builds from that map; every other element is handed back in `odd`.

Run by hand: .venv/bin/python tests/fuzz/fuzz_client_codec.py -max_total_time=300
"""

from __future__ import annotations

import asyncio
import sys
from array import array
from pathlib import Path
from typing import Any

import msgpack

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import Choices, run  # noqa: E402
from _msgpack_values import any_value, array_head, map_head, string  # noqa: E402

from tokenbroker import _client_results as res  # noqa: E402
from tokenbroker import _codec  # noqa: E402

KINDS = (_codec.KIND_RAW, _codec.KIND_TOKENS, _codec.KIND_TEXT, _codec.KIND_CHAT, _codec.KIND_TOKENS_LIST,
         _codec.KIND_CHAT_LIST, _codec.KIND_TOKENS)  # call i's kind is KINDS[i - 1]
PENDING = range(1, len(KINDS) + 1)
U32 = array("I", [0, 7, 2**32 - 1]).tobytes()
_LOOP = asyncio.new_event_loop()  # futures only: never run


def _pack(value: object) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def _good(c: Choices, rid: int) -> dict:
    """A reply of the usual shape for call `rid`'s kind, sometimes with a field the shape has not."""
    kind = KINDS[rid - 1] & 3
    worker = ("w-1", "", "ü")[c.below(3)]
    if kind == _codec.KIND_TEXT:
        reply: dict[str, Any] = {"id": rid, "ok": True, "text": "é" * c.below(5), "worker": worker}
    else:
        reply = {"id": rid, "ok": True, "tokens": U32[:4 * c.below(4)], "count": c.below(4), "worker": worker}
        if c.below(2):
            reply["cache"] = {"l0": ("hit", "miss", "off", "x")[c.below(4)], "l1_reused_tokens": c.below(9)}
        if kind == _codec.KIND_CHAT and c.below(2):
            reply["prompt"] = "p" if c.below(2) else None
    if c.below(4) == 0:
        reply[("truncated", "extra", "tokens", "text")[c.below(4)]] = c.below(3)
    if c.below(4) == 0:  # the same fields in another order
        reply = dict(reversed(list(reply.items())))
    return reply


def _twice(c: Choices) -> bytes:
    """A reply map with one key twice: `id` (the misread once: the first id's call got the second's
    body), a typed field, or any key."""
    pairs = [_pack("id") + _pack(1 + c.below(len(KINDS))), _pack("ok") + _pack(c.below(2) == 0),
             _pack("error") + _pack({"code": "overloaded", "message": "full"})]
    key = (b"\xa2id", b"\xa4text", b"\xa6tokens", b"\xa6worker", b"\xa5count", string(c))[c.below(6)]
    pairs += [key + any_value(c, 2), key + any_value(c, 2)]
    order = [pairs.pop(c.below(len(pairs))) for _ in range(len(pairs))]
    return map_head(c, len(order)) + b"".join(order)


def _malformed(c: Choices) -> bytes:
    """An element msgpack refuses, or reads only into what the codec must refuse."""
    rid = _pack(1 + c.below(len(KINDS)))
    k = c.below(5)
    if k == 0:  # bad UTF-8 where a reply has text
        return b"\x84\xa2id" + rid + b"\xa2ok\xc3\xa4text\xa2\xff\xfe\xa6worker\xa1w"
    if k == 1:  # a list as a map key
        return b"\x82\xa2id" + rid + b"\x91" + any_value(c, 3) + any_value(c, 3)
    if k == 2:  # a timestamp (ext -1) of a length msgpack refuses
        size = (1, 2, 16)[c.below(3)]
        return b"\x82\xa2id" + rid + b"\xa1t" + ((b"\xd4\xff" if size == 1 else b"\xd5\xff" if size == 2 else b"\xd8\xff")
                                                + c.take(size))
    if k == 3:  # a reply cut short (the frame's later elements then read from inside it)
        whole = _pack(_good(c, 1 + c.below(len(KINDS))))
        return whole[:c.below(len(whole))]
    return bytes([0xc1])  # the reserved byte


def element(c: Choices) -> bytes:
    shape = c.below(9)
    if shape <= 2:
        return _pack(_good(c, 1 + c.below(len(KINDS))))
    if shape == 3:
        return _pack({"id": 1 + c.below(len(KINDS)), "ok": False, "error": {"code": "overloaded", "message": "full"}})
    if shape == 4:
        return _pack({"id": (99, -1, "1", None, True, 1.0, [1])[c.below(7)], "ok": True})
    if shape == 5:
        return _twice(c)
    if shape == 6:
        return _malformed(c)
    return any_value(c, 1)


def frame(c: Choices) -> bytes:
    if c.below(4) == 0:
        body = element(c)
    else:
        n = c.below(13)
        body = array_head(c, n) + b"".join(element(c) for _ in range(n))
    mangle = c.below(8)
    if mangle == 0 and body:
        at = c.below(len(body))
        body = body[:at] + bytes([c.byte()]) + body[at + 1:]
    elif mangle == 1:
        body = body[:c.below(len(body) + 1)]
    return body


def _strict_pairs(pairs: list) -> dict:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ValueError("a map with a repeated key")
    return out


def reference(wire: bytes) -> tuple[bool, Any]:
    """msgpack's reading of the frame, a repeated key refused: (True, value) or (False, error)."""
    try:
        return True, msgpack.unpackb(wire, raw=False, strict_map_key=False, object_pairs_hook=_strict_pairs)
    except Exception as e:  # noqa: BLE001 - msgpack's every refusal (and a key it cannot hash) counts alike
        return False, e


def _overloaded(reply: object) -> bool:
    error = reply.get("error") if type(reply) is dict else None
    return type(reply) is dict and reply.get("ok") is not True and type(error) is dict and error.get("code") == "overloaded"


def _result(kind: int, reply: dict) -> object:
    """What a reply settles a call of `kind` with when the codec reads it into its result."""
    ids = "list" if kind >= 4 else "array"
    base = kind & 3
    if base == _codec.KIND_TOKENS:
        return res.tokens(reply, ids)  # type: ignore[arg-type]
    if base == _codec.KIND_TEXT:
        return res.text(reply)
    return res.chat_tokens(reply, ids)  # type: ignore[arg-type]


def check(wire: bytes) -> None:
    calls = {rid: _codec.Call(rid, b"", 0, KINDS[rid - 1], "op", _LOOP.create_future(), 0.0, 1.0) for rid in PENDING}
    pending = dict(calls)
    odd: list = []
    ok, ref = reference(wire)
    try:
        settled = _codec.settle(wire, calls, odd)
    except ValueError as e:
        assert not ok, f"msgpack reads {ref!r}, settle refused it: {e}"
        assert calls == pending and not odd, f"a refused frame handed back {odd!r} or settled calls"
        assert not any(call.future.done() for call in pending.values()), "a refused frame settled a call"
        return
    assert ok, f"msgpack (or the repeated-key rule) refuses ({ref!r}) what settle read"
    elements = ref if type(ref) is list else [ref]
    want: dict[int, dict] = {}
    back = []
    for e in elements:
        rid = e.get("id") if type(e) is dict else None
        if type(rid) is int and rid in pending and rid not in want and not _overloaded(e):
            want[rid] = e
        else:
            back.append(rid if type(e) is dict else None)
    assert settled == len(want), (settled, want)
    assert set(pending) - set(calls) == set(want), "settled calls"
    assert [rid for rid, _ in odd] == back, (odd, back)
    for rid, reply in want.items():
        got = pending[rid].future.result()
        if type(got) is dict:
            assert got == reply, (got, reply)
        else:
            assert got == _result(pending[rid].kind, reply), (got, reply)
    for rid in set(calls):
        assert not pending[rid].future.done()


def fuzz_one(data: bytes) -> None:
    check(frame(Choices(data)))


def seeds() -> list[bytes]:
    """Every element shape, in frames of a few (tests/test_fuzz_client.py checks the misreads themselves)."""
    out = [bytes([1, 3]) + bytes([shape]) * 60 for shape in range(9)]
    out += [bytes(pattern * 40) for pattern in (b"\x00", b"\x01\x02\x03", b"\x07\x05\x03\x02", b"\xff\x10\x40\x09")]
    return out


if __name__ == "__main__":
    run(fuzz_one, seeds)
