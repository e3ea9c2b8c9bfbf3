"""What the cache reports and how it holds its bounds: outcomes, counters, eviction, hot entries.

Runs on tiktoken's cl100k_base and DeepSeek's tokenizer.json (real vocabularies, no mocks).
"""

from __future__ import annotations

from functools import cache

import pytest
import tiktoken

from helpers import deepseek_tokenizer
from tokenbroker.common.config import CacheConfig
from tokenbroker.workers.cache import CacheOutcome, TokenCache

EOT = "<|endoftext|>"
DS_EOS = "<｜end▁of▁sentence｜>"


class TiktokenTok:
    kind = "tiktoken"
    named_specials: dict[str, str] = {}

    def __init__(self) -> None:
        self.raw = tiktoken.get_encoding("cl100k_base")
        self.special_tokens = {t: self.raw.encode_single_token(t) for t in self.raw.special_tokens_set}
        self.calls: list[str] = []  # every text tokenized, to see what the cache asked for

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        self.calls.append(text)
        return self.raw.encode(text, allowed_special="all")


class DeepSeekTok:
    kind = "huggingface"
    named_specials = {"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": DS_EOS}

    def __init__(self) -> None:
        self.raw = deepseek_tokenizer()
        self.special_tokens = {a.content: i for i, a in self.raw.get_added_tokens_decoder().items() if a.special}

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return self.raw.encode(text, add_special_tokens=add_special_tokens).ids


@cache
def deepseek() -> DeepSeekTok:
    return DeepSeekTok()


