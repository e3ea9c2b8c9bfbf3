"""Which worker holds which model, and so who may serve a request for it: loads, replicas and
evictions. No socket, no clock.

`eligible(model, catalog=...)` is the one answer to "who serves model X" (the dispatcher's allowed
set): a catalog model's holders, from what placement asked for and workers said they loaded (none
yet: the job waits for a load); any other name, the workers that resolve it by the names and
`--tokenizer-map` globs they gave in READY (a pool may mix workers started with other models), so
a worker never gets a request for a model it does not hold; None, any worker may take it: no
model (each worker's default), or a name no live worker resolves (the worker answers
`unknown_model` with its own message).

The broker decides; workers load in the background and say how it went (W_LOADED). With no cap
(`--max-models-per-worker 0`) every worker holds every placeable model, as in protocol version 1:
a worker that joins without one, or a model added at runtime, is loaded everywhere.

With a cap N, a worker holds at most N models (held or loading), and `plan(now, ...)` decides:

1. A model never loaded yet (a flag or add_model, state "loading") is loaded once, so the catalog
   learns its fingerprint and a bad source fails at once, not on its first request.
2. A model with queued requests and no worker holding or loading it is loaded on one worker.
3. A model whose holders have all been full for `replica_after` while its requests queue gets one
   more replica (one load at a time per model); so does the hottest model of a worker that has held
   far more jobs than the pool's mean for as long (the router's load bound: above both mean x 1.25
   and mean + 2) while another worker holds fewer than the mean: a model held by one worker must
   not leave the others idle.
4. A replica idle for `idle_after` is let go while its model has another one.

A load goes to a worker with a free model slot (the fewest models, then the fewest loads under
way); else a worker lets a model go first: the coldest (fewest recent requests, decayed over
`HEAT_HALF_LIFE_S`; then the least recently used) that holds no job there, has no request queued
for it (or another holder), and has been loaded for at least `min_residency`, or for
RESIDENCY_PER_LOAD times what its load took if that is less (a wake of a forked worker's dormant
copy takes a round trip, a parse seconds). The heat keeps the
models that carry the traffic in place while the rest take turns in the remaining slots, and the
residency bounds how often a slot can change hands, so a pool too small for its models degrades
into waiting for loads instead of spending its time loading (a worker loads one model at a time).
Loads lost with a worker that died are planned again, on another worker or its replacement.

`holders(model)` is what the dispatcher may send a catalog model's jobs to: the workers holding it, less
those loading another model while some other holder is not. A worker parsing a tokenizer
(`tokenizers` holds the GIL for the whole parse, seconds under load) serves nothing meanwhile, so
jobs sent there would wait for the load; a forked local worker's load is a wake (the template's
dormant copy, workers/registry.py) and this lasts one round trip.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Callable, Iterable

from tokenbroker.common.protocol import glob_pattern

REPLICA_AFTER_S = 0.05  # a model's holders all full this long, requests queued: add a replica
IDLE_AFTER_S = 30.0  # a replica that served nothing this long goes, while another replica stays
RETRY_AFTER_S = 1.0  # a worker that could not try a load (full, leaving) is asked again after this
MIN_RESIDENCY_S = 1.0  # a model loaded this recently is not let go for another...
RESIDENCY_PER_LOAD = 10.0  # ...nor one loaded for less than this many times what its load took (whichever is less)
HEAT_HALF_LIFE_S = 10.0  # a model's request count halves over this: what "recent traffic" means
_DECAY = math.log(2) / HEAT_HALF_LIFE_S
CACHED_NAMES = 4096  # resolved names remembered between pool changes
_NOBODY: frozenset[bytes] = frozenset()


@dataclass(frozen=True)
class Load:
    wid: bytes
    model: str
    share: str | None = None  # a model the worker holds with the same fingerprint: serve with its tokenizer


@dataclass(frozen=True)
class Unload:
    wid: bytes
    model: str


@dataclass
class Holding:
    """One worker's models: loaded (with when each was last given a job) and loading (since when)."""

    held: dict[str, float] = field(default_factory=dict)
    loading: dict[str, float] = field(default_factory=dict)
    since: dict[str, float] = field(default_factory=dict)  # when each held model finished loading
    cost: dict[str, float] = field(default_factory=dict)  # how long each held model's load took, LOAD to LOADED
    pinned: set[str] = field(default_factory=set)  # its own models (not the catalog's): never let go
    refused: set[str] = field(default_factory=set)  # models it must not be asked to load (a fingerprint mismatch)
    draining: bool = False
    busy_until: float = 0.0  # it could not try a load: not asked again before this
    engine_limit: int = 0  # distinct fast engines its serving thread holds (READY; 0: not said, no bound)


