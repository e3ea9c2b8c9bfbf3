"""Fuzz target: common/_wire's `skip_value` (the bounded MessagePack skipper both cores cimport)
against msgpack's own unpacker.

Each input is read as decisions (tests/fuzz/_harness.py's Choices): a shape, then the value built
header by header, then how to present it (junk before it, a cut, a flipped byte, the depth bound,
bytes or bytearray). Shapes: the raw bytes themselves; one map shaped like a request (known keys
among unknown ones, every width of header); an array of such maps (contract 1.2); any value; a
cut-off value; containers nested hundreds to over a thousand deep under a map key.

The oracle, for the value at `pos` under the bound `max_depth` (D = the most non-empty containers
on one path, the depth the skipper counts; bound = min(max(max_depth, 0), 1024)):

- skip_value never raises anything but WireError and never crashes (the process is the check);
- where msgpack decodes a value there, the skipper ends exactly where msgpack's `tell()` does if
  D <= bound, and refuses it `too_deep` if D > bound;
- where msgpack refuses the bytes (truncated, 0xc1, a container longer than the bytes), the
  skipper refuses them too. The one place msgpack is stricter by design: ext type -1 is its
  timestamp, and msgpack refuses one of the wrong length, which the skipper skips like any ext;
  and msgpack's own stack stops at 1024 levels.

Run by hand: .venv/bin/python tests/fuzz/fuzz_wire.py -max_total_time=300
"""

from __future__ import annotations

import struct
import sys
from pathlib import Path

import msgpack

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import Choices, run  # noqa: E402

from tokenbroker.common._wire import MAX_DEPTH, WireError, skip_value  # noqa: E402

KNOWN_KEYS = (b"id", b"op", b"text", b"model", b"tokens_format", b"messages", b"deadline_ms", b"ids",
              b"add_special_tokens", b"options")
DEPTHS = (0, 1, 2, 3, 8, 63, 64, 65, 100, 1023, 1024, 1025, 1 << 20)


def _uint(c: Choices) -> bytes:
    w = c.below(5)
    if w == 0:
        return bytes([c.below(128)])
    fmt = (">B", ">H", ">I", ">Q")[w - 1]
    return bytes([0xcb + w]) + c.take(struct.calcsize(fmt))


def _int(c: Choices) -> bytes:
    w = c.below(5)
    if w == 0:
        return bytes([0xe0 | c.below(32)])
    return bytes([0xcf + w]) + c.take(1 << (w - 1))


def _sized(c: Choices, fix: int | None, fix_max: int, codes: tuple[tuple[int, int], ...], n: int) -> bytes:
    """A header for `n` (bytes, items or pairs) in one of the widths that can hold it; fix if
    `fix` is given and n fits (msgpack writes the narrowest; the wire allows any)."""
    forms = []
    if fix is not None and n <= fix_max:
        forms.append(bytes([fix | n]))
    for code, width in codes:
        if n < 1 << (8 * width):
            forms.append(bytes([code]) + n.to_bytes(width, "big"))
    return forms[c.below(len(forms))]


class WireChoices(Choices):
    lies = False  # whether this input's headers may claim more than follows (a quarter of inputs)


def _lie(c: Choices, header: bytes) -> bytes:
    """Now and then, in an input allowed to lie, a header whose length claims more than follows,
    up to 2^32-1 (one lie spoils the whole value, so most inputs tell the truth)."""
    if not getattr(c, "lies", False) or c.below(8) != 0 or len(header) == 1:
        return header
    return header[:1] + bytes([0xff]) * (len(header) - 1)


def _str(c: Choices, payload: bytes | None = None) -> bytes:
    if payload is None:
        payload = c.take(c.below(40) if c.below(8) else c.below(70000))
    return _lie(c, _sized(c, 0xa0, 31, ((0xd9, 1), (0xda, 2), (0xdb, 4)), len(payload))) + payload


def _bin(c: Choices) -> bytes:
    payload = c.take(c.below(40))
    return _lie(c, _sized(c, None, 0, ((0xc4, 1), (0xc5, 2), (0xc6, 4)), len(payload))) + payload


def _ext(c: Choices) -> bytes:
    kind = c.byte()
    fixed = c.below(6)
    if fixed < 5:
        return bytes([0xd4 + fixed, kind]) + c.take(1 << fixed)
    payload = c.take(c.below(40))
    head = _sized(c, None, 0, ((0xc7, 1), (0xc8, 2), (0xc9, 4)), len(payload))
    return _lie(c, head) + bytes([kind]) + payload


def _scalar(c: Choices) -> bytes:
    k = c.below(10)
    if k == 0:
        return bytes([(0xc0, 0xc2, 0xc3)[c.below(3)]])
    if k == 1:
        return b"\xca" + c.take(4) if c.below(2) else b"\xcb" + c.take(8)
    if k == 2:
        return _int(c)
    if k == 3:
        return _str(c)
    if k == 4:
        return _bin(c)
    if k == 5:
        return _ext(c)
    if k == 6:
        return bytes([c.byte()])  # any header byte at all, 0xc1 included
    return _uint(c)


def _array_head(c: Choices, n: int) -> bytes:
    return _lie(c, _sized(c, 0x90, 15, ((0xdc, 2), (0xdd, 4)), n))


def _map_head(c: Choices, n: int) -> bytes:
    return _lie(c, _sized(c, 0x80, 15, ((0xde, 2), (0xdf, 4)), n))


def _value(c: Choices, depth: int) -> bytes:
    k = c.below(8)
    if depth >= 12 or c.left() <= 0 or k < 5:
        return _scalar(c)
    n = c.below(8) if c.below(8) else c.below(300)
    if k == 5 or k == 6:
        return _array_head(c, n) + b"".join(_value(c, depth + 1) for _ in range(n))
    return _map_head(c, n) + b"".join(_value(c, depth + 1) + _value(c, depth + 1) for _ in range(n))


