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
import sys
from dataclasses import dataclass

from tokenbroker.common.config import CacheConfig

from ._cache import L0Store, L1Store
from .accounting import empty_stats
from .l0 import new_l0
from .l1 import MIN_PREFIX, encoders, new_l1
from .segment import NotSplittable, Segmenter, Tokenizer, check_exact

log = logging.getLogger(__name__)

__all__ = ["CacheOutcome", "TokenCache"]

_LITTLE = sys.byteorder == "little"


@dataclass(frozen=True)
class CacheOutcome:
    l0: str  # "hit" | "miss" | "off"
    l1_reused_tokens: int  # 0 when L1 missed or is off


OFF = CacheOutcome("off", 0)
HIT = CacheOutcome("hit", 0)
MISS = CacheOutcome("miss", 0)


def u32_list(packed: bytes) -> list[int]:
    """Little-endian u32 bytes as a list of ids."""
    if _LITTLE:
        return memoryview(packed).cast("I").tolist()
    from array import array  # pragma: no cover - big-endian hosts only

    a = array("I")  # pragma: no cover
    a.frombytes(packed)  # pragma: no cover
    a.byteswap()  # pragma: no cover
    return a.tolist()  # pragma: no cover


class TokenCache:
    """Wraps one loaded tokenizer. Returned id lists are fresh: callers may keep or change them;
    returned packed bytes are immutable (an L0 hit returns the kept bytes object itself)."""

    def __init__(self, tokenizer: Tokenizer, config: CacheConfig, *, name: str = "",
                 l1_min_prefix: int = MIN_PREFIX) -> None:
        self.tokenizer = tokenizer
        self.name = name
        self._l0: L0Store | None = new_l0(config) if config.l0_enabled else None
        self._l1: L1Store | None = None
        self._whole = encoders(tokenizer)[1]
        self.l1_bypass_reason: str | None = None
        if config.l1_enabled:
            self.l1_bypass_reason = self._start_l1(config.l1_max_memory, l1_min_prefix)
            if self.l1_bypass_reason is not None:
                log.warning("tokenizer %s: L1 cache bypassed: %s", name or "?", self.l1_bypass_reason)

    def _start_l1(self, budget: int, min_prefix: int) -> str | None:
        """Build L1 if splitting at added tokens is exact for this tokenizer; else say why not."""
        try:
            seg = Segmenter(self.tokenizer)
        except NotSplittable as e:
            return str(e)
        probe = new_l1(self.tokenizer, seg, budget, min_prefix=0)  # the compiled path itself, on the probes
        reason = check_exact(seg, self.tokenizer, lambda text, flag: probe.encode(text, flag, False))
        if reason is None:
            self._l1 = new_l1(self.tokenizer, seg, budget, min_prefix=min_prefix)
        return reason

    def fast_engine_serves(self) -> None:
        """The tokenizer is now served by its fast engine (workers/engine.py, whose probes check every
        entry point L1 encodes with). L0 and L1 stay as the operator configured them: both call the
        wrapper, which now goes to the engine, and the reply's `cache` fields keep their meaning."""
        if self._l1 is not None:
            log.info("tokenizer %s: served by fastokens with L1 on (inputs whose deepest boundary ends before "
                     "%d characters are encoded whole: docs/sizing.md)", self.name or "?", self._l1.min_prefix)

    def encode_u32(self, text: str, add_special_tokens: bool = True) -> tuple[bytes, CacheOutcome]:
        """`encode`'s ids as little-endian uint32 bytes, packed end to end: engine buffer, caches and
        reply never hold an int per id."""
        l0, l1 = self._l0, self._l1
        if l1 is not None:  # L0 too, if on: looked up first, keyed in L1's one pass over the input
            packed = l1.encode(text, add_special_tokens, True, l0)
            reused = l1.last_reused
            if l0 is None:
                return packed, (CacheOutcome("off", reused) if reused else OFF)
            if l1.last_l0 == 1:
                return packed, HIT
            return packed, (CacheOutcome("miss", reused) if reused else MISS)
        if l0 is None:
            return self._whole(text, add_special_tokens), OFF
        kept = l0.get(text, add_special_tokens)
        if kept is not None:
            return kept, HIT
        packed = self._whole(text, add_special_tokens)
        l0.put(text, add_special_tokens, packed)
        return packed, MISS

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
        packed, outcome = self.encode_u32(text, add_special_tokens)
        return u32_list(packed), outcome

    def clear(self) -> None:
        """Let every L0 and L1 entry go, keeping the cumulative counters: the model went back to sleep
        (workers/registry.py `unload`), and what its traffic cached would stay resident, unseen."""
        if self._l0 is not None:
            self._l0.clear()
        if self._l1 is not None:
            self._l1.clear()

    def stats(self) -> dict[str, dict[str, int]]:
        """Cumulative lookups, evictions and reused bytes per layer, with current entries and charged bytes."""
        return {
            "l0": self._l0.stats() if self._l0 is not None else empty_stats(),
            "l1": self._l1.stats() if self._l1 is not None else empty_stats(),
        }
