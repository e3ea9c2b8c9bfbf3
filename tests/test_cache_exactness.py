"""The cache never changes a result: cached ids equal the tokenizer's own, id for id, on real tokenizers.

Tokenizers: DeepSeek's byte-level BPE tokenizer.json, BERT WordPiece, tiktoken's cl100k_base, and
SentencePiece-style Unigram tokenizers built here with the tokenizers library (Metaspace "first" and
"always", the legacy Prepend+Replace normalizer, and "raw": Metaspace "first" with no normalizer, so
normalized added tokens are boundaries too), each with a <s> $A </s> template, lstrip and rstrip
specials, a special whose text contains another, and non-special added tokens of both passes.
"""

from __future__ import annotations

import os
import random
from functools import cache
from typing import Any

import pytest
import tiktoken
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from helpers import BERT_DIR, served_tokenizer
from tokenbroker.common.config import EMBEDDED_DEFAULT
from tokenbroker.common.config import CacheConfig
from tokenbroker.workers.cache import TokenCache



class HFTok:
    """The worker's Hugging Face tokenizer shape: truncation and padding off, encode -> ids."""

    kind = "huggingface"

    def __init__(self, raw: Tokenizer, named: dict[str, str]) -> None:
        raw.no_truncation()
        raw.no_padding()
        self.raw = raw
        self.named_specials = named
        self.vocab_size = raw.get_vocab_size()
        self.special_tokens = {t: i for t in named.values() if (i := raw.token_to_id(t)) is not None}
        self.special_tokens.update({a.content: i for i, a in raw.get_added_tokens_decoder().items() if a.special})

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return self.raw.encode(text, add_special_tokens=add_special_tokens).ids


class TiktokenTok:
    """The worker's tiktoken shape: every special allowed in text, the flag changes nothing."""

    kind = "tiktoken"

    def __init__(self, raw: tiktoken.Encoding) -> None:
        self.raw = raw
        self.named_specials: dict[str, str] = {}
        self.vocab_size = raw.n_vocab
        self.special_tokens = {t: raw.encode_single_token(t) for t in raw.special_tokens_set}
        self._allowed = frozenset(self.special_tokens)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return self.raw.encode(text, allowed_special=self._allowed, disallowed_special=())


# Non-special added tokens of the "raw" tokenizer: matched after the (identity) normalizer, stripping
# whitespace, one that only matches as a word, and a raw one that overlaps "<|say|>" and so wins over
# it (the raw pass runs first).
RAW_EXTRA = [
    AddedToken("<|turn|>", special=False, normalized=True, rstrip=True),
    AddedToken("<|say|>", special=False, normalized=True, lstrip=True),
    AddedToken("<w2>", special=False, normalized=True, single_word=True),
    AddedToken("y|>Q", special=False, normalized=False),
]


def build_sentencepiece(scheme: str, *, extra: list[AddedToken] = ()) -> Tokenizer:
    """A small Unigram tokenizer the way SentencePiece conversions look in tokenizer.json; scheme
    "raw" is Metaspace "first" without a normalizer."""
    rng = random.Random(7)
    syl = ["he", "llo", "wor", "ld", "to", "ken", "bro", "ker", "ca", "che", "pre", "fix", "sys", "tè", "me", "na",
           "ïve", "日", "本", "42", "en", "d", "us", "er", "<", "|", ">", "s", "x", "y", "i", "m", "start"]
    words = ["".join(rng.choice(syl) for _ in range(rng.randint(1, 3))) for _ in range(400)]
    corpus = [" ".join(rng.choice(words) for _ in range(12)) for _ in range(600)]
    tok = Tokenizer(models.Unigram())
    if scheme == "legacy":  # Llama-2 style: no pre-tokenizer, the normalizer prepends and replaces
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.Strip(" ", 1, 0)])
    elif scheme == "raw":
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    else:
        tok.normalizer = normalizers.NFKC()
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme)
        tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme=scheme)
    trainer = trainers.UnigramTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>", "<pad>"], unk_token="<unk>")
    tok.train_from_iterator(corpus, trainer)
    tok.add_special_tokens([
        AddedToken("<|user|>", special=True, normalized=False, lstrip=True),
        AddedToken("<|end|>", special=True, normalized=False, rstrip=True),
        AddedToken("<|im|>", special=True, normalized=False),
        AddedToken("<|im|>start", special=True, normalized=False),
        *extra,
    ])
    tok.add_tokens([AddedToken("ITEM", normalized=True), AddedToken("x<|im|>y", normalized=False)])
    if scheme == "raw":
        tok.add_tokens(RAW_EXTRA)
    bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> $B </s>", special_tokens=[("<s>", bos), ("</s>", eos)])
    return tok


