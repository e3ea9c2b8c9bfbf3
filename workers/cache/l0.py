"""L0: exact (text, add_special_tokens) -> ids, least recently used first out.

Bounded twice: by entry count and by charged bytes, because an entry keeps the whole input, so a few
huge prompts could otherwise hold far more memory than the entry count suggests. An entry is charged
what it really holds (the str object as sys.getsizeof counts it, 4 bytes per id, bookkeeping), and
one charged above a quarter of the byte budget is never cached: it would evict a quarter of
everything for a single input.

The store is compiled (workers/cache/_cache.pyx, `L0Store`): the text is hashed once on its own
buffer (64 bits, keyed per process), a hit is checked against the kept str (a collision is a miss),
and the ids stay packed u32 bytes: a hit hands out the kept bytes object itself, no copy.
"""

from __future__ import annotations

from tokenbroker.common.config import CacheConfig

from ._cache import L0Store
from .accounting import ENTRY_OVERHEAD

__all__ = ["L0Store", "new_l0"]


def new_l0(config: CacheConfig) -> L0Store:
    """The L0 layer `config` asks for."""
    return L0Store(config.l0_max_entries, config.l0_max_bytes, ENTRY_OVERHEAD)