class Placement:
    def __init__(self, cap: int, *, replica_after: float = REPLICA_AFTER_S, idle_after: float = IDLE_AFTER_S,
                 min_residency: float = MIN_RESIDENCY_S) -> None:
        self.cap = cap
        self.replica_after = replica_after
        self.idle_after = idle_after
        self.min_residency = min_residency
        self._heat: dict[str, tuple[float, float]] = {}  # model -> (decayed request count, as of when)
        self._fingerprints: dict[str, str] = {}  # model -> its fingerprint, once a worker loaded it
        self._tokenizers: dict[str, str] = {}  # model -> its tokenizer's fingerprint (one engine per tokenizer)
        self.workers: dict[bytes, Holding] = {}
        self._held_by: dict[str, frozenset[bytes]] = {}  # model -> the workers holding it (not draining)
        # The same, less the loading ones while others are not. Edited in place, never replaced: the
        # dispatcher reads it per job (broker/_dispatch.pyx `holders`), as `eligible` would answer.
        self.holders_of: dict[str, frozenset[bytes]] = {}
        self._starved_since: dict[str, float] = {}
        self._overloaded_since: dict[bytes, float] = {}
        self._names = _NameIndex()

    # --- workers -------------------------------------------------------------------------

    def add_worker(self, wid: bytes, models: Iterable[str], now: float, *, own: Iterable[str] = (),
                   names: Iterable[str] = (), globs: Iterable[str] = (), engine_limit: int = 0) -> None:
        """A worker joined holding `models` (catalog names) and `own` models of its own, answering
        to the model `names` and `globs` of its READY, whose serving thread holds `engine_limit`
        distinct fast engines (0: unbounded)."""
        holding = Holding(held=dict.fromkeys(models, now), pinned=set(own), engine_limit=engine_limit)
        holding.held.update(dict.fromkeys(own, now))
        self.workers[wid] = holding
        for model in holding.held:
            self._index(model)
        names, globs = list(names), list(globs)
        if names or globs:
            self._names.add_worker(wid, names, globs)

    def drain_worker(self, wid: bytes) -> None:
        holding = self.workers.get(wid)
        if holding is not None:
            holding.draining = True
            for model in holding.held:
                self._index(model)

    def remove_worker(self, wid: bytes) -> None:
        holding = self.workers.pop(wid, None)
        if holding is not None:
            for model in holding.held:
                self._index(model)
        self._names.remove_worker(wid)

    # --- what workers said ---------------------------------------------------------------

    def loaded(self, wid: bytes, model: str, now: float) -> bool:
        """A load finished; False when the worker was not loading it (a stale or forged LOADED)."""
        holding = self.workers.get(wid)
        if holding is None or (started := holding.loading.pop(model, None)) is None:
            return False
        holding.held[model] = now
        holding.since[model] = now
        holding.cost[model] = now - started
        self._index_worker(wid)
        return True

    def failed(self, wid: bytes, model: str, now: float, *, retry: bool = False, refuse: bool = False) -> None:
        holding = self.workers.get(wid)
        if holding is None:
            return
        holding.loading.pop(model, None)
        if retry:
            holding.busy_until = now + RETRY_AFTER_S
        if refuse:
            holding.refused.add(model)
        if holding.held.pop(model, None) is not None:
            self._index(model)
        self._index_worker(wid)

    def used(self, wid: bytes, model: str, now: float) -> None:
        """A job of `model` went to `wid` (called per placed job: a dict store, nothing more)."""
        holding = self.workers.get(wid)
        if holding is not None and model in holding.held:
            holding.held[model] = now
        count, at = self._heat.get(model, (0.0, now))
        self._heat[model] = (count * math.exp(_DECAY * (at - now)) + 1.0, now)

    def heat(self, model: str, now: float) -> float:
        """A model's recent requests: each counts 1, halving every HEAT_HALF_LIFE_S."""
        count, at = self._heat.get(model, (0.0, now))
        return count * math.exp(_DECAY * (at - now))

    # --- reading -------------------------------------------------------------------------

    def eligible(self, model: str | None, *, catalog: bool) -> frozenset[bytes] | None:
        """The workers that may take a job of `model` now; None when any worker may.

        `catalog`: `model` is a catalog entry's name: its holders (empty: none yet, the job waits).
        Any other name: the workers whose READY names or globs resolve it (None when none does).

        >>> p = Placement(0)
        >>> p.add_worker(b"w1", ["deepseek"], 0.0, names=["deepseek", "default"])
        >>> p.add_worker(b"w2", [], 0.0, names=["bert"], globs=["bert-*"])
        >>> sorted(p.eligible("deepseek", catalog=True)), p.eligible("qwen", catalog=True)
        ([b'w1'], frozenset())
        >>> sorted(p.eligible("bert-base", catalog=False)), p.eligible(None, catalog=False), p.eligible("nope", catalog=False)
        ([b'w2'], None, None)
        """
        if model is None:
            return None  # each worker's default
        if catalog:
            return self.holders_of.get(model, _NOBODY)
        return self._names.eligible(model)

    def holders(self, model: str) -> frozenset[bytes]:
        """The workers that may take a job of catalog model `model` now: those that hold it and take jobs, less the ones loading while another holder is not. Empty exactly
        when no worker holds it."""
        return self.holders_of.get(model, frozenset())

    def held_by(self, model: str) -> frozenset[bytes]:
        """Every worker that holds `model` loaded and takes jobs (what replicas are counted on)."""
        return self._held_by.get(model, frozenset())

    def loading(self, model: str) -> bool:
        return any(model in h.loading for h in self.workers.values())

    def replicas(self) -> dict[str, int]:
        """How many workers hold each model loaded (the `models` reply's `workers`)."""
        out: dict[str, int] = {}
        for holding in self.workers.values():
            for model in holding.held:
                out[model] = out.get(model, 0) + 1
        return out

    # --- the policy ----------------------------------------------------------------------

    def plan(self, now: float, *, models: list[str], new: set[str], demand: dict[str, int],
             full: Callable[[bytes], bool], busy: Callable[[bytes, str], bool],
             fingerprints: dict[str, str] | None = None,
             jobs: Callable[[bytes], int] = lambda wid: 0,
             tokenizers: dict[str, str] | None = None) -> list[Load | Unload]:
        """What to load and unload now.

        `models`: the placeable catalog models, in catalog order; `new`: those never loaded yet;
        `demand`: queued requests per model; `full(wid)`: the worker has no free job slot;
        `busy(wid, model)`: the worker holds a job of that model; `fingerprints`: the known ones;
        `jobs(wid)`: how many jobs the worker holds; `tokenizers`: the known tokenizer fingerprints.
        Models with the same fingerprint are one model: a worker holding one serves another by
        sharing it. Models with the same tokenizer fingerprint (other templates over one tokenizer)
        share one engine: a slot counts tokenizers, not names, and their models go together. A
        worker gets at most min(cap, its engine limit) tokenizers: never more fast engines than its
        serving thread's state holds (workers/engine.py).
        """
        self._fingerprints = fingerprints or {}
        self._tokenizers = tokenizers or {}
        if self.cap <= 0:
            return self._everywhere(now, models)
        actions: list[Load | Unload] = []
        for model in models:
            queued = demand.get(model, 0)
            holders = self.held_by(model)
            if self.loading(model):
                continue
            if not holders:
                if queued or (model in new and not self._held_anywhere(model)):
                    actions += self._load_somewhere(model, now, demand, busy)
                continue
            if queued and all(full(w) for w in holders):
                since = self._starved_since.setdefault(model, now)
                if now - since >= self.replica_after:
                    got = self._load_somewhere(model, now, demand, busy)
                    if got:
                        del self._starved_since[model]
                    actions += got
            else:
                self._starved_since.pop(model, None)
        actions += self._rebalance(now, models, demand, busy, jobs)
        actions += self._idle_replicas(now, demand, busy)
        return actions

    def _rebalance(self, now: float, models: list[str], demand: dict[str, int], busy: Callable[[bytes, str], bool],
                   jobs: Callable[[bytes], int]) -> list[Load | Unload]:
        """One more replica of an overloaded worker's hottest model, on a worker below the mean."""
        live = [wid for wid, h in self.workers.items() if not h.draining]
        if len(live) < 2:
            return []
        held = {wid: jobs(wid) for wid in live}
        mean = sum(held.values()) / len(live)
        bound = max(mean * 1.25, mean + 2)
        if not any(n < mean for n in held.values()):
            return []
        placeable = set(models)
        for wid in live:
            if held[wid] <= bound:
                self._overloaded_since.pop(wid, None)
                continue
            since = self._overloaded_since.setdefault(wid, now)
            if now - since < self.replica_after:
                continue
            hottest = max((m for m in self.workers[wid].held if m in placeable and not self.loading(m)),
                          key=lambda m: self.heat(m, now), default=None)
            if hottest is None or any(held[w] <= bound for w in self.held_by(hottest)):
                continue
            got = self._load_somewhere(hottest, now, demand, busy)
            if got:
                del self._overloaded_since[wid]
                return got
        return []

    def _everywhere(self, now: float, models: list[str]) -> list[Load | Unload]:
        actions: list[Load | Unload] = []
        for wid, holding in self.workers.items():
            if holding.draining or now < holding.busy_until:
                continue
            for model in models:
                if model not in holding.held and model not in holding.loading and model not in holding.refused:
                    actions.append(self._start(wid, model, now, self._twin(holding, model)))
        return actions

    def _key(self, model: str) -> str:
        """What a slot holds: the model's tokenizer (its tokenizer fingerprint, else its fingerprint),
        or the model itself while unknown."""
        return self._tokenizers.get(model) or self._fingerprints.get(model) or "\0" + model

    def room(self, holding: Holding) -> int:
        """The tokenizers a worker may hold under a cap: the cap, or fewer when its serving thread
        holds fewer fast engines.

        >>> p = Placement(6)
        >>> p.room(Holding(engine_limit=4)), p.room(Holding()), Placement(2).room(Holding(engine_limit=4))
        (4, 6, 2)
        """
        return min(self.cap, holding.engine_limit) if holding.engine_limit > 0 else self.cap

    def _twin(self, holding: Holding, model: str) -> str | None:
        """A model the worker holds with the same (known) fingerprint as `model`, if any."""
        fingerprint = self._fingerprints.get(model)
        if not fingerprint:
            return None
        return next((m for m in holding.held if self._fingerprints.get(m) == fingerprint), None)

    def _holds_tokenizer(self, holding: Holding, model: str) -> bool:
        """The worker holds or loads a model over `model`'s (known) tokenizer."""
        tokenizer = self._tokenizers.get(model)
        return bool(tokenizer) and any(self._tokenizers.get(m) == tokenizer for m in (*holding.held, *holding.loading))

    def slots(self, holding: Holding) -> int:
        """The tokenizers a worker holds or is loading (names sharing one count once)."""
        return len({self._key(m) for m in (*holding.held, *holding.loading)})

    def _held_anywhere(self, model: str) -> bool:
        return any(model in h.held for h in self.workers.values())

    def _load_somewhere(self, model: str, now: float, demand: dict[str, int],
                        busy: Callable[[bytes, str], bool]) -> list[Load | Unload]:
        candidates = [(wid, h) for wid, h in self.workers.items()
                      if not h.draining and now >= h.busy_until and model not in h.held
                      and model not in h.loading and model not in h.refused]
        twins = [(self.slots(h), wid, twin) for wid, h in candidates if (twin := self._twin(h, model)) is not None]
        if twins:  # no load, no slot: the worker serves it with the tokenizer it has
            _, wid, twin = min(twins)
            return [self._start(wid, model, now, twin)]
        engine = [(self.slots(h), wid) for wid, h in candidates if self._holds_tokenizer(h, model)]
        if engine:  # its tokenizer's engine is there: a load, and no slot (the worker shares the engine)
            return [self._start(min(engine)[1], model, now)]
        roomy = [(self.slots(h), len(h.loading), wid) for wid, h in candidates if self.slots(h) < self.room(h)]
        if roomy:
            return [self._start(min(roomy)[2], model, now)]
        victims = []
        for wid, h in candidates:
            if h.loading:
                continue  # one load at a time per worker: it keeps serving its other models meanwhile
            groups: dict[str, list[str]] = {}
            for other in h.held:
                groups.setdefault(self._key(other), []).append(other)
            mine = []
            for members in groups.values():
                if any(m in h.pinned or busy(wid, m) or (demand.get(m, 0) and len(self.held_by(m)) <= 1)
                       for m in members):
                    continue  # held here for its jobs, or its requests wait for this very worker
                mine.append((sum(self.heat(m, now) for m in members), max(h.held[m] for m in members),
                             max(self._evictable(h, m) for m in members), wid, members))
            coldest = min(mine, key=lambda v: v[:2], default=None)
            if coldest is not None and now >= coldest[2]:
                victims.append(coldest)  # (a coldest one loaded just now: wait for it, rather than evict a hotter one)
        if not victims:
            return []
        *_, wid, members = min(victims, key=lambda v: v[:2])
        return [*(self._stop(wid, m) for m in members), self._start(wid, model, now)]

    def _evictable(self, holding: Holding, model: str) -> float:
        """When a held model may be let go for another: after `min_residency`, or sooner after a
        cheap load (RESIDENCY_PER_LOAD x its load's time: a forked worker's wake of the template's
        copy takes a round trip), so the time a slot spends loading stays a small share of its time.
        A model the worker joined with has no residency to wait for (as before any load)."""
        since = holding.since.get(model)
        if since is None:
            return -math.inf
        return since + min(self.min_residency, RESIDENCY_PER_LOAD * holding.cost.get(model, math.inf))

    def _idle_replicas(self, now: float, demand: dict[str, int], busy: Callable[[bytes, str], bool]) -> list[Load | Unload]:
        actions: list[Load | Unload] = []
        for wid, holding in self.workers.items():
            for model, last in list(holding.held.items()):
                if (now - last >= self.idle_after and model not in holding.pinned and len(self.held_by(model)) > 1
                        and not demand.get(model, 0) and not busy(wid, model)):
                    actions.append(self._stop(wid, model))
        return actions

    def unload_everywhere(self, model: str, busy: Callable[[bytes, str], bool]) -> list[Unload] | None:
        """remove_model: every holder lets it go once it holds no job of it; None while one still does."""
        if any(model in h.held and busy(wid, model) for wid, h in self.workers.items()):
            return None
        out = []
        for wid, holding in self.workers.items():
            if model in holding.held or model in holding.loading:
                holding.loading.pop(model, None)
                out.append(self._stop(wid, model))
                self._index_worker(wid)
        return out

    def reset(self, model: str) -> None:
        """add_model again: workers that failed it may be asked again."""
        for holding in self.workers.values():
            holding.refused.discard(model)

    # --- internals -----------------------------------------------------------------------

    def _start(self, wid: bytes, model: str, now: float, share: str | None = None) -> Load:
        self.workers[wid].loading[model] = now
        if share is None:  # a shared name loads nothing: the worker keeps serving
            self._index_worker(wid)
        return Load(wid, model, share)

    def _stop(self, wid: bytes, model: str) -> Unload:
        holding = self.workers[wid]
        holding.held.pop(model, None)
        holding.since.pop(model, None)
        holding.cost.pop(model, None)
        self._index(model)
        return Unload(wid, model)

    def _index(self, model: str) -> None:
        found = frozenset(wid for wid, h in self.workers.items() if model in h.held and not h.draining)
        if found:
            self._held_by[model] = found
            self.holders_of[model] = frozenset(w for w in found if not self.workers[w].loading) or found
        else:
            self._held_by.pop(model, None)
            self.holders_of.pop(model, None)

    def _index_worker(self, wid: bytes) -> None:
        """Its loads started or ended: whether it takes its models' jobs changed."""
        holding = self.workers.get(wid)
        if holding is not None:
            for model in holding.held:
                self._index(model)


class _NameIndex:
    """Model names -> the live workers that answer to them, by their READY names and globs."""

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

    def eligible(self, model: str) -> frozenset[bytes] | None:
        """The workers that resolve `model`, exactly or by a glob; None when none does."""
        if model in self._cache:
            return self._cache[model]
        found = frozenset(wid for wid, names in self._names.items()
                          if model in names or any(p.fullmatch(model) for p in self._globs[wid]))
        result = found or None
        if len(self._cache) < CACHED_NAMES:
            self._cache[model] = result
        return result