SP_NAMED = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}


@cache
def tokenizer(name: str) -> Any:
    """The shipped tokenizers as a worker serves them, with the engine it chooses (fastokens for
    DeepSeek and cl100k, whose texts holding U+180E go to tiktoken, the reference for BERT, which
    fastokens refuses); the SentencePiece-style ones built here in the worker's shape, on the
    reference (fastokens has no Unigram)."""
    if name == "deepseek":
        return served_tokenizer(EMBEDDED_DEFAULT)
    if name == "bert":
        return served_tokenizer(str(BERT_DIR))
    if name == "cl100k":
        return served_tokenizer("cl100k_base")
    scheme = name.removeprefix("sp-")
    return HFTok(build_sentencepiece(scheme), SP_NAMED)


@cache
def reference(name: str) -> Any:
    """The reference library's own encode for `name`, whatever engine serves it: (text, flag) -> ids."""
    tok = tokenizer(name)
    if tok.kind == "tiktoken":
        allowed = frozenset(tok.special_tokens)
        return lambda text, flag: tok.raw.encode(text, allowed_special=allowed, disallowed_special=())
    return lambda text, flag: tok.raw.encode(text, add_special_tokens=flag).ids


# Examples per tokenizer and layer set; raise it for a longer hunt (TOKENBROKER_EXACTNESS_EXAMPLES=500).
EXAMPLES = int(os.environ.get("TOKENBROKER_EXACTNESS_EXAMPLES", "30"))
NAMES = ["deepseek", "bert", "cl100k", "sp-first", "sp-always", "sp-legacy", "sp-raw"]
LAYERS = {
    "l0": CacheConfig(l0_enabled=True, l0_max_entries=64),
    "l1": CacheConfig(l1_enabled=True, l1_max_memory=256 * 1024),
    "both": CacheConfig(l0_enabled=True, l0_max_entries=64, l1_enabled=True, l1_max_memory=256 * 1024),
}


@cache
def token_cache(name: str, layers: str) -> TokenCache:
    """One cache per tokenizer and layer set, kept across examples so later examples hit earlier entries."""
    return TokenCache(tokenizer(name), LAYERS[layers], name=name, l1_min_prefix=0)


def spliced_specials(name: str) -> list[str]:
    """Special (and other added) tokens worth splicing into text for this tokenizer."""
    tok = tokenizer(name)
    picks = list(tok.named_specials.values())
    if name == "deepseek":
        picks += ["<｜User｜>", "<｜Assistant｜>", "<think>", "</think>", "<｜tool▁sep｜>", "<|EOT|>"]
    elif name == "cl100k":
        picks += sorted(tok.special_tokens)
    elif name.startswith("sp-"):
        picks += ["<|user|>", "<|end|>", "<|im|>", "<|im|>start", "x<|im|>y", "ITEM", "<|im|", "|im|>"]
        if name == "sp-raw":
            picks += [t.content for t in RAW_EXTRA] + ["<|sa", "<|say|>Q", "<|turn|>ITEM"]
    return picks


WORDS = ["hello", "world", " the", "cache", "naïve", "日本語", "42", "x", "y", "start", "<", ">", "|", "▁", "ITEM",
         "user", "Ünïcödé", "don't", "  ", "\n", "\t", " ", "\r\n", "🙂"]


