"""Where L1 cuts an input: right after added tokens, exactly where the tokenizer itself splits.

Why splitting there is exact, and how it is kept exact:
- Both tokenizer kinds cut their input at added-token matches before anything else runs, then
  pre-tokenize and tokenize each piece on its own. Hugging Face does it in two passes: tokens with
  `normalized=False` (special or not) are matched leftmost-longest on the raw text; the pieces
  between are normalized and tokens with `normalized=True` matched in each. Where the normalizer is
  the identity (none, or an empty Sequence: DeepSeek's `<｜User｜>` and `<｜Assistant｜>` are such),
  the second pass matches raw text too, so both are boundaries; otherwise only the first pass's.
  tiktoken cuts at its special regex. `Segmenter.matcher` (compiled, workers/cache/_cache.pyx) finds
  those same matches: a code-point trie over the same tokens, leftmost-longest too, run in the same
  two passes.
- A piece is encoded with the token before it as left context and that token's id dropped, so
  whatever depends on what precedes a piece (Metaspace prepend_scheme "first", an rstrip token
  eating the whitespace after it) sees what the whole input would show it. Each result is checked:
  the context id must come first and a piece must end with its boundary's id; otherwise the lookup
  falls back to tokenizing the whole input. Tokens whose match depends on the text after them
  (single_word) or that have whitespace at an edge are never boundaries.
- Post-processing (BOS/EOS templates) adds ids around the whole sequence once: pieces are encoded
  without it and the head and tail learnt at load are added once at the end.
- At load, probe inputs built from the tokenizer's own boundary tokens (named specials, non-special
  and second-pass ones, tokens nested in others) compare the split result with a plain encode for
  both flag values; any difference bypasses L1 for that tokenizer, with the reason.
"""

from __future__ import annotations

import json
from bisect import bisect_left
from dataclasses import dataclass, replace
from typing import Any, Callable, Protocol

from ..tokenizers import ids_to_u32

from ._cache import Matcher


class Tokenizer(Protocol):
    """What the cache needs of tokenbroker.workers.tokenizers.Tokenizer."""

    kind: str
    named_specials: dict[str, str]
    special_tokens: dict[str, int]
    raw: Any

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]: ...

    def encode_u32(self, texts: list[str], *, add_special_tokens: bool = True) -> list[bytes]: ...


class NotSplittable(Exception):
    """This tokenizer cannot be split at added tokens exactly; the message says why."""


@dataclass(frozen=True)
class _Matched:
    """What a tokenizer's first split matches: literal tokens per pass, and which of them are boundaries."""

    first: list[str]  # matched leftmost-longest on the raw input
    second: list[str]  # matched the same way in each piece the first pass leaves (raw text, as normalizing is the identity)
    bounds: dict[str, int]  # tokens L1 may cut after -> id
    notable: list[str]  # boundaries worth probing first: non-special, second-pass, or stripping whitespace


def _identity_normalizer(normalizer: Any) -> bool:
    """No normalizer, or Sequences of nothing: the normalized text is the raw text, byte for byte."""
    if normalizer is None:
        return True
    try:
        state = json.loads(normalizer.__getstate__())
    except (AttributeError, TypeError, ValueError):
        return False

    def empty(node: Any) -> bool:
        return (isinstance(node, dict) and node.get("type") == "Sequence"
                and all(empty(child) for child in node.get("normalizers", ())))

    return state is None or empty(state)


def one_pass_suffices(first: list[str], second: list[str]) -> bool:
    """Whether one leftmost-longest pass over `first` and `second` together finds what matching
    `first` and then `second` in the gaps finds, on every text. It does unless a `first` token can
    take text a `second` one would have started first: one inside a `second` token, or one that
    begins with the end of a `second` token. (A `first` token that starts first wins either way.)

    >>> one_pass_suffices(["<a>", "<b>"], ["<u>", "<v>"])
    True
    >>> one_pass_suffices(["bc"], ["ab"])  # "abc": the first pass takes "bc"; one pass would take "ab"
    False
    """
    ordered = sorted(first)
    for s in second:
        for k in range(1, len(s)):
            i = bisect_left(ordered, s[k:])
            if i < len(ordered) and ordered[i].startswith(s[k:]):
                return False
        if any(f in s for f in ordered if len(f) <= len(s)):
            return False
    return True


def _hf_tokens(tok: Tokenizer) -> _Matched:
    """Added tokens of a tokenizers.Tokenizer by pass; boundaries are those matched on raw text whose
    match depends on nothing after them."""
    raw = tok.raw
    if getattr(raw, "truncation", None) is not None or getattr(raw, "padding", None) is not None:
        raise NotSplittable("truncation or padding is on")
    if getattr(raw, "encode_special_tokens", False):
        raise NotSplittable("encode_special_tokens is on: special tokens are not split out")
    added = raw.get_added_tokens_decoder()
    raw_second = _identity_normalizer(raw.normalizer)
    first = [a.content for a in added.values() if not a.normalized]
    second = [a.content for a in added.values() if a.normalized] if raw_second else []
    bounds, notable = {}, []
    for i, a in added.items():
        if (a.normalized and not raw_second) or a.single_word:
            continue
        bounds[a.content] = i
        if not a.special or a.normalized or a.lstrip or a.rstrip:
            notable.append(a.content)
    return _Matched(first, second, bounds, notable)


