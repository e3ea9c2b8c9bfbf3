"""Contract 1.3's per-text `truncated` through a real broker and worker, in every cache mode: a batch
with `truncate_prompt_tokens` answers one int per text (the ids that text dropped, in the texts'
order), a single text one int, for every shipped tokenizer, list and u32 replies, the raw wire and
the typed client. The second pass of each check is served from the caches where they are on."""

from __future__ import annotations

from array import array
from typing import Iterator

import pytest
from helpers import BERT_DIR, QWEN_TIKTOKEN, BrokerProcess, Conn, deepseek_tokenizer_json, start_broker
from test_tokenin import Reference, expected

from tokenbroker import Client

MODELS = ["deepseek", "bert", "qwen", "o200k"]
CACHE_FLAGS = {
    "off": (),
    "l0": ("--tokenizer-cache-enable-l0",),
    "l1": ("--tokenizer-cache-enable-l1",),
    "l0+l1": ("--tokenizer-cache-enable-l0", "--tokenizer-cache-enable-l1"),
}
# Lengths differ on purpose: under a cut of 12 ids some texts lose many, one loses none, "" loses none.
TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog, again and again and again.",
    "hi",
    "héllo 世界 🤖 naïve café <|im_start|>user\nhi<|im_end|>\n" * 3,
    "",
    "Prefix caches want the same ids: " * 9,
]


@pytest.fixture(scope="module", params=list(CACHE_FLAGS))
def broker(request: pytest.FixtureRequest) -> Iterator[BrokerProcess]:
    b = start_broker("--model-path", str(deepseek_tokenizer_json()), "--served-model-name", "deepseek",
                     "--model", f"bert={BERT_DIR}", "--model", f"qwen={QWEN_TIKTOKEN}", "--model", "o200k=o200k_base",
                     *CACHE_FLAGS[request.param], workers=1)
    yield b
    b.stop()


def _u32(data: bytes) -> list[int]:
    a = array("I")
    a.frombytes(data)
    return a.tolist()


@pytest.mark.parametrize("model", MODELS)
def test_a_batch_gets_the_ids_each_text_dropped_a_single_text_an_int(broker: BrokerProcess, model: str) -> None:
    ref = Reference(model)
    conn = Conn(broker.endpoint)
    try:
        for keep, side in ((12, "left"), (12, "right"), (0, "left"), (10_000, "left")):
            want = [expected(ref, t, True, keep, side == "left") for t in TEXTS]
            assert keep != 12 or len({w["truncated"] for w in want}) > 2  # the texts are cut by different amounts
            for _ in range(2):  # the second time from L0/L1 where they are on
                for fmt in ("list", "u32"):
                    b = conn.call("tokenize", model=model, text=TEXTS, truncate_prompt_tokens=keep,
                                  truncation_side=side, tokens_format=fmt)
                    assert b["ok"], b
                    got = b["tokens"] if fmt == "list" else [_u32(t) for t in b["tokens"]]
                    assert got == [w["ids"] for w in want]
                    assert b["truncated"] == [w["truncated"] for w in want]
                    assert b["count"] == sum(len(w["ids"]) for w in want)
                    for text, w in zip(TEXTS, want):
                        r = conn.call("tokenize", model=model, text=text, truncate_prompt_tokens=keep,
                                      truncation_side=side, tokens_format=fmt)
                        assert r["ok"], r
                        assert type(r["truncated"]) is int and r["truncated"] == w["truncated"], text
            one = conn.call("tokenize", model=model, text=[TEXTS[0]], truncate_prompt_tokens=keep, truncation_side=side)
            assert one["truncated"] == [want[0]["truncated"]]  # a batch of one is still a batch
        plain = conn.call("tokenize", model=model, text=TEXTS)
        assert "truncated" not in plain
    finally:
        conn.close()


def test_the_typed_client_exposes_truncated_per_text(broker: BrokerProcess) -> None:
    with Client(broker.endpoint, ids="list") as tb:
        for model in MODELS:
            ref = Reference(model)
            want = [expected(ref, t, True, 12, True) for t in TEXTS]
            b = tb.tokenize_batch(TEXTS, model=model, truncate=12)
            assert b.tokens == [w["ids"] for w in want]
            assert b.truncated == [w["truncated"] for w in want]
            assert tb.tokenize(TEXTS[0], model=model, truncate=12).truncated == want[0]["truncated"]
            assert tb.tokenize_batch(TEXTS, model=model).truncated is None
