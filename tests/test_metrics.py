"""PoolMetrics as a pure object: the exposition it builds from snapshots and worker reports.

These run no broker: they publish snapshots as the loop does and read the registry back with
prometheus-client's own parser. test_metrics_e2e.py checks the same claims against a real pool.
"""

from __future__ import annotations

import shutil
import subprocess
import urllib.request

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tokenbroker.broker.metrics import CACHE_LAYERS, PoolMetrics
from tokenbroker.broker.snapshot import PoolSnapshot, WorkerView

PROMTOOL = shutil.which("promtool")


def report(incarnation: str, *, served: int = 0, rss: int = 0, **layers: dict) -> dict:
    """A heartbeat body as workers/main.py sends it."""
    caches = {layer: {"hits": 0, "misses": 0, "evictions": 0, "reused_bytes": 0, "entries": 0, "bytes": 0,
                      **layers.get(layer, {})} for layer in CACHE_LAYERS}
    return {"incarnation": incarnation, "pid": 1, "rss": rss, "served": served, "caches": caches}


def worker(name: str, rep: dict, *, state: str = "idle", in_flight: int = 0) -> WorkerView:
    return WorkerView(name=name, host="h", pid=rep.get("pid", 0), state=state, in_flight=in_flight, capacity=4, report=rep)


def snapshot(*workers: WorkerView, restarts: int = 0) -> PoolSnapshot:
    return PoolSnapshot(restarts=restarts, workers=workers)


def scrape(m: PoolMetrics) -> dict[tuple[str, frozenset], float]:
    """Every sample of one scrape, parsed by prometheus-client's parser."""
    text = generate_latest(m.registry).decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def lookups(samples: dict, layer: str, result: str) -> float:
    return samples[("smg_tokenizer_cache_lookups_total", frozenset({("layer", layer), ("result", result)}))]


def names(samples: dict) -> set[str]:
    return {name for name, _ in samples}


def test_every_cache_series_exists_with_zeros_before_any_worker_reports():
    samples = scrape(PoolMetrics())
    for layer in CACHE_LAYERS:
        for result in ("hit", "miss"):
            assert lookups(samples, layer, result) == 0
        assert samples[("smg_tokenizer_cache_evictions_total", frozenset({("layer", layer)}))] == 0
        assert samples[("smg_tokenizer_cache_reused_bytes_total", frozenset({("layer", layer)}))] == 0
    assert samples[("smg_allocator_allocated_bytes", frozenset())] > 0  # the broker's own memory


def test_disabled_layer_reports_zeros_when_workers_send_no_stats_for_it():
    m = PoolMetrics()
    rep = report("a", l0={"hits": 4, "misses": 1})
    del rep["caches"]["l1"]
    m.publish(snapshot(worker("w1", rep)))
    samples = scrape(m)
    assert lookups(samples, "l0", "hit") == 4
    assert lookups(samples, "l1", "hit") == 0 and lookups(samples, "l1", "miss") == 0


def test_counters_sum_workers_and_memory_sums_the_broker_and_workers():
    m = PoolMetrics()
    m.publish(snapshot(worker("w1", report("a", rss=1000, served=3, l0={"hits": 2, "misses": 1, "reused_bytes": 10})),
                       worker("w2", report("b", rss=2000, served=5, l0={"hits": 1, "misses": 4, "reused_bytes": 7},
                                           l1={"hits": 1, "misses": 3, "reused_bytes": 40, "entries": 6, "bytes": 900})),
                       restarts=2))
    s = scrape(m)
    assert lookups(s, "l0", "hit") == 3 and lookups(s, "l0", "miss") == 5
    assert lookups(s, "l1", "hit") == 1 and lookups(s, "l1", "miss") == 3
    assert s[("smg_tokenizer_cache_reused_bytes_total", frozenset({("layer", "l0")}))] == 17
    assert s[("tokenbroker_cache_entries", frozenset({("layer", "l1")}))] == 6
    assert s[("tokenbroker_cache_bytes", frozenset({("layer", "l1")}))] == 900
    assert s[("tokenbroker_worker_jobs_total", frozenset())] == 8
    assert s[("tokenbroker_worker_restarts_total", frozenset())] == 2
    memory = {dict(k)["process"]: v for (n, k), v in s.items() if n == "tokenbroker_process_resident_memory_bytes"}
    assert memory["w1"] == 1000 and memory["w2"] == 2000 and memory["broker"] > 0
    assert s[("smg_allocator_allocated_bytes", frozenset())] == sum(memory.values())


