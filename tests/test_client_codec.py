"""The client's codec (msgspec) against msgpack, the contract's reference codec: same request
bytes for the bodies the client packs on its fast path, same values for every reply shape."""

from __future__ import annotations

from array import array

import msgpack
import pytest

from tokenbroker._client_core import _decode, _encode

U32 = array("I", [0, 1, 0xFFD6, 2**32 - 1, 128000]).tobytes()

BODIES = [
    {"op": "tokenize", "text": "Hello, world!", "add_special_tokens": True, "tokens_format": "u32", "id": 1,
     "deadline_ms": 30000},
    {"op": "tokenize", "text": "日本語 🙂" * 500, "add_special_tokens": False, "tokens_format": "u32", "model": "m",
     "affinity": "a" * 40, "id": 2**40, "deadline_ms": 1},
    {"op": "ping", "id": 7, "deadline_ms": 2000},
    {"op": "detokenize_stream", "columns": {"tokens": U32, "lengths": b"\x01\x00\x00\x00" * 5, "states": b"",
                                            "state_lengths": b"\x00" * 20, "final": b"\x01" * 5},
     "model": "m", "id": 3, "deadline_ms": 99},
    {"op": "tokenize", "text": "x" * 70000, "id": 4, "deadline_ms": 5},
]

REPLIES = [
    {"id": 1, "ok": True, "tokens": U32, "count": 5, "worker": "w-1", "cache": {"hit": False, "level": None}},
    {"id": 2, "ok": False, "error": {"code": "overloaded", "message": "queue full"}},
    {"id": 3, "ok": True, "columns": {"text": "é".encode(), "text_lengths": b"\x02\x00\x00\x00", "states": b"s",
                                      "state_lengths": b"\x01\x00\x00\x00", "finished": b"\x01",
                                      "stops": {0: "stop", 3: 17}}},
    [{"id": i, "ok": True, "text": "t" * i, "worker": ""} for i in range(20)],
    {"id": -(2**63), "ok": True, "big": 2**64 - 1, "f": 1.5, "none": None, "list": [1, [2, [3]]], b"k": 1, 1.5: 2},
    {"id": 9, "ok": True, "tokens": b"\x00" * 70000, "text": "x" * 70000},
    {"id": 10, "ok": True, "ext": msgpack.ExtType(5, b"ab")},
    "not a map",
    [],
]


@pytest.mark.parametrize("body", BODIES, ids=range(len(BODIES)))
def test_requests_pack_to_msgpacks_bytes(body: dict) -> None:
    assert _encode(body) == msgpack.Packer(use_bin_type=True).pack(body)


@pytest.mark.parametrize("reply", REPLIES, ids=range(len(REPLIES)))
def test_replies_decode_to_msgpacks_values(reply: object) -> None:
    wire = msgpack.packb(reply, use_bin_type=True)
    assert _decode(wire) == msgpack.unpackb(wire, raw=False, strict_map_key=False)


@pytest.mark.parametrize("wire", [b"", b"\xc1", b"\x92\x01", msgpack.packb({"id": 1}) + b"\x00",
                                  b"\x81\xa1a\xd4\xfbx"], ids=["empty", "reserved", "short", "extra", "ext-negative"])
def test_frames_msgpack_refuses_are_refused(wire: bytes) -> None:
    with pytest.raises(Exception):
        msgpack.unpackb(wire, raw=False, strict_map_key=False)
    with pytest.raises(Exception):
        _decode(wire)
