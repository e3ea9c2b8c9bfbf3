"""The compiled boundary matcher and hash (workers/cache/_cache.pyx) against plain Python definitions.

The matcher must find exactly the leftmost-longest matches of its tokens, in one or two passes, on
any str (latin-1, UCS-2, UCS-4, lone surrogates included), and never read past the text; the hash
must give equal texts equal keys, whatever object holds them.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenbroker.workers.cache._cache import Matcher, hash_text


def leftmost_longest(tokens: dict[str, int], text: str, lo: int = 0, hi: int | None = None) -> list[tuple[int, int, int]]:
    """Every match, left to right: at each position the longest token that starts there, then past it."""
    hi = len(text) if hi is None else hi
    out, i = [], lo
    while i < hi:
        best = max((t for t in tokens if text.startswith(t, i) and i + len(t) <= hi), key=len, default=None)
        if best is None:
            i += 1
            continue
        out.append((i, i + len(best), tokens[best]))
        i += len(best)
    return out


def reference(first: dict[str, int], second: dict[str, int], text: str) -> list[tuple[int, int, int]]:
    """Pass one over the text, pass two in the gaps it leaves; boundaries (id >= 0) only."""
    ones = leftmost_longest(first, text)
    out, gap = [], 0
    for start, end, tid in [*ones, (len(text), len(text), -1)]:
        if second:
            out += leftmost_longest(second, text, gap, start)
        if start < len(text):
            out.append((start, end, tid))
        gap = end
    return [m for m in out if m[2] >= 0]


ALPHABET = ["<", ">", "|", "a", "b", " ", "\n", "é", "｜", "▁", "日", "🙂", "\ud800", "\x00"]
token = st.lists(st.sampled_from(ALPHABET), min_size=1, max_size=5).map("".join)
tokens = st.dictionaries(token, st.integers(-1, 50), max_size=8)
text = st.lists(st.one_of(st.sampled_from(ALPHABET), token), max_size=60).map("".join)


@settings(max_examples=400, deadline=None, database=None)
@given(first=tokens, second=tokens, text=text)
def test_matcher_finds_the_leftmost_longest_boundaries_in_one_or_two_passes(first, second, text) -> None:
    second = {t: i for t, i in second.items() if t not in first}
    m = Matcher(sorted(first.items()), sorted(second.items()))
    assert m.boundaries(text) == reference(first, second, text)


@pytest.mark.parametrize("firsts", [1, 2, 4, 5, 9])  # memchr streams up to 4 first code points, a table past that
def test_matcher_scans_with_any_number_of_first_code_points(firsts: int) -> None:
    heads = ["<", "｜", "🙂", "[", "a", "日", "\x00", "é", "Z"][:firsts]
    toks = {f"{h}tok{i}>": i for i, h in enumerate(heads)}
    body = "".join(f"x{h}y{h}tok{i}>z " for i, h in enumerate(heads)) * 50
    for wrap in ("", "日", "🙂"):  # latin-1, UCS-2 and UCS-4 strs of the same matches
        t = wrap + body + wrap
        assert Matcher(sorted(toks.items()), []).boundaries(t) == reference(toks, {}, t)


def test_matcher_with_no_tokens_finds_nothing_and_hostile_runs_stay_linear() -> None:
    assert Matcher([], []).boundaries("<|x|>" * 10) == []
    m = Matcher([("<" * 30 + ">", 1)], [])
    hostile = "<" * 200_000  # every position a candidate, no match: bounded by the token's length
    assert m.boundaries(hostile) == []
    assert m.boundaries(hostile + ">") == [(len(hostile) - 30, len(hostile) + 1, 1)]


@given(st.text(max_size=200), st.booleans())
def test_equal_texts_have_equal_keys_and_the_flag_changes_them(t: str, flag: bool) -> None:
    copy = "".join(list(t))  # another object, the same text
    assert hash_text(t, flag) == hash_text(copy, flag)
    assert hash_text(t, True) != hash_text(t, False)
    assert hash_text(t + "x", flag) != hash_text(t + "y", flag)