def test_proportional_memory_sums_each_process_once_and_falls_back_to_rss():
    m = PoolMetrics()
    with_pss = {**report("a", rss=5000), "pss": 1500}
    m.publish(snapshot(worker("w1", with_pss), worker("w2", report("b", rss=2000)), worker("w3", report("c"))))
    s = scrape(m)
    pss = {dict(k)["process"]: v for (n, k), v in s.items() if n == "tokenbroker_process_proportional_memory_bytes"}
    assert pss["w1"] == 1500 and "w2" not in pss and "w3" not in pss and pss["broker"] > 0
    # w2 reports no PSS (an older or non-Linux worker): its RSS counts; w3 has sent no memory yet.
    assert s[("tokenbroker_pool_proportional_memory_bytes", frozenset())] == sum(pss.values()) + 2000


def test_lane_reports_are_exported_per_worker_and_lane():
    m = PoolMetrics()
    lanes = {"render": {"pending": 1, "wedged": 1, "replaced": 2}, "encode": {"pending": 0, "wedged": 0, "replaced": 0}}
    m.publish(snapshot(worker("w1", {**report("a"), "lanes": lanes}), worker("w2", {**report("b"), "lanes": "junk"})))
    s = scrape(m)
    assert s[("tokenbroker_worker_lane_wedged", frozenset({("worker", "w1"), ("lane", "render")}))] == 1
    assert s[("tokenbroker_worker_lane_replaced", frozenset({("worker", "w1"), ("lane", "render")}))] == 2
    assert s[("tokenbroker_worker_lane_jobs", frozenset({("worker", "w1"), ("lane", "render")}))] == 1
    assert not [k for k in s if k[0].startswith("tokenbroker_worker_lane") and ("worker", "w2") in k[1]]


def test_departed_worker_keeps_its_counts_and_loses_its_gauges():
    m = PoolMetrics()
    last = report("a", rss=1000, l0={"hits": 5, "misses": 2, "evictions": 1, "entries": 3})
    m.publish(snapshot(worker("w1", last, in_flight=2)))
    before = scrape(m)
    m.worker_left("w1", last)
    m.publish(snapshot())
    after = scrape(m)
    assert lookups(after, "l0", "hit") == lookups(before, "l0", "hit") == 5
    assert after[("smg_tokenizer_cache_evictions_total", frozenset({("layer", "l0")}))] == 1
    assert ("tokenbroker_worker_in_flight", frozenset({("worker", "w1")})) in before
    assert not [k for k in after if ("worker", "w1") in k[1] or ("process", "w1") in k[1]]
    assert after[("tokenbroker_cache_entries", frozenset({("layer", "l0")}))] == 0


def test_worker_that_left_but_is_still_in_the_last_snapshot_is_counted_once():
    m = PoolMetrics()
    last = report("a", l0={"hits": 5})
    m.publish(snapshot(worker("w1", report("a", l0={"hits": 4}))))
    m.worker_left("w1", last)  # the loop calls this before its next publish
    assert lookups(scrape(m), "l0", "hit") == 5


def test_repeated_and_stale_reports_are_not_counted_twice():
    m = PoolMetrics()
    m.publish(snapshot(worker("w1", report("a", l0={"hits": 3}))))
    scrape(m)
    m.publish(snapshot(worker("w1", report("a", l0={"hits": 3}))))
    scrape(m)
    m.publish(snapshot(worker("w1", report("a", l0={"hits": 2}))))  # out of order: never lowers the count
    assert lookups(scrape(m), "l0", "hit") == 3


def test_reconnecting_worker_with_the_same_incarnation_continues_its_counts():
    m = PoolMetrics()
    m.publish(snapshot(worker("remote", report("a", l0={"hits": 3}))))
    scrape(m)
    m.worker_left("remote", report("a", l0={"hits": 3}))
    m.publish(snapshot(worker("remote", report("a", l0={"hits": 7}))))
    assert lookups(scrape(m), "l0", "hit") == 7


def test_replacement_worker_adds_to_the_dead_ones_counts():
    m = PoolMetrics()
    m.worker_left("w1.1", report("a", l0={"hits": 3}))
    m.publish(snapshot(worker("w1.2", report("b", l0={"hits": 1}))))
    assert lookups(scrape(m), "l0", "hit") == 4


def test_departed_incarnations_beyond_the_kept_number_fold_into_the_baseline():
    m = PoolMetrics(retired_keep=2)
    for i in range(10):
        m.worker_left(f"w{i}", report(f"inc{i}", l0={"misses": i}))
    m.publish(snapshot(worker("live", report("live", l0={"misses": 100}))))
    assert lookups(scrape(m), "l0", "miss") == sum(range(10)) + 100
    assert len(m._ledger._by_incarnation) <= 3  # bounded memory: 2 departed + 1 live


def test_worker_left_before_its_first_heartbeat_counts_nothing():
    m = PoolMetrics()
    m.worker_left("w1", {})
    assert lookups(scrape(m), "l0", "miss") == 0


