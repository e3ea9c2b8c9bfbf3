"""detokenize_stream through real brokers: exact against the broker's own `detokenize`, states that any
broker serving the same model accepts, bad states answered `invalid_input` naming the sequence.

Two brokers load the same models (DeepSeek's tokenizer.json, BERT WordPiece, Qwen's qwen.tiktoken and
a Metaspace BPE with byte fallback built by tests/test_stream.py); every test sends a sequence's steps
to either broker, so a state made by one is read by the other.
"""

from __future__ import annotations

import random
import struct

import pytest
from helpers import BERT_DIR, QWEN_TIKTOKEN, Conn, deepseek_tokenizer_json, start_broker
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_stream import WORDS, source

MODELS = ["deepseek", "bert", "qwen", "bytefallback"]
EXAMPLES = 12


def model_args() -> list[str]:
    return [
        "--model-path", str(deepseek_tokenizer_json()), "--served-model-name", "deepseek",
        "--model", f"bert={BERT_DIR}",
        "--model", f"qwen={QWEN_TIKTOKEN}",
        "--model", f"bytefallback={source('sp-bytefallback')}",
    ]


@pytest.fixture(scope="module")
def brokers():
    pair = [start_broker(*model_args(), workers=1) for _ in range(2)]
    conns = [Conn(b.endpoint) for b in pair]
    yield conns
    for c in conns:
        c.close()
    for b in pair:
        b.stop()


def ok(reply: dict) -> dict:
    assert reply["ok"], reply
    return reply


def encode(conn: Conn, model: str, text: str) -> list[int]:
    return ok(conn.call("tokenize", model=model, text=text, add_special_tokens=False))["tokens"]


def detokenize(conn: Conn, model: str, ids: list[int]) -> str:
    return ok(conn.call("detokenize", model=model, tokens=ids))["text"]


def run_streams(conns: list[Conn], model: str, gens: list[list[int]], *, rng: random.Random,
                prompts: list[list[int]] | None = None, max_step: int = 1) -> list[str]:
    """Stream many sequences together, each step to a randomly chosen broker; their texts."""
    n = len(gens)
    texts, states = [""] * n, [None] * n
    at = [0] * n
    live = set(range(n))
    first = True
    while live:
        order = sorted(live)
        seqs = []
        for k in order:
            size = rng.randint(0, max_step)
            chunk = gens[k][at[k]:at[k] + size]
            at[k] += len(chunk)
            seq = {"tokens": chunk, "state": states[k], "final": at[k] >= len(gens[k])}
            if first and prompts is not None:
                seq["prompt_tokens"] = prompts[k]
            seqs.append(seq)
        reply = ok(rng.choice(conns).call("detokenize_stream", model=model, seqs=seqs))
        assert "cache" not in reply and reply["worker"]
        assert len(reply["seqs"]) == len(order)
        for k, r in zip(order, reply["seqs"]):
            texts[k] += r["text"]
            if r["state"] is None:
                assert r["finished"] == "final" and r["stop"] is None
                live.discard(k)
            else:
                assert r["finished"] is None and isinstance(r["state"], bytes)
                states[k] = r["state"]
        first = False
    return texts


def test_models_reply_carries_one_fingerprint_per_model_the_same_on_both_brokers(brokers) -> None:
    a, b = (ok(c.call("models"))["models"] for c in brokers)
    fa = {m["name"]: m["fingerprint"] for m in a}
    assert fa == {m["name"]: m["fingerprint"] for m in b}
    assert set(fa) == set(MODELS) and len(set(fa.values())) == len(MODELS)
    assert all(len(f) == 64 and int(f, 16) >= 0 for f in fa.values())


@pytest.mark.parametrize("model", MODELS)
def test_256_sequences_stream_exactly_across_two_brokers(brokers, model: str) -> None:
    rng = random.Random(model)
    c = brokers[0]
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(0, 10))) for _ in range(256)]
    gens = [encode(c, model, t) for t in texts]
    got = run_streams(brokers, model, gens, rng=rng)
    want = ok(c.call("detokenize", model=model, tokens=gens))["text"] if any(gens) else [""] * 256
    assert got == want