def _tiktoken_tokens(tok: Tokenizer) -> _Matched:
    raw_specials = set(getattr(tok.raw, "special_tokens_set", ()))
    allowed = {t: i for t, i in tok.special_tokens.items() if t in raw_specials}
    everything = sorted(raw_specials | set(tok.special_tokens))
    joined = "\0".join(everything)
    for t in everything:  # tiktoken's special regex is an alternation in hash order: ambiguous if nested
        if joined.count(t) > 1:
            raise NotSplittable(f"special token {t!r} occurs inside another special token")
    return _Matched(list(allowed), [], allowed, [])


class Segmenter:
    """Where L1 may cut a tokenizer's inputs: its boundary tokens (added tokens L1 may cut after, with
    their ids), compiled into a `Matcher` that finds them in one pass over a str, exactly where the
    tokenizer's own first split finds them; and the ids add_special_tokens puts around a sequence."""

    def __init__(self, tok: Tokenizer) -> None:
        if tok.kind == "huggingface":
            matched = _hf_tokens(tok)
        elif tok.kind == "tiktoken":
            matched = _tiktoken_tokens(tok)
        else:
            raise NotSplittable(f"unknown tokenizer kind {tok.kind!r}")
        # A token with whitespace at its edge could meet an lstrip/rstrip neighbour: never split there.
        self._bounds = {t: i for t, i in matched.bounds.items() if t and t == t.strip()}
        self.notable = [t for t in matched.notable if t in self._bounds]
        if matched.second and one_pass_suffices(matched.first, matched.second):
            matched = replace(matched, first=matched.first + matched.second, second=[])
        # Every token the tokenizer matches in a pass takes its text away from the others, boundary
        # or not (single_word tokens, tokens with edge whitespace): those are matched and glued back
        # into the text around them (id -1).
        bound = self._bounds.get
        first = sorted({t: bound(t, -1) for t in matched.first if t}.items())
        second = sorted({t: bound(t, -1) for t in matched.second if t}.items())
        if any(i < 0 or i > 0xFFFFFFFF for t, i in first + second if t in self._bounds):
            raise NotSplittable("an added token's id does not fit 32 bits")
        self.matcher = Matcher(first, second)
        self.head, self.tail = _learn_template(tok)

    @property
    def boundaries(self) -> dict[str, int]:
        """Boundary token text -> id."""
        return self._bounds


def _learn_template(tok: Tokenizer) -> tuple[list[int], list[int]]:
    """The ids add_special_tokens puts before and after a sequence, checked on a few inputs."""
    empty = tok.encode("", add_special_tokens=True)
    if tok.encode("", add_special_tokens=False):
        raise NotSplittable("encoding the empty text gives ids")
    splits: set[int] | None = None
    for probe in ("a", "hello world", "Hello, World! 123\n"):
        with_, without = tok.encode(probe, add_special_tokens=True), tok.encode(probe, add_special_tokens=False)
        n = len(without)
        ok = {i for i in range(len(empty) + 1)
              if with_ == [*empty[:i], *without, *empty[i:]] and len(with_) == n + len(empty)}
        splits = ok if splits is None else splits & ok
    if not splits:
        raise NotSplittable("add_special_tokens does more than add fixed ids around the sequence")
    i = min(splits)
    return empty[:i], empty[i:]


_FILLERS = ("", "a", "hello", " hello", "hello ", "  ", "\n", " \n\t", "Hi there.", "héllo wörld", "日本語",
            "123", "x  y", "\u2581", "<", ">")


def probe_texts(seg: Segmenter, named: dict[str, str], added: list[str]) -> list[str]:
    """Inputs where a careless split at added tokens goes wrong: edges, whitespace, neighbours, nesting."""
    bounds = sorted(seg.boundaries)
    joined = "\0".join(added)
    inner = [s for s in bounds if joined.count(s) > 1]  # inside another added token
    outer = [a for a in added if any(s != a and s in a for s in inner[:16])][:16]
    picked = [t for t in named.values() if t in seg.boundaries] + inner[:8] + seg.notable[:8]
    picked += bounds[:: max(1, len(bounds) // 8)][:8]
    picked = list(dict.fromkeys(picked))[:24]
    texts = []
    for o in outer:
        texts += [o, f"x{o}y", o[:-1], o[1:], f"{o} {o}", f"{o[:-1]} {o}"]
    for i, s in enumerate(picked):
        t = picked[(i + 1) % len(picked)]
        texts += [s, s + s, f"a{s}b", f" {s} ", f"{s} hello", f"hello {s}", f"hello{s}world", f"{s}\n{t}\n",
                  f"  {s}  {t}  ", f"{s}{t}", f"{s}x y", f"x y{s}", f"\n{s}\n\nhello\n{t}", f"{s}   "]
        texts += [f"{a}{s}{b}" for a, b in zip(_FILLERS, reversed(_FILLERS))]
    return texts


def check_exact(seg: Segmenter, tok: Tokenizer, split_encode: Callable[[str, bool], bytes]) -> str | None:
    """Why splitting changes a result on the probes, or None when it never does. `split_encode` is
    the compiled L1 path (an empty store that keeps nothing: every boundary a cut), packed ids."""
    decoder = getattr(tok.raw, "get_added_tokens_decoder", None)
    added = [a.content for a in decoder().values()] if decoder else list(tok.special_tokens)
    for text in probe_texts(seg, tok.named_specials, added):
        for flag in (False, True):
            if split_encode(text, flag) != ids_to_u32(tok.encode(text, add_special_tokens=flag)):
                return f"splitting at added tokens changes the ids of {text!r} (add_special_tokens={flag})"
    return None