def test_request_counts_and_latency_by_op():
    m = PoolMetrics()
    for seconds in (0.0002, 0.003, 0.003):
        m.request_done("tokenize", "ok", seconds)
    m.request_done("tokenize", "timeout", 1.5)
    m.request_done("invalid", "bad_request", 0.0)
    r = m.registry
    assert r.get_sample_value("tokenbroker_requests_total", {"op": "tokenize", "outcome": "ok"}) == 3
    assert r.get_sample_value("tokenbroker_requests_total", {"op": "tokenize", "outcome": "timeout"}) == 1
    assert r.get_sample_value("tokenbroker_requests_total", {"op": "invalid", "outcome": "bad_request"}) == 1
    assert r.get_sample_value("tokenbroker_request_duration_seconds_count", {"op": "tokenize"}) == 4
    assert r.get_sample_value("tokenbroker_request_duration_seconds_bucket", {"op": "tokenize", "le": "0.005"}) == 3


def test_workers_by_state_always_lists_every_state():
    m = PoolMetrics()
    m.publish(snapshot(worker("w1", report("a"), state="busy", in_flight=3), worker("w2", report("b"))))
    s = scrape(m)
    states = {dict(k)["state"]: v for (n, k), v in s.items() if n == "tokenbroker_workers"}
    assert states == {"idle": 1, "busy": 1, "draining": 0}
    assert s[("tokenbroker_worker_in_flight", frozenset({("worker", "w1")}))] == 3


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["bump", "publish", "scrape", "leave", "rejoin", "join"]),
                          st.integers(0, 5), st.integers(1, 50)), max_size=40))
def test_counters_never_fall_and_end_at_every_incarnations_latest_count(events):
    """Any order of reports, departures, rejoins and scrapes: totals only grow, and end exact."""
    m = PoolMetrics()
    latest: dict[str, int] = {"inc0": 0}  # incarnation -> its cumulative L0 hits
    live = {"inc0"}
    previous = 0.0
    for kind, pick, amount in events:
        ordered = sorted(latest)
        inc = ordered[pick % len(ordered)]
        if kind == "bump" and inc in live:
            latest[inc] += amount
        elif kind == "publish":
            m.publish(snapshot(*(worker(i, report(i, l0={"hits": latest[i]})) for i in sorted(live))))
        elif kind == "leave" and inc in live:
            live.discard(inc)
            m.worker_left(inc, report(inc, l0={"hits": latest[inc]}))
        elif kind == "rejoin" and inc not in live:
            live.add(inc)
        elif kind == "join":
            new = f"inc{len(latest)}"
            latest[new] = 0
            live.add(new)
        elif kind == "scrape":
            now = lookups(scrape(m), "l0", "hit")
            assert now >= previous
            previous = now
    m.publish(snapshot(*(worker(i, report(i, l0={"hits": latest[i]})) for i in sorted(live))))
    final = lookups(scrape(m), "l0", "hit")
    assert final >= previous
    assert final == sum(latest.values())


def test_exporter_serves_the_exposition_over_http():
    m = PoolMetrics()
    m.request_done("ping", "ok", 0.0001)
    url = m.serve("127.0.0.1", 0)
    try:
        text = urllib.request.urlopen(url, timeout=10).read().decode()
    finally:
        m.close()
    families = {f.name for f in text_string_to_metric_families(text)}
    assert {"tokenbroker_requests", "smg_tokenizer_cache_lookups", "smg_allocator_allocated_bytes"} <= families


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (Debian: apt-get install prometheus)")
def test_promtool_finds_no_problem_in_the_exposition():
    m = PoolMetrics()
    m.request_done("tokenize", "ok", 0.001)
    m.request_done("invalid", "bad_request", 0.0)
    m.publish(snapshot(worker("w1", report("a", rss=10, l0={"hits": 1}, l1={"misses": 1}), state="busy", in_flight=1)))
    text = generate_latest(m.registry)
    done = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True, timeout=30)
    assert done.returncode == 0 and not done.stdout.strip() and not done.stderr.strip(), done.stdout + done.stderr


def test_worker_without_a_heartbeat_yet_shows_no_memory_rather_than_zero():
    m = PoolMetrics()
    m.publish(snapshot(worker("new", {}), worker("old", report("a", rss=5000))))
    s = scrape(m)
    memory = {dict(k)["process"]: v for (n, k), v in s.items() if n == "tokenbroker_process_resident_memory_bytes"}
    assert set(memory) == {"broker", "old"}
    assert s[("smg_allocator_allocated_bytes", frozenset())] == memory["broker"] + 5000
    assert s[("tokenbroker_worker_in_flight", frozenset({("worker", "new")}))] == 0
