"""MessagePack values built header by header from the fuzzer's choices, for every fuzz target that
reads requests (tests/fuzz/_harness.py's Choices), and msgpack's own reading of bytes, the reference.

The builders write the wire form directly, not through msgpack.packb, so they reach what msgpack
never writes: every width of every header (a 3-byte str in a str32 header, a map16 of one pair),
reserved ext types, 0xc1, and (where `Choices.lies`) headers whose length claims more than follows.

- `any_value(c, depth)`: any value, containers to 12 deep;
- `request(c)`: one map shaped like a request, the protocol's keys (KNOWN_KEYS, sometimes twice)
  among unknown ones, any values;
- `array_head(c, n)` + n requests: a contract-1.2 array;
- `nested(c)`: containers of one item, up to 1,200 deep, under map keys or in arrays;
- `reference(wire, pos)`: msgpack's verdict on the value at pos, ("ok", end, value) or
  ("refused", 0, error), maps read as `Pairs`; `nesting_depth(value)`: the most non-empty
  containers on one path of it.
"""

from __future__ import annotations

import struct

import msgpack

from _harness import Choices

KNOWN_KEYS = (b"id", b"op", b"text", b"model", b"tokens_format", b"messages", b"deadline_ms", b"ids",
              b"add_special_tokens", b"options")


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


def _lie(c: Choices, header: bytes) -> bytes:
    """Now and then, in an input allowed to lie, a header whose length claims more than follows,
    up to 2^32-1 (one lie spoils the whole value, so most inputs tell the truth)."""
    if not c.lies or c.below(8) != 0 or len(header) == 1:
        return header
    return header[:1] + bytes([0xff]) * (len(header) - 1)


def string(c: Choices, payload: bytes | None = None) -> bytes:
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


def scalar(c: Choices) -> bytes:
    k = c.below(10)
    if k == 0:
        return bytes([(0xc0, 0xc2, 0xc3)[c.below(3)]])
    if k == 1:
        return b"\xca" + c.take(4) if c.below(2) else b"\xcb" + c.take(8)
    if k == 2:
        return _int(c)
    if k == 3:
        return string(c)
    if k == 4:
        return _bin(c)
    if k == 5:
        return _ext(c)
    if k == 6:
        return bytes([c.byte()])  # any header byte at all, 0xc1 included
    return _uint(c)


def array_head(c: Choices, n: int) -> bytes:
    return _lie(c, _sized(c, 0x90, 15, ((0xdc, 2), (0xdd, 4)), n))


def map_head(c: Choices, n: int) -> bytes:
    return _lie(c, _sized(c, 0x80, 15, ((0xde, 2), (0xdf, 4)), n))


def any_value(c: Choices, depth: int) -> bytes:
    k = c.below(8)
    if depth >= 12 or c.left() <= 0 or k < 5:
        return scalar(c)
    n = c.below(8) if c.below(8) else c.below(300)
    if k == 5 or k == 6:
        return array_head(c, n) + b"".join(any_value(c, depth + 1) for _ in range(n))
    return map_head(c, n) + b"".join(any_value(c, depth + 1) + any_value(c, depth + 1) for _ in range(n))


def request(c: Choices) -> bytes:
    """One map shaped like a request: known keys (sometimes twice) among unknown ones, any values."""
    n = c.below(12)
    pairs = []
    for _ in range(n):
        if c.below(3):
            key = string(c, KNOWN_KEYS[c.below(len(KNOWN_KEYS))])
        else:
            key = any_value(c, 1)
        pairs.append(key + any_value(c, 1))
    return map_head(c, n) + b"".join(pairs)


def nested(c: Choices) -> bytes:
    """Containers of one item (arrays, or maps holding it under a key), `levels` deep, then a leaf:
    a pattern of up to four such heads, repeated (building each level alone cost most of a run)."""
    levels = c.below(1200) if c.below(2) else c.below(80)
    pattern = []
    for _ in range(1 + c.below(4)):
        pattern.append(map_head(c, 1) + string(c, b"k") if c.below(4) == 0 else array_head(c, 1))
    heads = (pattern * (levels // len(pattern) + 1))[:levels]
    return b"".join(heads) + any_value(c, 11)


class Pairs(list):
    """A map as `reference` reads it: its (key, value) pairs in order, a repeated key kept. A type of
    its own, so that `nesting_depth` never takes an array of tuples (an ExtType is one) for a map."""


def nesting_depth(value: object) -> int:
    """The most non-empty containers on one path of a decoded value (maps as `Pairs` or dicts,
    arrays as lists or tuples; an ExtType is a leaf): the depth the skipper counts. Iterative
    (values reach 1024 deep, Python's recursion limit is 1000)."""
    best = 0
    stack = [(value, 0)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, msgpack.ExtType) or not isinstance(v, (list, tuple, dict)) or not v:
            continue
        d += 1
        best = max(best, d)
        if isinstance(v, Pairs):
            stack.extend((x, d) for pair in v for x in pair)
        elif isinstance(v, dict):
            stack.extend((x, d) for pair in v.items() for x in pair)
        else:
            stack.extend((x, d) for x in v)
    return best


def _ext_value(code: int, data: bytes) -> bytes:
    """Any ext type as plain bytes (msgpack's ExtType refuses the reserved negative codes, which
    the wire allows and the skipper skips)."""
    return data


def reference(wire: bytes, pos: int) -> tuple[str, int, object]:
    """msgpack's reading of the value at `pos`: ("ok", end, value) or ("refused", 0, the error)."""
    unpacker = msgpack.Unpacker(raw=True, strict_map_key=False, object_pairs_hook=Pairs, use_list=True,
                                ext_hook=_ext_value, max_buffer_size=max(len(wire), 1))
    unpacker.feed(wire[pos:])
    try:
        value = unpacker.unpack()
    except (msgpack.OutOfData, ValueError) as e:  # FormatError, StackError are ValueErrors
        return "refused", 0, e
    return "ok", pos + unpacker.tell(), value
