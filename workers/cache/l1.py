"""L1: the ids of prefixes that end right after added tokens, so a new turn pays only for itself.

Where inputs are cut, and why that is exact, is workers/cache/segment.py's job; this module keeps
the prefixes (a byte-budgeted store with sampled LRU eviction) and serves lookups through them.

Bounded by design: a lookup first decides where it may cut (a few boundaries, `plan_cuts`), encodes
the input once in spans between those cuts, and only then, with every entry's charge known, copies
the prefixes it keeps, at most a quarter of the budget per input. An input with a boundary every few
bytes costs its tokenization, one digest per boundary and O(log boundaries) copies, never a copy
per boundary.
"""

from __future__ import annotations

import hashlib
import logging
import random
from array import array
from dataclasses import dataclass
from itertools import accumulate

from .accounting import ENTRY_OVERHEAD, ID_TYPECODE, LayerStats
from .segment import Segmenter, Tokenizer

log = logging.getLogger(__name__)

EVICTION_SAMPLE = 32
# Boundaries keyed first, deepest first: a growing conversation adds a few added tokens per turn, so
# its previous request's deepest boundary is among them; only on a miss there are the others keyed.
PROBE_FIRST = 8
# Cuts a lookup makes past its hit, so entries it may store, per input: the deepest few (the next
# turn of a conversation extends this one), then boundaries at powers of two from the start (shared
# system prompts sit at the first ones) and back from the end (a conversation that branches off a
# few turns back).
DEEPEST = 4
# One input adds at most this share of the budget: like L0, one input never evicts more than a quarter.
INPUT_SHARE = 4


# --- the store --------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Entry:
    ids: array
    charge: int
    used: int
    index: int


class PrefixStore:
    """digest -> prefix ids under a byte budget; evicts the least recently used of 32 sampled entries."""

    def __init__(self, budget: int, *, rng: random.Random | None = None) -> None:
        self.budget = budget
        self.bytes = 0
        self.evictions = 0
        self._map: dict[bytes, _Entry] = {}
        self._keys: list[bytes] = []
        self._clock = 0
        self._rng = rng or random.Random()

    def __len__(self) -> int:
        return len(self._map)

    def deepest(self, keys: list[bytes]) -> tuple[int, array | None]:
        """(index, ids) of the last key present, touching it; (-1, None) when none is."""
        for i in range(len(keys) - 1, -1, -1):
            entry = self._map.get(keys[i])
            if entry is not None:
                self._clock += 1
                entry.used = self._clock
                return i, entry.ids
        return -1, None

    def put_many(self, items: list[tuple[bytes, array, int]]) -> None:
        """Store (key, ids, charge) items, deepest first while they fit, evicting to make room."""
        chosen, total = [], 0
        for key, ids, charge in reversed(items):
            if key not in self._map and total + charge <= self.budget:
                chosen.append((key, ids, charge))
                total += charge
        while self._map and self.bytes + total > self.budget:
            self._evict_one()
        for key, ids, charge in reversed(chosen):
            self._clock += 1
            self._map[key] = _Entry(ids, charge, self._clock, len(self._keys))
            self._keys.append(key)
            self.bytes += charge

    def clear(self) -> None:
        """Let every prefix go; the eviction count stays."""
        self._map = {}
        self._keys = []
        self.bytes = 0

    def _evict_one(self) -> None:
        n = len(self._keys)
        sample = self._rng.sample(range(n), min(EVICTION_SAMPLE, n))
        victim = min(sample, key=lambda i: self._map[self._keys[i]].used)
        key = self._keys[victim]
        last = self._keys.pop()
        if victim < len(self._keys):
            self._keys[victim] = last
            self._map[last].index = victim
        self.bytes -= self._map.pop(key).charge
        self.evictions += 1


# --- the layer --------------------------------------------------------------------------------------


def plan_cuts(n: int, depth: int) -> list[int]:
    """Boundaries after `depth` (of `n`) a lookup cuts at, most worth keeping first: the `DEEPEST`
    deepest, then 2^k - 1 from the start and n - 1 - 2^k from the end alternately; all of them when
    there are no more than 2 x DEEPEST. At most DEEPEST + 2 log2(n) + 2, whatever the input.

    >>> plan_cuts(20, -1)
    [19, 18, 17, 16, 0, 1, 3, 15, 7, 11]
    """
    if n - depth <= 2 * DEEPEST:  # a short tail: every boundary in it
        return list(range(n - 1, depth, -1))
    picks = list(range(n - 1, max(depth, n - 1 - DEEPEST), -1))
    k = 1
    while k <= n:
        picks += (k - 1, n - 1 - k)
        k <<= 1
    return list(dict.fromkeys(i for i in picks if depth < i < n))  # in order, each once


