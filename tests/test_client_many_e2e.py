"""`tokenize_many`, `detokenize_many` and `chat_many` against real brokers: the same results as
the same calls made one by one (per-item errors included), mixed models, cancellation, deadlines,
the coalescing limits, and a broker SIGKILLed under batch traffic with nothing lost or duplicated.

Every broker is a real `tokenbroker serve` with real workers and tokenizers; every reply goes
through the compiled codec (src/tokenbroker/_codec.py: _packer, _calls, _frames, _replies)."""

from __future__ import annotations

import asyncio
import signal

import pytest

import tokenbroker as tb
from helpers import BERT_DIR, CHAT_TEMPLATES, QWEN_TIKTOKEN, batch_ids, deepseek_tokenizer_json, start_broker, until

TEMPLATE = CHAT_TEMPLATES / "deepseek-v3.1.jinja"


def texts(n: int, size: int = 1) -> list[str]:
    return [f"text {i} with ünïcode 日本 🙂: " + "the quick brown fox jumps over the lazy dog " * size for i in range(n)]


def chats(n: int) -> list[list[dict]]:
    return [[{"role": "system", "content": f"You are assistant {i}."}, {"role": "user", "content": f"Question {i}?"},
             {"role": "assistant", "content": "An answer."}, {"role": "user", "content": "And then?"}]
            for i in range(n)]


@pytest.fixture(scope="module")
def broker():
    b = start_broker("--model-path", str(deepseek_tokenizer_json()), "--served-model-name", "deepseek",
                     "--chat-template", str(TEMPLATE), "--model", f"bert={BERT_DIR}",
                     "--model", f"qwen={QWEN_TIKTOKEN}", workers=2)
    yield b
    b.stop()


def _same(a: object, b: object) -> bool:
    """Results equal, ignoring which worker served them and what the cache said."""
    strip = {"worker": "", "cache": None}
    return {**a.__dict__, **strip} == {**b.__dict__, **strip} if hasattr(a, "__dict__") else \
        all(getattr(a, f) == getattr(b, f) for f in a.__slots__ if f not in strip)  # type: ignore[attr-defined]


@pytest.mark.parametrize("options", [{}, {"add_special_tokens": False},
                                     {"offsets": True, "token_strs": True, "truncate": 5, "truncation_side": "right",
                                      "block_hashes": tb.BlockHashSpec(4, "0")}], ids=["plain", "no-specials", "1.2"])
def test_tokenize_many_equals_tokenize_one_by_one(broker, options):
    items = texts(150, size=3) + [""]

    async def main() -> None:
        async with tb.AsyncClient(broker.endpoint) as client:
            many = await client.tokenize_many(items, **options)
            one = [await client.tokenize(t, **options) for t in items]
            assert len(many) == len(one) == len(items)
            assert all(type(m) is tb.Tokens and _same(m, o) for m, o in zip(many, one))
            assert client.pending() == 0

    asyncio.run(main())
    assert [t.tokens.tolist() for t in tb.Client(broker.endpoint).tokenize_many(items[:3])] == \
        batch_ids(broker.endpoint, items[:3])


def test_ids_as_lists_and_the_sync_twins(broker):
    items = texts(40)
    want = batch_ids(broker.endpoint, items)
    with tb.Client(broker.endpoint, ids="list") as client:
        got = client.tokenize_many(items)
        assert [t.tokens for t in got] == want and all(type(t.tokens) is list for t in got)
        back = client.detokenize_many([t.tokens for t in got], skip_special_tokens=False)
        assert [t.text for t in back] == [client.detokenize(t.tokens, skip_special_tokens=False).text for t in got]
        assert client.tokenize_many([]) == [] and client.detokenize_many([]) == [] and client.chat_many([]) == []


def test_per_item_errors_are_the_ones_calls_one_by_one_raise(broker):
    """An id out of the vocabulary fails its own sequence (invalid_input), the others are served;
    raised (the first in order) by default, in place with return_exceptions."""
    seqs: list = [[1, 2, 3], [10**9], [], [4, 5], [2**31, 7]]

    async def main() -> None:
        async with tb.AsyncClient(broker.endpoint) as client:
            one: list = []
            for s in seqs:
                try:
                    one.append(await client.detokenize(s))
                except tb.TokenbrokerError as e:
                    one.append(e)
            many = await client.detokenize_many(seqs, return_exceptions=True)
            for m, o in zip(many, one):
                if isinstance(o, tb.TokenbrokerError):
                    assert type(m) is type(o) and m.code == o.code == "invalid_input"  # type: ignore[union-attr]
                else:
                    assert type(m) is tb.Text and m.text == o.text  # type: ignore[union-attr]
            with pytest.raises(tb.InvalidInput) as info:
                await client.detokenize_many(seqs)
            assert str(info.value) == str(one[1])
            assert client.pending() == 0

    asyncio.run(main())


