"""The routing policy as plain calls: affinity, rendezvous fallback, bounded load, memory bound."""

from __future__ import annotations

import random
import tracemalloc
from collections import Counter, deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenbroker.broker._routekey import RouteKey, route_key
from tokenbroker.broker._router import Router, Slots
from tokenbroker.broker.frontend import peek_request
from tokenbroker.common.protocol import pack

WORKERS = [b"w0", b"w1", b"w2", b"w3"]


class Placing(Router):
    """The router with the dispatcher's part played by the test: a pick places the job there (its
    worker's `Slots` hold it, and by default the index records the key, as an ok answer would);
    `finished` answers one job of a worker."""

    placed = 0

    def add_worker(self, wid: bytes, capacity: int) -> None:  # type: ignore[override]
        known = self._workers.get(wid)
        if known is not None and capacity >= 1:
            known.load.capacity = capacity
            return
        super().add_worker(wid, Slots(capacity))

    def pick(self, key: RouteKey | None, *, overflow: bool = True, record: bool = True,  # type: ignore[override]
             allowed: frozenset[bytes] | None = None) -> bytes | None:
        wid = super().pick(key, overflow=overflow, allowed=allowed)
        if wid is not None:
            self.placed += 1
            self._workers[wid].load.jobs[self.placed] = None  # a job held there (only counted)
            if record and key is not None:
                self.record(key, wid)
        return wid

    def finished(self, wid: bytes) -> None:
        w = self._workers.get(wid)
        if w is not None and w.load.jobs:
            w.load.jobs.popitem()

    def in_flight(self) -> dict[bytes, int]:
        return {wid: w.load.held for wid, w in self._workers.items()}

    def preferred(self, key: RouteKey) -> bytes:
        """The worker `key` would go to with no load: index hit, else rendezvous."""
        w = self._lookup(key)
        return (w or self._rendezvous(key.key, self._workers.values())).wid


def router(workers: list[bytes] = WORKERS, capacity: int = 4, **options: object) -> Placing:
    r = Placing(**options)  # type: ignore[arg-type]
    for wid in workers:
        r.add_worker(wid, capacity)
    return r


def session(name: str) -> RouteKey:
    key = route_key(peek_request(pack({"op": "tokenize", "affinity": name, "text": "x"})))
    assert key is not None
    return key


def text_key(text: str) -> RouteKey:
    key = route_key(peek_request(pack({"op": "tokenize", "model": "m", "text": text})))
    assert key is not None
    return key


def key_preferring(r: Router, wid: bytes, avoid: set[bytes] = frozenset()) -> RouteKey:  # type: ignore[assignment]
    """An unindexed session key whose rendezvous winner is `wid`."""
    for i in range(10_000):
        key = session(f"probe-{wid!r}-{i}")
        if r.preferred(key) == wid and key.key not in avoid:
            return key
    raise AssertionError(f"no key prefers {wid!r}")


def pick(r: Router, key: RouteKey | None) -> bytes:
    wid = r.pick(key)
    assert wid is not None
    return wid


def conversation(user: str, turns: int) -> list[str]:
    text = "<|system|>You are terse. " * 30 + "<|end|>"
    out = []
    for k in range(turns):
        text += f"<|user|>{user} turn {k}: " + "tell me more. " * (20 + 9 * k) + "<|end|><|assistant|>"
        out.append(text)
        text += f"reply {k} to {user}. " * 40 + "<|end|>"
    return out


def test_turns_of_one_conversation_go_to_one_worker_while_others_interleave() -> None:
    r = router()
    convs = {f"user{u}": conversation(f"user{u}", 8) for u in range(24)}
    placed: dict[str, set[bytes]] = {u: set() for u in convs}
    held: deque[bytes] = deque()
    for turn in range(8):
        for user, texts in convs.items():
            wid = pick(r, text_key(texts[turn]))
            placed[user].add(wid)
            held.append(wid)
            if len(held) > 6:  # a few in flight at once, as with pipelined clients
                r.finished(held.popleft())
    moved = [u for u, ws in placed.items() if len(ws) > 1]
    assert len(moved) <= 2, f"conversations split over workers: {moved}"
    assert len({w for ws in placed.values() for w in ws}) == len(WORKERS)
    assert r.stats()["affinity_hits"] >= 24 * 7 - 4


def test_identical_keys_stick_to_one_worker() -> None:
    r = router()
    for name in ("a", "b", "c"):
        key = session(name)
        seen = set()
        for _ in range(50):
            wid = pick(r, key)
            seen.add(wid)
            r.finished(wid)
        assert len(seen) == 1


def test_distinct_keys_spread_over_all_workers_by_rendezvous() -> None:
    r = router(capacity=1000)
    counts = Counter(r.preferred(session(f"s{i}")) for i in range(2000))
    assert set(counts) == set(WORKERS)
    assert min(counts.values()) > 2000 / len(WORKERS) * 0.8


