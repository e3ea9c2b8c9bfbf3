"""L1: the ids of prefixes that end right after added tokens, so a new turn pays only for itself.

Where inputs are cut, and why that is exact, is workers/cache/segment.py's job; the per-request work
is compiled (workers/cache/_cache.pyx, `L1Store`); this module holds the policy:

- A lookup finds the input's boundaries in one pass, keys every prefix ending at one in one more
  (a 64-bit hash of the str's own buffer), and takes the deepest stored prefix whose text equals the
  input's, byte for byte. It then cuts at a few boundaries past the hit (`plan_cuts`: the `DEEPEST`
  deepest, where the next turn of a conversation finds this one, then powers of two from the start
  and from the end), encodes the spans between them in one batch call to the engine, each with its
  left neighbour token as context, and checks each span's first and last id.
- What it keeps: one block per input (the text up to its deepest kept boundary, in the str's own
  width, and those ids), shared by every boundary kept from it; charged once, plus ENTRY_OVERHEAD
  per boundary, at most 1/INPUT_SHARE of the budget per input. Exact LRU over boundaries; a block's
  bytes are freed with its last boundary.
- `MIN_PREFIX`: an input whose deepest boundary ends before this many code points is encoded whole,
  not looked up, nor stored (counted as a miss): such a prefix saves less than L1's fixed cost (the
  split encode call, the store: about 4-5 us with fastokens). Set no higher: a conversation whose
  early turns are skipped stores nothing for its next turn to hit (scripts/bench_cache; multi-turn
  traffic 1.16x at 0-512, 0.85x at 2,048; docs/sizing.md, "What the caches buy").

An input with a boundary every few bytes costs its tokenization, one hash pass, and O(log boundaries)
spans and kept boundaries, never a copy per boundary.
"""

from __future__ import annotations

import sys
from array import array
from typing import Callable

from ..tokenizers import ids_to_u32
from ._cache import L1Store, plan_cuts
from .accounting import ENTRY_OVERHEAD
from .segment import Segmenter, Tokenizer

__all__ = ["DEEPEST", "INPUT_SHARE", "MIN_PREFIX", "L1Store", "new_l1", "plan_cuts"]

DEEPEST = 4
INPUT_SHARE = 4
MIN_PREFIX = 512
_LITTLE = sys.byteorder == "little"


def encoders(tok: Tokenizer) -> tuple[Callable, Callable[[str, bool], bytes]]:
    """(the tokenizer's batch encode to one flat u32 buffer, its whole-input encode to packed ids):
    the wrapper's own (the fast engine's buffers when it serves), else built on `encode`."""
    engine_flat = getattr(tok, "encode_flat", None)
    if engine_flat is not None:
        def flat(texts: list[str], *, add_special_tokens: bool = False) -> "tuple[bytes, array | list[int]]":
            # the wrapper's ends are little-endian uint64 bytes (the engine's buffer): read as ints once
            buf, offsets = engine_flat(texts, add_special_tokens=add_special_tokens)
            ends = array("Q")
            ends.frombytes(offsets)
            if not _LITTLE:  # pragma: no cover - big-endian hosts only
                ends.byteswap()
            return buf, ends
    else:
        def flat(texts: list[str], *, add_special_tokens: bool = False) -> "tuple[bytes, array | list[int]]":
            parts = [ids_to_u32(tok.encode(t, add_special_tokens=add_special_tokens)) for t in texts]
            ends = [0]
            for p in parts:
                ends.append(ends[-1] + len(p) // 4)
            return b"".join(parts), ends
    many = getattr(tok, "encode_u32", None)
    if many is not None:
        def whole(text: str, flag: bool) -> bytes:
            return many([text], add_special_tokens=flag)[0]
    else:
        def whole(text: str, flag: bool) -> bytes:
            return ids_to_u32(tok.encode(text, add_special_tokens=flag))
    return flat, whole


def new_l1(tok: Tokenizer, seg: Segmenter, budget: int, *, min_prefix: int = MIN_PREFIX) -> L1Store:
    """An L1 layer over `tok`, cutting where `seg` says, within `budget` charged bytes."""
    flat, whole = encoders(tok)
    return L1Store(seg.matcher, flat, whole, ids_to_u32(seg.head), ids_to_u32(seg.tail), budget,
                   budget // INPUT_SHARE, ENTRY_OVERHEAD, min_prefix, DEEPEST)
