"""The broker's compiled request path (broker/_core.pyx) against hostile frames, through a real
broker: what it refuses itself (never forwarded), at what CPU, while small requests keep flowing."""

from __future__ import annotations

import msgpack
import pytest

from helpers import Conn, cpu_seconds, error_code, start_broker
from tokenbroker.broker._core import MAX_DEPTH, MAX_FIELDS


@pytest.fixture(scope="module")
def broker():
    b = start_broker(workers=1)
    yield b
    b.stop()


def test_a_value_nested_a_million_deep_under_an_unknown_key_is_refused_by_the_broker(broker) -> None:
    conn = Conn(broker.endpoint)
    try:
        deep = b"\x84\xa2id\xa4deep\xa2op\xa8tokenize\xa4text\xa2hi\xa4junk" + b"\x91" * 1_000_000 + b"\xc0"
        conn.send_raw(b"", deep)
        reply = conn.recv()
        assert error_code(reply) == "bad_request" and reply["id"] == "deep"
        assert f"nested deeper than {MAX_DEPTH} levels" in reply["error"]["message"]  # the broker's words, not a worker's
        conn.send_raw(b"", b"\x91" + deep)  # the same request as the one element of an array
        arr = conn.recv()
        assert isinstance(arr, dict) and error_code(arr) == "bad_request" and arr["id"] is None
        assert conn.call("tokenize", text="still served")["ok"]
    finally:
        conn.close()


def test_maps_of_three_million_unknown_keys_are_refused_by_the_broker_with_their_id(broker) -> None:
    conn, small = Conn(broker.endpoint), Conn(broker.endpoint)
    try:
        keys = 3_000_000
        body = {f"k{i}": 0 for i in range(keys)}
        body.update({"op": "tokenize", "text": "x"})
        frames = [msgpack.packb({**body, "id": f"big{n}"}) for n in range(6)]  # the id last: found by walking
        assert len(frames[0]) > 25_000_000
        before = cpu_seconds(broker.proc.pid)
        for frame in frames:
            conn.send_raw(b"", frame)
        ids = set()
        for _ in range(6):
            reply = conn.recv(timeout=120)
            assert error_code(reply) == "bad_request" and f"at most {MAX_FIELDS}" in reply["error"]["message"]
            ids.add(reply["id"])
        assert ids == {f"big{n}" for n in range(6)}
        spent = cpu_seconds(broker.proc.pid) - before
        assert spent < 6 * 0.25, f"the broker spent {spent:.2f} s of CPU on six hostile maps"  # ~30 ms each, loaded machine
        assert small.call("tokenize", text="meanwhile")["ok"]
    finally:
        conn.close()
        small.close()