def test_preferred_worker_full_but_within_bound_overflows_to_a_free_one() -> None:
    r = router(capacity=2, balance_margin=10)
    key = session("busy")
    home = pick(r, key)
    assert pick(r, key) == home
    third = pick(r, key)
    assert third != home
    assert r.stats()["overflows"] == 1


def test_without_overflow_a_job_waits_for_its_full_preferred_worker() -> None:
    r = router(capacity=2, balance_margin=10)
    key = session("busy")
    home = pick(r, key)
    assert pick(r, key) == home
    assert r.pick(key, overflow=False) is None  # others are free, but it would rather wait
    assert r.in_flight()[home] == 2 and r.stats()["in_flight"] == 2
    elsewhere = next(w for w in WORKERS if w != home)
    assert r.pick(key_preferring(r, elsewhere), overflow=False) == elsewhere
    r.finished(home)
    assert r.pick(key, overflow=False) == home


def test_without_overflow_an_overloaded_preferred_worker_is_still_left() -> None:
    r = router(capacity=10)
    key = session("hot")
    home = pick(r, key)
    assert pick(r, key) == home
    assert r.pick(key, overflow=False) not in (None, home)  # 3 > mean + margin: spilled
    assert r.stats()["spills"] == 1


def test_pick_says_none_only_when_every_worker_is_full() -> None:
    r = router(capacity=2)
    held = [pick(r, session(f"k{i}")) for i in range(8)]
    assert Counter(held) == Counter({w: 2 for w in WORKERS})
    assert r.pick(session("one more")) is None
    assert r.pick(None) is None
    r.finished(b"w2")
    assert r.pick(session("one more")) == b"w2"


def test_unkeyed_requests_go_to_the_least_loaded_worker() -> None:
    r = router(capacity=10, balance_margin=10)
    for _ in range(3):
        pick(r, key_preferring(r, b"w0"))
    pick(r, key_preferring(r, b"w1"))
    assert pick(r, None) in (b"w2", b"w3")
    assert pick(r, None) in (b"w2", b"w3")
    assert pick(r, None) in (b"w1", b"w2", b"w3")


def within_bound(r: Router, chosen: bytes) -> bool:
    loads = r.in_flight()
    mean = sum(loads.values()) / len(loads)
    return loads[chosen] <= max(r.balance_factor * mean, mean + r.balance_margin) + 1e-9


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32), factor=st.sampled_from([1.0, 1.25, 2.0]), margin=st.integers(1, 4),
       hot_share=st.floats(0.3, 0.95))
def test_hot_key_spills_and_the_pool_stays_within_the_load_bound(seed: int, factor: float, margin: int,
                                                                  hot_share: float) -> None:
    rng = random.Random(seed)
    r = router(capacity=64, balance_factor=factor, balance_margin=margin)
    hot = session("hot")
    held: list[bytes] = []
    hot_workers = set()
    for step in range(600):
        if held and (len(held) > 40 or rng.random() < 0.45):
            r.finished(held.pop(rng.randrange(len(held))))
            continue
        is_hot = rng.random() < hot_share
        wid = pick(r, hot if is_hot else session(f"cold{rng.randrange(200)}"))
        held.append(wid)
        if is_hot:
            hot_workers.add(wid)
        assert within_bound(r, wid), (step, r.in_flight())
    assert r.stats()["spills"] > 0
    assert len(hot_workers) > 1


def test_spilled_key_stays_on_its_new_worker_when_the_old_one_drains() -> None:
    r = router(capacity=50)
    hot = session("hot")
    home = r.preferred(hot)
    held = []
    while (wid := pick(r, hot)) == home:
        held.append(wid)
    new_home = wid
    assert r.stats()["spills"] == 1
    assert len(held) == 2  # a third job: 3 > max(1.25 * 0.75, 0.75 + 2), the mean counting it
    for w in held:
        r.finished(w)  # the old home is idle now, the new one holds one job
    for _ in range(20):
        wid = pick(r, hot)
        assert wid == new_home
        r.finished(wid)
    assert r.stats()["spills"] == 1


def test_a_hot_conversation_walks_under_steady_overload_but_never_flaps() -> None:
    r = router(capacity=100)
    hot = session("hot")
    background = [key_preferring(r, w) for w in WORKERS]
    held: deque[bytes] = deque()
    path: list[bytes] = []
    for step in range(300):
        for key in background:  # every worker gets one job of its own per step
            held.append(pick(r, key))
        for _ in range(2):  # the hot key brings half the traffic
            wid = pick(r, hot)
            path.append(wid)
            held.append(wid)
        while len(held) > 24:
            r.finished(held.popleft())
    runs = list(_runs(path))
    # Its own traffic is twice a worker's share, so it must move on; each worker it moves to
    # starts at or below the mean and keeps it until that one is over the bound in turn, so it
    # goes round the pool rather than back and forth.
    assert len(runs) > 2, "the hot key never left a worker it overloads"
    assert min(len(run) for run in runs[:-1]) >= 2, "the hot key moved after a single job"
    visits = [run[0] for run in runs]
    # So it goes round at least three workers; three or all four, the key's rendezvous order decides
    # (its hash's luck, not pinned: under the route key's hash before issue 38, "hot" took all four
    # and "hot2" three).
    assert all(a != c for a, c in zip(visits, visits[2:])), f"the hot key went back and forth: {visits}"


