"""The fast engine of a model: fastokens, built beside the reference library and taken only once proven exact.

A loaded tokenizer (workers/tokenizers.py) always keeps its reference library object (`tokenizers`
or `tiktoken`): the fingerprint, the stream decoder and L1's checks read it. `fastokens` encodes the
same tokenizer.json or tiktoken ranks 10-50x faster, but it is another implementation, so it serves
a model only when `probe` finds it gives the reference's ids and text on a battery of inputs chosen
where two implementations part: every added token alone, at the start, middle and end of a text and
next to another, with both `add_special_tokens`; the edge strings the tests use; the code points at
the edge of the whitespace class (WHITESPACE_EDGES) alone and in space runs; random unicode,
whitespace runs and long repeats; decodes of random id sequences with and without skipping specials.
One differing result and the model stays on the reference, with one log line naming the probe;
except where only whitespace-edge probes differ: then the code points they hold are guarded (texts
holding one go to the reference) and, if the whole battery then passes, fastokens serves the rest.

The worker serves with the reference as soon as that is loaded, then builds and probes the fast
engine off the main thread (workers/loader.py) and switches by setting one attribute: ids are the
same, so caches stay valid and the fingerprint (which names the tokenizer, not its engine) holds.
The probes' verdict is kept on disk per tokenizer fingerprint and engine version (`verdict_dir`), so
a later start builds a passed engine without probing it and never builds a refused one.

fastokens keeps per-thread state for a few engines (0.3.5: four); a thread that alternates among
more rebuilds it at every switch (~3 ms a 4 KB encode instead of ~55 us). `engine_limit` measures
that count once per engine version with a probe that times alternation, and EnginePlan keeps that
many engines on the worker's serving thread and runs the others on threads of their own, each
warmed where it encodes before a request reaches it.

>>> tok = load_tokenizer("o200k_base")  # doctest: +SKIP
>>> fast, why = speed_up(tok, "auto")  # doctest: +SKIP
>>> fast.name, why  # doctest: +SKIP
('fastokens', None)
"""

from __future__ import annotations

import _thread
import functools
import hashlib
import json
import logging
import os
import queue
import random
import tempfile
import threading
import time
from array import array
from base64 import b64encode
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from importlib import metadata
from pathlib import Path
from typing import Any, cast

from .tokenizers import InvalidTokenId, Tokenizer, check_ids, flat_of, ids_to_u32, le_array

log = logging.getLogger(__name__)

FASTOKENS = "fastokens"
# fastokens' decode holds the GIL (its encode does not): a longer sequence goes to the reference,
# which releases it, so the heartbeat thread is never held up for more than a few milliseconds.
FAST_DECODE_MAX_IDS = 16384


class EngineUnavailable(Exception):
    """fastokens is not installed, or refuses this tokenizer (an unsupported normalizer, say)."""


# --- the engine --------------------------------------------------------------------------------------