class L1Cache:
    """Prefix lookups and inserts for one tokenizer; `encode` returns (ids, ids reused from L1, and the
    ids as an array nobody else holds, for L0 to keep without converting them again, or None)."""

    def __init__(self, tok: Tokenizer, segmenter: Segmenter, budget: int) -> None:
        self._tok = tok
        self._seg = segmenter
        self._store = PrefixStore(budget)
        self._input_budget = budget // INPUT_SHARE
        self._stats = LayerStats()
        self.fallbacks = 0  # lookups a piece check refused: tokenized whole instead

    def encode(self, text: str, add_special_tokens: bool) -> tuple[list[int], int, array | None]:
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError:  # lone surrogates: no bytes to key on
            data = b""
        parts = self._seg.split(data)
        n = len(parts) >> 1  # boundaries
        if not n:
            self._count(False, 0)
            return self._tok.encode(text, add_special_tokens=add_special_tokens), 0, None
        ends = list(accumulate(map(len, parts)))[1::2]  # byte offset right after each boundary
        keys, depth, prefix = self._lookup(memoryview(data), ends, add_special_tokens)
        acc = prefix[:] if prefix is not None else array(ID_TYPECODE)
        reused = len(acc)
        order = plan_cuts(n, depth)  # most worth keeping first
        cuts = sorted(order)
        marks: dict[int, int] = {}  # cut -> ids up to and with it
        total, prev, seg = 0, depth, self._seg
        for cut in [*cuts, n]:  # n: the text after the last boundary
            right = parts[2 * cut + 1] if cut < n else None
            if cut == prev + 1:  # one piece, as most spans are
                ids = seg.encode_piece(parts[2 * cut], parts[2 * prev + 1] if prev >= 0 else None, right)
            else:
                ids = self._span(data, parts, ends, prev, cut)
            if ids is None:
                return self._fallback(text, add_special_tokens)
            acc.fromlist(ids)
            if right is not None:
                marks[cut] = len(acc)
                total += ends[cut] + 4 * len(acc) + ENTRY_OVERHEAD
            prev = cut
        # Every charge is known now: choose what to keep, most worth keeping first, before copying
        # anything. keys holds the deepest boundaries' keys, every cut's among them: i's is keys[i - n].
        keep = cuts if total <= self._input_budget else self._within_budget(order, marks, ends)
        items = [(keys[cut - n], acc[:marks[cut]], ends[cut] + 4 * marks[cut] + ENTRY_OVERHEAD) for cut in keep]
        if items:
            self._store.put_many(items)
        self._count(depth >= 0, ends[depth] if depth >= 0 else 0)
        self._seg.finish(acc, add_special_tokens)
        return acc.tolist(), reused, acc

    def _within_budget(self, order: list[int], marks: dict[int, int], ends: list[int]) -> list[int]:
        """The cuts in `order` that fit one input's share of the budget, taken in that order, ascending."""
        keep, total = [], 0
        for cut in order:
            charge = ends[cut] + 4 * marks[cut] + ENTRY_OVERHEAD
            if total + charge <= self._input_budget:
                keep.append(cut)
                total += charge
        return sorted(keep)

    def _lookup(self, view: memoryview, ends: list[int], flag: bool) -> tuple[list[bytes], int, array | None]:
        """(the keys of the deepest boundaries, at least every one after the hit; the hit's boundary
        or -1; its ids or None). The deepest few are keyed and looked up first; the rest only if
        none of them is stored."""
        n = len(ends)
        lo = max(0, n - PROBE_FIRST)
        keys = _prefix_keys(view, ends[lo:], flag)
        depth, prefix = self._store.deepest(keys)
        if prefix is not None or not lo:
            return keys, depth + lo if prefix is not None else -1, prefix
        head = _prefix_keys(view, ends[:lo], flag)
        depth, prefix = self._store.deepest(head)
        return head + keys, depth, prefix

    def _span(self, data: bytes, parts: list[bytes], ends: list[int], a: int, b: int) -> list[int] | None:
        """Ids of the text after boundary `a` (-1: the start) up to and with boundary `b` (len(ends): the end)."""
        n = len(ends)
        left = parts[2 * a + 1] if a >= 0 else None
        right = parts[2 * b + 1] if b < n else None
        if b == a + 1:
            return self._seg.encode_piece(parts[2 * b], left, right)
        start = ends[a] if a >= 0 else 0
        stop = ends[b] - len(right) if right is not None else len(data)
        return self._seg.encode_piece(data[start:stop], left, right, inner=True)

    def _fallback(self, text: str, add_special_tokens: bool) -> tuple[list[int], int, None]:
        self.fallbacks += 1
        self._count(False, 0)
        return self._tok.encode(text, add_special_tokens=add_special_tokens), 0, None

    def _count(self, hit: bool, reused_bytes: int) -> None:
        if hit:
            self._stats.hits += 1
            self._stats.reused_bytes += reused_bytes
        else:
            self._stats.misses += 1

    def clear(self) -> None:
        self._store.clear()

    def stats(self) -> dict[str, int]:
        self._stats.entries = len(self._store)
        self._stats.bytes = self._store.bytes
        self._stats.evictions = self._store.evictions
        return self._stats.as_dict()


def _prefix_keys(view: memoryview, ends: list[int], add_special_tokens: bool) -> list[bytes]:
    """sha256 of the flag and each prefix `view[:end]` (16 bytes of it, as much as a key needs): the
    bytes before the first end in one call, then one digest per boundary. A lookup asks first for the
    few deepest, where a growing conversation finds its previous turn, so most boundaries are never
    digested. (sha256 runs in OpenSSL, on SHA extensions where the CPU has them: twice blake2b's speed.)"""
    h = hashlib.sha256(b"\x01" if add_special_tokens else b"\x00")
    keys, pos = [], 0
    for end in ends:
        h.update(view[pos:end])
        keys.append(h.copy().digest()[:16])
        pos = end
    return keys
