"""The frontend's compiled drain (broker/_frontend.pyx), end to end: a real broker, real workers,
real sockets. What its change could break and no other test covers: a message with the wrong number
of frames answered on the envelope it came with, an oversized frame and a valid one read in the same
turn, and the payloads held as libzmq's messages let go with their jobs (RSS stays bounded).
"""

from __future__ import annotations

import msgpack
import pytest

from helpers import Conn, error_code, rss, start_broker

pack = lambda obj: msgpack.packb(obj, use_bin_type=True)  # noqa: E731

LIMIT = 100_000  # --max-request-bytes of the shared broker


@pytest.fixture(scope="module")
def broker():
    b = start_broker("--max-request-bytes", str(LIMIT), "--max-client-pending", "100000", workers=1)
    yield b
    b.stop()


def test_a_message_with_the_wrong_frames_is_refused_on_the_envelope_it_came_with(broker) -> None:
    plain = Conn(broker.endpoint, delimiter=False)
    try:
        plain.send_raw(pack({"id": 1, "op": "ping"}), pack({"id": 2, "op": "ping"}))  # two payloads, no delimiter
        frames = plain.recv_frames()
        assert len(frames) == 1  # no delimiter came, none goes back
        reply = msgpack.unpackb(frames[0], raw=False)
        assert reply["id"] is None and error_code(reply) == "bad_request" and "got 2 frames" in reply["error"]["message"]
        plain.send_raw(b"", pack({"id": 3, "op": "ping"}), b"extra")  # a delimiter, then two frames
        frames = plain.recv_frames()
        assert frames[0] == b"" and len(frames) == 2  # the delimiter mirrored
        reply = msgpack.unpackb(frames[1], raw=False)
        assert error_code(reply) == "bad_request" and "got 3 frames" in reply["error"]["message"]
        plain.send_raw(b"", pack({"id": 4, "op": "ping"}))  # the same connection is served as before
        frames = plain.recv_frames()
        assert frames[0] == b"" and msgpack.unpackb(frames[1], raw=False)["id"] == 4
    finally:
        plain.close()


def test_an_oversized_frame_and_a_valid_one_in_one_turn_are_each_answered(broker) -> None:
    conn = Conn(broker.endpoint)
    try:
        conn.send({"id": "big", "op": "tokenize", "text": "x" * (2 * LIMIT)})
        conn.send({"id": "small", "op": "tokenize", "text": "hello"})
        conn.send_raw(b"", pack([{"id": "a0", "op": "tokenize", "text": "one"}, {"id": "a1", "op": "ping"}]))
        replies = {}
        while len(replies) < 4:
            got = conn.recv()
            for r in got if isinstance(got, list) else [got]:
                replies[r["id"]] = r
        assert error_code(replies["big"]) == "too_large" and str(LIMIT) in replies["big"]["error"]["message"]
        assert replies["small"]["ok"] and replies["small"]["tokens"]
        assert replies["a0"]["ok"] and replies["a1"]["ok"]
    finally:
        conn.close()


def test_payloads_are_let_go_with_their_jobs(broker) -> None:
    """About 70 MB of requests (lone and in arrays, each padded to 4 KB by a field the worker
    ignores, so the test costs tokenizing little) pass through; a payload held past its job would
    show in the broker's resident memory."""
    conn = Conn(broker.endpoint)
    pad = "x" * 4000
    arrays = [pack([{"id": k * 16 + j, "op": "tokenize", "text": f"{j}", "pad": pad} for j in range(16)]) for k in range(4)]
    lone = pack({"id": -1, "op": "tokenize", "text": "lone", "pad": pad * 16})

    def answered() -> int:
        got = conn.recv()  # replies to an array speaker come coalesced: count them
        assert all(r["ok"] for r in (got if isinstance(got, list) else [got]))
        return len(got) if isinstance(got, list) else 1

    def run(frames: int) -> None:
        in_flight = 0
        for k in range(frames):
            conn.send_raw(b"", arrays[k % 4])
            conn.send_raw(b"", lone)
            in_flight += 17
            while in_flight > 64:
                in_flight -= answered()
        while in_flight:
            in_flight -= answered()

    try:
        run(100)  # warm: the allocators and libzmq's buffers settle
        before = rss(broker.proc.pid)
        run(550)  # ~9,000 requests, ~70 MB of payload
        grown = rss(broker.proc.pid) - before
        assert grown < 16 * 1024 * 1024, f"the broker grew {grown / 2**20:.1f} MiB over 70 MB of requests"
    finally:
        conn.close()
