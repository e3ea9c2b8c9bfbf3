"""`count` through a real broker under hostile conditions: no network on the request path, huge image headers.

Issue 11 row 2: a `count` for an OpenAI model whose encoding was not on disk made the worker fetch
it through tiktoken, with no timeout; behind a proxy that never answers the worker wedged for good.
Row 8: image header sizes were trusted, so a 2^32-1 square PNG header counted 8e15 tokens and 3,000
of them made the reply overflow (`internal: OverflowError`).
"""

from __future__ import annotations

import base64
import contextlib
import json
import socket
import struct
import threading
import zlib
from collections.abc import Iterator

import pytest

from helpers import FIXTURES, serving


@contextlib.contextmanager
def silent_proxy() -> Iterator[str]:
    """A TCP listener that accepts every connection and never answers: a proxy that hangs its clients."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        thread.join()
        for s in held:
            s.close()
        listener.close()


def test_count_for_an_openai_model_without_a_local_encoding_never_touches_the_network(monkeypatch, tmp_path):
    empty_cache = tmp_path / "no-encodings-here"
    empty_cache.mkdir()
    body = {"model": "gpt-4o", "messages": [{"role": "user", "content": "Hello, world!"}]}
    with silent_proxy() as proxy:
        for var in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"):
            monkeypatch.setenv(var, proxy)
        monkeypatch.delenv("NO_PROXY", raising=False)
        monkeypatch.delenv("no_proxy", raising=False)
        monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(empty_cache))
        with serving() as (_, conn):
            lenient = conn.call("count", body=body, timeout=60)
            assert lenient["ok"], lenient
            assert lenient["method"] == "fallback" and lenient["count"] > 0
            assert any("o200k_base" in w and "local" in w for w in lenient["warnings"]), lenient["warnings"]
            strict = conn.call("count", body=body, strict=True, timeout=60)
            assert not strict["ok"] and strict["error"]["code"] == "unknown_model", strict
            assert "o200k_base" in strict["error"]["message"]
            # the worker is not wedged: later requests are served
            for _ in range(3):
                assert conn.call("tokenize", text="still here", timeout=60)["ok"]
                assert conn.call("count", body=dict(body, model="gpt-4"), timeout=60)["ok"]
        assert list(empty_cache.iterdir()) == []  # nothing was downloaded into the cache either


def _png_header(width: int, height: int) -> str:
    """A PNG signature and IHDR chunk claiming `width` x `height` (all the counter reads), base64."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 6, 0, 0, 0)
    chunk = struct.pack(">I", len(ihdr)) + b"IHDR" + ihdr + struct.pack(">I", zlib.crc32(b"IHDR" + ihdr))
    return base64.b64encode(b"\x89PNG\r\n\x1a\n" + chunk).decode()


HUGE = 2**32 - 1
# (format, model, one message carrying the image, what its provider charges for a square image scaled down)
_HUGE_IMAGE_BODIES = [
    ("gemini.generate", "gemini-2.0-flash",
     lambda b64: {"role": "user", "parts": [{"inlineData": {"mimeType": "image/png", "data": b64}}]}, 258 * 16),  # 4 x 4 tiles
    ("openai.chat", "gpt-4o",
     lambda b64: {"role": "user", "content": [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b64}"}}]},
     85 + 170 * 4),  # fit in 2048x2048, then 768x768: 2 x 2 tiles
    ("anthropic.messages", "claude-sonnet-4",
     lambda b64: {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64}}]},
     1600),
]


@pytest.mark.parametrize("fmt,model,message,scaled", _HUGE_IMAGE_BODIES, ids=[b[0] for b in _HUGE_IMAGE_BODIES])
def test_huge_image_headers_are_scaled_like_the_provider_does_and_never_fail_a_count(fmt, model, message, scaled):
    b64 = _png_header(HUGE, HUGE)
    key = "contents" if fmt == "gemini.generate" else "messages"
    one = {key: [message(b64)]}
    many = {key: [message(b64) for _ in range(3000)]}
    with serving() as (_, conn):
        single = conn.call("count", body=one, format=fmt, model=model, timeout=120)
        assert single["ok"], single
        assert scaled <= single["count"] <= scaled + 16  # the image as its provider scales it, plus framing
        lots = conn.call("count", body=many, format=fmt, model=model, timeout=120)
        assert lots["ok"], lots
        assert 3000 * scaled <= lots["count"] <= 3000 * (scaled + 16)
        assert conn.call("tokenize", text="still serving", timeout=60)["ok"]


def test_published_function_tool_and_responses_counts_through_the_broker():
    """The fixture's published counts, answered by a real worker whose encodings come from local files."""
    cases = json.loads((FIXTURES / "count" / "openai_function_counts.json").read_text())
    with serving() as (_, conn):
        for case in cases:
            reply = conn.call("count", body=case["body"], format=case["format"], model=case["model"], strict=True, timeout=60)
            assert reply["ok"], (case["id"], reply)
            assert (reply["count"], reply["method"], reply["warnings"]) == (case["published_tokens"], "tiktoken", []), case["id"]


