"""broker/placement.py and broker/catalog.py on their own: socket-free policy, driven with explicit clocks."""

from __future__ import annotations

import pytest

from tokenbroker.broker.catalog import FAILED, LOADING, READY, Catalog
from tokenbroker.broker.placement import Load, Placement, Unload
from tokenbroker.common.config import ModelConfig, ModelSpec
from tokenbroker.common.errors import ProtocolError
from tokenbroker.common.protocol import LoadSpec

W1, W2, W3 = b"w1", b"w2", b"w3"


def never(*_args) -> bool:
    return False


def plan(p: Placement, now: float, models, *, new=(), demand=None, full=never, busy=never):
    return p.plan(now, models=list(models), new=set(new), demand=demand or {}, full=full, busy=busy)


def test_without_a_cap_every_worker_loads_every_model_once():
    p = Placement(0)
    p.add_worker(W1, ["a"], 0.0)
    p.add_worker(W2, [], 0.0)
    assert plan(p, 0.0, ["a", "b"]) == [Load(W1, "b"), Load(W2, "a"), Load(W2, "b")]
    assert plan(p, 0.1, ["a", "b"]) == []  # loads under way are not asked again
    assert p.loaded(W2, "a", 0.2) and p.holders("a") == {W1, W2}
    p.failed(W2, "b", 0.3, refuse=True)  # a source that fails on W2 is not asked of W2 again
    p.loaded(W1, "b", 0.3)
    assert plan(p, 0.4, ["a", "b"]) == []


def test_a_model_with_queued_requests_loads_on_the_emptiest_worker():
    p = Placement(2)
    p.add_worker(W1, ["a"], 0.0)
    p.add_worker(W2, [], 0.0)
    assert plan(p, 1.0, ["a", "b"], demand={"b": 3}) == [Load(W2, "b")]
    assert plan(p, 1.1, ["a", "b"], demand={"b": 3}) == []  # one load at a time per model
    assert not p.holders("b")
    p.loaded(W2, "b", 1.2)
    assert p.holders("b") == {W2}


def test_a_full_worker_lets_its_least_recently_used_idle_model_go():
    p = Placement(2)
    p.add_worker(W1, ["a", "b"], 0.0)
    p.used(W1, "a", 5.0)  # b is the least recently used
    assert plan(p, 6.0, ["a", "b", "c"], demand={"c": 1}) == [Unload(W1, "b"), Load(W1, "c")]
    assert p.holders("b") == frozenset()


def test_a_model_with_a_job_held_or_requests_waiting_for_it_is_not_let_go():
    p = Placement(1)
    p.add_worker(W1, ["a"], 0.0)
    busy = lambda wid, model: model == "a"  # noqa: E731
    assert plan(p, 1.0, ["a", "b"], demand={"b": 1}, busy=busy) == []
    assert plan(p, 1.0, ["a", "b"], demand={"a": 2, "b": 1}) == []  # a's requests wait for W1
    assert plan(p, 1.0, ["a", "b"], demand={"b": 1}) == [Unload(W1, "a"), Load(W1, "b")]


def test_a_never_loaded_model_loads_once_so_its_source_is_checked():
    p = Placement(1)
    p.add_worker(W1, ["a"], 0.0)
    p.add_worker(W2, [], 0.0)
    assert plan(p, 0.0, ["a", "b"], new={"b"}) == [Load(W2, "b")]
    p.loaded(W2, "b", 0.5)
    p.used(W2, "b", 0.5)
    assert plan(p, 1.0, ["a", "b", "c"], new={"c"}) == [Unload(W1, "a"), Load(W1, "c")]


def test_a_replica_is_added_when_every_holder_stays_full_and_idle_ones_go():
    p = Placement(2, replica_after=0.05, idle_after=30.0)
    p.add_worker(W1, ["a"], 0.0)
    p.add_worker(W2, [], 0.0)
    full = lambda wid: wid == W1  # noqa: E731
    assert plan(p, 1.0, ["a"], demand={"a": 9}, full=full) == []  # full only just now
    assert plan(p, 1.06, ["a"], demand={"a": 9}, full=full) == [Load(W2, "a")]
    p.loaded(W2, "a", 1.1)
    p.used(W1, "a", 40.0)
    assert plan(p, 45.0, ["a"]) == [Unload(W2, "a")]  # idle 44 s while W1's replica serves
    assert p.holders("a") == {W1}
    assert plan(p, 100.0, ["a"]) == []  # the last replica stays


