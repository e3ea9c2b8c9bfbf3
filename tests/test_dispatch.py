"""The dispatch policy alone: batching, spill wait, byte limits, one owner of in-flight state. No sockets."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from tokenbroker.broker._dispatch import Dispatcher
from tokenbroker.broker._jobs import Job
from tokenbroker.broker._routekey import route_key
from tokenbroker.broker._router import Router
from tokenbroker.broker.frontend import peek_request
from tokenbroker.broker.placement import Placement
from tokenbroker.common.protocol import Envelope, pack

W1, W2 = b"w1", b"w2"


def dispatcher(*workers: tuple[bytes, int], spill_wait: float = 0.02, worker_bytes: int = 1 << 20,
               **kwargs) -> Dispatcher:
    d = Dispatcher(Router(), spill_wait=spill_wait, worker_bytes=worker_bytes, **kwargs)
    for wid, capacity in workers:
        d.add_worker(wid, capacity)
    return d


_ids = iter(range(1, 1 << 30))


def job(text: str = "x", *, now: float = 0.0, size: int = 0, affinity: str | None = None) -> Job:
    payload = {"op": "tokenize", "text": text + " " * size}
    if affinity is not None:
        payload["affinity"] = affinity
    peek = peek_request(pack(payload))
    return Job(next(_ids), Envelope(b"c", True), b"\xc0", peek.raw, peek.op, route_key(peek),
               received=now, deadline=now + 30, queued=now)


def placed(batches: list[tuple[bytes, list[Job]]]) -> dict[bytes, list[int]]:
    return {wid: [j.job_id for j in jobs] for wid, jobs in batches}


def test_one_turn_sends_each_worker_one_batch_of_everything_that_fits():
    d = dispatcher((W1, 8), (W2, 8))
    jobs = [job(f"text {i}") for i in range(12)]
    for j in jobs:
        d.enqueue(j)
    batches = d.assign(now=1.0)
    assert len(batches) == 2 and len({wid for wid, _ in batches}) == 2
    assert sorted(i for ids in placed(batches).values() for i in ids) == sorted(j.job_id for j in jobs)
    assert d.waiting == 0 and all(j.worker is not None and j.attempts == 1 for j in jobs)


def test_nothing_is_assigned_and_no_timer_runs_when_every_worker_is_full():
    d = dispatcher((W1, 2))
    for i in range(5):
        d.enqueue(job(f"t{i}"))
    assert len(placed(d.assign(now=0.0))[W1]) == 2
    assert d.assign(now=10.0) == [] and d.waiting == 3
    assert d.next_timer(now=10.0) is None  # only an answer can help: the loop sleeps until one comes


def test_an_answer_frees_its_slot_for_the_next_job():
    d = dispatcher((W1, 1))
    a, b = job("a"), job("b")
    d.enqueue(a)
    d.enqueue(b)
    assert placed(d.assign(0.0)) == {W1: [a.job_id]}
    assert d.finish(W1, a.job_id) is a and a.worker is None
    assert placed(d.assign(0.0)) == {W1: [b.job_id]}


def test_a_forged_or_late_answer_finishes_nothing():
    d = dispatcher((W1, 4), (W2, 4))
    a = job("a")
    d.enqueue(a)
    (wid, _), = d.assign(0.0)
    other = W2 if wid == W1 else W1
    assert d.finish(other, a.job_id) is None  # not that worker's job
    assert d.finish(wid, 12345) is None  # no such job
    assert d.held(wid) == 1


def test_a_job_waits_for_its_busy_preferred_worker_until_the_spill_time():
    d = dispatcher((W1, 1), (W2, 1), spill_wait=0.02)
    home = job("conversation", affinity="s")
    d.enqueue(home)
    (wid, _), = d.assign(0.0)
    other = W2 if wid == W1 else W1
    again = job("conversation", affinity="s", now=0.001)
    d.enqueue(again)
    assert d.assign(0.005) == []  # its worker is full but within the bound: it waits
    assert d.next_timer(0.005) == 0.001 + 0.02  # ... and the loop wakes when it may spill
    assert placed(d.assign(0.03)) == {other: [again.job_id]}


def test_a_huge_job_holds_up_only_its_own_worker():
    d = dispatcher((W1, 8), (W2, 8), worker_bytes=1000)
    big = job("big", size=5000)
    d.enqueue(big)
    (wid, _), = d.assign(0.0)
    small = [job(f"small {i}") for i in range(6)]
    for j in small:
        d.enqueue(j)
    other = W2 if wid == W1 else W1
    assert {wid: sorted(ids) for wid, ids in placed(d.assign(0.1)).items()} == {other: [j.job_id for j in small]}
    assert d.held(wid) == 1


def test_a_gone_worker_hands_back_what_it_held():
    d = dispatcher((W1, 4))
    jobs = [job(f"t{i}") for i in range(3)]
    for j in jobs:
        d.enqueue(j)
    d.assign(0.0)
    lost = d.remove_worker(W1)
    assert sorted(j.job_id for j in lost) == sorted(j.job_id for j in jobs)
    assert all(j.worker is None for j in lost) and d.next_timer(0.0) is None
    for j in lost:
        d.requeue(j)
    d.add_worker(W2, 4)
    assert sorted(placed(d.assign(1.0))[W2]) == sorted(j.job_id for j in jobs)
    assert all(j.attempts == 2 for j in jobs)


def test_a_draining_worker_gets_nothing_new_and_finishes_what_it_holds():
    d = dispatcher((W1, 4), (W2, 4))
    a = job("a", affinity="k")
    d.enqueue(a)
    (wid, _), = d.assign(0.0)
    d.drain_worker(wid)
    b = job("b", affinity="k")
    d.enqueue(b)
    other = W2 if wid == W1 else W1
    assert placed(d.assign(1.0)) == {other: [b.job_id]}
    assert d.finish(wid, a.job_id) is a and d.held(wid) == 0


def test_expired_queued_jobs_leave_the_count_and_are_skipped():
    d = dispatcher((W1, 1))
    first = job("first")
    d.enqueue(first)
    d.assign(0.0)
    stale = [job(f"s{i}") for i in range(200)]
    for j in stale:
        d.enqueue(j)
    for j in stale[:150]:
        j.answered = True
        d.dequeued(j)
    assert d.waiting == 50
    d.finish(W1, first.job_id)
    assert placed(d.assign(1.0)) == {W1: [stale[150].job_id]}


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), capacities=st.lists(st.integers(1, 6), min_size=1, max_size=4))
def test_the_router_reads_each_workers_load_from_its_slots(seed: int, capacities: list[int]) -> None:
    """Random arrivals, answers, deaths and drains: the load the router sees is the slots' own
    count, no worker holds more than its capacity, and every job is queued, held, or answered once."""
    rng = random.Random(seed)
    d = dispatcher(*((b"w%d" % i, c) for i, c in enumerate(capacities)))
    live = {b"w%d" % i for i in range(len(capacities))}
    answered: set[int] = set()
    all_jobs: list[Job] = []
    now = 0.0
    for step in range(300):
        now += rng.random() * 0.01
        r = rng.random()
        if r < 0.45:
            j = job(f"conv {rng.randrange(8)}", now=now, affinity=rng.choice([None, "a", "b"]))
            all_jobs.append(j)
            d.enqueue(j)
        elif r < 0.85:
            held = [(wid, jid) for wid, s in d.workers.items() for jid in s.jobs]
            if held:
                wid, jid = rng.choice(held)
                j = d.finish(wid, jid)
                assert j is not None and j.job_id not in answered
                answered.add(j.job_id)
                j.answered = True
        elif r < 0.92 and len(live) > 1:
            wid = rng.choice(sorted(live))
            live.discard(wid)
            for j in d.remove_worker(wid):
                d.requeue(j)
        elif r < 0.96:
            wid = b"n%d" % step
            live.add(wid)
            d.add_worker(wid, rng.randint(1, 6))
        d.assign(now)
        seen = {wid: w.load for wid, w in d.router._workers.items()}
        for wid, slots in d.workers.items():
            assert len(slots.jobs) <= slots.capacity
            if not slots.draining:
                assert seen[wid] is slots and seen[wid].held == len(slots.jobs)
            assert all(j.worker == wid for j in slots.jobs.values())
        queued = {j.job_id for j in d.pending if not j.answered}
        held = {jid for s in d.workers.values() for jid in s.jobs}
        assert not queued & held and not (queued | held) & answered
        assert queued | held | answered == {j.job_id for j in all_jobs}
        assert d.waiting == len(queued)


def test_a_job_goes_only_to_the_workers_holding_its_model_and_does_not_hold_up_others():
    p = Placement(0)
    d = dispatcher((W1, 1), (W2, 4), eligible=p.eligible)
    p.add_worker(W1, [], 0.0, names=["bert"])
    p.add_worker(W2, [], 0.0, names=["deepseek", "default"], globs=["gpt-*"])
    bert = [job(f"b{i}") for i in range(3)]
    for j in bert:
        j.model = "bert"
    other = [job(f"d{i}") for i in range(3)]
    other[0].model, other[1].model = "deepseek", "gpt-4o"
    for j in (*bert, *other):
        d.enqueue(j)
    placed_now = placed(d.assign(now=1.0))
    assert placed_now[W1] == [bert[0].job_id]  # one slot: the other bert jobs wait for it...
    assert sorted(placed_now[W2]) == sorted(j.job_id for j in other)  # ...without holding these up
    assert d.next_timer(now=1.0) is None  # only W1's answer can help them: no timer, no spin
    d.finish(W1, bert[0].job_id)
    assert placed(d.assign(now=1.1)) == {W1: [bert[1].job_id]}


def test_a_model_no_worker_holds_goes_anywhere_and_the_worker_says_so():
    p = Placement(0)
    d = dispatcher((W1, 4), eligible=p.eligible)
    p.add_worker(W1, [], 0.0, names=["bert"])
    j = job("x")
    j.model = "nope"
    d.enqueue(j)
    assert placed(d.assign(0.0)) == {W1: [j.job_id]}