def test_small_requests_are_answered_while_a_huge_image_count_runs_off_the_round_loop():
    """Issue 35: the three 3,000-image bodies, each sent with small requests right behind it on one
    connection and one worker. The count runs on the worker's encode lane (workers/count_lane.py),
    so every small request is answered before it, and the count is still the sane one."""
    b64 = _png_header(HUGE, HUGE)
    with serving() as (broker, conn):
        assert conn.call("count", body={"messages": [{"role": "user", "content": "warm"}]}, model="gpt-4o")["ok"]
        want = [conn.call("tokenize", text=f"small {i}")["tokens"] for i in range(4)]  # answered alone
        for fmt, model, message, scaled in _HUGE_IMAGE_BODIES:
            key = "contents" if fmt == "gemini.generate" else "messages"
            conn.send({"id": "big", "op": "count", "body": {key: [message(b64) for _ in range(3000)]},
                       "format": fmt, "model": model})
            small = {f"t{i}": {"op": "tokenize", "text": f"small {i}"} for i in range(4)}
            small["c"] = {"op": "count", "body": {key: [message(b64)]}, "format": fmt, "model": model}
            for rid, body in small.items():
                conn.send({"id": rid, **body})
            replies = [conn.recv(timeout=120) for _ in range(len(small) + 1)]
            order = [r["id"] for r in replies]
            assert order[-1] == "big", (fmt, order)  # every small one first
            assert all(r["ok"] for r in replies), replies
            by_id = {r["id"]: r for r in replies}
            assert [by_id[f"t{i}"]["tokens"] for i in range(4)] == want
            assert scaled <= by_id["c"]["count"] <= scaled + 16
            assert 3000 * scaled <= by_id["big"]["count"] <= 3000 * (scaled + 16)


def _strings(value: object) -> list[str]:
    """Every str value inside a JSON-like body (not its keys)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return []


def test_a_count_is_bounded_before_it_is_counted_and_its_deadline_watched_on_the_lane():
    """Over --max-batch-items list items a body is not harvested: with `strict` it is answered
    too_large, without it estimated from its characters (a count never fails on its input without
    strict); a lane count past its deadline is answered timeout, and the worker goes on serving."""
    b64 = _png_header(HUGE, HUGE)
    body = {"messages": [_HUGE_IMAGE_BODIES[1][2](b64) for _ in range(3000)]}
    with serving("--max-batch-items", "4000") as (_, conn):
        over = conn.call("count", body=body, format="openai.chat", model="gpt-4o", strict=True, timeout=120)
        assert not over["ok"] and over["error"]["code"] == "too_large", over  # 3,000 messages + 3,000 parts
        assert "--max-batch-items" in over["error"]["message"]
        estimated = conn.call("count", body=body, format="openai.chat", model="gpt-4o", timeout=120)
        assert estimated["ok"] and estimated["method"] == "estimate" and estimated["vocabulary"] is None, estimated
        chars = sum(len(s) for s in _strings(body))
        assert estimated["count"] == (chars + 1) // 2
        assert any("--max-batch-items" in w for w in estimated["warnings"]), estimated["warnings"]
        as_json = json.dumps(body)  # the same body sent as JSON text (str) and as JSON bytes (bin): the same answers
        for given in (as_json, as_json.encode()):
            over = conn.call("count", body=given, format="openai.chat", model="gpt-4o", strict=True, timeout=120)
            assert not over["ok"] and over["error"]["code"] == "too_large" and "--max-batch-items" in over["error"]["message"], over
            again = conn.call("count", body=given, format="openai.chat", model="gpt-4o", timeout=120)
            assert again["ok"] and again["method"] == "estimate" and again["count"] == estimated["count"], again
            assert any("--max-batch-items" in w for w in again["warnings"]), again["warnings"]
        half = {"messages": body["messages"][:1500]}
        assert conn.call("count", body=half, format="openai.chat", model="gpt-4o", timeout=120)["ok"]
        late = conn.call("count", body={"messages": [{"role": "user", "content": "word " * 20}] * 1500},
                         format="openai.chat", model="gpt-4o", deadline_ms=1, timeout=120)
        assert not late["ok"] and late["error"]["code"] == "timeout", late
        assert conn.call("tokenize", text="still serving", timeout=60)["ok"]


def test_small_requests_go_beside_fourteen_huge_image_counts_on_two_workers(conn):
    """Issue 40: fourteen 3,000-image bodies (296 KiB each) sent at once, small requests right behind
    (the shared two-worker broker; its model o200k counts them, loaded, so no count builds an
    encoding first). A worker counts each body on its encode lane and the broker sends it one at a
    time, outside its byte budget (broker/_dispatch.pyx `Dispatcher.enqueue`): the small requests go to
    the workers at once and are answered while the first bodies are counted. Held by their bytes,
    four bodies filled a worker and the small requests queued behind the six left over: each was
    answered after eight or nine bodies."""
    b64 = _png_header(HUGE, HUGE)
    fmt, _, message, scaled = _HUGE_IMAGE_BODIES[1]
    big = {"op": "count", "body": {"messages": [message(b64)] * 3000}, "format": fmt, "model": "o200k"}
    want = conn.call("tokenize", text="small")["tokens"]
    for i in range(14):
        conn.send({"id": f"big{i}", **big})
    for i in range(8):
        conn.send({"id": f"small{i}", "op": "tokenize", "text": "small"})
    replies = [conn.recv(timeout=120) for _ in range(14 + 8)]
    assert all(r["ok"] for r in replies), [r for r in replies if not r["ok"]]
    order = [r["id"] for r in replies]
    bigs_before = [sum(o.startswith("big") for o in order[:order.index(f"small{i}")]) for i in range(8)]
    assert max(bigs_before) <= 2, order  # each small one answered while the workers counted their first bodies
    assert all(r["tokens"] == want for r in replies if r["id"].startswith("small"))
    assert all(3000 * scaled <= r["count"] <= 3000 * (scaled + 16) for r in replies if r["id"].startswith("big")), replies