@dataclass(eq=False)
class FastEngine:
    """A `fastokens.Tokenizer` behind the wrapper's own encode/decode signatures and id checks.

    `tiktoken`: built from tiktoken ranks (no post-processor, specials matched in text; decoding
    stays with tiktoken, which is faster); otherwise tokenizer.json's.
    """

    raw: Any
    vocab_size: int
    unassigned: frozenset[int]
    tiktoken: bool
    name: str = FASTOKENS
    # Code points fastokens was found to part from the reference at (`guard`): a text holding one is
    # encoded by `reference` (the same tokenizer with no fast engine). Empty for most models.
    guard: tuple[str, ...] = ()
    reference: Any = None
    # The thread it encodes on when the serving thread already holds as many engines as fastokens'
    # per-thread state keeps (EnginePlan); None: the calling thread.
    home: "EngineThread | None" = None

    def guarded(self, text: str) -> bool:
        """Whether the reference encodes `text` (it holds a guarded code point). An ASCII or Latin-1
        text never holds one: `in` answers without a scan."""
        return any(c in text for c in self.guard)

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` on this engine's thread: the calling one, or its `home` (EnginePlan)."""
        home = self.home
        return fn(*args) if home is None else home.call(fn, *args)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.guard and self.guarded(text):
            return self.reference.encode(text, add_special_tokens=add_special_tokens)
        return self._call(self.raw.encode, text, add_special_tokens).ids

    def encode_many(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        out = [e.ids for e in self._call(self.raw.encode_batch, texts, add_special_tokens)]
        if self.guard:
            for i, text in enumerate(texts):
                if self.guarded(text):
                    out[i] = self.reference.encode(text, add_special_tokens=add_special_tokens)
        return out

    def encode_u32(self, texts: list[str], add_special_tokens: bool = True) -> list[bytes]:
        """Each text's ids as little-endian uint32 bytes, cut from one flat buffer: no int per id."""
        flat, offsets = self.encode_flat(texts, add_special_tokens)
        ends = le_array("Q", offsets)
        return [flat[4 * ends[i]:4 * ends[i + 1]] for i in range(len(texts))]

    def encode_flat(self, texts: list[str], add_special_tokens: bool = True) -> tuple[bytes, bytes]:
        """All texts' ids as one little-endian uint32 buffer, and where each text's ids end in it
        (text i's are ids ends[i]:ends[i + 1], ends little-endian uint64s): the engine's own two
        buffers, which the worker's replies are written from (workers/_core.pyx pack_tokens)
        without a copy per text or a Python int per id. A guarded text's ids are the reference's."""
        flat, offsets = self._call(self.raw.encode_batch_flat, texts, add_special_tokens)
        if self.guard and any(self.guarded(t) for t in texts):
            return self._splice(texts, flat, offsets, add_special_tokens)
        return flat, offsets

    def _splice(self, texts: list[str], flat: bytes, offsets: bytes, add_special_tokens: bool) -> tuple[bytes, bytes]:
        """The two buffers again, with the reference's ids for the guarded texts (rare: one copy)."""
        ends = le_array("Q", offsets)
        view = memoryview(flat).cast("B")
        return flat_of([ids_to_u32(self.reference.encode(text, add_special_tokens=add_special_tokens))
                        if self.guarded(text) else view[4 * ends[i]:4 * ends[i + 1]] for i, text in enumerate(texts)])

    def encode_ordinary(self, text: str) -> list[int]:
        if self.guard and self.guarded(text):
            return self.reference.encode_ordinary(text)
        return self._call(self.raw.encode_ordinary, text).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str | None:
        """The text of `ids`, or None when the reference decodes it: always for tiktoken (faster),
        and a sequence too long to hold the GIL for."""
        if self.tiktoken or len(ids) > FAST_DECODE_MAX_IDS:
            return None  # tiktoken's own decode is faster than fastokens' (scripts/bench_engine: 2x)
        if ids:
            low, high = min(ids), max(ids)
            if low < 0 or high >= self.vocab_size or (self.unassigned and not self.unassigned.isdisjoint(ids)):
                check_ids(ids, self.vocab_size, self.unassigned)  # raises InvalidTokenId
        return self._call(self.raw.decode, ids, skip_special_tokens)


def build_fast(tok: Tokenizer) -> FastEngine:
    """fastokens for `tok`'s own tokenizer, from what the reference holds (so both read the same
    definition); EngineUnavailable says why not. Its caches are set here: the segment cache off
    (L0 and L1 hold what it would, see docs/sizing.md), whatever FASTOKENS_SEGMENT_CACHE says."""
    try:
        import fastokens
    except ImportError as e:
        raise EngineUnavailable("fastokens is not installed") from e
    try:
        if tok.kind == "huggingface":
            raw = fastokens.Tokenizer.from_json_str(tok.raw.to_str())
            raw.no_truncation()
            raw.no_padding()
        elif tok.kind == "tiktoken":
            raw = _from_encoding(fastokens, tok.raw)
        else:
            raise EngineUnavailable(f"no fast engine for a {tok.kind} tokenizer")
        raw.enable_segment_cache(0)
    except EngineUnavailable:
        raise
    except Exception as e:  # ValueError from fastokens: "unsupported normalizer type: BertNormalizer", ...
        raise EngineUnavailable(f"fastokens refuses it: {str(e).splitlines()[0][:200] if str(e) else type(e).__name__}") from e
    return FastEngine(raw=raw, vocab_size=tok.vocab_size, unassigned=getattr(tok, "unassigned", frozenset()),
                      tiktoken=tok.kind == "tiktoken")


def _from_encoding(fastokens: Any, enc: Any) -> Any:
    """A tiktoken.Encoding's ranks, pattern and specials, as fastokens reads them: a rank file
    written from the encoding itself, so any encoding works, named or built from a file."""
    ranks = getattr(enc, "_mergeable_ranks", None)
    if not isinstance(ranks, Mapping):
        raise EngineUnavailable("this tiktoken Encoding does not expose its ranks")
    lines = b"".join(b64encode(token) + b" " + str(rank).encode() + b"\n"
                     for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]))
    fd, path = tempfile.mkstemp(prefix="tokenbroker-ranks-", suffix=".tiktoken")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(lines)
        return fastokens.Tokenizer.from_tiktoken(path, pattern=enc._pat_str, special_tokens=dict(enc._special_tokens))
    finally:
        os.unlink(path)


class PackedRanks(Mapping[bytes, int]):
    """A tiktoken Encoding's `_mergeable_ranks` (token bytes -> rank) in three flat buffers instead
    of a dict of 100-200k bytes and int objects: 26-54 MiB less per encoding, the same items.

    tiktoken encodes and decodes with its own Rust copy of the ranks: the Python dict is read only
    when something is built from it (the fingerprint, a fast engine, a pickle), never on the serving
    path. The template (workers/zygote.py) packs the dicts of the models it holds once those are
    built, so the pool shares a few MiB instead of the dicts. A lookup by token (rare) builds the
    dict back, once.

    >>> r = PackedRanks({b"b": 1, b"a": 0, b"cd": 5})
    >>> list(r.items()), len(r), r[b"cd"], b"x" in r
    ([(b'a', 0), (b'b', 1), (b'cd', 5)], 3, 5, False)
    """

    def __init__(self, ranks: Mapping[bytes, int]) -> None:
        pairs = sorted(ranks.items(), key=lambda kv: kv[1])
        self._blob = b"".join(token for token, _ in pairs)
        self._ends = array("Q")
        end = 0
        for token, _ in pairs:
            end += len(token)
            self._ends.append(end)
        self._ranks = array("Q", (rank for _, rank in pairs))
        self._index: dict[bytes, int] | None = None

    def __len__(self) -> int:
        return len(self._ranks)

    def _token(self, i: int) -> bytes:
        return self._blob[self._ends[i - 1] if i else 0:self._ends[i]]

    def __iter__(self) -> Iterator[bytes]:
        return (self._token(i) for i in range(len(self._ranks)))

    def items(self) -> Iterator[tuple[bytes, int]]:  # type: ignore[override]
        """In rank order (what the fingerprint and the rank file sort them into anyway)."""
        return ((self._token(i), self._ranks[i]) for i in range(len(self._ranks)))

    def values(self) -> Iterator[int]:  # type: ignore[override]
        return iter(self._ranks)

    def __getitem__(self, token: bytes) -> int:
        if self._index is None:
            self._index = dict(self.items())
        return self._index[token]

    def __reduce__(self) -> tuple:  # a pickled Encoding gets a plain dict back
        return (dict, (list(self.items()),))


def pack_ranks(tok: Tokenizer) -> int:
    """Replace a tiktoken tokenizer's `_mergeable_ranks` dict with PackedRanks; how many ranks it
    packed (0: not tiktoken, or packed already)."""
    enc = tok.raw
    ranks = getattr(enc, "_mergeable_ranks", None) if tok.kind == "tiktoken" else None
    if not isinstance(ranks, dict):
        return 0
    enc._mergeable_ranks = PackedRanks(ranks)
    return len(ranks)


# --- the probes -------------------------------------------------------------------------------------

# Inputs where tokenizers have parted before: empty and one-character texts, spaces at the edges and
# before newlines, CRLF, tabs, contractions, digits, combining marks, ZWJ emoji, RTL, CJK, the
# SentencePiece marker, lone surrogate-free astral characters, control characters.
EDGE_STRINGS = (
    "", " ", "  ", "a", "A", "\n", "\r\n", "\t", " \n", "\n ", "hello world", " hello", "hello ",
    "Hello, World! 123\n", "don't I'll we've they're it's", "1234567890 3.14159 1e-9 0x1F",
    "e\u0301 \u00e9 \u0041\u030a", "👨‍👩‍👧‍👦 🇫🇷 👍🏽", "مرحبا بالعالم", "שלום", "日本語のテキスト", "中文分词测试",
    "한국어 텍스트", "\u2581hello\u2581world", "\x00\x01\x1f\x7f", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𐍈", "   leading and trailing   ",
    "tabs\tand\ttabs\t\t", "line\n\nbreaks\n\n\n", "a\u00a0b\u2009c\u200bd", "<s></s><unk>[CLS][SEP]",
    "<|endoftext|>", "<|im_start|>user\nhi<|im_end|>", "def f(x):\n    return x ** 2\n", "{\"key\": [1, 2, null]}",
    "ÀÉÎÕÜ àéîõü ßẞ ǅ", "İstanbul ıi", "ﬁ ﬂ ㎏ ① Ⅻ", "x" * 3 + " " * 3 + "y" * 3,
)
# Code points at the edge of the whitespace class, where one regex engine's `\s` is not another's:
# Unicode's White_Space (VT, FF, NEL, NBSP, OGHAM, the U+2000 spaces, LS, PS, NNBSP, MMSP,
# IDEOGRAPHIC), the ones Unicode took out of it or never had in it though some engines count them
# (MONGOLIAN VOWEL SEPARATOR U+180E, ZWSP, WORD JOINER, BOM) and the ASCII separators Python's
# str.isspace takes (FS, GS, RS, US). fastokens 0.3.5 serves the shipped split patterns with a
# scanner of its own, but a pattern it does not recognise goes to a regex path that takes U+180E for
# whitespace: 'a  \u180e  b' gets other ids there than from `tokenizers`.
WHITESPACE_EDGES = (
    "\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\x1f", "\x85", "\xa0", "\u1680", "\u180e",
    *(chr(c) for c in range(0x2000, 0x200B)), "\u200b", "\u2028", "\u2029", "\u202f", "\u205f",
    "\u2060", "\u3000", "\ufeff",
)
RANDOM_SEED = 21  # the probes are the same at every load: a failure is reproducible


@dataclass(frozen=True)
class Probe:
    """One probe input: what it tests (for the log line) and the text."""

    what: str
    text: str


def probe_texts(tok: Tokenizer, rng: random.Random, *, max_added: int = 2048) -> list[Probe]:
    """The encode battery for `tok`: its added tokens in every position, edge strings, noise."""
    added = _added_tokens(tok)[:max_added]
    probes = [Probe("edge string", s) for s in EDGE_STRINGS]
    for i, t in enumerate(added):
        u = added[(i + 1) % len(added)]
        probes += [Probe("added token alone", t), Probe("added token at the start", f"{t}hello world"),
                   Probe("added token in the middle", f"hello{t}world"), Probe("added token at the end", f"hello world{t}"),
                   Probe("added token between spaces", f"a  {t}  b"), Probe("added tokens adjacent", f"{t}{u}"),
                   Probe("added tokens on lines", f"\n{t}\n{u} x\n")]
    for n in (1, 2, 3, 5, 8, 17, 64, 257, 1000):
        for run in (" ", "\n", "\t", " \n", "\r\n", "\u3000"):
            probes.append(Probe("whitespace run", f"x{run * n}y"))
        probes.append(Probe("whitespace run", " " * n))
    for c in WHITESPACE_EDGES:
        probes += [Probe("whitespace edge", text) for text in _edge_forms(c)]
    for unit in ("a", "ab", "aaaab", "的", "1", "12", "🙂", ". ", "-\n", "’s "):
        probes.append(Probe("long repeat", unit * (2048 // len(unit))))
    for _ in range(96):
        probes.append(Probe("random unicode", _random_text(rng, rng.randint(1, 48))))
    return probes


def _edge_forms(c: str) -> list[str]:
    """A whitespace-edge code point alone, between words, inside and at the edges of space runs, right
    before a word after spaces (r50k and GPT-2 part from tiktoken on `  \u180ehello` only), before a newline."""
    return [c, f" {c}", f"{c} ", f"a{c}b", f"a {c} b", f"a  {c}  b", f" {c}hello", f"  {c}hello", f"x{c * 3}y",
            f"{c}\n{c}", f"\t{c} 1"]


def edge_guard(tok: Tokenizer, fast: FastEngine) -> tuple[str, ...]:
    """The whitespace-edge code points whose probes `fast` fails (`tok` on its reference)."""
    parted = []
    for c in WHITESPACE_EDGES:
        texts = _edge_forms(c)
        if any(tok.encode_many(texts, add_special_tokens=flag) != fast.encode_many(texts, flag) for flag in (True, False)):
            parted.append(c)
    return tuple(parted)


def _added_tokens(tok: Tokenizer) -> list[str]:
    decoder = getattr(tok.raw, "get_added_tokens_decoder", None)
    if decoder is not None:
        return [a.content for _, a in sorted(decoder().items())]
    return sorted(tok.special_tokens)


def _random_text(rng: random.Random, n: int) -> str:
    """Code points from every plane that matters, surrogates excluded (a wire string cannot hold one)."""
    ranges = ((0x20, 0x7E), (0x00, 0x1F), (0xA0, 0x2FF), (0x300, 0x36F), (0x370, 0x10FF), (0x2000, 0x2BFF),
              (0x3000, 0x9FFF), (0xAC00, 0xD7A3), (0xE000, 0xFFFD), (0x10000, 0x1FAFF), (0x20000, 0x2A6DF))
    out: list[str] = []
    for _ in range(n):
        lo, hi = ranges[rng.randrange(len(ranges))]
        out.append(chr(rng.randint(lo, hi)))
    return "".join(out)


def probe(tok: Tokenizer, fast: FastEngine, *, seed: int = RANDOM_SEED) -> str | None:
    """What differs between `fast` and the reference of `tok` on the battery, or None when nothing does.

    Runs with `tok` still on its reference (its `fast` unset): the reference side is `tok` itself.
    """
    rng = random.Random(seed)
    probes = probe_texts(tok, rng)
    texts = [p.text for p in probes]
    reference_ids: dict[bool, list[list[int]]] = {}
    for flag in (True, False):
        want = tok.encode_many(texts, add_special_tokens=flag)
        reference_ids[flag] = want
        got = fast.encode_many(texts, add_special_tokens=flag)
        for p, w, g in zip(probes, want, got):
            if w != g:
                return f"encode {p.what} {p.text[:60]!r} (add_special_tokens={flag})"
        packed = fast.encode_u32(texts, add_special_tokens=flag)
        if any(b != ids_to_u32(w) for b, w in zip(packed, want)):
            return f"encode_batch_flat (add_special_tokens={flag})"
    if tok.kind == "tiktoken":
        for p in probes[:: max(1, len(probes) // 256)]:
            if tok.raw.encode_ordinary(p.text) != fast.encode_ordinary(p.text):
                return f"encode_ordinary {p.what} {p.text[:60]!r}"
    sequences = [ids for ids in reference_ids[True] if ids][:: max(1, len(probes) // 256)]
    sequences += _random_ids(tok, rng, 160)
    for skip in (True, False):
        for ids in sequences:
            text = _decode_or_error(fast, ids, skip)
            if text is not None and text != _decode_or_error(tok, ids, skip):
                return f"decode {ids[:12]}{'...' if len(ids) > 12 else ''} (skip_special_tokens={skip})"
    return None


def _random_ids(tok: Tokenizer, rng: random.Random, n: int) -> list[list[int]]:
    """Random valid id sequences, with the specials and the ids just below the vocabulary's end mixed in."""
    unassigned: frozenset[int] = getattr(tok, "unassigned", frozenset())
    pool = sorted(tok.special_tokens.values()) + [i for i in range(max(0, tok.vocab_size - 64), tok.vocab_size)]
    out: list[list[int]] = []
    for _ in range(n):
        seq = []
        for _ in range(rng.randint(1, 40)):
            t = rng.choice(pool) if rng.random() < 0.15 else rng.randrange(tok.vocab_size)
            if t not in unassigned:
                seq.append(t)
        out.append(seq)
    return out


def _decode_or_error(engine: Any, ids: list[int], skip: bool) -> str | None:
    """The text, the error, or None: this engine leaves the sequence to the reference."""
    try:
        return engine.decode(ids, skip_special_tokens=skip)
    except InvalidTokenId as e:
        return f"InvalidTokenId({e.index}, {e.token_id})"


# --- the choice --------------------------------------------------------------------------------------


def speed_up(tok: Tokenizer, mode: str, *, name: str = "", fingerprint: str = "") -> tuple[FastEngine | None, str | None]:
    """(the fast engine to serve `tok` with, or None; why not, when not). Slow: runs off the main thread.

    `auto` takes fastokens when every probe matches; `fast` takes it whenever it loads, unprobed;
    `reference` never builds it. One log line says what was chosen and what it cost. With the
    tokenizer's `fingerprint`, the probes' verdict is kept on disk for this engine version
    (verdict_dir) and read back at the next start: a refused tokenizer is not built again, a passed
    one is built and not probed again (the battery takes 0.5-3 s a tokenizer).
    """
    if mode == "reference":
        return None, "--tokenizer-backend reference"
    label = name or tok.description
    kept = read_verdict(f"probe-{fingerprint}") if fingerprint and mode == "auto" else None
    if kept is not None and kept.get("ok") is False and isinstance(kept.get("failed"), str):
        log.warning("model %s: fastokens differs from %s on probe: %s; served by %s (the verdict of an earlier "
                    "start)", label, tok.backend, kept["failed"], tok.backend)
        return None, f"probe failed: {kept['failed']}"
    start = time.monotonic()
    try:
        fast = build_fast(tok)
    except EngineUnavailable as e:
        log.info("model %s: served by %s: %s", label, tok.backend, e)
        return None, str(e)
    built = time.monotonic() - start
    if mode == "fast":
        log.info("model %s: fastokens (forced, unprobed), built in %.2fs", label, built)
        return fast, None
    if kept is not None and kept.get("ok") is True and isinstance(kept.get("guard"), list):
        if kept["guard"]:
            fast.guard, fast.reference = tuple(kept["guard"]), replace(cast(Any, tok), fast=None)
        log.info("model %s: fastokens passed its probes%s at an earlier start, built in %.2fs", label,
                 _guarded(tok, fast), built)
        return fast, None
    failed = probe(tok, fast)
    if failed is not None and failed.startswith("encode whitespace edge "):
        failed = _guard(tok, fast, failed)
    probed = time.monotonic() - start - built
    if failed is not None:
        log.warning("model %s: fastokens differs from %s on probe: %s; served by %s", label, tok.backend, failed, tok.backend)
        if fingerprint:
            write_verdict(f"probe-{fingerprint}", {"ok": False, "failed": failed})
        return None, f"probe failed: {failed}"
    if fingerprint:
        write_verdict(f"probe-{fingerprint}", {"ok": True, "guard": list(fast.guard)})
    log.info("model %s: fastokens passed its probes%s, built in %.2fs, probed in %.2fs", label, _guarded(tok, fast),
             built, probed)
    return fast, None


def _guarded(tok: Tokenizer, fast: FastEngine) -> str:
    """What the log says of a guard: which code points' texts go to the reference."""
    if not fast.guard:
        return ""
    return f" (texts holding {', '.join(f'U+{ord(c):04X}' for c in fast.guard)} go to {tok.backend})"


def _guard(tok: Tokenizer, fast: FastEngine, failed: str) -> str | None:
    """A whitespace-edge probe failed: guard the code points whose probes fail (their texts go to the
    reference) and probe the whole battery again. None when that passes (`fast` keeps the guard);
    else what failed first, with `fast` unguarded.

    fastokens' regex path (a split pattern its own scanner does not know, cl100k_base's among them)
    takes U+180E for whitespace; every text where cl100k_base parted from tiktoken in a hunt of
    960,000 short texts built from the edge code points held a U+180E."""
    guard = edge_guard(tok, fast)
    if not guard:
        return failed
    fast.guard, fast.reference = guard, replace(cast(Any, tok), fast=None)  # the same wrapper, never fast
    again = probe(tok, fast)
    if again is not None:
        fast.guard, fast.reference = (), None
        return failed
    return None


def choose(tok: Tokenizer, mode: str, *, name: str = "") -> Tokenizer:
    """`tok` served by the engine `mode` picks, at once (in-process use: tests, benchmarks); a worker
    does the same in its loader thread and switches between rounds."""
    tok.fast, _ = speed_up(tok, mode, name=name)
    return tok


# --- verdicts kept on disk ---------------------------------------------------------------------------

ENGINE_CACHE_ENV = "TOKENBROKER_ENGINE_CACHE"


@functools.cache
def engine_version() -> str:
    """What a verdict depends on besides the tokenizer: fastokens', the reference libraries' and
    this module's versions (the battery and the limit probe live here: an edit re-runs them)."""
    versions = []
    for dist in ("fastokens", "tokenizers", "tiktoken"):
        try:
            versions.append(f"{dist}={metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            versions.append(f"{dist}=none")
    source = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]
    return hashlib.sha256(" ".join([*versions, source]).encode()).hexdigest()[:24]


def verdict_dir() -> Path:
    """$TOKENBROKER_ENGINE_CACHE, else tokenbroker/engines in the user's cache folder."""
    given = os.environ.get(ENGINE_CACHE_ENV)
    if given:
        return Path(given)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tokenbroker" / "engines"


def read_verdict(key: str) -> dict | None:
    """A verdict kept under `key` for this engine version, or None (none, unreadable, malformed)."""
    try:
        found = json.loads((verdict_dir() / f"{key}-{engine_version()}.json").read_text())
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


def write_verdict(key: str, verdict: dict) -> None:
    """Keep `verdict` for the next start (atomically: a reader sees all of it or none); a folder that
    cannot be written only costs the next start its probe."""
    folder = verdict_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".verdict-")
        with os.fdopen(fd, "w") as f:
            json.dump(verdict, f)
        os.replace(tmp, folder / f"{key}-{engine_version()}.json")
    except OSError as e:
        log.debug("cannot keep the verdict %s in %s: %s", key, folder, e)


# --- the limit: fast engines per thread ----------------------------------------------------------------

LIMIT_PROBE_MAX = 8  # engines the probe alternates among at most; a limit found this high is no limit here
CLIFF_FACTOR = 20.0  # an encode this many times slower than with one engine: the thread's state thrashes
CLIFF_FLOOR_S = 100e-6  # and at least this much slower (fastokens 0.3.5: ~2 us -> ~700 us on the probe's text)


def _probe_json() -> str:
    """A tokenizer.json with 256 byte-level tokens and no merges: fastokens builds it in ~20 ms, and
    a thread alternating among more instances than its state holds pays the same rebuild per encode
    as with a real vocabulary (the state does not depend on the tokenizer: four of any kind)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = HFTokenizer(models.BPE({c: i for i, c in enumerate(alphabet)}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok.to_str()


def measure_limit(most: int = LIMIT_PROBE_MAX) -> tuple[int, list[float]]:
    """(how many fastokens instances one thread alternates among at full speed, the best seconds per
    encode with 1..`most` in turn). Runs on a thread of its own, so the probe's state is never the
    caller's. A cliff counts when the next count is slow too (one noisy sample is not a cliff)."""
    import fastokens

    text = ["an engine probe, one short line of text " * 10]
    seconds: list[float] = []

    def run() -> None:
        source = _probe_json()
        engines = []
        for _ in range(most):
            engine = fastokens.Tokenizer.from_json_str(source)
            engine.enable_segment_cache(0)
            engines.append(engine)
        for n in range(1, most + 1):
            for e in engines[:n]:
                e.encode_batch_flat(text)
            best = float("inf")
            for _ in range(3):
                start = time.perf_counter()
                for i in range(4 * n):
                    engines[i % n].encode_batch_flat(text)
                best = min(best, (time.perf_counter() - start) / (4 * n))
            seconds.append(best)

    prober = threading.Thread(target=run, name="tokenbroker-engine-probe")
    prober.start()
    prober.join()
    base = seconds[0]
    slow = [t > max(CLIFF_FACTOR * base, base + CLIFF_FLOOR_S) for t in seconds]
    for n in range(1, most):
        if slow[n] and (n + 1 == most or slow[n + 1]):
            return n, seconds
    return most, seconds


@functools.cache
def engine_limit() -> int:
    """How many fast engines one thread serves before fastokens' per-thread state thrashes: measured
    once per engine version (measure_limit, ~0.3 s), kept on disk, read back at every later start."""
    try:
        import fastokens  # noqa: F401
    except ImportError:
        return LIMIT_PROBE_MAX  # no fast engine at all: nothing to plan around
    kept = read_verdict("limit")
    if kept is not None and isinstance(kept.get("limit"), int) and 1 <= kept["limit"] <= LIMIT_PROBE_MAX:
        log.info("fast engines: %d per thread (measured before, %s)", kept["limit"], verdict_dir())
        return cast(int, kept["limit"])
    limit, seconds = measure_limit()
    log.info("fast engines: %d per thread, measured (us per encode with 1..%d in turn: %s)", limit, len(seconds),
             " ".join(f"{t * 1e6:.0f}" for t in seconds))
    write_verdict("limit", {"limit": limit, "us": [round(t * 1e6, 1) for t in seconds]})
    return limit


class EngineThread:
    """A thread of its own for fast engines beyond what the serving thread's state holds: a call
    hands it the engine's function and waits (~20-30 us a hand-off, against ~3 ms an encode pays on a
    thread that alternates among more engines than its state holds). fastokens' encode releases the
    GIL, so the waiting thread's Python is never held up by it."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.engines = 0  # engines placed here (EnginePlan)
        self._calls: queue.SimpleQueue[tuple[Callable[..., Any], tuple, list, Any]] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) on this thread; what it raises is raised here."""
        done = _thread.allocate_lock()
        done.acquire()
        box: list = []
        self._calls.put((fn, args, box, done))
        done.acquire()
        if len(box) == 2:
            raise box[1]
        return box[0]

    def _run(self) -> None:
        while True:  # a daemon thread: it ends with its process
            fn, args, box, done = self._calls.get()
            try:
                box.append(fn(*args))
            except BaseException as e:  # handed to the caller
                box += [None, e]
            del fn, args, box
            done.release()


WARM_TEXT = "Warm up: a short text with words, digits 12345, punctuation (!?) and ünïcödé."


class EnginePlan:
    """Which thread each fast engine of a worker encodes on: the first `limit` on the serving thread
    (the worker's main thread, which runs the rounds), the rest `limit` to a thread of their own.
    Each engine is warmed where it will encode when placed (fastokens builds its per-thread state at
    a thread's first encode with an engine: 9-54 ms that no request should pay). Main thread only."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.threads: list[EngineThread] = []
        self._placed: dict[int, FastEngine] = {}  # id -> engine, those placed and still served

    def place(self, engines: Iterable[FastEngine]) -> None:
        """Place and warm every engine of `engines` (those served now) not placed yet; forget the
        ones no longer served, so their places free up."""
        live = {id(e): e for e in engines}
        start, placed = time.perf_counter(), 0
        for key in [k for k in self._placed if k not in live]:
            gone = self._placed.pop(key)
            if gone.home is not None:
                gone.home.engines -= 1
        for key, engine in live.items():
            if key in self._placed:
                continue
            serving = sum(1 for e in self._placed.values() if e.home is None)
            if serving < self.limit:
                engine.home = None
            else:
                home = next((t for t in self.threads if t.engines < self.limit), None)
                if home is None:
                    home = EngineThread(f"tokenbroker-engines-{len(self.threads) + 1}")
                    self.threads.append(home)
                    log.info("fast engines: the serving thread holds %d (fastokens keeps per-thread state for "
                             "that many); more encode on thread %s", self.limit, home.name)
                home.engines += 1
                engine.home = home
            self._placed[key] = engine
            warm(engine)
            placed += 1
        if placed:
            serving = sum(1 for e in self._placed.values() if e.home is None)
            log.info("fast engines: %d placed and warmed in %.1f ms (%d on the serving thread, %d on %d threads of "
                     "their own; limit %d a thread)", placed, (time.perf_counter() - start) * 1e3, serving,
                     len(self._placed) - serving, self.report()["threads"], self.limit)

    def report(self) -> dict[str, int]:
        """What heartbeats carry: the limit, the fast engines served, the threads of their own."""
        return {"limit": self.limit, "fast": len(self._placed), "threads": sum(1 for t in self.threads if t.engines)}


def warm(engine: FastEngine) -> None:
    """One encode where `engine` will encode: the thread's state for it is built now."""
    engine.encode_flat([WARM_TEXT], True)