def turns(name: str) -> st.SearchStrategy[list[str]]:
    """Conversations: turns of text, whitespace and special tokens, later turns extending earlier ones."""
    piece = st.one_of(
        st.sampled_from(spliced_specials(name)),
        st.sampled_from(WORDS),
        st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=8),
    )
    turn = st.lists(piece, min_size=1, max_size=8).map("".join)
    return st.lists(turn, min_size=1, max_size=5)


def check_conversation(name: str, layers: str, conversation: list[str]) -> None:
    cache_, encode = token_cache(name, layers), reference(name)
    text = ""
    for turn in conversation:
        text += turn
        for flag in (False, True):
            want = encode(text, flag)
            for _ in range(2):  # the second time it may come from L0
                got, _outcome = cache_.encode(text, flag)
                assert got == want, f"{name}/{layers} add_special_tokens={flag} {text!r}"


@pytest.mark.parametrize("layers", sorted(LAYERS))
@pytest.mark.parametrize("name", NAMES)
def test_cached_ids_equal_uncached_ids_on_random_spliced_texts(name: str, layers: str) -> None:
    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)
    @given(conversation=turns(name))
    def run(conversation: list[str]) -> None:
        check_conversation(name, layers, conversation)

    run()


@pytest.mark.parametrize("name", NAMES)
def test_l1_is_exact_and_active_for_real_tokenizers(name: str) -> None:
    c = token_cache(name, "l1")
    assert c.l1_active and c.l1_bypass_reason is None


@pytest.mark.parametrize("name", ["sp-first", "sp-always", "sp-legacy"])
def test_cache_is_right_where_a_naive_prefix_split_is_wrong(name: str) -> None:
    tok = tokenizer(name)
    cases = [
        ("hello world<|im|>", "tokenbroker cache"),  # Metaspace "first" must not prepend to the second half
        ("hello<|end|>", "   world"),  # the rstrip special eats the spaces after it
        ("hello <|im|>", "start now"),  # "<|im|>start" is the longer special: the split point is not a boundary
        ("hello x<|im|>", "y world"),  # an added token around a special
    ]
    wrong = 0
    for prefix, rest in cases:
        full = prefix + rest
        for flag in (False, True):
            naive = tok.encode(prefix, add_special_tokens=flag) + tok.encode(rest, add_special_tokens=flag)
            want = tok.encode(full, add_special_tokens=flag)
            wrong += naive != want
            c = TokenCache(tok, LAYERS["l1"], l1_min_prefix=0)
            assert c.encode(prefix + "<|im|>", flag)[0] == tok.encode(prefix + "<|im|>", add_special_tokens=flag)
            assert c.encode(full, flag)[0] == want
            assert c.encode(full + "<|end|> more", flag)[0] == tok.encode(full + "<|end|> more", add_special_tokens=flag)
    assert wrong > 0, "the cases should include ones that naive splitting gets wrong"


def test_single_word_special_stays_exact() -> None:
    """single_word specials match only between non-word characters: pieces that would differ are refused."""
    tok = HFTok(build_sentencepiece("first", extra=[AddedToken("<w>", special=True, normalized=False, single_word=True)]),
                SP_NAMED)
    c = TokenCache(tok, LAYERS["l1"], l1_min_prefix=0)
    for text in ["a<w>b", "a <w> b", "<w>b <w> c", "x <w>", "<w>", "<w>y<|im|> z <w>"]:
        for flag in (False, True):
            assert c.encode(text, flag)[0] == tok.encode(text, add_special_tokens=flag), text


def test_tiktoken_with_nested_special_tokens_bypasses_l1_and_says_why() -> None:
    base = tiktoken.get_encoding("cl100k_base")
    nested = tiktoken.Encoding(
        name="cl100k_nested", pat_str=base._pat_str, mergeable_ranks=base._mergeable_ranks,
        special_tokens={"<|a|>": base.n_vocab, "<|a|>b": base.n_vocab + 1},
    )
    tok = TiktokenTok(nested)
    c = TokenCache(tok, LAYERS["both"], name="nested", l1_min_prefix=0)
    assert not c.l1_active
    assert c.l1_bypass_reason is not None and "<|a|>" in c.l1_bypass_reason
    ids, outcome = c.encode("x<|a|>b y<|a|>", True)
    assert ids == tok.encode("x<|a|>b y<|a|>") and outcome.l1_reused_tokens == 0
    assert c.stats()["l1"]["misses"] == 0


