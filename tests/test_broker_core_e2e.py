"""The broker's compiled request path (broker/_peek.pyx) against hostile frames, through a real
broker: what it refuses itself (never forwarded), at what CPU and memory, while small requests keep
flowing. Contract 1.4's bounds on a request (PROTOCOL.md, "Version 1.4 additions"): 4,096 fields a
map, 100 levels of nesting (an array's element alone), each key once, 4,096 requests an array."""

from __future__ import annotations

import msgpack
import pytest

from helpers import Conn, cpu_seconds, error_code, rss, start_broker
from tokenbroker.broker._peek import MAX_ARRAY_REQUESTS, MAX_DEPTH, MAX_FIELDS

pack = msgpack.packb


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
        conn.send_raw(b"", b"\x91" + deep)  # the same request as the one element of an array: answered alone, with its id
        arr = conn.recv()
        assert isinstance(arr, dict) and error_code(arr) == "bad_request" and arr["id"] == "deep"
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


def replies(conn: Conn, count: int, timeout: float = 60.0) -> list[dict]:
    """`count` replies, arrays of replies unpacked."""
    out: list[dict] = []
    while len(out) < count:
        value = msgpack.unpackb(conn.recv_frames(timeout)[-1], raw=False)
        out.extend(value if isinstance(value, list) else [value])
    assert len(out) == count, f"{len(out)} replies, expected {count}"
    return out


def raw_map(*pairs: tuple[str, object]) -> bytes:
    """A map written pair by pair, so a key may come twice (a dict cannot say that)."""
    return bytes([0x80 | len(pairs)]) + b"".join(pack(k) + pack(v) for k, v in pairs)


def test_a_deep_element_of_an_array_is_answered_alone_and_the_others_are_served(broker) -> None:
    conn = Conn(broker.endpoint)
    try:
        too_deep = b"\x91" * (MAX_DEPTH + 1) + b"\xc0"
        deep_first = b"\x83\xa4junk" + too_deep + b"\xa2id\xa2d1\xa2op\xa4ping"  # its id after the deep value
        deep_last = b"\x83\xa2id\xa2d2\xa2op\xa4ping\xa4junk" + too_deep
        at_bound = b"\x83\xa2id\xa2ok\xa2op\xa4ping\xa4junk" + b"\x91" * MAX_DEPTH + b"\xc0"
        conn.send_raw(b"", b"\x95" + pack({"id": 1, "op": "tokenize", "text": "served"}) + deep_first + at_bound
                      + deep_last + pack({"id": 2, "op": "ping"}))
        got = {r["id"]: r for r in replies(conn, 5)}
        assert set(got) == {1, 2, "d1", "d2", "ok"}
        for rid in ("d1", "d2"):
            assert error_code(got[rid]) == "bad_request"
            assert f"nested deeper than {MAX_DEPTH} levels" in got[rid]["error"]["message"]
        assert got[1]["ok"] and got[2]["ok"] and got["ok"]["ok"]
    finally:
        conn.close()


@pytest.mark.parametrize("pairs, key, rid", [
    ((("id", "s"), ("op", "tokenize"), ("text", "a"), ("text", "b")), "text", "s"),  # scalar values alike
    ((("id", "u"), ("op", "tokenize"), ("text", "a"), ("x", 1), ("x", [1])), "x", "u"),  # an unknown key
    ((("id", 1), ("op", "tokenize"), ("text", "a"), ("id", 2)), "id", None),  # which id? none is echoed
    ((("id", [1]), ("op", "tokenize"), ("text", "a"), ("id", 2)), None, None),  # the id's type is the first fault
])
def test_a_request_map_with_a_repeated_key_is_refused_naming_it(broker, pairs, key, rid) -> None:
    conn = Conn(broker.endpoint)
    try:
        conn.send_raw(b"", raw_map(*pairs))
        reply = conn.recv()
        assert error_code(reply) == "bad_request" and reply["id"] == rid
        if key is not None:
            assert f"key {key!r} twice" in reply["error"]["message"]
        conn.send_raw(b"", b"\x92" + raw_map(*pairs) + pack({"id": "fine", "op": "ping"}))  # in an array: alone
        got = {r["id"]: r for r in replies(conn, 2)}
        assert error_code(got[rid]) == "bad_request" and got["fine"]["ok"]
    finally:
        conn.close()


