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

import sys
from pathlib import Path

import msgpack

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import Choices, run  # noqa: E402
from _msgpack_values import any_value, array_head, nested, nesting_depth, reference, request  # noqa: E402

from tokenbroker.common._wire import MAX_DEPTH, WireError, skip_value  # noqa: E402

DEPTHS = (0, 1, 2, 3, 8, 63, 64, 65, 100, 1023, 1024, 1025, 1 << 20)


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
        deep = nesting_depth(ref)
        if deep > bound:
            assert fault == "too_deep", f"depth {deep} > bound {bound}: skip gave end={end} fault={fault}"
        else:
            assert end == ref_end, f"msgpack ends at {ref_end}, skip at {end} (fault {fault}); depth {deep}"
    elif end is not None:
        stricter = isinstance(ref, msgpack.StackError) or any(w in str(ref) for w in ("timestamp", "nanoseconds"))
        assert stricter, f"msgpack refuses ({ref!r}) what skip_value skips to {end}"
        assert pos < end <= len(wire)


def fuzz_one(data: bytes) -> None:
    c = Choices(data)
    shape = c.below(6)
    c.lies = c.below(4) == 0
    if shape == 0:
        body = bytes(c.take(c.left()))
    elif shape == 1:
        body = request(c)
    elif shape == 2:
        n = c.below(70)
        body = array_head(c, n) + b"".join(request(c) for _ in range(n))
    elif shape == 3:
        body = any_value(c, 0)
    elif shape == 4:
        whole = any_value(c, 0) if c.below(2) else request(c)
        body = whole[:c.below(len(whole) + 1)]
    else:
        body = nested(c)
    present = c.byte()
    junk = bytes(c.take(c.below(4))) if present & 1 else b""
    wire = bytearray(junk + body)
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
