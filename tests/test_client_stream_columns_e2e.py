"""The stream helper's columnar step (`step_columns`) against its dict step (`step`), through a real
broker, for every tokenizer the repo ships: sequence by sequence and step by step the same text,
the same finish and the same stop, whether the keys come in the helper's own order (its states
buffer sent untouched), in another order, with several ids a step, first steps with options,
stop strings and ids, and finals."""

from __future__ import annotations

import asyncio
import random
from array import array

import pytest
from helpers import LSTRIP_DIR, SP_LEGACY_DIR, start_broker
from test_stream_e2e import model_args

import tokenbroker as tb

MODELS = ["deepseek", "bert", "qwen", "bytefallback", "lstrip", "splegacy"]
PROSE = ("Streams show text as it comes: 日本語の文章、emoji 🙂🚀, naïve café, Привет мир, مرحبا, "
         "numbers 3.14159 and code `x = f(y)`; the end. ") * 6


@pytest.fixture(scope="module")
def broker():
    b = start_broker(*model_args(), "--model", f"lstrip={LSTRIP_DIR}", "--model", f"splegacy={SP_LEGACY_DIR}",
                     workers=2)
    yield b
    b.stop()


async def _compare(client: tb.AsyncClient, model: str, seed: int) -> None:
    rng = random.Random(seed)
    ids = (await client.tokenize(PROSE, model=model, add_special_tokens=False)).tokens.tolist()
    n, steps = 24, 14
    gens = []
    for _ in range(n):
        at = rng.randrange(0, max(1, len(ids) - 3 * steps))
        gens.append(ids[at:at + 3 * steps])
    dict_stream, col_stream = client.detokenize_stream(model=model), client.detokenize_stream(model=model)
    for k in range(n):
        options: dict = {}
        if k % 4 == 1:
            options["prompt_tokens"] = ids[:5 + k]
        if k % 5 == 2:
            options["stop"] = [PROSE[40:43]]
        if k % 7 == 3:
            options["stop_token_ids"] = [gens[k][6]]
        if k % 6 == 5:
            options["skip_special_tokens"] = False
        for s in (dict_stream, col_stream):
            s.open(k, **options)
    texts = {"dict": [""] * n, "cols": [""] * n}
    cursor = [0] * n
    for step in range(steps):
        open_keys = [k for k in range(n) if k in dict_stream]
        assert open_keys == sorted(k for k in range(n) if k in col_stream)
        if not open_keys:
            break
        last = step == steps - 1
        chunk = {}
        for k in open_keys:
            size = 1 if step % 3 == 0 else rng.randrange(0, 4)
            chunk[k] = gens[k][cursor[k]:cursor[k] + size]
            cursor[k] += size
        finals = [k for k in open_keys if last or rng.random() < 0.05]
        got_dict = await dict_stream.step(chunk, final=finals)
        # the columnar step: the helper's own order when every open sequence has a state, else ours
        keys = col_stream.order if set(col_stream.order) == set(open_keys) and step % 2 else open_keys
        flat = array("I", [i for k in keys for i in chunk[k]])
        lengths = array("I", [len(chunk[k]) for k in keys])
        flags = bytes(k in finals for k in keys)
        if all(len(chunk[k]) == 1 for k in keys) and step % 4 == 0:
            got_cols = await col_stream.step_columns(keys, flat, final=flags)  # one id each: no lengths
        else:
            got_cols = await col_stream.step_columns(keys, flat, lengths, final=flags if any(flags) else None)
        assert list(got_cols.keys()) == list(keys) or sorted(got_cols.keys()) == sorted(keys)
        for k, t in zip(got_cols.keys(), got_cols.texts()):
            texts["cols"][k] += t
        for k, t in zip(got_dict.keys(), got_dict.texts()):
            texts["dict"][k] += t
        for k in open_keys:
            assert got_cols[k] == got_dict[k], (model, step, k)
        assert got_cols.finished == got_dict.finished
    assert texts["cols"] == texts["dict"]
    assert len(col_stream) == len(dict_stream) == 0


@pytest.mark.parametrize("model", MODELS)
def test_the_columnar_step_equals_the_dict_step_sequence_by_sequence(broker, model: str) -> None:
    async def main() -> None:
        async with tb.AsyncClient(broker.endpoint) as client:
            await _compare(client, model, seed=MODELS.index(model))
            assert client.pending() == 0

    asyncio.run(main())


def test_the_sync_columnar_step_and_bad_columns(broker) -> None:
    with tb.Client(broker.endpoint, model="deepseek") as client:
        ids = client.tokenize("Hello, wörld! 日本語 👍 done", add_special_tokens=False).tokens
        stream = client.detokenize_stream()
        for k in ("a", "b"):
            stream.open(k)
        text = {"a": "", "b": ""}
        for i, token in enumerate(ids):
            got = stream.step_columns(stream.order or ["a", "b"], array("I", [token, token]),
                                      final=b"\x01\x01" if i == len(ids) - 1 else None)
            for k, t in zip(got.keys(), got.texts()):
                text[k] += t
        assert text["a"] == text["b"] == client.detokenize(ids).text and len(stream) == 0
        stream.open("c")
        with pytest.raises(ValueError):
            stream.step_columns(["c"], array("I", [1, 2]))  # two ids, one key, no lengths
        with pytest.raises(ValueError):
            stream.step_columns(["c"], array("I", [1]), final=b"\x01\x00")
        with pytest.raises(KeyError):
            stream.step_columns(["nope"], array("I", [1]))
