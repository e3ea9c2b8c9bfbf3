"""L0: exact (text, add_special_tokens) -> ids, least recently used first out.

Bounded twice: by entry count and by charged bytes, because an entry keeps the whole input, so a few
huge prompts could otherwise hold far more memory than the entry count suggests. An entry is charged
what it really holds (the str object, 4 bytes per id, bookkeeping), and one charged above a quarter of
the byte budget is never cached: it would evict a quarter of everything for a single input.
"""

from __future__ import annotations

import sys
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import cast

from .accounting import ENTRY_OVERHEAD, ID_TYPECODE, LayerStats

_LITTLE = sys.byteorder == "little"


def _swapped(ids: array) -> bytes:  # pragma: no cover - big-endian hosts only
    copy = array(ID_TYPECODE, ids)
    copy.byteswap()
    return copy.tobytes()


@dataclass(slots=True)
class _Entry:
    ids: array
    utf8_len: int
    charge: int


class L0Cache:
    """Exact-match cache; `get` counts a lookup, `put` stores a result it was not asked to keep a reference to."""

    def __init__(self, max_entries: int, max_bytes: int) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._map: OrderedDict[tuple[str, bool], _Entry] = OrderedDict()
        self._stats = LayerStats()

    def get(self, text: str, add_special_tokens: bool) -> list[int] | None:
        """A fresh list of the cached ids, or None (a miss, counted)."""
        ids = self._hit(text, add_special_tokens)
        return None if ids is None else ids.tolist()

    def get_u32(self, text: str, add_special_tokens: bool) -> bytes | None:
        """The cached ids as little-endian uint32 bytes (one copy, no int per id), or None (a miss)."""
        ids = self._hit(text, add_special_tokens)
        if ids is None:
            return None
        return ids.tobytes() if _LITTLE else _swapped(ids)

    def _hit(self, text: str, add_special_tokens: bool) -> array | None:
        """The stored ids of `text`, counted as a hit and made most recent; None, counted as a miss."""
        key = (text, add_special_tokens)
        entry = self._map.get(key)
        if entry is None:
            self._stats.misses += 1
            return None
        self._map.move_to_end(key)
        self._stats.hits += 1
        self._stats.reused_bytes += entry.utf8_len
        return entry.ids

    def put_u32(self, text: str, add_special_tokens: bool, packed: bytes) -> None:
        """Keep little-endian uint32 `packed` ids for `text`: copied into the store as they are."""
        stored = array(ID_TYPECODE)
        stored.frombytes(packed)
        if not _LITTLE:  # pragma: no cover
            stored.byteswap()
        self.put(text, add_special_tokens, stored, stored)

    def put(self, text: str, add_special_tokens: bool, ids: list[int] | array, stored: array | None = None) -> None:
        """Keep a copy of `ids` for `text`, evicting the least recently used entries to stay in bounds.
        `stored`, when given, holds the same ids and is handed over: kept as it is, not copied."""
        charge = sys.getsizeof(text) + 4 * len(ids) + ENTRY_OVERHEAD
        if charge > self.max_bytes // 4:
            return
        if stored is None:
            stored = array(ID_TYPECODE)
            stored.fromlist(cast("list[int]", ids))  # the list fast path: a third quicker than array(typecode, ids)
        utf8_len = len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))
        entry = _Entry(stored, utf8_len, charge)
        key = (text, add_special_tokens)
        old = self._map.pop(key, None)
        if old is not None:  # stored already (a text encoded twice in one batch)
            self._stats.bytes -= old.charge
        while self._map and (len(self._map) >= self.max_entries or self._stats.bytes + charge > self.max_bytes):
            _, gone = self._map.popitem(last=False)
            self._stats.bytes -= gone.charge
            self._stats.evictions += 1
        self._map[key] = entry
        self._stats.bytes += charge
        self._stats.entries = len(self._map)

    def stats(self) -> dict[str, int]:
        self._stats.entries = len(self._map)
        return self._stats.as_dict()

    def clear(self) -> None:
        """Let every entry go (its memory with it); the cumulative counters stay."""
        self._map = OrderedDict()
        self._stats.bytes = 0
        self._stats.entries = 0
