"""One engine per distinct tokenizer, in a real worker: models over one tokenizer.json share it.

Two models read the same tokenizer.json (one from its folder, one from a copy elsewhere), each with a
chat template of its own: the worker holds one tokenizer for both, and one pair of caches, so a text
that one model's request put in L0 is an L0 hit for the other. Each still renders its own template
and `models` lists both names.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from helpers import CHAT_TEMPLATES, LSTRIP_DIR, serving

from tokenbroker.workers.tokenizers import load_tokenizer

TEXT = "one text, sent through both models <|user|> hello <|end|>"
TEXTS = [TEXT, "", " ", "<s>", "<|both|>x<|both|> <nl> ITEM item <w>w<w>", "words " * 300 + "<|end|>" * 3,
         "\n\n  <|user|>  \t<|end|>\u3000ünïcödé 🙂"]
MESSAGES = [{"role": "user", "content": "hi"}]
CACHE_MODES = {"off": (), "l0": ("--tokenizer-cache-enable-l0",), "l1": ("--tokenizer-cache-enable-l1",),
               "l0+l1": ("--tokenizer-cache-enable-l0", "--tokenizer-cache-enable-l1")}


@pytest.mark.parametrize("mode", list(CACHE_MODES))
def test_two_models_over_one_tokenizer_json_share_one_engine_and_its_caches(tmp_path: Path, mode: str) -> None:
    copy = tmp_path / "tokenizer.json"
    shutil.copy(LSTRIP_DIR / "tokenizer.json", copy)
    plain = tmp_path / "plain.jinja"
    plain.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}")
    reference = load_tokenizer(str(LSTRIP_DIR))
    with serving("--model", f"a={LSTRIP_DIR}", "--model-chat-template", f"a={CHAT_TEMPLATES / 'chatml.jinja'}",
                 "--model", f"b={copy}", "--model-chat-template", f"b={plain}", *CACHE_MODES[mode]) as (_, c):
        first = c.call("tokenize", model="a", text=TEXT)
        second = c.call("tokenize", model="b", text=TEXT)
        if "l0" in mode:
            assert (first["cache"]["l0"], second["cache"]["l0"]) == ("miss", "hit")  # one L0 for both models
        for flag in (True, False):
            for _ in range(2):  # a second time: what the caches kept, through the other model first
                for model in ("b", "a"):
                    got = c.call("tokenize", model=model, text=TEXTS, add_special_tokens=flag)
                    assert got["tokens"] == [reference.encode(t, add_special_tokens=flag) for t in TEXTS], (model, flag)
        prompts = {m: c.call("chat", model=m, messages=MESSAGES, add_generation_prompt=False, return_prompt=True)
                   for m in ("a", "b")}
        assert prompts["a"]["ok"] and prompts["b"]["ok"], prompts
        assert "<|im_start|>user" in prompts["a"]["prompt"] and prompts["b"]["prompt"] == "[user] hi\n"
        models = c.call("models")
        listed = {m["name"]: m for m in models["models"]}
        assert {"a", "b"} <= set(listed), models
        assert listed["a"]["fingerprint"] != listed["b"]["fingerprint"]  # the templates differ
