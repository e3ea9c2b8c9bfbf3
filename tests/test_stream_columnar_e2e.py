"""The columnar `detokenize_stream` through real brokers, and the client helper that speaks it.

Two brokers load the same models (DeepSeek's tokenizer.json, Qwen's qwen.tiktoken, BERT
WordPiece). Every step goes to one broker in the columnar form and the same step,
from the same states, to the other in the row form: the replies agree sequence by sequence, the
states either broker makes are the same bytes and either broker reads them. The client helper
(`Client.detokenize_stream()`, `AsyncClient.detokenize_stream()`) is checked against `detokenize`.
"""

from __future__ import annotations

import asyncio
import random
import struct

import msgpack
import pytest
from helpers import BERT_DIR, QWEN_TIKTOKEN, Conn, deepseek_tokenizer_json, start_broker
from test_stream import WORDS
from test_stream_columnar import columns_of, rows_of

import tokenbroker as tb

MODELS = ["deepseek", "qwen", "bert"]  # an OpenAI encoding: tests/test_stream_columnar.py (cl100k), in the worker's decoder


class IndexConn(Conn):
    """A test connection whose replies may have int map keys: the columnar reply's `stops` maps indexes."""

    def recv(self, timeout: float = 60.0) -> dict:
        return msgpack.unpackb(self.recv_frames(timeout)[-1], raw=False, strict_map_key=False)


@pytest.fixture(scope="module")
def brokers():
    args = ["--model-path", str(deepseek_tokenizer_json()), "--served-model-name", "deepseek",
            "--model", f"qwen={QWEN_TIKTOKEN}", "--model", f"bert={BERT_DIR}"]
    pair = [start_broker(*args, workers=1) for _ in range(2)]
    conns = [IndexConn(b.endpoint) for b in pair]
    yield pair, conns
    for c in conns:
        c.close()
    for b in pair:
        b.stop()


def ok(reply: dict) -> dict:
    assert reply["ok"], reply
    return reply


def prose(rng: random.Random, words: int = 30) -> str:
    return "".join(rng.choice(WORDS) for _ in range(words))


def encode(conn: Conn, model: str, text: str) -> list[int]:
    return ok(conn.call("tokenize", model=model, text=text, add_special_tokens=False))["tokens"]


@pytest.mark.parametrize("model", MODELS)
def test_columnar_on_one_broker_equals_rows_on_the_other_with_the_same_states(brokers, model: str) -> None:
    _, conns = brokers
    rng = random.Random(model)
    gens = [encode(conns[0], model, prose(rng)) for _ in range(24)]
    options = [{} if k % 3 else {"stop": [rng.choice(["日本", "he", "🙂", "zz"])], "include_stop_str_in_output": k % 2 == 0}
               for k in range(len(gens))]
    at, states = [0] * len(gens), [None] * len(gens)
    live = set(range(len(gens)))
    shown = [""] * len(gens)
    while live:
        order = sorted(live)
        seqs = []
        for k in order:
            chunk = gens[k][at[k]:at[k] + rng.choice([0, 1, 1, 2, 4])]
            at[k] += len(chunk)
            seqs.append({"tokens": chunk, "state": states[k], "final": at[k] >= len(gens[k]),
                         **(options[k] if states[k] is None else {})})
        a, b = rng.sample(conns, 2)  # states made by one broker go to the other next step
        rows = ok(a.call("detokenize_stream", model=model, seqs=seqs))["seqs"]
        picked = [k for k, s in zip(order, seqs) if s["state"] is not None or not options[k]]
        if picked:
            cols = ok(b.call("detokenize_stream", model=model,
                             columns=columns_of([s for k, s in zip(order, seqs) if k in picked])))
            assert rows_of(cols) == [r for k, r in zip(order, rows) if k in picked]
        for k, r in zip(order, rows):
            shown[k] += r["text"]
            if r["finished"]:
                live.discard(k)
            else:
                states[k] = r["state"]
    for k, g in enumerate(gens):
        if not options[k]:
            assert shown[k] == ok(conns[1].call("detokenize", model=model, tokens=g))["text"]


def test_a_step_sent_again_to_either_broker_gives_the_same_reply_byte_for_byte(brokers) -> None:
    _, conns = brokers
    ids = encode(conns[0], "qwen", "日本語の文章も、emoji 🙂🚀 too")
    seqs = [{"tokens": ids[k:k + 2], "state": None, "final": False} for k in range(0, len(ids), 2)]
    first = ok(conns[0].call("detokenize_stream", model="qwen", columns=columns_of(seqs)))
    nxt = {**columns_of(seqs), "states": first["columns"]["states"], "state_lengths": first["columns"]["state_lengths"]}
    replies = [ok(c.call("detokenize_stream", model="qwen", columns=nxt)) for c in (*conns, *conns)]
    assert all(r["columns"] == replies[0]["columns"] for r in replies)


