"""Which workers hold a model: the names and globs each worker said it answers to in its READY.

A pool may mix workers started with different models (remote workers with their own flags). A
request that names a model goes only to the workers that resolve that name, exactly or by one of
their `--tokenizer-map` globs; so a worker never gets a request for a model it does not hold.
A request with no model (each worker's default), or for a name no live worker resolves (the
worker answers `unknown_model` with its own message), may go to any worker.
"""

from __future__ import annotations

import re

from tokenbroker.common.protocol import glob_pattern

CACHED_NAMES = 4096  # resolved names remembered between pool changes


class ModelIndex:
    """Model names -> the live workers that answer to them. No socket, no clock."""

    def __init__(self) -> None:
        self._names: dict[bytes, frozenset[str]] = {}
        self._globs: dict[bytes, tuple[re.Pattern[str], ...]] = {}
        self._cache: dict[str, frozenset[bytes] | None] = {}

    def add_worker(self, wid: bytes, names: list[str], globs: list[str]) -> None:
        self._names[wid] = frozenset(names)
        self._globs[wid] = tuple(glob_pattern(g) for g in globs)
        self._cache.clear()

    def remove_worker(self, wid: bytes) -> None:
        if self._names.pop(wid, None) is not None:
            self._globs.pop(wid, None)
            self._cache.clear()

    def eligible(self, model: str | None) -> frozenset[bytes] | None:
        """The workers that resolve `model`; None when any worker may take it.

        >>> index = ModelIndex()
        >>> index.add_worker(b"w1", ["deepseek", "default"], [])
        >>> index.add_worker(b"w2", ["bert"], ["bert-*"])
        >>> sorted(index.eligible("bert-base")), index.eligible(None), index.eligible("nope")
        ([b'w2'], None, None)
        """
        if model is None:
            return None
        if model in self._cache:
            return self._cache[model]
        found = frozenset(wid for wid, names in self._names.items()
                          if model in names or any(p.fullmatch(model) for p in self._globs[wid]))
        result = found or None
        if len(self._cache) < CACHED_NAMES:
            self._cache[model] = result
        return result
