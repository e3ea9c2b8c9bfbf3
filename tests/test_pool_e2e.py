"""The pool under stress: killed workers, deadlines, limits, shutdown, boot failure, remote workers, CLI."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

from helpers import (
    BERT_DIR,
    Conn,
    alive,
    error_code,
    free_port,
    scrape,
    series,
    serving,
    socket_inodes,
    start_broker,
    wait_until,
)


def _holds_a_job(broker, pid: int) -> bool:
    """Whether the broker's exporter shows the worker with this pid holding a job."""
    samples = scrape(broker.metrics)
    names = {dict(labels)["worker"] for labels in series(samples, "tokenbroker_worker_info") if dict(labels)["pid"] == str(pid)}
    return any(v >= 1 for labels, v in series(samples, "tokenbroker_worker_in_flight").items() if dict(labels)["worker"] in names)


def test_killed_worker_is_replaced_and_its_requests_answered():
    broker = start_broker(workers=2)
    c = Conn(broker.endpoint)
    try:
        n = 300
        for i in range(n):
            c.send({"id": i, "op": "tokenize", "text": f"request {i} " + "lorem ipsum " * 2000})
        first = c.recv()
        victim = broker.worker_pids()[0]
        os.kill(victim, signal.SIGKILL)
        replies = {first["id"]: first}
        while len(replies) < n:
            r = c.recv(timeout=60)
            replies[r["id"]] = r
        assert sorted(replies) == list(range(n))
        assert all(r["ok"] for r in replies.values()), {error_code(r) for r in replies.values()}
        wait_until(lambda: c.call("ping")["workers"] == 2, what="pool back to two workers")
        assert victim not in broker.worker_pids() and len(broker.worker_pids()) == 2
    finally:
        c.close()
        assert broker.stop() == 0


def test_request_dying_with_two_workers_is_answered_worker_failed():
    broker = start_broker("--metrics-port", str(free_port()), workers=1)
    c, probe = Conn(broker.endpoint), Conn(broker.endpoint)
    try:
        c.send({"id": "big", "op": "tokenize", "text": "word " * 3_000_000, "deadline_ms": 120000})
        for _ in range(2):
            wait_until(lambda: probe.call("ping")["workers"] == 1, what="a ready worker")
            pids = wait_until(lambda: broker.worker_pids() or None, what="the ready worker's pid")  # forked: it may show a turn later
            wait_until(lambda: _holds_a_job(broker, pids[0]), what="the queued job at the ready worker")
            os.kill(pids[0], signal.SIGKILL)
            wait_until(lambda: broker.worker_pids() and broker.worker_pids() != pids, what="respawn")
        reply = c.recv(timeout=60)
        assert reply["id"] == "big" and error_code(reply) == "worker_failed"
        wait_until(lambda: probe.call("ping")["workers"] == 1, what="pool back")
    finally:
        c.close()
        probe.close()
        broker.stop()


def test_deadline_passing_is_answered_timeout_and_the_broker_keeps_serving():
    with serving(workers=1) as (_, c):
        c.send({"id": "slow", "op": "tokenize", "text": "word " * 2_000_000, "deadline_ms": 5})
        reply = c.recv()
        assert reply["id"] == "slow" and error_code(reply) == "timeout"
        assert c.call("tokenize", text="still here")["ok"]


def test_payload_over_max_request_bytes_is_too_large():
    with serving("--max-request-bytes", "1000", workers=1) as (_, c):
        reply = c.call("tokenize", text="x" * 2000)
        assert error_code(reply) == "too_large" and "1000" in reply["error"]["message"]
        assert c.call("tokenize", text="small")["ok"]


def test_full_queue_answers_overloaded_and_nothing_is_lost():
    with serving("--max-pending", "2", workers=1) as (_, c):
        n = 40
        for i in range(n):
            c.send({"id": i, "op": "tokenize", "text": "word " * 200000})
        replies = [c.recv(timeout=120) for _ in range(n)]
        codes = [error_code(r) for r in replies]
        assert sorted(r["id"] for r in replies) == list(range(n))
        assert "overloaded" in codes and None in codes
        assert set(codes) <= {None, "overloaded"}


def test_workers_come_back_at_once_after_the_broker_was_paused():
    """A stalled broker (SIGSTOP) makes its workers reconnect; on resume they must serve without a gap."""
    with serving(workers=1) as (broker, c):
        assert c.call("tokenize", text="before")["ok"]
        (worker,) = broker.worker_pids()
        sockets = socket_inodes(worker)
        broker.proc.send_signal(signal.SIGSTOP)
        try:  # after heartbeat interval x liveness the worker gives up on the broker and opens a new connection
            wait_until(lambda: broker.logged("broker silent") and socket_inodes(worker) - sockets, timeout=60,
                       what="the worker to give up on the paused broker and reconnect")
        finally:
            broker.proc.send_signal(signal.SIGCONT)
        reply = c.call("tokenize", text="after", timeout=10)
        assert reply["ok"], reply
        assert c.call("ping")["workers"] == 1


def test_held_bytes_over_max_pending_bytes_are_overloaded():
    with serving("--max-pending-bytes", "3000000", workers=1) as (_, c):
        text = "word " * 200000  # 1 MB each: the fourth held payload passes the bound
        for i in range(8):
            c.send({"id": i, "op": "tokenize", "text": text})
        codes = [error_code(c.recv(timeout=120)) for _ in range(8)]
        assert "overloaded" in codes and None in codes
        assert c.call("tokenize", text="small")["ok"]


