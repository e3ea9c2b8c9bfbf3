"""Frames from a peer on the backend are untrusted: malformed ones are dropped, names cannot be taken."""

from __future__ import annotations

import struct
import subprocess
import sys
import time

import msgpack
import pytest
import zmq

from helpers import Conn, free_port, start_broker, wait_until
from tokenbroker.common.protocol import (B_JOBS, B_RESET, PROTOCOL_VERSION, W_BYE, W_HEARTBEAT, W_READY, W_RESULTS,
                                         pack_results, unpack_jobs)


def ready(name: str, **over) -> bytes:
    body = {"version": PROTOCOL_VERSION, "capacity": 4, "name": name, "pid": 1, "host": "rogue", "models": ["deepseek"],
            "incarnation": "f" * 32, **over}
    return msgpack.packb(body, use_bin_type=True)


@pytest.fixture(scope="module")
def tcp_broker():
    port = free_port()
    broker = start_broker("--backend", f"tcp://127.0.0.1:{port}", workers=1)
    yield broker, f"tcp://127.0.0.1:{port}"
    broker.stop()


def rogue(endpoint: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


MALFORMED = {
    "ready with capacity 0": [W_READY, ready("r0", capacity=0)],
    "ready with a huge capacity": [W_READY, ready("r1", capacity=10**9)],
    "ready that is not MessagePack": [W_READY, b"\xc1\xc1"],
    "ready that is a list": [W_READY, msgpack.packb([1, 2])],
    "ready with a non-printable name": [W_READY, ready("bad\nname")],
    "ready with two bodies": [W_READY, ready("r2"), b"x"],
    "results with a 3-byte header": [W_RESULTS, b"abc", b"payload"],
    "results with no payload": [W_RESULTS, struct.pack("<QB", 1, 0)],
    "results with an unknown outcome": [W_RESULTS, struct.pack("<QBI", 1, 250, 1), b"\x80"],
    "results whose lengths disagree with the payload": [W_RESULTS, struct.pack("<QBI", 1, 0, 5), b"\x80"],
    "heartbeat that is not MessagePack": [W_HEARTBEAT, b"\xc1"],
    "heartbeat with many frames": [W_HEARTBEAT, b"\x80", b"\x80"],
    "unknown kind": [b"Z", b"whatever"],
    "empty message": [b""],
}


@pytest.mark.parametrize("frames", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_backend_frame_leaves_the_broker_serving(tcp_broker, frames: list[bytes]) -> None:
    broker, backend = tcp_broker
    c = Conn(broker.endpoint)
    sock = rogue(backend)
    try:
        assert c.call("tokenize", text="before")["ok"]
        sock.send_multipart(frames)
        if frames[0] == W_RESULTS:  # also from a peer the broker knows: a READY first, then the bad frame
            # (without CURVE, a peer that knows the model's fingerprint, which is no secret, is admitted)
            fingerprints = {m["name"]: m["fingerprint"] for m in c.call("models")["models"]}
            sock.send_multipart([W_READY, ready("known-rogue", fingerprints=fingerprints)])
            wait_until(lambda: c.call("ping")["workers"] == 2, what="the rogue admitted")
            sock.send_multipart(frames)
        for i in range(5):
            reply = c.call("tokenize", text=f"after {i}", deadline_ms=2000, timeout=30)
            assert reply["ok"] or reply["error"]["code"] == "timeout"  # a job sent to the silent rogue times out
        assert broker.proc.poll() is None
        assert c.call("ping")["workers"] >= 1
    finally:
        sock.close()
        c.close()


def _admit(c: Conn, sock: zmq.Socket, name: str) -> None:
    """`sock` says READY as `name` with the pool's fingerprints (no secret without CURVE) and is admitted."""
    workers = c.call("ping")["workers"]
    fingerprints = {m["name"]: m["fingerprint"] for m in c.call("models")["models"]}
    sock.send_multipart([W_READY, ready(name, fingerprints=fingerprints)])
    wait_until(lambda: c.call("ping")["workers"] == workers + 1, what=f"{name} admitted")


def _a_job(client: zmq.Socket, sock: zmq.Socket) -> tuple[int, dict]:
    """Requests with fresh affinity keys until one reaches the rogue `sock`: its job id and request."""
    for i in range(200):
        client.send_multipart([b"", msgpack.packb({"id": i, "op": "tokenize", "text": f"to the rogue {i}",
                                                   "affinity": f"rogue-{i}", "deadline_ms": 30000})])
        while sock.poll(50):
            kind, *body = sock.recv_multipart()
            if kind == B_JOBS:
                (job_id, _, payload), = unpack_jobs(body)
                return job_id, msgpack.unpackb(payload)
    raise AssertionError("no job reached the rogue worker in 200 requests")


def test_a_draining_workers_last_results_go_back_as_sent_once_and_let_it_go(tcp_broker) -> None:
    """W_RESULTS are finished in the broker's compiled drain. One that disagrees with itself (a
    frame too many) is dropped and logged with why, and its job stays held; the worker says BYE
    holding that job; its well-formed result then answers the client with exactly the bytes the
    worker sent (a view of its frame, never re-encoded), and the broker lets the idle worker go,
    so the same result sent again is answered to no one but the worker: RESET."""
    broker, backend = tcp_broker
    c = Conn(broker.endpoint)
    client = rogue(broker.endpoint)
    sock = rogue(backend)
    try:
        _admit(c, sock, "results-rogue")
        job_id, request = _a_job(client, sock)
        reply = msgpack.packb({"id": request["id"], "ok": True, "tokens": [7, 7, 7], "worker": "results-rogue"})
        results = pack_results([(job_id, "ok", reply)])
        time.sleep(1.1)  # the backend logs one malformed RESULTS a second; an earlier test's may be that recent
        sock.send_multipart([*results, b"a frame too many"])
        wait_until(lambda: broker.logged("worker results-rogue sent a malformed RESULTS: a result batch must be a "
                                         "header and one payload frame, got 3 frames"), what="the refusal logged")
        sock.send_multipart([W_BYE])
        sock.send_multipart(results)
        got = []
        while reply not in got and client.poll(10_000):
            got.append(client.recv_multipart()[-1])
        sock.send_multipart(results)  # again, from a worker the broker let go
        assert wait_until(lambda: sock.poll(100) and sock.recv_multipart() == [B_RESET], what="RESET")
        while client.poll(300):
            got.append(client.recv_multipart()[-1])
        assert got.count(reply) == 1
        assert c.call("tokenize", text="still serving")["ok"]
    finally:
        sock.close()
        client.close()
        c.close()


def test_replies_to_a_client_that_left_cost_the_broker_nothing(tcp_broker) -> None:
    """Arrays from clients that close before their replies come: each reply is dropped at its send
    (costing only itself), and the broker serves the next client's array whole."""
    broker, _ = tcp_broker
    c = Conn(broker.endpoint)
    try:
        wait_until(lambda: c.call("ping")["workers"] == 1, what="earlier tests' rogues gone")
        for round in range(3):
            gone = rogue(broker.endpoint)
            gone.send_multipart([b"", msgpack.packb([{"id": i, "op": "tokenize", "text": f"left {round} {i}"}
                                                     for i in range(64)])])
            gone.send_multipart([b"", msgpack.packb({"id": 0, "op": "tokenize", "text": "x" * 100_000})])
            gone.close()
        c.send_raw(b"", msgpack.packb([{"id": i, "op": "tokenize", "text": f"after {i}"} for i in range(64)]))
        replies: list[dict] = []
        while len(replies) < 64:  # one frame per turn that answered some: an array, or a lone reply's map
            got = msgpack.unpackb(c.recv_frames()[-1])
            replies += got if isinstance(got, list) else [got]
        assert sorted(r["id"] for r in replies) == list(range(64)) and all(r["ok"] for r in replies)
        assert broker.proc.poll() is None and not broker.logged("Traceback")
    finally:
        c.close()


def test_a_worker_with_another_fingerprint_is_refused_with_both_named() -> None:
    """Admission: a remote worker started with another tokenizer than the broker's first worker."""
    port = free_port()
    broker = start_broker("--backend", f"tcp://127.0.0.1:{port}", "--served-model-name", "m", workers=1)
    lines = broker.log
    worker = subprocess.Popen([sys.executable, "-m", "tokenbroker", "worker", "--connect", f"tcp://127.0.0.1:{port}",
                               "--name", "other-flags", "--model-path", "cl100k_base", "--served-model-name", "m"],
                              stderr=subprocess.DEVNULL)
    c = Conn(broker.endpoint)
    try:
        want = c.call("models")["models"][0]["fingerprint"]
        wait_until(lambda: any("refused worker other-flags" in line for line in lines), timeout=60,
                   what="the refusal in the broker's log")
        line = next(line for line in lines if "refused worker other-flags" in line)
        assert "model 'm' has fingerprint" in line and want in line and "start it with the same model flags" in line
        assert c.call("ping")["workers"] == 1
        assert {c.call("tokenize", text=f"t{i}", affinity=str(i))["worker"] for i in range(20)} != {"other-flags"}
    finally:
        worker.kill()
        worker.wait()
        c.close()
        broker.stop()


def test_a_peer_cannot_take_over_a_connected_workers_name() -> None:
    port = free_port()
    backend = f"tcp://127.0.0.1:{port}"
    broker = start_broker("--backend", backend, workers=1)
    worker = subprocess.Popen([sys.executable, "-m", "tokenbroker", "worker", "--connect", backend, "--name", "victim"],
                              stderr=subprocess.DEVNULL)
    c = Conn(broker.endpoint)
    sock = rogue(f"tcp://127.0.0.1:{port}")
    try:
        wait_until(lambda: c.call("ping")["workers"] == 2, timeout=60, what="the remote worker")
        sock.send_multipart([W_READY, ready("victim")])  # same name, another process (incarnation)
        sock.send_multipart([W_READY, ready("victim", incarnation="")])
        served_by = {c.call("tokenize", text=f"probe {i}", affinity=f"s{i}")["worker"] for i in range(40)}
        assert c.call("ping")["workers"] == 2
        assert "victim" in served_by and sock.poll(500) == 0  # the rogue was given no job
        assert worker.poll() is None  # and the victim was not replaced or killed
    finally:
        worker.kill()
        worker.wait()
        sock.close()
        c.close()
        broker.stop()


def test_each_model_goes_only_to_the_workers_that_hold_it() -> None:
    """A pool of a local DeepSeek worker and a remote worker holding only BERT: no request for one
    model reaches the other's worker, so none is answered unknown_model."""
    from helpers import BERT_DIR

    port = free_port()
    broker = start_broker("--backend", f"tcp://127.0.0.1:{port}", "--served-model-name", "deepseek", workers=1)
    worker = subprocess.Popen([sys.executable, "-m", "tokenbroker", "worker", "--connect", f"tcp://127.0.0.1:{port}",
                               "--name", "bert-only", "--model", f"bert={BERT_DIR}"], stderr=subprocess.DEVNULL)
    c = Conn(broker.endpoint)
    try:
        wait_until(lambda: c.call("ping")["workers"] == 2, timeout=60, what="the remote worker")
        for i in range(40):
            c.send({"id": i, "op": "tokenize", "model": "bert" if i % 2 else "deepseek", "text": f"text {i}"})
        replies = [c.recv() for _ in range(40)]
        assert all(r["ok"] for r in replies), [r["error"] for r in replies if not r["ok"]]
        for r in replies:
            assert (r["worker"] == "bert-only") == (r["id"] % 2 == 1), r
    finally:
        worker.kill()
        worker.wait()
        c.close()
        broker.stop()