def conversation(user: int, turns: int, *, size: int = 300, system: str = "You are helpful.") -> str:
    """A chat rendered with the end-of-text special between turns."""
    parts = [f"<|system|>{system}{EOT}"]
    for t in range(turns):
        parts.append(f"user {user} turn {t}: " + ("lorem ipsum dolor sit amet " * (size // 27)) + EOT)
    return "".join(parts)


def test_with_both_layers_off_encode_passes_through() -> None:
    tok = TiktokenTok()
    c = TokenCache(tok, CacheConfig(), l1_min_prefix=0)
    ids, outcome = c.encode(f"hi{EOT}there")
    assert ids == tok.raw.encode(f"hi{EOT}there", allowed_special="all")
    assert outcome == CacheOutcome("off", 0)
    assert not c.l1_active and c.l1_bypass_reason is None
    assert all(v == 0 for layer in c.stats().values() for v in layer.values())


def test_l0_hit_returns_same_ids_counts_input_bytes_and_never_reaches_l1() -> None:
    tok = TiktokenTok()
    c = TokenCache(tok, CacheConfig(l0_enabled=True, l1_enabled=True), l1_min_prefix=0)
    text = f"héllo{EOT} wörld"
    first, o1 = c.encode(text)
    calls = len(tok.calls)
    second, o2 = c.encode(text)
    assert first == second == tok.raw.encode(text, allowed_special="all")
    assert (o1.l0, o2) == ("miss", CacheOutcome("hit", 0))
    assert len(tok.calls) == calls  # not tokenized again
    s = c.stats()
    assert s["l0"]["hits"] == 1 and s["l0"]["misses"] == 1
    assert s["l0"]["reused_bytes"] == len(text.encode("utf-8"))
    assert s["l1"]["hits"] + s["l1"]["misses"] == 1  # only the first lookup reached L1


def test_l0_keys_on_the_add_special_tokens_flag() -> None:
    tok = deepseek()
    c = TokenCache(tok, CacheConfig(l0_enabled=True), l1_min_prefix=0)
    assert c.encode("hi", True)[1].l0 == "miss"
    assert c.encode("hi", False)[1].l0 == "miss"
    assert c.encode("hi", True)[1].l0 == "hit"


def test_input_without_special_tokens_is_an_l1_miss() -> None:
    c = TokenCache(TiktokenTok(), CacheConfig(l1_enabled=True), l1_min_prefix=0)
    ids, outcome = c.encode("no special tokens here")
    assert outcome == CacheOutcome("off", 0)
    assert c.stats()["l1"]["misses"] == 1 and c.stats()["l1"]["entries"] == 0


def test_growing_conversation_reuses_its_latest_turn() -> None:
    tok = TiktokenTok()
    c = TokenCache(tok, CacheConfig(l1_enabled=True), l1_min_prefix=0)
    previous = ""
    for turns in range(1, 9):
        text = conversation(1, turns)
        ids, outcome = c.encode(text)
        assert ids == tok.raw.encode(text, allowed_special="all")
        if previous:  # everything up to the previous turn's last special came from L1
            assert outcome.l1_reused_tokens == len(tok.raw.encode(previous, allowed_special="all"))
        previous = text
    s = c.stats()["l1"]
    assert s["hits"] == 7 and s["misses"] == 1
    assert s["reused_bytes"] == sum(len(conversation(1, t).encode()) for t in range(1, 8))


def test_a_cached_prefix_is_found_under_many_new_boundaries() -> None:
    """A lookup keys the deepest few boundaries first; a hit further back is still the deepest one."""
    tok = TiktokenTok()
    c = TokenCache(tok, CacheConfig(l1_enabled=True), l1_min_prefix=0)
    text = conversation(3, 2)
    c.encode(text)
    for extra in (1, 7, 8, 9, 30):
        longer = text + "".join(f"q{i}{EOT}" for i in range(extra)) + "tail"
        ids, outcome = c.encode(longer)
        assert ids == tok.raw.encode(longer, allowed_special="all")
        assert outcome.l1_reused_tokens == len(tok.raw.encode(text, allowed_special="all"))
        text += "more" + EOT  # a new prefix every round, deeper than the last
        c.encode(text)


def test_a_miss_tokenizes_each_piece_once_and_a_hit_only_the_rest() -> None:
    tok = TiktokenTok()
    c = TokenCache(tok, CacheConfig(l1_enabled=True), l1_min_prefix=0)
    tok.calls.clear()  # the load-time probes
    text = conversation(2, 6)
    c.encode(text)
    assert text not in tok.calls  # never the whole input
    seen = sum(len(t) for t in tok.calls)
    assert seen <= len(text) + len(EOT) * text.count(EOT)  # each piece once, plus one special of context
    tok.calls.clear()
    longer = text + "and one more question" + EOT + "tail"
    ids, outcome = c.encode(longer)
    assert ids == tok.raw.encode(longer, allowed_special="all")
    assert sum(len(t) for t in tok.calls) <= len("and one more question" + EOT + "tail") + 2 * len(EOT)


def test_returned_ids_are_fresh_lists() -> None:
    c = TokenCache(deepseek(), CacheConfig(l0_enabled=True, l1_enabled=True), l1_min_prefix=0)
    text = f"abc{DS_EOS}def"
    ids, _ = c.encode(text)
    want = list(ids)
    ids.append(-1)
    ids2, outcome = c.encode(text)
    assert outcome.l0 == "hit" and ids2 == want
    ids2.clear()
    assert c.encode(text + "g")[0] == deepseek().encode(text + "g")


def test_l0_bounds_hold_under_a_flood_of_distinct_large_inputs() -> None:
    cfg = CacheConfig(l0_enabled=True, l0_max_entries=50, l0_max_bytes=400_000)
    c = TokenCache(TiktokenTok(), cfg, l1_min_prefix=0)
    for i in range(120):
        c.encode(f"{i} " + "x" * (5000 + 97 * i))
        s = c.stats()["l0"]
        assert s["bytes"] <= cfg.l0_max_bytes and s["entries"] <= cfg.l0_max_entries
    assert s["evictions"] > 0
    for i in range(200):
        c.encode(f"short {i}")
    assert c.stats()["l0"]["entries"] == cfg.l0_max_entries


def test_l0_does_not_keep_an_input_over_a_quarter_of_its_byte_budget() -> None:
    c = TokenCache(TiktokenTok(), CacheConfig(l0_enabled=True, l0_max_bytes=100_000), l1_min_prefix=0)
    big = "word " * 6000  # 30 kB of text, plus its ids
    assert c.encode(big)[1].l0 == "miss"
    assert c.encode(big)[1].l0 == "miss"
    assert c.stats()["l0"]["entries"] == 0


def test_l0_hot_entry_survives_turnover() -> None:
    c = TokenCache(TiktokenTok(), CacheConfig(l0_enabled=True, l0_max_entries=20), l1_min_prefix=0)
    hot = "the hot prompt"
    c.encode(hot)
    for i in range(500):
        c.encode(f"cold {i}")
        if i % 10 == 0:
            assert c.encode(hot)[1].l0 == "hit"
    assert c.stats()["l0"]["evictions"] >= 480


def test_l1_bound_holds_and_a_hot_prefix_survives_turnover() -> None:
    budget = 200_000
    tok = TiktokenTok()
    c = TokenCache(tok, CacheConfig(l1_enabled=True, l1_max_memory=budget), l1_min_prefix=0)
    shared = "You are a careful assistant. " * 100  # a long system prompt every user shares
    for user in range(150):
        text = conversation(user, 4, size=600, system=shared)
        ids, outcome = c.encode(text)
        assert ids == tok.raw.encode(text, allowed_special="all")
        if user:
            assert outcome.l1_reused_tokens >= len(tok.raw.encode(f"<|system|>{shared}{EOT}", allowed_special="all"))
        s = c.stats()["l1"]
        assert s["bytes"] <= budget
    assert s["evictions"] > 0 and s["entries"] > 0


def test_l1_keeps_no_input_over_its_share_of_the_budget_and_evicts_whole_blocks() -> None:
    """One input adds at most a quarter of the budget: a prefix whose block (text and ids) is charged
    more is not kept; kept ones are evicted least recently used first, the bound never passed."""
    budget = 40_000
    tok = TiktokenTok()
    c = TokenCache(tok, CacheConfig(l1_enabled=True, l1_max_memory=budget), l1_min_prefix=0)
    big = "x y " * 5000 + EOT  # 20 kB of text: over a quarter of the budget
    assert c.encode(big + "tail")[0] == tok.raw.encode(big + "tail", allowed_special="all")
    assert c.stats()["l1"]["entries"] == 0
    for i in range(100):
        text = f"prompt {i} " + "w " * 400 + EOT + "question"
        assert c.encode(text)[0] == tok.raw.encode(text, allowed_special="all")
        s = c.stats()["l1"]
        assert 0 < s["bytes"] <= budget
    assert s["evictions"] > 0
    assert c.encode(text + "!")[1].l1_reused_tokens > 0  # the most recent survives


def test_clear_drops_every_entry_and_keeps_the_counters() -> None:
    c = TokenCache(deepseek(), CacheConfig(l0_enabled=True, l1_enabled=True), l1_min_prefix=0)
    text = f"abc{DS_EOS}def"
    c.encode(text)
    c.encode(text)
    c.clear()
    s = c.stats()
    assert s["l0"]["entries"] == s["l1"]["entries"] == s["l0"]["bytes"] == s["l1"]["bytes"] == 0
    assert s["l0"]["hits"] == 1 and s["l0"]["misses"] == 1
    ids, outcome = c.encode(text)
    assert ids == deepseek().encode(text) and outcome == CacheOutcome("miss", 0)


def test_l1_skips_inputs_whose_deepest_boundary_is_short() -> None:
    """The documented rule (workers/cache/l1.py MIN_PREFIX): a prefix shorter than that is not worth a
    lookup; such an input is encoded whole, counted as an L1 miss, and nothing is kept."""
    from tokenbroker.workers.cache.l1 import MIN_PREFIX

    tok = TiktokenTok()
    c = TokenCache(tok, CacheConfig(l1_enabled=True))
    short = "a" * (MIN_PREFIX - len(EOT) - 1) + EOT
    for _ in range(2):
        ids, outcome = c.encode(short + "tail")
        assert ids == tok.raw.encode(short + "tail", allowed_special="all") and outcome.l1_reused_tokens == 0
    assert c.stats()["l1"]["entries"] == 0 and c.stats()["l1"]["misses"] == 2
    long = "a" * MIN_PREFIX + EOT
    c.encode(long + "tail")
    ids, outcome = c.encode(long + "more")
    assert ids == tok.raw.encode(long + "more", allowed_special="all") and outcome.l1_reused_tokens > 0


@pytest.mark.parametrize("flag", [False, True])
def test_l1_keys_on_the_add_special_tokens_flag(flag: bool) -> None:
    c = TokenCache(deepseek(), CacheConfig(l1_enabled=True), l1_min_prefix=0)
    c.encode(f"abc{DS_EOS}def", flag)
    assert c.encode(f"abc{DS_EOS}xyz", flag)[1].l1_reused_tokens > 0
    assert c.encode(f"abc{DS_EOS}xyz", not flag)[1].l1_reused_tokens == 0


def test_text_with_lone_surrogates_is_tokenized_as_the_tokenizer_does() -> None:
    tok = TiktokenTok()
    c = TokenCache(tok, CacheConfig(l0_enabled=True, l1_enabled=True), l1_min_prefix=0)
    text = f"a\ud800b{EOT}c"
    want = tok.raw.encode(text, allowed_special="all")
    assert c.encode(text)[0] == want and c.encode(text)[0] == want


def test_l1_entry_is_charged_its_prefix_bytes_its_ids_and_a_fixed_overhead() -> None:
    from tokenbroker.workers.cache.accounting import ENTRY_OVERHEAD

    tok = TiktokenTok()
    c = TokenCache(tok, CacheConfig(l1_enabled=True), l1_min_prefix=0)
    prefix = f"naïve prefix{EOT}"
    c.encode(prefix + "rest")
    s = c.stats()["l1"]
    n_ids = len(tok.raw.encode(prefix, allowed_special="all"))
    # held as CPython holds the str: one byte per character here (latin-1), 2 or 4 in wider strs
    assert s["entries"] == 1 and s["bytes"] == len(prefix) + 4 * n_ids + ENTRY_OVERHEAD
    # a UCS-2 str reusing the latin-1 prefix: its block (not chained across widths) holds its whole
    # text to its new boundary at 2 bytes per character
    assert c.encode(f"{prefix}日本{EOT}rest")[1].l1_reused_tokens == n_ids
    wide = f"{prefix}日本{EOT}"
    s2 = c.stats()["l1"]
    assert s2["bytes"] - s["bytes"] == 2 * len(wide) + 4 * len(tok.raw.encode(wide, allowed_special="all")) + ENTRY_OVERHEAD


def test_l1_flood_of_tiny_distinct_prefixes_stays_in_budget() -> None:
    from tokenbroker.workers.cache.accounting import ENTRY_OVERHEAD

    budget = 64 * 1024
    c = TokenCache(TiktokenTok(), CacheConfig(l1_enabled=True, l1_max_memory=budget), l1_min_prefix=0)
    for i in range(3000):
        c.encode(f"{i}{EOT}x")
    s = c.stats()["l1"]
    assert s["bytes"] <= budget and s["entries"] <= budget // ENTRY_OVERHEAD and s["evictions"] > 0


def test_deepseek_conversation_reuses_through_its_user_and_assistant_tokens() -> None:
    """<｜User｜> and <｜Assistant｜> are non-special added tokens: the next turn reuses everything up to
    the previous request's generation prompt, not just up to its last end-of-sentence."""
    tok = deepseek()
    c = TokenCache(tok, CacheConfig(l1_enabled=True), l1_min_prefix=0)
    bos = tok.named_specials["bos_token"]
    text = f"{bos}You are terse."
    for turn in range(4):
        text += f"<｜User｜>question {turn}?<｜Assistant｜>"
        ids, outcome = c.encode(text)
        assert ids == tok.encode(text)
        if turn:
            assert outcome.l1_reused_tokens == len(tok.encode(previous, add_special_tokens=False))
        text += f"answer {turn}.{DS_EOS}"
        previous = text.removesuffix(f"answer {turn}.{DS_EOS}")


def test_an_input_with_thousands_of_boundaries_costs_few_tokenizer_calls_and_a_bounded_share() -> None:
    """Cuts are planned before encoding: O(log boundaries) tokenizer calls and copies, and one input
    stores at most a quarter of the budget, however many boundaries it has."""
    from tokenbroker.workers.cache.l1 import plan_cuts

    budget = 2_000_000  # a quarter holds the deepest prefix (~130 kB charged) a few times over
    tok = TiktokenTok()
    c = TokenCache(tok, CacheConfig(l1_enabled=True, l1_max_memory=budget), l1_min_prefix=0)
    text = "".join(f"{i}{EOT}" for i in range(5000)) + "tail"
    tok.calls.clear()
    ids, outcome = c.encode(text)
    assert ids == tok.raw.encode(text, allowed_special="all") and outcome.l1_reused_tokens == 0
    planned = len(plan_cuts(5000, -1))
    assert len(tok.calls) <= planned + 1
    s = c.stats()["l1"]
    assert 0 < s["entries"] <= planned and s["bytes"] <= budget // 4
    tok.calls.clear()
    longer = text + f"more{EOT}end"
    ids, outcome = c.encode(longer)
    assert ids == tok.raw.encode(longer, allowed_special="all")
    assert outcome.l1_reused_tokens > 0 and sum(map(len, tok.calls)) < 100  # only what follows the hit


@pytest.mark.parametrize("wide", ["日本", "👍"])
def test_a_turn_that_brings_a_wider_character_still_reuses_the_history(wide: str) -> None:
    """Keys follow how CPython holds the str (1, 2 or 4 bytes a character): a turn whose new text
    needs a wider str still finds the prefixes its narrower history stored, then stores its own."""
    tok = TiktokenTok()
    c = TokenCache(tok, CacheConfig(l1_enabled=True), l1_min_prefix=0)
    text = conversation(5, 3)  # latin-1
    c.encode(text)
    for more in (f"a question with {wide}{EOT}", "and the next one" + EOT):
        longer = text + more
        ids, outcome = c.encode(longer)
        assert ids == tok.raw.encode(longer, allowed_special="all")
        assert outcome.l1_reused_tokens == len(tok.raw.encode(text, allowed_special="all"))
        text = longer