def test_a_map_at_the_field_bound_is_served_and_one_over_is_refused_with_its_id(broker) -> None:
    conn = Conn(broker.endpoint)
    try:
        fields = {f"k{i}": 0 for i in range(MAX_FIELDS - 3)}
        conn.send({"id": "at", "op": "tokenize", "text": "x", **fields})
        assert conn.recv()["ok"]
        conn.send({"id": "over", "op": "tokenize", "text": "x", "k-one-more": 0, **fields})
        reply = conn.recv()
        assert error_code(reply) == "bad_request" and reply["id"] == "over"
        assert f"at most {MAX_FIELDS}" in reply["error"]["message"]
    finally:
        conn.close()


def test_an_array_over_the_request_bound_gets_one_reply_and_nothing_in_it_is_served(broker) -> None:
    conn = Conn(broker.endpoint)
    try:
        conn.send_raw(b"", pack([{"id": i, "op": "ping"} for i in range(MAX_ARRAY_REQUESTS + 1)]))
        conn.send({"id": "after", "op": "ping"})
        got = []
        while not got or got[-1]["id"] != "after":
            got.extend(replies(conn, 1))
        assert len(got) == 2, f"{len(got) - 1} replies to the array"
        assert error_code(got[0]) == "bad_request" and got[0]["id"] is None
        assert f"at most {MAX_ARRAY_REQUESTS}" in got[0]["error"]["message"]
        conn.send_raw(b"", pack([{"id": i, "op": "ping"} for i in range(MAX_ARRAY_REQUESTS)]))  # at the bound: served
        assert sorted(r["id"] for r in replies(conn, MAX_ARRAY_REQUESTS) if r["ok"]) == list(range(MAX_ARRAY_REQUESTS))
    finally:
        conn.close()


def test_hostile_arrays_cost_the_broker_one_bounded_pass(broker) -> None:
    """4,000,000 empty maps in one 4 MB frame: one reply, no memory or CPU to speak of; 4,096 empty
    maps (each refused: no op) cost 4,096 small replies, no exception kept per element."""
    conn, small = Conn(broker.endpoint), Conn(broker.endpoint)
    pid = broker.proc.pid
    try:
        huge = b"\xdd" + (4_000_000).to_bytes(4, "big") + b"\x80" * 4_000_000
        bound = b"\xdc" + MAX_ARRAY_REQUESTS.to_bytes(2, "big") + b"\x80" * MAX_ARRAY_REQUESTS
        assert small.call("ping")["ok"]
        before_rss, before_cpu = rss(pid), cpu_seconds(pid)
        for _ in range(8):
            conn.send_raw(b"", huge)
            conn.send_raw(b"", bound)
        assert small.call("tokenize", text="meanwhile")["ok"]
        got = replies(conn, 8 * (1 + MAX_ARRAY_REQUESTS))
        assert sum(f"at most {MAX_ARRAY_REQUESTS}" in r["error"]["message"] for r in got) == 8
        assert all(error_code(r) == "bad_request" and r["id"] is None for r in got)
        spent, grown = cpu_seconds(pid) - before_cpu, rss(pid) - before_rss
        # 8 x 4 MB received, and 8 x 4,096 refusals answered: well under a second on a loaded machine
        assert spent < 1.5, f"the broker spent {spent:.2f} s of CPU on 8 hostile arrays"
        assert grown < 100 * 2**20, f"the broker grew by {grown / 2**20:.0f} MiB"
    finally:
        conn.close()
        small.close()