def test_a_worker_that_could_not_try_is_asked_again_later_and_a_dead_ones_loads_are_replanned():
    p = Placement(1)
    p.add_worker(W1, [], 0.0)
    assert plan(p, 0.0, ["a"], demand={"a": 1}) == [Load(W1, "a")]
    p.failed(W1, "a", 0.1, retry=True)
    assert plan(p, 0.5, ["a"], demand={"a": 1}) == []
    assert plan(p, 1.2, ["a"], demand={"a": 1}) == [Load(W1, "a")]
    p.remove_worker(W1)
    p.add_worker(W3, [], 2.0)
    assert plan(p, 2.0, ["a"], demand={"a": 1}) == [Load(W3, "a")]


def test_own_models_are_never_let_go_and_removal_waits_for_held_jobs():
    p = Placement(1)
    p.add_worker(W1, [], 0.0, own=["theirs"])
    assert plan(p, 1.0, ["a"], demand={"a": 1}) == []
    p.add_worker(W2, ["a"], 0.0)
    busy = lambda wid, model: wid == W2  # noqa: E731
    assert p.unload_everywhere("a", busy) is None
    assert p.unload_everywhere("a", never) == [Unload(W2, "a")]
    assert not p.holders("a")


def catalog() -> Catalog:
    return Catalog(ModelConfig((ModelSpec("deepseek", "ds", ("default",)), ModelSpec("bert", "bert-dir")),
                               (("bert-*", "bert"), ("*", "deepseek"))))


def test_the_catalog_resolves_names_aliases_and_globs_like_a_worker():
    c = catalog()
    assert c.resolve(None).name == "deepseek" and c.resolve("bert-large").name == "bert"
    assert c.resolve("anything").name == "deepseek" and c.resolve("") is None
    c.entries["bert"].removing = True
    assert c.resolve("bert") is None


def test_the_catalog_adds_refuses_conflicts_retries_failures_and_drops():
    c = catalog()
    entry = c.add(LoadSpec("qwen", "/q", ["qw"]))
    assert entry.state == LOADING and c.resolve("qw") is entry
    assert c.add(LoadSpec("qwen", "/q")) is entry
    with pytest.raises(ProtocolError, match="'name'"):
        c.add(LoadSpec("qwen", "/other"))
    with pytest.raises(ProtocolError, match="'aliases'"):
        c.add(LoadSpec("x", "/x", ["default"]))
    c.failed("qwen", "no such file")
    assert entry.state == FAILED and c.describe({})[-1]["error"] == "no such file"
    assert c.add(LoadSpec("qwen", "/q")).state == LOADING  # added again: retried
    c.loaded("qwen", {"kind": "tiktoken", "vocab_size": 5}, "ab" * 32)
    c.failed("qwen", "a later failure elsewhere")
    assert entry.state == READY  # a model some worker loaded stays ready
    c.drop("qwen")
    assert c.resolve("qw").name == "deepseek"  # the "*" glob now
    assert "qwen" not in {m["name"] for m in c.describe({})}


def test_the_coldest_model_goes_first_and_a_fresh_load_stays_for_its_residency():
    p = Placement(2, min_residency=1.0)
    p.add_worker(W1, [], 0.0)
    for model in ("hot", "cold"):
        assert plan(p, 0.0, [model], demand={model: 1}) == [Load(W1, model)]
        p.loaded(W1, model, 0.1)
    for t in range(20):
        p.used(W1, "hot", 1.0 + t / 100)
    p.used(W1, "cold", 1.5)  # used last, but far less
    assert plan(p, 1.2, ["hot", "cold", "new"], demand={"new": 1}) == [Unload(W1, "cold"), Load(W1, "new")]
    p.loaded(W1, "new", 1.3)
    assert plan(p, 1.8, ["hot", "cold", "new"], demand={"cold": 1}) == []  # "new" has been here 0.5 s only
    assert plan(p, 2.4, ["hot", "cold", "new"], demand={"cold": 1}) == [Unload(W1, "new"), Load(W1, "cold")]
    assert p.heat("hot", 11.2) == pytest.approx(p.heat("hot", 1.2) / 2)  # halves every 10 s


def test_models_with_one_fingerprint_share_a_slot_and_go_together():
    p = Placement(1, min_residency=0.0)
    fps = {"a": "f1", "a2": "f1", "b": "f2"}
    p.add_worker(W1, ["a"], 0.0)
    assert p.plan(1.0, models=["a", "a2", "b"], new=set(), demand={"a2": 1}, full=never, busy=never,
                  fingerprints=fps) == [Load(W1, "a2", share="a")]  # the same tokenizer: no load, no slot
    p.loaded(W1, "a2", 1.0)
    assert p.slots(p.workers[W1]) == 1
    assert p.plan(2.0, models=["a", "a2", "b"], new=set(), demand={"b": 1}, full=never, busy=never,
                  fingerprints=fps) == [Unload(W1, "a"), Unload(W1, "a2"), Load(W1, "b")]


