"""What both cache layers share: what an entry is charged beyond its bytes, what a layer reports."""

from __future__ import annotations

# Charged per entry on top of what it holds (L0: its str object and 4 bytes per id; L1: its share of
# a block, charged once per block: the prefix in the str's own width and 4 bytes per id): the dict
# slot, the key int, the entry object and its links really take about this much, and without it a
# flood of distinct tiny entries could hold many times the budget.
ENTRY_OVERHEAD = 256

# What `stats()` reports per layer: cumulative counters and the current size.
STAT_KEYS = ("hits", "misses", "evictions", "reused_bytes", "entries", "bytes")


def empty_stats() -> dict[str, int]:
    """A layer that is off reports zeros."""
    return dict.fromkeys(STAT_KEYS, 0)
