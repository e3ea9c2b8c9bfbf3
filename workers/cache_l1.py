"""L1: the ids of every prefix that ends right after a special token, so a new turn pays only for itself.

Where inputs are cut, and why that is exact, is workers/cache_segment.py's job; this module keeps
the prefixes (a byte-budgeted store with sampled LRU eviction) and serves lookups through them.
"""

from __future__ import annotations

import hashlib
import logging
import random
import threading
from array import array
from dataclasses import dataclass
from itertools import accumulate

from .cache_l0 import ID_TYPECODE, LayerStats
from .cache_segment import Segmenter, Tokenizer

log = logging.getLogger(__name__)

EVICTION_SAMPLE = 32
# Charged per entry on top of the prefix bytes and 4 bytes per id: the dict slot, key digest, entry
# object and array header really take about this much, and without it a flood of distinct tiny
# prefixes could hold many times the budget.
ENTRY_OVERHEAD = 256
# Boundaries keyed first, deepest first: a growing conversation adds a few specials per turn, so its
# previous request's deepest boundary is among them; only on a miss there are the others keyed.
PROBE_FIRST = 8


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


class L1Cache:
    """Prefix lookups and inserts for one tokenizer; `encode` returns (ids, ids reused from L1, and the
    ids as an array nobody else holds, for L0 to keep without converting them again, or None)."""

    def __init__(self, tok: Tokenizer, segmenter: Segmenter, budget: int) -> None:
        self._tok = tok
        self._seg = segmenter
        self._store = PrefixStore(budget)
        self._lock = threading.Lock()
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
            with self._lock:
                self._count(False, 0)
            return self._tok.encode(text, add_special_tokens=add_special_tokens), 0, None
        view = memoryview(data)
        lo = max(0, n - PROBE_FIRST)  # ends[j] and keys[j] are boundary lo + j's
        ends = _ends(parts, len(data), lo)
        keys = _prefix_keys(view, ends, add_special_tokens)
        with self._lock:
            depth, prefix = self._store.deepest(keys)
        if prefix is not None:
            depth += lo
        elif lo:  # rarely: a shallow hit, or a miss, which caches every boundary anyway
            head = _ends(parts, len(data), 0)[:lo]
            keys = _prefix_keys(view, head, add_special_tokens) + keys
            ends, lo = head + ends, 0
            with self._lock:
                depth, prefix = self._store.deepest(keys)
        acc = prefix[:] if prefix is not None else array(ID_TYPECODE)
        reused = len(acc)
        new: list[tuple[bytes, array, int]] = []
        for i in range(depth + 1, n):
            ids = self._seg.encode_piece(parts[2 * i], parts[2 * i - 1] if i else None, parts[2 * i + 1])
            if ids is None:
                return self._fallback(text, add_special_tokens)
            acc.fromlist(ids)
            new.append((keys[i - lo], acc[:], ends[i - lo] + 4 * len(acc) + ENTRY_OVERHEAD))
        rest = self._seg.encode_piece(parts[-1], parts[-2], None)
        if rest is None:
            return self._fallback(text, add_special_tokens)
        with self._lock:
            if new:
                self._store.put_many(new)
            self._count(depth >= 0, ends[depth - lo] if depth >= 0 else 0)
        acc.fromlist(rest)
        self._seg.finish(acc, add_special_tokens)
        return acc.tolist(), reused, acc

    def _fallback(self, text: str, add_special_tokens: bool) -> tuple[list[int], int, None]:
        with self._lock:
            self.fallbacks += 1
            self._count(False, 0)
        return self._tok.encode(text, add_special_tokens=add_special_tokens), 0, None

    def _count(self, hit: bool, reused_bytes: int) -> None:
        if hit:
            self._stats.hits += 1
            self._stats.reused_bytes += reused_bytes
        else:
            self._stats.misses += 1

    def stats(self) -> dict[str, int]:
        with self._lock:
            self._stats.entries = len(self._store)
            self._stats.bytes = self._store.bytes
            self._stats.evictions = self._store.evictions
            return self._stats.as_dict()


def _ends(parts: list[bytes], size: int, lo: int) -> list[int]:
    """Byte offsets right after boundaries lo..n-1 of split `parts` of `size` bytes, counted from the
    end: a lookup that needs only the deepest few boundaries touches only the parts after them."""
    tail = parts[2 * lo + 1:]
    return list(accumulate(map(len, tail), initial=size - sum(map(len, tail))))[1::2]


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