def test_malformed_buffers_are_answered_and_disturb_no_other_request(brokers) -> None:
    pair, conns = brokers
    conn = conns[0]
    ids = encode(conn, "deepseek", "hello world 日本")
    good = columns_of([{"tokens": ids[:1], "state": None}, {"tokens": ids[1:3], "state": None}])
    want = ok(conn.call("detokenize_stream", model="deepseek", columns=good))["columns"]
    states = want["states"]
    n0 = struct.unpack("<I", want["state_lengths"][:4])[0]
    step = {**good, "states": states, "state_lengths": want["state_lengths"]}
    forged = bytearray(states)
    forged[n0 + 3] ^= 1
    cases = [
        ({**step, "lengths": step["lengths"][:4]}, "invalid_input", "columns.state_lengths"),
        ({**step, "tokens": step["tokens"][:-2]}, "invalid_input", "columns.tokens"),
        ({**step, "states": bytes(forged)}, "invalid_input", "sequence 1"),
        ({**step, "state_lengths": struct.pack("<2I", 5, len(states) - 5)}, "invalid_input", "sequence 0"),
        ({**step, "final": b"\x00\x03"}, "invalid_input", "columns.final"),
        ({**step, "tokens": [1, 2, 3]}, "bad_request", "columns.tokens"),
        ({**step, "lengths": None}, "bad_request", "columns.lengths"),
    ]
    for k, (cols, code, words) in enumerate(cases):
        reply = conn.call("detokenize_stream", model="deepseek", columns=cols)  # its id is echoed (Conn.call waits for it)
        assert not reply["ok"], reply
        assert reply["error"]["code"] == code and words in reply["error"]["message"], (k, reply)
    again = ok(conn.call("detokenize_stream", model="deepseek", columns=step))["columns"]
    assert again == ok(conns[1].call("detokenize_stream", model="deepseek", columns=step))["columns"]
    both = conn.call("detokenize_stream", model="deepseek", columns=step, seqs=[])
    assert both["error"]["code"] == "bad_request"
    assert all(b.proc.poll() is None for b in pair)


def helper_loop(stream, gens: dict, opts: dict, rng: random.Random) -> tuple[dict, dict]:
    """A scheduler's loop: open as sequences arrive, one step for all, read every text, drop the finished."""
    texts = {k: "" for k in gens}
    ended: dict = {}
    at = dict.fromkeys(gens, 0)
    waiting = list(gens)
    while waiting or len(stream):
        for _ in range(rng.randint(0, 3)):  # sequences join while others run
            if waiting:
                k = waiting.pop()
                stream.open(k, **opts.get(k, {}))
        step = {}
        for k in stream.keys():
            step[k] = gens[k][at[k]:at[k] + 1]
            at[k] += len(step[k])
        final = [k for k in step if at[k] >= len(gens[k])]
        deltas = yield step, final
        for k, text in zip(deltas.keys(), deltas.texts()):
            texts[k] += text
        for k, d in deltas.finished.items():
            ended[k] = d
            assert k not in stream
    return texts, ended


def drive(stream, gens, opts, seed) -> tuple[dict, dict]:
    loop = helper_loop(stream, gens, opts, random.Random(seed))
    try:
        step, final = next(loop)
        while True:
            step, final = loop.send(stream.step(step, final=final))
    except StopIteration as e:
        return e.value


def test_the_client_helper_streams_exactly_in_the_columnar_form(brokers) -> None:
    pair, conns = brokers
    rng = random.Random(5)
    gens = {f"s{k}": encode(conns[0], "deepseek", prose(rng, 12)) for k in range(20)}
    opts = {"s3": {"stop": ["日本"]}, "s7": {"stop": ["🙂"], "include_stop_str_in_output": True},
            "s11": {"prompt_tokens": gens["s2"][:5]}}
    with tb.Client(pair[0].endpoint) as client:
        texts, ended = drive(client.detokenize_stream(model="deepseek"), gens, opts, 1)
        for k, g in gens.items():
            if k not in opts:
                assert texts[k] == client.detokenize(g, model="deepseek").text
                assert ended[k].finished == "final"
        for k in ("s3", "s7"):
            if ended[k].finished == "stop":
                assert ended[k].stop == opts[k]["stop"][0]
        # the same loop in the row form only (a 1.1 broker's) gives the same texts
        row_stream = tb.DetokenizeStream(client.detokenize_stream()._call, model="deepseek", timeout=None, columnar=False)
        assert drive(row_stream, gens, opts, 1) == (texts, ended)


def test_the_async_helper_sends_first_steps_with_options_alongside_and_names_keys_in_errors(brokers) -> None:
    pair, conns = brokers
    gens = {k: encode(conns[0], "qwen", f"{k}: hello 🙂 world 日本語") for k in ("a", "b", "c")}

    async def run() -> tuple[dict, dict]:
        async with tb.AsyncClient(pair[1].endpoint) as client:
            stream = client.detokenize_stream(model="qwen")
            texts, ended = {}, {}
            stream.open("a")
            stream.open("b", stop=["日本"])
            stream.open("c", skip_special_tokens=False)
            first = True
            while len(stream):  # an empty step for all, then every id with `final`
                step = {k: ([] if first else gens[k]) for k in stream.keys()}
                deltas = await stream.step(step, final=[] if first else list(step))
                first = False
                for k, d in deltas.items():
                    texts[k] = texts.get(k, "") + d.text
                    if d.finished:
                        ended[k] = d.finished
            stream.open("z")
            await stream.step({"z": gens["a"][:1]})
            with pytest.raises(tb.InvalidInput, match="key 'z'"):
                await stream.step({"z": [2**31]})
            assert "z" in stream  # the refused step left its state
            return texts, ended

    texts, ended = asyncio.run(run())
    assert texts["a"] == "a: hello 🙂 world 日本語" and texts["c"] == "c: hello 🙂 world 日本語"
    assert ended == {"a": "final", "b": "stop", "c": "final"}
    assert texts["b"] == "b: hello 🙂 world "
