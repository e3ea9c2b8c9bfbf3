"""What both cache layers share: how ids are stored, what an entry is charged, what a layer counts."""

from __future__ import annotations

from dataclasses import dataclass

ID_TYPECODE = "I"  # unsigned 32-bit: every vocabulary fits, and 4 bytes per id is what we charge
# Charged per entry on top of its text (L0) or prefix (L1) bytes and 4 bytes per id: the dict slot,
# key (a tuple or a digest), entry object and array header really take about this much, and without
# it a flood of distinct tiny entries could hold many times the budget.
ENTRY_OVERHEAD = 256


@dataclass
class LayerStats:
    """Cumulative counters of one layer plus its current size, as the metrics exporter reads them."""

    hits: int = 0
    misses: int = 0
    evictions: int = 0
    reused_bytes: int = 0
    entries: int = 0
    bytes: int = 0

    def as_dict(self) -> dict[str, int]:
        return {
            "hits": self.hits, "misses": self.misses, "evictions": self.evictions,
            "reused_bytes": self.reused_bytes, "entries": self.entries, "bytes": self.bytes,
        }