def test_tokenizer_with_truncation_on_bypasses_l1() -> None:
    tok = tokenizer("bert")
    raw = Tokenizer.from_file(str(BERT_DIR / "tokenizer.json"))  # the file sets truncation at 128

    class Truncating(HFTok):
        def __init__(self) -> None:
            super().__init__(raw, tok.named_specials)
            raw.enable_truncation(128)

    c = TokenCache(Truncating(), LAYERS["l1"], l1_min_prefix=0)
    assert not c.l1_active and "truncation" in (c.l1_bypass_reason or "")


def test_boundaries_are_the_added_tokens_matched_on_raw_text_special_or_not() -> None:
    from tokenbroker.workers.cache.segment import Segmenter

    raw = Segmenter(tokenizer("sp-raw")).boundaries
    assert {"<|turn|>", "<|say|>", "ITEM", "y|>Q", "x<|im|>y", "<|im|>", "</s>"} <= raw.keys()
    assert "<w2>" not in raw  # single_word: whether it matches depends on the text after it
    normalizing = Segmenter(tokenizer("sp-first")).boundaries
    assert "x<|im|>y" in normalizing and "ITEM" not in normalizing  # NFKC runs before ITEM is matched
    deepseek = Segmenter(tokenizer("deepseek")).boundaries  # its normalizer is an empty Sequence
    assert {"<｜User｜>", "<｜Assistant｜>", "<think>", "<｜end▁of▁sentence｜>"} <= deepseek.keys()


def test_second_pass_tokens_are_cut_exactly_where_the_tokenizer_splits() -> None:
    tok = tokenizer("sp-raw")
    c = TokenCache(tok, LAYERS["l1"], l1_min_prefix=0)
    cases = [
        ("hello<|turn|>", "   world"),  # rstrip: the spaces after it are eaten
        ("hello ", "<|say|> there"),  # lstrip: the space before it is eaten
        ("a <|sa", "y|>Q b"),  # the raw pass takes y|>Q first, so <|say|> never matches
        ("ITEM<|turn|>", "ITEMS <w2> x<w2>y"),
        ("<|im|>ITEM", "<|turn|><|say|>"),
    ]
    for prefix, rest in cases:
        for flag in (False, True):
            for text in (prefix, prefix + rest, prefix + rest + "<|turn|> more"):
                assert c.encode(text, flag)[0] == tok.encode(text, add_special_tokens=flag), text
    c.encode("shared start<|turn|>", True)
    ids, outcome = c.encode("shared start<|turn|>  and more", True)
    assert ids == tok.encode("shared start<|turn|>  and more") and outcome.l1_reused_tokens > 0


@pytest.mark.parametrize("name", NAMES)
def test_cached_ids_equal_uncached_ids_when_spans_hold_many_boundaries(name: str) -> None:
    """Inputs with dozens of boundaries: L1 cuts at only a few of them (plan_cuts) and encodes the
    spans between in one call each, boundaries inside included; ids still equal a plain encode."""
    tok = tokenizer(name)
    piece = st.one_of(st.sampled_from(spliced_specials(name)), st.sampled_from(spliced_specials(name)),
                      st.sampled_from(WORDS))

    @settings(max_examples=max(10, EXAMPLES // 3), deadline=None, suppress_health_check=[HealthCheck.too_slow],
              database=None)
    @given(pieces=st.lists(piece, min_size=20, max_size=80), cut=st.integers(0, 79))
    def run(pieces: list[str], cut: int) -> None:
        c = TokenCache(tok, LAYERS["l1"], l1_min_prefix=0)
        head, text = "".join(pieces[:cut]), "".join(pieces)
        for flag in (False, True):
            c.encode(head, flag)  # a stored prefix somewhere inside, so lookups hit at various depths
            assert c.encode(text, flag)[0] == tok.encode(text, add_special_tokens=flag), text
            assert c.encode(text + "tail", flag)[0] == tok.encode(text + "tail", add_special_tokens=flag)

    run()
