"""The model fingerprint (workers/fingerprint.py): the same for the same model, different when an id or
a rendered prompt could differ. It keys detokenize_stream's state MAC and the broker's worker admission."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from helpers import BERT_DIR, QWEN_TIKTOKEN

from tokenbroker.workers.chat import ChatTemplates
from tokenbroker.workers.fingerprint import model_fingerprint
from tokenbroker.workers.tokenizers import load_tokenizer


def fp(source: str, templates: ChatTemplates | None = None) -> str:
    return model_fingerprint(load_tokenizer(source), templates)


def test_same_model_loaded_twice_has_the_same_fingerprint() -> None:
    for source in (str(BERT_DIR), str(QWEN_TIKTOKEN), "cl100k_base"):
        a, b = fp(source), fp(source)
        assert a == b and len(a) == 64 and int(a, 16) >= 0


def test_different_tokenizers_have_different_fingerprints() -> None:
    prints = {fp(s) for s in (str(BERT_DIR), str(QWEN_TIKTOKEN), "cl100k_base", "o200k_base")}
    assert len(prints) == 4


def test_chat_template_changes_the_fingerprint() -> None:
    plain = fp(str(BERT_DIR))
    one = fp(str(BERT_DIR), ChatTemplates(default="{{ messages }}", named={}, source="test"))
    other = fp(str(BERT_DIR), ChatTemplates(default="{{ messages }}!", named={}, source="elsewhere"))
    same_text = fp(str(BERT_DIR), ChatTemplates(default="{{ messages }}", named={}, source="another file"))
    assert len({plain, one, other}) == 3 and one == same_text  # where it came from does not count


def test_an_added_special_token_or_option_changes_the_fingerprint(tmp_path: Path) -> None:
    base = fp(str(BERT_DIR))
    copy = tmp_path / "bert"
    shutil.copytree(BERT_DIR, copy)
    assert fp(str(copy)) == base  # the folder's path does not count
    spec = json.loads((copy / "tokenizer.json").read_text())
    spec["added_tokens"].append({"id": max(a["id"] for a in spec["added_tokens"]) + 40000, "content": "<new>",
                                 "single_word": False, "lstrip": False, "rstrip": False, "normalized": False, "special": True})
    (copy / "tokenizer.json").write_text(json.dumps(spec))
    added = fp(str(copy))
    shutil.copy(BERT_DIR / "tokenizer.json", copy / "tokenizer.json")
    config = json.loads((copy / "tokenizer_config.json").read_text())
    config["do_lower_case"] = not config.get("do_lower_case", True)
    (copy / "tokenizer_config.json").write_text(json.dumps(config))
    option = fp(str(copy))
    assert len({base, added, option}) == 3