def test_mixed_models_in_one_batch_and_batches_of_several_models_at_once(broker):
    items = texts(30, size=2)
    models = ["deepseek", "bert", "qwen", None, "no-such-model"] * 6

    async def main() -> None:
        async with tb.AsyncClient(broker.endpoint, model="bert") as client:
            many = await client.tokenize_many(items, model=models, return_exceptions=True)
            for text, model, got in zip(items, models, many):
                if model == "no-such-model":
                    assert isinstance(got, tb.UnknownModel)
                else:
                    assert _same(got, await client.tokenize(text, model=model))
            per_model = await asyncio.gather(*(client.tokenize_many(items, model=m) for m in ("deepseek", "bert", "qwen")))
            for m, got in zip(("deepseek", "bert", "qwen"), per_model):
                assert [t.tokens for t in got] == [(await client.tokenize(t, model=m)).tokens for t in items]
            with pytest.raises(ValueError):
                await client.tokenize_many(items, model=["bert"])
            assert client.pending() == 0

    asyncio.run(main())


def test_chat_many_equals_chat_one_by_one(broker):
    conversations = chats(20)

    async def main() -> None:
        async with tb.AsyncClient(broker.endpoint, model="deepseek") as client:
            many = await client.chat_many(conversations, return_prompt=True)
            one = [await client.chat(c, return_prompt=True) for c in conversations]
            assert all(type(m) is tb.ChatTokens and _same(m, o) for m, o in zip(many, one))
            many_plain = await client.chat_many(conversations)
            assert [m.tokens for m in many_plain] == [o.tokens for o in one]
            with pytest.raises(tb.TemplateError):  # bert has no chat template: every item fails alike
                await client.chat_many(conversations[:3], model="bert")
            with pytest.raises(TypeError):  # a body MessagePack cannot hold raises at once, nothing pending
                await client.chat_many([[{"role": "user", "content": {1, 2}}]])
            assert client.pending() == 0

    asyncio.run(main())


def test_a_batch_larger_than_a_frame_goes_in_several_frames(broker):
    items = texts(700)
    want = batch_ids(broker.endpoint, items)

    async def main() -> None:
        async with tb.AsyncClient(broker.endpoint) as client:
            await client.ping()
            before = client.status()[0].frames
            got = await client.tokenize_many(items)
            assert [t.tokens.tolist() for t in got] == want
            assert client.status()[0].frames - before >= 3  # at most 256 requests a frame

    asyncio.run(main())


def test_a_cancelled_batch_leaves_nothing_behind_and_its_late_replies_are_dropped():
    b = start_broker(workers=1)
    try:
        items = texts(600, size=20)

        async def main() -> None:
            async with tb.AsyncClient(b.endpoint) as client:
                await client.ping()
                task = asyncio.ensure_future(client.tokenize_many(items))
                await until(lambda: client.status()[0].sent >= 601, what="the batch to be sent")
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                assert client.pending() == 0 and client.status()[0].outstanding == 0
                await until(lambda: client.status()[0].dropped > 0, what="late replies to be dropped")
                assert [t.count for t in await client.tokenize_many(items[:5])] == \
                    [len(x) for x in batch_ids(b.endpoint, items[:5])]
                assert client.pending() == 0

        asyncio.run(main())
    finally:
        b.stop()


def test_a_batch_nobody_answers_fails_each_item_as_unavailable_after_its_deadline():
    import zmq

    sock = zmq.Context.instance().socket(zmq.ROUTER)  # a peer that takes requests and never answers
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    try:
        async def main() -> None:
            async with tb.AsyncClient(f"tcp://127.0.0.1:{port}", timeout=0.3) as client:
                got = await client.tokenize_many(texts(5), return_exceptions=True)
                assert all(isinstance(g, tb.Unavailable) for g in got)
                with pytest.raises(tb.Unavailable):
                    await client.tokenize_many(texts(5))
                assert client.pending() == 0

        asyncio.run(main())
    finally:
        sock.close(0)


def test_a_broker_killed_under_tokenize_many_traffic_loses_and_duplicates_nothing():
    a, b = start_broker(workers=1), start_broker(workers=1)
    try:
        items = texts(1600, size=20)
        want = batch_ids(b.endpoint, items)
        chunks = [items[i:i + 64] for i in range(0, len(items), 64)]

        async def main() -> None:
            async with tb.AsyncClient([a.endpoint, b.endpoint], liveness_s=0.5) as client:
                calls = [asyncio.ensure_future(client.tokenize_many(c)) for c in chunks]
                await until(lambda: all(s.sent > 100 for s in client.status()), what="calls spread over both")
                await until(lambda: client.status()[0].outstanding > 100 and sum(c.done() for c in calls) > 0,
                            what="load on both brokers")
                a.stop(signal.SIGKILL)
                results = await asyncio.gather(*calls)
                assert [t.tokens.tolist() for r in results for t in r] == want  # each in its place, once
                left, other = client.status()
                assert not left.alive and left.left >= 1 and left.resent > 0 and left.outstanding == 0
                assert other.alive and other.outstanding == 0
                assert client.pending() == 0

        asyncio.run(main())
    finally:
        a.stop(signal.SIGKILL)
        b.stop()