def _runs(path: list[bytes]):
    run: list[bytes] = []
    for wid in path:
        if run and run[-1] != wid:
            yield run
            run = []
        run.append(wid)
    if run:
        yield run


def test_removing_a_worker_moves_only_its_keys() -> None:
    names = [b"w0", b"w1", b"w2", b"w3", b"w4"]
    r = router(names, capacity=4)
    keys = [session(f"s{i}") for i in range(400)] + [text_key(f"document {i}. " * 200) for i in range(200)]
    before = {}
    for key in keys:
        before[key] = pick(r, key)
        r.finished(before[key])
    r.remove_worker(b"w2")
    after = {}
    for key in keys:
        after[key] = pick(r, key)
        r.finished(after[key])
    moved = [k for k in keys if after[k] != before[k]]
    assert moved and all(before[k] == b"w2" for k in moved)
    assert len(moved) == sum(1 for k in keys if before[k] == b"w2")
    assert r.stats()["spills"] == 0


def test_joining_worker_takes_only_unindexed_keys_it_wins() -> None:
    r = router()
    indexed = [session(f"old{i}") for i in range(200)]
    for key in indexed:
        r.finished(pick(r, key))
    fresh = [session(f"new{i}") for i in range(400)]
    before = {k: r.preferred(k) for k in indexed + fresh}
    r.add_worker(b"w4", 4)
    assert all(r.preferred(k) == before[k] for k in indexed)
    moved = [k for k in fresh if r.preferred(k) != before[k]]
    assert moved and all(r.preferred(k) == b"w4" for k in moved)
    assert 0.1 < len(moved) / len(fresh) < 0.3


def test_removed_worker_in_flight_goes_and_late_finishes_are_ignored() -> None:
    r = router(capacity=4, balance_margin=10)
    for _ in range(3):
        assert pick(r, key_preferring(r, b"w1")) == b"w1"
    r.remove_worker(b"w1")
    assert b"w1" not in r.in_flight() and r.stats()["in_flight"] == 0
    r.finished(b"w1")
    r.finished(b"w0")  # nothing in flight there: no negative count
    assert r.in_flight() == {b"w0": 0, b"w2": 0, b"w3": 0}


def test_rejoined_worker_id_does_not_inherit_its_old_index_entries() -> None:
    r = router([b"a", b"b"], capacity=50, balance_margin=1, balance_factor=1.0)
    key = key_preferring(r, b"a")
    held = []
    while (wid := pick(r, key)) == b"a":
        held.append(wid)
    assert wid == b"b" and r.preferred(key) == b"b"
    for w in held + [wid]:
        r.finished(w)
    r.remove_worker(b"b")
    r.add_worker(b"b", 50)  # a new process under the same id: an empty L1
    assert r.preferred(key) == b"a"  # back to rendezvous, not the stale entry


def test_index_memory_stays_bounded() -> None:
    r = router(capacity=10, index_max_entries=2000)
    texts = [f"prompt {i} " * 400 for i in range(900)]  # 17 blocks each: 2000 entries hold ~120 texts
    tracemalloc.start()
    try:
        for t in texts[:600]:  # several times round the LRU, so the dict has reached its churn size
            r.finished(pick(r, text_key(t)))
        churned, _ = tracemalloc.get_traced_memory()
        assert r.stats()["index_entries"] == 2000
        for t in texts[600:]:
            r.finished(pick(r, text_key(t)))
        later, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert r.stats()["index_entries"] == 2000
    assert churned / 2000 < 250  # bytes per entry, everything the router allocated included
    assert later - churned < 2000 * 5  # entries replaced, not added


def test_index_keeps_the_most_recently_used_prefixes() -> None:
    r = router([b"a", b"b"], capacity=100, index_max_entries=50, balance_factor=1.0, balance_margin=1)
    key = key_preferring(r, b"a")
    pick(r, key)
    pick(r, key)
    moved = pick(r, key)  # a at 2, bound 2 with 3 jobs over 2 workers: spills to b
    assert moved == b"b"
    for w in (b"a", b"a", b"b"):
        r.finished(w)
    for i in range(200):  # churn the index, touching the hot key now and then
        r.finished(pick(r, session(f"churn{i}")))
        if i % 10 == 0:
            r.finished(pick(r, key))
    assert r.stats()["index_entries"] <= 50
    assert r.preferred(key) == b"b"


def test_constructor_rejects_nonsense() -> None:
    with pytest.raises(ValueError):
        Router(balance_factor=0.5)
    with pytest.raises(ValueError):
        Router(balance_margin=-1)
    with pytest.raises(ValueError):
        Router(index_max_entries=0)
    with pytest.raises(ValueError):
        router(capacity=0)