def test_sigterm_answers_every_held_request_then_stops_cleanly():
    with serving(workers=1) as (broker, c):
        for i in range(20):
            c.send({"id": i, "op": "tokenize", "text": "word " * 50000})
        c.recv()
        broker.proc.send_signal(signal.SIGTERM)
        replies = [c.recv(timeout=60) for _ in range(19)]
        assert all(r["ok"] or error_code(r) == "overloaded" for r in replies)
        assert broker.proc.wait(30) == 0
        assert not broker.worker_pids()


def test_boot_failure_refuses_to_start_and_names_the_problem(tmp_path):
    broker = start_broker("--model-path", str(tmp_path / "nothing-here"), expect_ready=False)
    out, err = broker.proc.communicate(timeout=120)
    assert broker.proc.returncode != 0
    assert "ready" not in out
    assert "nothing-here" in err


def test_remote_worker_joins_over_tcp_serves_and_leaves_on_sigterm():
    port = free_port()
    broker = start_broker("--backend", f"tcp://127.0.0.1:{port}", workers=0)
    c = Conn(broker.endpoint)
    worker = subprocess.Popen(
        [sys.executable, "-m", "tokenbroker", "worker", "--connect", f"tcp://127.0.0.1:{port}",
         "--name", "remote-1", "--model", f"bert={BERT_DIR}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        wait_until(lambda: c.call("ping")["workers"] == 1, timeout=60, what="remote worker to join")
        reply = c.call("tokenize", text="hello remote")
        assert reply["ok"] and reply["worker"] == "remote-1"
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(30) == 0
        wait_until(lambda: c.call("ping")["workers"] == 0, what="remote worker to leave")
    finally:
        worker.kill()
        c.close()
        broker.stop()


def test_cli_client_prints_json(multi_broker):
    def run(*args: str) -> dict:
        out = subprocess.run([sys.executable, "-m", "tokenbroker", *args, "--endpoint", multi_broker.endpoint],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    tokens = run("tokenize", "hello world", "--model", "bert")["tokens"]
    assert tokens[0] == 101 and tokens[-1] == 102
    assert run("detokenize", *map(str, tokens), "--model", "bert")["text"] == "hello world"
    assert {m["name"] for m in run("models", "--json")["models"]} >= {"deepseek", "bert"}


def test_a_long_request_is_served_and_its_worker_not_taken_for_hung():
    """Tokenizing ~10 MB takes longer than the heartbeat liveness; the worker must keep beating."""
    with serving(workers=1) as (broker, c):
        pids = broker.worker_pids()
        reply = c.call("tokenize", text="word " * 2_000_000, deadline_ms=180_000, timeout=200)
        assert reply["ok"], reply.get("error")
        assert reply["count"] == len(reply["tokens"]) > 1_000_000
        assert broker.worker_pids() == pids


def test_huge_deadline_is_served_and_does_not_stop_the_broker():
    with serving(workers=1) as (_, c):
        assert c.call("tokenize", text="x", deadline_ms=2**64 - 1)["ok"]
        assert c.call("ping")["workers"] == 1


def test_every_request_is_answered_when_deadlines_race_the_worker():
    """Deadlines that end while a job waits on the worker: each one gets exactly one reply."""
    with serving(workers=1) as (_, c):
        n = 0
        for round_ in range(40):
            c.send({"id": n, "op": "tokenize", "text": "lorem ipsum " * 4000})
            n += 1
            for deadline in (8, 12, 16, 20):
                c.send({"id": n, "op": "tokenize", "text": f"short {round_}", "deadline_ms": deadline})
                n += 1
        replies = [c.recv(timeout=30) for _ in range(n)]
        assert sorted(r["id"] for r in replies) == list(range(n))
        assert {r["error"]["code"] for r in replies if not r["ok"]} <= {"timeout"}


def test_a_remote_worker_leaving_under_load_takes_no_request_down_with_it():
    port = free_port()
    with serving("--backend", f"tcp://127.0.0.1:{port}", workers=1) as (_, c):
        remote = subprocess.Popen([sys.executable, "-m", "tokenbroker", "worker", "--connect", f"tcp://127.0.0.1:{port}",
                                   "--name", "leaving"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_until(lambda: c.call("ping")["workers"] == 2, timeout=60, what="the remote worker")
            n = 200
            for i in range(n):
                c.send({"id": i, "op": "tokenize", "text": f"request {i} " + "lorem ipsum " * 500})
            first = c.recv()
            remote.send_signal(signal.SIGTERM)
            replies = [first] + [c.recv(timeout=30) for _ in range(n - 1)]
            assert sorted(r["id"] for r in replies) == list(range(n))
            assert all(r["ok"] for r in replies), {r["error"]["code"] for r in replies if not r["ok"]}
            assert remote.wait(30) == 0
        finally:
            remote.kill()


def test_local_workers_leave_when_their_broker_is_killed():
    broker = start_broker(workers=2)
    pids = wait_until(lambda: len(broker.worker_pids()) == 2 and broker.worker_pids(), what="two workers")
    broker.stop(signal.SIGKILL)

    wait_until(lambda: not any(alive(pid) for pid in pids), timeout=30, what="orphaned workers to exit")


def test_requests_that_time_out_in_the_queue_are_let_go_at_once():
    """With no worker to take them, timed-out queued requests must not stay held until the queue moves."""
    with serving("--metrics-port", str(free_port()), workers=0) as (broker, c):
        for i in range(300):
            c.send({"id": i, "op": "tokenize", "text": "x" * 1000, "deadline_ms": 1})
        codes = {c.recv()["error"]["code"] for _ in range(300)}
        assert codes == {"timeout"}
        wait_until(lambda: scrape(broker.metrics)[("tokenbroker_requests_held", frozenset())] == 0, timeout=10,
                   what="held requests to drop to zero")
