"""A worker's two-level cache in front of one tokenizer: L0 exact inputs, L1 prefixes at added tokens.

Caches only ever save work: every result equals the tokenizer's own, id for id (docs/protocol.md,
"Token ids"). L1 proves that per tokenizer at load (see segment.py) and is bypassed, with the reason
in `l1_bypass_reason`, where it cannot. Decoding is never cached.

One thread touches the caches: the worker's round thread (Ops, the heartbeat's stats, the switch to
the fast engine). The lanes (workers/background.py) encode only cache-less models and render, and
the beat thread sends stats read on the round thread, so L0 and L1 take no lock.

>>> ids, outcome = TokenCache(tok, CacheConfig(l0_enabled=True)).encode("hello")  # doctest: +SKIP
>>> outcome  # doctest: +SKIP
CacheOutcome(l0='miss', l1_reused_tokens=0)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from tokenbroker.common.config import CacheConfig

from ..tokenizers import ids_to_u32
from .accounting import LayerStats
from .l0 import L0Cache
from .l1 import L1Cache
from .segment import NotSplittable, Segmenter, Tokenizer, check_exact

log = logging.getLogger(__name__)

__all__ = ["CacheOutcome", "TokenCache"]


@dataclass(frozen=True)
class CacheOutcome:
    l0: str  # "hit" | "miss" | "off"
    l1_reused_tokens: int  # 0 when L1 missed or is off


OFF = CacheOutcome("off", 0)


class TokenCache:
    """Wraps one loaded tokenizer. Returned id lists are fresh: callers may keep or change them."""

    def __init__(self, tokenizer: Tokenizer, config: CacheConfig, *, name: str = "") -> None:
        self.tokenizer = tokenizer
        self.name = name
        self._l0 = L0Cache(config.l0_max_entries, config.l0_max_bytes) if config.l0_enabled else None
        self._l1: L1Cache | None = None
        self.l1_bypass_reason: str | None = None
        if config.l1_enabled:
            self.l1_bypass_reason = self._start_l1(config.l1_max_memory)
            if self.l1_bypass_reason is not None:
                log.warning("tokenizer %s: L1 cache bypassed: %s", name or "?", self.l1_bypass_reason)

    def _start_l1(self, budget: int) -> str | None:
        """Build L1 if splitting at added tokens is exact for this tokenizer; else say why not."""
        try:
            seg = Segmenter(self.tokenizer)
        except NotSplittable as e:
            return str(e)
        reason = check_exact(seg, self.tokenizer)
        if reason is None:
            self._l1 = L1Cache(self.tokenizer, seg, budget)
        return reason

    def fast_engine_serves(self) -> None:
        """The tokenizer is now served by its fast engine (workers/engine.py, whose probes also check
        `encode_ordinary`, what L1 encodes its pieces with). L0 and L1 stay as the operator configured
        them: the reply's `cache` fields keep their meaning. With fastokens, L1 costs more than it saves
        on agent traffic (scripts/bench_engine: 1.9x the CPU of L0 alone), so docs/sizing.md advises
        leaving it off where fastokens serves."""
        if self._l1 is not None:
            log.info("tokenizer %s: served by fastokens with L1 on: L1 re-encodes less but costs more than "
                     "fastokens' own encode on most traffic (docs/sizing.md)", self.name or "?")

    def encode_u32(self, text: str, add_special_tokens: bool = True) -> tuple[bytes, CacheOutcome]:
        """`encode`'s ids as little-endian uint32 bytes: without L1, built and kept without an int
        per id (the engine's packed buffer into L0, L0's array out)."""
        if self._l1 is not None:
            ids, outcome = self.encode(text, add_special_tokens)
            return ids_to_u32(ids), outcome
        if self._l0 is None:
            return self.tokenizer.encode_u32([text], add_special_tokens=add_special_tokens)[0], OFF
        packed = self._l0.get_u32(text, add_special_tokens)
        if packed is not None:
            return packed, CacheOutcome("hit", 0)
        packed = self.tokenizer.encode_u32([text], add_special_tokens=add_special_tokens)[0]
        self._l0.put_u32(text, add_special_tokens, packed)
        return packed, CacheOutcome("miss", 0)

    @property
    def l1_active(self) -> bool:
        """L1 is enabled and exact for this tokenizer."""
        return self._l1 is not None

    @property
    def enabled(self) -> bool:
        return self._l0 is not None or self._l1 is not None

    def encode(self, text: str, add_special_tokens: bool = True) -> tuple[list[int], CacheOutcome]:
        """The tokenizer's ids for `text`, and where they came from."""
        if self._l0 is None and self._l1 is None:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens), OFF
        l0 = "off"
        if self._l0 is not None:
            ids = self._l0.get(text, add_special_tokens)
            if ids is not None:
                return ids, CacheOutcome("hit", 0)
            l0 = "miss"
        reused, stored = 0, None
        if self._l1 is not None:
            ids, reused, stored = self._l1.encode(text, add_special_tokens)
        else:
            ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        if self._l0 is not None:
            self._l0.put(text, add_special_tokens, ids, stored)
        return ids, CacheOutcome(l0, reused)

    def clear(self) -> None:
        """Let every L0 and L1 entry go, keeping the cumulative counters: the model went back to sleep
        (workers/registry.py `unload`), and what its traffic cached would stay resident, unseen."""
        if self._l0 is not None:
            self._l0.clear()
        if self._l1 is not None:
            self._l1.clear()

    def stats(self) -> dict[str, dict[str, int]]:
        """Cumulative lookups, evictions and reused bytes per layer, with current entries and charged bytes."""
        empty = LayerStats().as_dict()
        return {
            "l0": self._l0.stats() if self._l0 is not None else empty,
            "l1": self._l1.stats() if self._l1 is not None else empty,
        }