@pytest.mark.parametrize("model", MODELS)
def test_random_texts_and_steps_with_prompts_match_detokenize_across_brokers(brokers, model: str) -> None:
    c = brokers[0]

    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)
    @given(parts=st.lists(st.one_of(st.sampled_from(WORDS), st.text(max_size=5)), max_size=8),
           cut=st.integers(0, 12), seed=st.integers(0, 2**16))
    def run(parts, cut, seed):
        ids = encode(c, model, "".join(parts))
        prompt, gen = ids[:cut], ids[cut:]
        full, head = detokenize(c, model, prompt + gen), detokenize(c, model, prompt)
        while not full.startswith(head) and head.endswith("\ufffd"):
            head = head[:-1]
        got = run_streams(brokers, model, [gen], rng=random.Random(seed), prompts=[prompt], max_step=3)
        assert got == [full[len(head):]]

    run()


def test_stop_string_across_steps_through_the_broker(brokers) -> None:
    c = brokers[0]
    ids = encode(c, "qwen", "Sure. The answer is 42.\n\nUser: next")
    state, shown = None, ""
    for k, t in enumerate(ids):
        seq = {"tokens": [t], "state": state} if state else {"tokens": [t], "stop": ["\n\nUser:"]}
        r = ok(brokers[k % 2].call("detokenize_stream", model="qwen", seqs=[seq]))["seqs"][0]
        shown += r["text"]
        if r["finished"]:
            break
        state = r["state"]
    assert shown == "Sure. The answer is 42." and r == {**r, "finished": "stop", "stop": "\n\nUser:", "state": None}


def test_u32_bin_tokens_are_accepted(brokers) -> None:
    c = brokers[1]
    ids = encode(c, "deepseek", "bin tokens 🙂")
    r = ok(c.call("detokenize_stream", model="deepseek", seqs=[{"tokens": struct.pack(f"<{len(ids)}I", *ids), "final": True}]))
    assert r["seqs"][0]["text"] == "bin tokens 🙂"


def first_states(c: Conn, model: str) -> list[bytes]:
    ids = encode(c, model, "hello world")
    r = ok(c.call("detokenize_stream", model=model, seqs=[{"tokens": ids[:1]} for _ in range(3)]))
    return [s["state"] for s in r["seqs"]]


def test_altered_or_truncated_state_is_invalid_input_naming_the_sequence(brokers) -> None:
    a, b = brokers
    states = first_states(a, "deepseek")
    for bad in (states[2][:-1], states[2][:5], bytes([states[2][0] ^ 1]) + states[2][1:],
                states[2][:20] + bytes([states[2][20] ^ 0x40]) + states[2][21:]):
        seqs = [{"tokens": [], "state": states[0]}, {"tokens": [], "state": states[1]}, {"tokens": [], "state": bad}]
        r = b.call("detokenize_stream", model="deepseek", seqs=seqs)
        assert not r["ok"] and r["error"]["code"] == "invalid_input"
        assert "seqs[2].state" in r["error"]["message"] and "sequence 2" in r["error"]["message"]
    assert ok(b.call("detokenize_stream", model="deepseek", seqs=[{"tokens": [], "state": s} for s in states]))


def test_a_state_of_another_model_is_invalid_input_and_a_non_bin_state_a_bad_request(brokers) -> None:
    a, b = brokers
    qwen_state = first_states(a, "qwen")[0]
    r = b.call("detokenize_stream", model="deepseek", seqs=[{"tokens": []}, {"tokens": [], "state": qwen_state}])
    assert not r["ok"] and r["error"]["code"] == "invalid_input" and "seqs[1].state" in r["error"]["message"]
    r = b.call("detokenize_stream", model="deepseek", seqs=[{"tokens": [], "state": "not a bin"}])
    assert not r["ok"] and r["error"]["code"] == "bad_request" and "seqs[0].state" in r["error"]["message"]
    r = b.call("detokenize_stream", model="deepseek", seqs="nope")
    assert not r["ok"] and r["error"]["code"] == "bad_request" and "'seqs'" in r["error"]["message"]
    assert ok(b.call("ping"))["workers"] == 1  # the worker is still there