def test_an_overloaded_workers_hottest_model_gets_a_replica_where_jobs_are_fewer():
    p = Placement(3, replica_after=0.05)
    p.add_worker(W1, ["hot", "warm"], 0.0)
    p.add_worker(W2, ["cold"], 0.0)
    for t in range(10):
        p.used(W1, "hot", t / 10)
    p.used(W1, "warm", 0.5)
    jobs = {W1: 30, W2: 2}.get
    args = dict(models=["hot", "warm", "cold"], new=set(), demand={}, full=never, busy=never, jobs=jobs)
    assert p.plan(1.0, **args) == []  # overloaded only just now
    assert p.plan(1.1, **args) == [Load(W2, "hot")]
    p.loaded(W2, "hot", 1.2)
    assert p.plan(1.3, **args) == []  # the hot model is on both: nothing more to spread
    assert p.plan(2.0, **{**args, "jobs": {W1: 10, W2: 9}.get}) == []  # balanced


def test_a_worker_that_loads_gets_no_jobs_of_its_other_models_while_another_holder_is_free():
    p = Placement(3)
    p.add_worker(W1, ["a"], 0.0)
    p.add_worker(W2, ["a"], 0.0)
    assert plan(p, 1.0, ["a", "b"], demand={"b": 1}) == [Load(W1, "b")]
    assert p.holders("a") == {W2} and p.held_by("a") == {W1, W2}  # W1 parses: its GIL is held
    p.loaded(W1, "b", 2.0)
    assert p.holders("a") == {W1, W2}
    p.remove_worker(W2)
    assert plan(p, 3.0, ["a", "b", "c"], demand={"c": 1}) == [Load(W1, "c")]
    assert p.holders("a") == {W1}  # the only holder takes the jobs, loading or not
    p.failed(W1, "c", 3.5)
    assert p.holders("a") == p.held_by("a") == {W1}


def test_a_model_whose_load_was_a_wake_may_give_its_slot_up_sooner():
    p = Placement(1, min_residency=1.0)
    p.add_worker(W1, [], 0.0)
    assert plan(p, 0.0, ["a", "b", "c"], demand={"a": 1}) == [Load(W1, "a")]
    p.loaded(W1, "a", 0.002)  # 2 ms: a forked worker woke the template's copy
    assert plan(p, 0.01, ["a", "b", "c"], demand={"b": 1}) == []  # held 8 ms: under 10 x its load
    assert plan(p, 0.03, ["a", "b", "c"], demand={"b": 1}) == [Unload(W1, "a"), Load(W1, "b")]
    p.loaded(W1, "b", 0.83)  # 0.8 s: a parse
    assert plan(p, 1.5, ["a", "b", "c"], demand={"c": 1}) == []  # min_residency bounds the wait: 1 s, not 8
    assert plan(p, 1.9, ["a", "b", "c"], demand={"c": 1}) == [Unload(W1, "b"), Load(W1, "c")]


def test_a_worker_gets_no_more_tokenizers_than_its_serving_thread_holds_fast_engines():
    """READY's engine_limit bounds a worker's distinct tokenizers below the cap: W1's thread holds two
    fast engines, so under a cap of 4 its third tokenizer goes to W2; models over one tokenizer (the
    same tokenizer fingerprint, other templates) count once and load where its engine is."""
    p = Placement(4)
    p.add_worker(W1, ["a", "b"], 0.0, engine_limit=2)
    p.add_worker(W2, ["x", "y"], 0.0, engine_limit=8)
    tokenizers = {"a": "ta", "b": "tb", "c": "tc", "b-chat": "tb", "x": "tx", "y": "ty"}
    fingerprints = {m: "f-" + m for m in tokenizers}  # every model has a template of its own

    def plan_with(now, demand):
        return p.plan(now, models=list(tokenizers), new=set(), demand=demand, full=never, busy=never,
                      fingerprints=fingerprints, tokenizers=tokenizers)

    assert plan_with(1.0, {"c": 1}) == [Load(W2, "c")]  # W1 has room under the cap, not on its thread
    p.loaded(W2, "c", 1.1)
    assert plan_with(2.0, {"b-chat": 1}) == [Load(W1, "b-chat")]  # b's engine is on W1: no new slot
    p.loaded(W1, "b-chat", 2.1)
    assert p.slots(p.workers[W1]) == 2 and p.room(p.workers[W1]) == 2
