"""`--tokenizer-map` globs and the OpenAI model families that choose a tiktoken encoding."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenbroker.workers.count.openai_families import normalise_openai_model, openai_encoding_for
from tokenbroker.workers.tokenizer_map import TokenizerMap


def test_the_glob_with_the_most_literal_characters_wins_whatever_the_order() -> None:
    pairs = [("*", "any"), ("claude-*", "claude"), ("claude-3-*", "claude3"), ("*-haiku", "haiku")]
    for order in (pairs, list(reversed(pairs))):
        m = TokenizerMap(order)
        assert m.lookup("claude-3-haiku") == "claude3"
        assert m.lookup("claude-opus-4") == "claude"
        assert m.lookup("gpt-4o") == "any"


def test_equally_specific_globs_fall_to_the_one_that_sorts_first() -> None:
    m = TokenizerMap([("*-mini", "mini"), ("gpt-*", "gpt")])  # 5 literal characters each; "*-mini" < "gpt-*"
    assert m.lookup("gpt-mini") == "mini"
    assert TokenizerMap([("gpt-*", "gpt"), ("*-mini", "mini")]).lookup("gpt-mini") == "mini"


def test_globs_are_anchored_and_case_sensitive() -> None:
    m = TokenizerMap([("claude", "exact"), ("gem*", "gem")])
    assert m.lookup("claude") == "exact"
    assert m.lookup("claude-3") is None
    assert m.lookup("my-claude") is None
    assert m.lookup("Claude") is None
    assert m.lookup("gemini-2.5-pro") == "gem"
    assert m.lookup("xgemini") is None


def test_only_star_is_special() -> None:
    m = TokenizerMap([("gpt-4.?", "literal"), ("a[bc]d", "brackets")])
    assert m.lookup("gpt-4.?") == "literal"
    assert m.lookup("gpt-4.1") is None
    assert m.lookup("a[bc]d") == "brackets"
    assert m.lookup("abd") is None


def test_star_matches_nothing_and_slashes() -> None:
    m = TokenizerMap([("openai/*", "openai"), ("llama-*-instruct", "llama")])
    assert m.lookup("openai/") == "openai"
    assert m.lookup("openai/gpt/4o") == "openai"
    assert m.lookup("llama--instruct") == "llama"


def test_a_glob_given_twice_keeps_its_first_target_and_an_empty_map_matches_nothing() -> None:
    assert TokenizerMap([("x*", "first"), ("x*", "second")]).lookup("xy") == "first"
    assert TokenizerMap([]).lookup("anything") is None


@settings(max_examples=100, deadline=None)
@given(name=st.text(alphabet="ab-*.", max_size=10), glob=st.text(alphabet="ab-*.", max_size=6))
def test_a_glob_without_star_matches_only_itself(name: str, glob: str) -> None:
    literal = glob.replace("*", "")
    assert (TokenizerMap([(literal, "t")]).lookup(name) == "t") == (name == literal)


@pytest.mark.parametrize(("model", "encoding"), [
    ("gpt-4o", "o200k_base"), ("gpt-4o-2024-08-06", "o200k_base"), ("GPT-4o-Mini", "o200k_base"),
    ("chatgpt-4o-latest", "o200k_base"), ("gpt-4.1", "o200k_base"), ("gpt-4.1-mini-2025-04-14", "o200k_base"),
    ("gpt-4.5-preview", "o200k_base"), ("gpt-5", "o200k_base"), ("gpt-5.1", "o200k_base"), ("gpt-5-nano", "o200k_base"),
    ("o1", "o200k_base"), ("o1-preview-2024-09-12", "o200k_base"), ("o3-mini", "o200k_base"), ("o4-mini-2025-04-16", "o200k_base"),
    ("gpt-oss-20b", "o200k_harmony"), ("openai/gpt-oss-120b", "o200k_harmony"),
    ("gpt-4", "cl100k_base"), ("gpt-4-0613", "cl100k_base"), ("gpt-4-turbo", "cl100k_base"), ("gpt-4-32k", "cl100k_base"),
    ("gpt-3.5-turbo", "cl100k_base"), ("gpt-3.5-turbo-0301", "cl100k_base"), ("azure/gpt-35-turbo-16k", "cl100k_base"),
    ("openai/gpt-4o", "o200k_base"), ("ft:gpt-3.5-turbo-0613:acme::7qTVM5AR", "cl100k_base"),
    ("claude-sonnet-4", None), ("gemini-2.5-pro", None), ("gpt-4x", None), ("o10", None), ("llama-3-8b", None), ("", None),
])
def test_openai_families_map_to_their_encoding(model: str, encoding: str | None) -> None:
    assert openai_encoding_for(model) == encoding


def test_normalising_drops_case_prefixes_and_fine_tune_wrappers() -> None:
    assert normalise_openai_model("Azure/GPT-35-Turbo-0301") == "gpt-3.5-turbo-0301"
    assert normalise_openai_model("openrouter/openai/gpt-4o") == "gpt-4o"
    assert normalise_openai_model("ft:gpt-4o-mini-2024-07-18:org::abc") == "gpt-4o-mini-2024-07-18"
