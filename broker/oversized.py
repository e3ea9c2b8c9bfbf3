"""The `id` of a frame too large to serve, read in place: nothing copied, nothing decoded.

A frame over --max-request-bytes is answered `too_large` with its id when the id can be read
(contract 1.2, "Limits that answer"). Such a frame may be 8x the limit (hundreds of MiB), so it
is never copied into a bytes object or fed to an Unpacker (which would copy it into its buffer):
this walks the MessagePack headers over a memoryview of ZeroMQ's own buffer, jumping over every
str, bin and ext by its length, until it finds the top-level key "id". Only the id's own bytes are
copied. The walk is bounded in steps (a map of a million tiny values is not worth reading).

>>> import msgpack
>>> frame = msgpack.packb({"op": "tokenize", "text": "x" * 100, "id": "r7"})
>>> id_in_place(memoryview(frame))
b'\\xa2r7'
>>> id_in_place(memoryview(b"\\xc1"))  # not MessagePack: no id
b'\\xc0'
"""

from __future__ import annotations

from tokenbroker.common._wire import id_problem
from tokenbroker.common.protocol import NIL

MAX_STEPS = 4096  # MessagePack values walked over before giving up on the id
MAX_ID_BYTES = 1024  # a longer id is not echoed (the reply would amplify a hostile frame's id)

_FIXED = {0xC0: 1, 0xC2: 1, 0xC3: 1, 0xCA: 5, 0xCB: 9, 0xCC: 2, 0xCD: 3, 0xCE: 5, 0xCF: 9,
          0xD0: 2, 0xD1: 3, 0xD2: 5, 0xD3: 9, 0xD4: 3, 0xD5: 4, 0xD6: 6, 0xD7: 10, 0xD8: 18}
# Length-prefixed values (str, bin, ext): the length's size, and the header bytes before the payload.
_SIZED = {0xD9: (1, 2), 0xDA: (2, 3), 0xDB: (4, 5), 0xC4: (1, 2), 0xC5: (2, 3), 0xC6: (4, 5),
          0xC7: (1, 3), 0xC8: (2, 4), 0xC9: (4, 6)}
_COUNTED = {0xDC: (2, 1), 0xDD: (4, 1), 0xDE: (2, 2), 0xDF: (4, 2)}  # array16/32, map16/32: (size, values per item)
_ID_KEY = b"\xa2id"


def _uint(view: memoryview, at: int, size: int) -> int:
    if at + size > len(view):
        raise IndexError
    return int.from_bytes(view[at:at + size], "big")


def value_header(view: memoryview, at: int) -> tuple[int, int]:
    """(where the value at `at` ends, how many values it contains that follow it)."""
    b = view[at]
    if b <= 0x7F or b >= 0xE0:
        return at + 1, 0
    if 0xA0 <= b <= 0xBF:
        return at + 1 + (b & 0x1F), 0
    if 0x90 <= b <= 0x9F:
        return at + 1, b & 0x0F
    if 0x80 <= b <= 0x8F:
        return at + 1, 2 * (b & 0x0F)
    if b in _FIXED:
        return at + _FIXED[b], 0
    if b in _SIZED:
        size, head = _SIZED[b]
        return at + head + _uint(view, at + 1, size), 0
    if b in _COUNTED:
        size, per = _COUNTED[b]
        return at + 1 + size, per * _uint(view, at + 1, size)
    raise ValueError(f"0x{b:02x} is not MessagePack")


def _skip(view: memoryview, at: int, budget: list[int]) -> int:
    """Where the value at `at` ends (containers included), charging each value walked to `budget`."""
    pending = 1
    while pending:
        budget[0] -= 1
        if budget[0] < 0:
            raise ValueError("too many values")
        at, inner = value_header(view, at)
        pending += inner - 1
    if at > len(view):
        raise IndexError
    return at


def id_in_place(view: memoryview) -> bytes:
    """The raw MessagePack bytes of the payload map's top-level `id`, or nil when it cannot be read."""
    try:
        end, fields = value_header(view, 0)
        if not (0x80 <= view[0] <= 0x8F or view[0] in (0xDE, 0xDF)):
            return NIL
        budget = [MAX_STEPS]
        at = end
        for _ in range(fields // 2):
            key_end = _skip(view, at, budget)
            is_id = view[at:key_end] == _ID_KEY
            value_end = _skip(view, key_end, budget)
            if is_id:
                return _checked_id(bytes(view[key_end:value_end]))
            at = value_end
    except (IndexError, ValueError):
        pass
    return NIL


def _checked_id(raw: bytes) -> bytes:
    """The id as it came when a reply may echo it (common/_wire.pxd states which), else nil."""
    if len(raw) > MAX_ID_BYTES:
        return NIL
    return raw if id_problem(raw) is None else NIL
