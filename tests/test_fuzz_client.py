"""The client codec's fuzz target (tests/fuzz/fuzz_client_codec.py) on the frames that once were
misread, and its oracle shown able to fail: a reader that settles a frame's elements one by one
(what the codec did: the first reply settled, then the malformed second raised) is caught.
tests/test_fuzz.py replays the target's seeds and runs it under atheris like every target."""

from __future__ import annotations

import random
import sys
from pathlib import Path
from types import ModuleType

import msgpack
import pytest

from tokenbroker import _codec

FUZZ = Path(__file__).parent / "fuzz"


@pytest.fixture(scope="module")
def target() -> ModuleType:
    sys.path.insert(0, str(FUZZ))
    try:
        import fuzz_client_codec
    finally:
        sys.path.remove(str(FUZZ))
    return fuzz_client_codec


GOOD = msgpack.packb({"id": 2, "ok": True, "text": "a", "worker": "w"})
LATE = msgpack.packb({"id": 99, "ok": True})
MISREAD = {
    # `id` twice: the call of the first id was settled with the body, an overloaded error included
    "id-twice-overloaded": b"\x84\xa2id\x01\xa2ok\xc2\xa5error\x81\xa4code\xaaoverloaded\xa2id\x03",
    "id-twice": b"\x85\xa2id\x01\xa2ok\xc3\xa6tokens\xc4\x00\xa5count\x00\xa2id\x03",
    # a good reply, then a malformed element: the first call was settled, then the frame raised
    "bad-utf8": b"\x93" + GOOD + b"\x84\xa2id\x04\xa2ok\xc3\xa4text\xa2\xff\xfe\xa6worker\xa1w" + LATE,
    "list-key": b"\x93" + GOOD + b"\x81\x91\x01\x02" + LATE,
    "timestamp-1-byte": b"\x93" + GOOD + b"\x82\xa2id\x04\xa1t\xd4\xff\x00" + LATE,
}


@pytest.mark.parametrize("wire", MISREAD.values(), ids=MISREAD.keys())
def test_the_misread_frames_are_refused_whole(target: ModuleType, wire: bytes) -> None:
    assert target.reference(wire)[0] is False  # malformed, by msgpack or the repeated-key rule
    target.check(wire)  # settle refuses it: nothing settled, nothing handed back


def test_good_frames_settle_every_call_they_name(target: ModuleType) -> None:
    wire = msgpack.packb([{"id": 2, "ok": True, "text": "é", "worker": "w"},
                          {"id": 1, "ok": False, "error": {"code": "overloaded", "message": "m"}},
                          {"id": 4, "ok": True, "tokens": b"\x01\x00\x00\x00", "count": 1, "worker": "w"}, LATE, 7])
    target.check(wire)


class _ElementWise:
    """The codec's reader as it was: each element of an array settled as it is read, so a
    malformed later one raises after earlier calls were settled."""

    def __getattr__(self, name: str) -> object:
        return getattr(_codec, name)

    @staticmethod
    def settle(wire: bytes, calls: dict, odd: list) -> int:
        unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
        unpacker.feed(wire)
        try:
            n = unpacker.read_array_header()
        except Exception:
            return _codec.settle(wire, calls, odd)
        at, settled = unpacker.tell(), 0
        for _ in range(n):
            unpacker.skip()
            settled += _codec.settle(wire[at:unpacker.tell()], calls, odd)
            at = unpacker.tell()
        return settled


def test_the_oracle_catches_a_reader_that_settles_before_it_has_read_the_frame(target: ModuleType,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(target, "_codec", _ElementWise())
    for name in ("bad-utf8", "timestamp-1-byte"):
        with pytest.raises(AssertionError):
            target.check(MISREAD[name])


def test_random_inputs(target: ModuleType) -> None:
    """A few thousand inputs in process (atheris' guided run is tests/test_fuzz.py's)."""
    rng = random.Random(39)
    for _ in range(3000):
        target.fuzz_one(rng.randbytes(rng.randrange(240)))