def _request(c: Choices) -> bytes:
    """One map shaped like a request: known keys (sometimes twice) among unknown ones, any values."""
    n = c.below(12)
    pairs = []
    for _ in range(n):
        if c.below(3):
            key = _str(c, KNOWN_KEYS[c.below(len(KNOWN_KEYS))])
        else:
            key = _value(c, 1)
        pairs.append(key + _value(c, 1))
    return _map_head(c, n) + b"".join(pairs)


def _nested(c: Choices) -> bytes:
    """Containers of one item (arrays, or maps holding it under a key), `levels` deep, then a leaf:
    a pattern of up to four such heads, repeated (building each level alone cost most of a run)."""
    levels = c.below(1200) if c.below(2) else c.below(80)
    pattern = []
    for _ in range(1 + c.below(4)):
        pattern.append(_map_head(c, 1) + _str(c, b"k") if c.below(4) == 0 else _array_head(c, 1))
    heads = (pattern * (levels // len(pattern) + 1))[:levels]
    return b"".join(heads) + _value(c, 11)


def _depth(value: object) -> int:
    """The most non-empty containers on one path of a value msgpack decoded (maps as lists of
    (key, value) tuples, arrays as lists): the depth the skipper counts. Iterative (values reach
    1024 deep, Python's recursion limit is 1000)."""
    best = 0
    stack = [(value, 0)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, list) and v:
            d += 1
            best = max(best, d)
            if isinstance(v[0], tuple):
                stack.extend((x, d) for pair in v for x in pair)
            else:
                stack.extend((x, d) for x in v)
    return best


def _ext_value(code: int, data: bytes) -> bytes:
    """Any ext type as plain bytes (msgpack's ExtType refuses the reserved negative codes, which
    the wire allows and the skipper skips)."""
    return data


def reference(wire: bytes, pos: int) -> tuple[str, int, object]:
    """msgpack's reading of the value at `pos`: ("ok", end, value) or ("refused", 0, the error)."""
    unpacker = msgpack.Unpacker(raw=True, strict_map_key=False, object_pairs_hook=list, use_list=True,
                                ext_hook=_ext_value, max_buffer_size=max(len(wire), 1))
    unpacker.feed(wire[pos:])
    try:
        value = unpacker.unpack()
    except (msgpack.OutOfData, ValueError) as e:  # FormatError, StackError are ValueErrors
        return "refused", 0, e
    return "ok", pos + unpacker.tell(), value


def check(wire: bytes | bytearray, pos: int, max_depth: int) -> None:
    try:
        end: int | None = skip_value(wire, pos, max_depth)
        fault = None
    except WireError as e:
        end, fault = None, e.fault
    if pos < 0 or pos > len(wire):
        assert fault == "truncated", (pos, len(wire), end, fault)
        return
    verdict, ref_end, ref = reference(bytes(wire), pos)
    if verdict == "ok":
        bound = min(max(max_depth, 0), MAX_DEPTH)
        depth = _depth(ref)
        if depth > bound:
            assert fault == "too_deep", f"depth {depth} > bound {bound}: skip gave end={end} fault={fault}"
        else:
            assert end == ref_end, f"msgpack ends at {ref_end}, skip at {end} (fault {fault}); depth {depth}"
    elif end is not None:
        stricter = isinstance(ref, msgpack.StackError) or any(w in str(ref) for w in ("timestamp", "nanoseconds"))
        assert stricter, f"msgpack refuses ({ref!r}) what skip_value skips to {end}"
        assert pos < end <= len(wire)


def fuzz_one(data: bytes) -> None:
    c = WireChoices(data)
    shape = c.below(6)
    c.lies = c.below(4) == 0
    if shape == 0:
        value = bytes(c.take(c.left()))
    elif shape == 1:
        value = _request(c)
    elif shape == 2:
        n = c.below(70)
        value = _array_head(c, n) + b"".join(_request(c) for _ in range(n))
    elif shape == 3:
        value = _value(c, 0)
    elif shape == 4:
        whole = _value(c, 0) if c.below(2) else _request(c)
        value = whole[:c.below(len(whole) + 1)]
    else:
        value = _nested(c)
    present = c.byte()
    junk = bytes(c.take(c.below(4))) if present & 1 else b""
    wire = bytearray(junk + value)
    if present & 2 and wire:  # one corrupted byte
        wire[c.below(len(wire))] = c.byte()
    if present & 4:  # trailing bytes after the value
        wire += c.take(c.below(8))
    pos = len(junk)
    if present & 8 and c.below(4) == 0:  # a position outside the bytes
        pos = (-1, len(wire), len(wire) + 1, 0)[c.below(4)]
    max_depth = DEPTHS[c.below(len(DEPTHS))] if present & 16 else 64
    check(wire if present & 32 else bytes(wire), pos, max_depth)


def seeds() -> list[bytes]:
    """Starting inputs: each shape once with a few choice patterns, so the first runs already
    reach every branch of the generators."""
    out = [bytes([shape]) + bytes(pattern * 40) for shape in range(6)
           for pattern in (b"\x00", b"\x01\x02\x03", b"\x07\x05\x03\x02", b"\xff\x10\x40\x09")]
    out.append(b"\x00" + msgpack.packb({"id": 1, "op": "tokenize", "text": "hello"}))
    out.append(b"\x00" + msgpack.packb([{"id": i, "op": "tokenize", "text": "x" * i} for i in range(5)]))
    return out


if __name__ == "__main__":
    run(fuzz_one, seeds)
