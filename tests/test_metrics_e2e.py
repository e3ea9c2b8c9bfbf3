"""The exporter of a real pool: known traffic in, prometheus-client's parser on the scrape out.

One broker for the module (two local workers, L0 capped at 2 entries so evictions are known, L1 on,
a TCP backend so a remote worker can join and leave). Worker stats ride on heartbeats (<= 1 s lag):
every check polls the scrape until it settles.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import urllib.request

import pytest
from helpers import Conn, Samples, free_port, sample, scrape, series, start_broker, wait_until

PROMTOOL = shutil.which("promtool")
CACHE_FLAGS = ("--tokenizer-cache-enable-l0", "--tokenizer-cache-l0-max-entries", "2", "--tokenizer-cache-enable-l1")
BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
SYSTEM = f"{BOS}You are terse. {'Keep every answer short. ' * 24}{EOS}"  # past L1's MIN_PREFIX (512 characters)
PLAIN, OTHER = "plain words and no special tokens at all", "another plain text"
FIRST, SECOND = SYSTEM + "first question", SYSTEM + "second question"
AFFINITY = "metrics-session"  # pins the known traffic on one worker, whose caches it then fills
COUNTERS = ("smg_tokenizer_cache_lookups_total", "smg_tokenizer_cache_evictions_total",
            "smg_tokenizer_cache_reused_bytes_total", "tokenbroker_requests_total",
            "tokenbroker_worker_restarts_total", "tokenbroker_worker_jobs_total")

def cache_counts(s: Samples) -> dict[str, float]:
    out = {}
    for layer in ("l0", "l1"):
        out[f"{layer}.hit"] = sample(s, "smg_tokenizer_cache_lookups_total", layer=layer, result="hit")
        out[f"{layer}.miss"] = sample(s, "smg_tokenizer_cache_lookups_total", layer=layer, result="miss")
        out[f"{layer}.evictions"] = sample(s, "smg_tokenizer_cache_evictions_total", layer=layer)
        out[f"{layer}.reused"] = sample(s, "smg_tokenizer_cache_reused_bytes_total", layer=layer)
    return out


def query_hit_ratio(s: Samples, layer: str) -> float:
    """The README query over a window spanning the broker's life (counters start at 0):
    sum by (layer) (rate(..{result="hit"}[w])) / sum by (layer) (rate(..[w])) = hits / lookups."""
    mine = {labels: v for labels, v in series(s, "smg_tokenizer_cache_lookups_total").items() if ("layer", layer) in labels}
    return sum(v for labels, v in mine.items() if ("result", "hit") in labels) / sum(mine.values())


def assert_not_lower(before: Samples, after: Samples) -> None:
    for key, v in before.items():
        if key[0] in COUNTERS:
            assert after.get(key, 0.0) >= v, f"{key} fell from {v} to {after.get(key)}"


@pytest.fixture(scope="module")
def pool():
    backend = f"tcp://127.0.0.1:{free_port()}"
    broker = start_broker("--metrics-port", str(free_port()), "--backend", backend, *CACHE_FLAGS, workers=2)
    broker.backend = backend
    yield broker
    broker.stop()


@pytest.fixture(scope="module")
def traffic(pool):
    """Sends the known traffic once; returns (scrape before, expected increases, the serving worker's name)."""
    before = scrape(pool.metrics)
    c = Conn(pool.endpoint)
    try:
        replies = [c.call("tokenize", text=t, affinity=AFFINITY) for t in (PLAIN, PLAIN, PLAIN, FIRST, SECOND)]
        replies.append(c.call("tokenize", text=[FIRST, OTHER], affinity=AFFINITY))  # a batch: one lookup per text
    finally:
        c.close()
    assert all(r["ok"] for r in replies), replies
    assert len({r["worker"] for r in replies}) == 1, "the affinity key should pin the session on one worker"
    assert [r["cache"]["l0"] for r in replies[:5]] == ["miss", "hit", "hit", "miss", "miss"]
    assert replies[4]["cache"]["l1_reused_tokens"] > 0  # SECOND reused FIRST's system prompt from L1
    n = len(SYSTEM.encode())
    # L0 (2 entries): PLAIN miss, hit, hit; FIRST miss; SECOND miss evicts PLAIN; FIRST hit; OTHER miss evicts SECOND.
    # L1 sees only L0 misses: PLAIN and OTHER (no special tokens) miss, FIRST misses, SECOND hits on SYSTEM.
    expected = {"l0.hit": 3, "l0.miss": 4, "l0.evictions": 2, "l0.reused": 2 * len(PLAIN.encode()) + len(FIRST.encode()),
                "l1.hit": 1, "l1.miss": 3, "l1.evictions": 0, "l1.reused": n}
    return before, expected, replies[0]["worker"]


def settled(pool, before: Samples, expected: dict[str, float]) -> Samples:
    """Poll the scrape until the cache counters moved by exactly `expected` since `before`."""
    base = cache_counts(before)

    def check():
        s = scrape(pool.metrics)
        return s if {k: v - base[k] for k, v in cache_counts(s).items()} == expected else None

    return wait_until(check, timeout=20, what=f"cache counters to move by {expected}")


def test_scrape_after_known_traffic_counts_lookups_hits_evictions_and_reused_bytes(pool, traffic):
    before, expected, _ = traffic
    s = settled(pool, before, expected)
    assert sample(s, "tokenbroker_requests_total", op="tokenize", outcome="ok") - \
        before.get(("tokenbroker_requests_total", frozenset({("op", "tokenize"), ("outcome", "ok")})), 0) == 6
    assert sample(s, "tokenbroker_request_duration_seconds_count", op="tokenize") >= 6
    assert sample(s, "tokenbroker_request_duration_seconds_bucket", op="tokenize", le="+Inf") >= 6


def test_every_series_exists_with_its_labels(pool, traffic):
    s = settled(pool, traffic[0], traffic[1])
    for layer in ("l0", "l1"):
        for result in ("hit", "miss"):
            sample(s, "smg_tokenizer_cache_lookups_total", layer=layer, result=result)
        for name in ("smg_tokenizer_cache_evictions_total", "smg_tokenizer_cache_reused_bytes_total",
                     "tokenbroker_cache_entries", "tokenbroker_cache_bytes"):
            sample(s, name, layer=layer)
    assert sample(s, "tokenbroker_cache_entries", layer="l0") == 2  # the capped L0 of the serving worker
    assert sample(s, "tokenbroker_cache_bytes", layer="l1") > 0
    for name in ("tokenbroker_queue_depth", "tokenbroker_requests_held", "tokenbroker_worker_restarts_total",
                 "tokenbroker_worker_jobs_total", "smg_allocator_allocated_bytes", "tokenbroker_start_time_seconds"):
        sample(s, name)
    assert {dict(k)["state"] for k in series(s, "tokenbroker_workers")} == {"idle", "busy", "draining"}
    workers = {dict(k)["worker"] for k in series(s, "tokenbroker_worker_in_flight")}
    assert len(workers) == 2

    def memory_of_all():  # a worker's memory shows from its first heartbeat on
        s = scrape(pool.metrics)
        memory = {dict(k)["process"]: v for k, v in series(s, "tokenbroker_process_resident_memory_bytes").items()}
        return (s, memory) if set(memory) == workers | {"broker"} else None

    s, memory = wait_until(memory_of_all, timeout=10, what="every worker's memory")
    assert all(v > 0 for v in memory.values()), memory
    assert sample(s, "smg_allocator_allocated_bytes") == sum(memory.values())
    # PSS (workers read it every few seconds): each worker's is below its RSS (forked workers share
    # the template's pages), and the pool's PSS sum below the RSS sum.
    def pss_of_all():
        s = scrape(pool.metrics)
        pss = {dict(k)["process"]: v for k, v in series(s, "tokenbroker_process_proportional_memory_bytes").items()}
        return (s, pss) if workers <= set(pss) else None

    s, pss = wait_until(pss_of_all, timeout=15, what="every worker's PSS")
    memory = {dict(k)["process"]: v for k, v in series(s, "tokenbroker_process_resident_memory_bytes").items()}
    assert all(0 < pss[w] < memory[w] for w in workers), (pss, memory)
    assert sample(s, "tokenbroker_pool_proportional_memory_bytes") == sum(pss.values())
    assert sample(s, "tokenbroker_pool_proportional_memory_bytes") < sample(s, "smg_allocator_allocated_bytes")
    pids = {int(dict(k)["pid"]) for k in series(s, "tokenbroker_worker_info")}
    assert pids == set(pool.worker_pids())


def test_top_once_shows_the_hit_ratios_the_query_computes(pool, traffic):
    s = settled(pool, traffic[0], traffic[1])
    done = subprocess.run([sys.executable, "-m", "tokenbroker", "top", "--once", "--url", pool.metrics],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    now = scrape(pool.metrics)  # nothing moved since `s`: top saw the same counters
    assert all(now[k] == v for k, v in s.items() if k[0] == "smg_tokenizer_cache_lookups_total")
    rows = {line.split()[0]: line.split() for line in done.stdout.splitlines() if line.split()[:1] in (["l0"], ["l1"])}
    for layer in ("l0", "l1"):
        assert float(rows[layer][1]) == pytest.approx(query_hit_ratio(s, layer), abs=0.0005)
    worker_rows = [line for line in done.stdout.splitlines() if line.startswith(("broker", "local"))]
    assert len(worker_rows) == 3 and "tokenize" in done.stdout


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (Debian: apt-get install prometheus)")
def test_promtool_finds_no_problem_in_the_live_exposition(pool, traffic):
    settled(pool, traffic[0], traffic[1])
    text = urllib.request.urlopen(pool.metrics, timeout=10).read()
    done = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True, timeout=30)
    assert done.returncode == 0 and not done.stdout.strip() and not done.stderr.strip(), done.stdout + done.stderr


HIT_RATIO_QUERY = ('sum by (layer) (rate(smg_tokenizer_cache_lookups_total{result="hit"}[5m]))'
                   ' / sum by (layer) (rate(smg_tokenizer_cache_lookups_total[5m]))')
EVICTION_QUERY = 'rate(smg_tokenizer_cache_evictions_total{layer="l0"}[5m])'


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (Debian: apt-get install prometheus)")
def test_the_operators_queries_run_as_written_on_the_live_series(pool, traffic, tmp_path):
    """PromQL itself (promtool test rules) evaluates both queries on the scraped series, replayed as
    five minutes from zero at broker start to the scraped values: the answers are hits / lookups and
    evictions / 300 s, what `top --once` shows."""
    s = settled(pool, traffic[0], traffic[1])
    watched = ("smg_tokenizer_cache_lookups_total", "smg_tokenizer_cache_evictions_total")
    inputs = [{"series": name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels)) + "}", "values": f"0 0 0 0 0 {v:g}"}
              for (name, labels), v in sorted(s.items(), key=repr) if name in watched]
    expected = [
        {"expr": HIT_RATIO_QUERY, "eval_time": "5m",
         "exp_samples": [{"labels": f'{{layer="{layer}"}}', "value": query_hit_ratio(s, layer)} for layer in ("l0", "l1")]},
        {"expr": EVICTION_QUERY, "eval_time": "5m",
         "exp_samples": [{"labels": '{layer="l0"}', "value": sample(s, "smg_tokenizer_cache_evictions_total", layer="l0") / 300}]},
    ]
    spec = tmp_path / "queries.yml"  # JSON is YAML
    spec.write_text(json.dumps({"rule_files": [], "evaluation_interval": "1m",
                                "tests": [{"interval": "1m", "input_series": inputs, "promql_expr_test": expected}]}))
    done = subprocess.run([PROMTOOL, "test", "rules", str(spec)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stdout + done.stderr


def test_counters_never_fall_when_a_worker_is_killed_or_a_remote_worker_leaves(pool, traffic):
    last = settled(pool, traffic[0], traffic[1])
    kept = cache_counts(last)
    victim = traffic[2]  # the worker whose caches hold all the counts
    info = {dict(k)["worker"]: int(dict(k)["pid"]) for k in series(last, "tokenbroker_worker_info")}
    remote = subprocess.Popen([sys.executable, "-m", "tokenbroker", "worker", "--connect", pool.backend,
                               "--name", "remote-metrics", *CACHE_FLAGS],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # boots while the victim is replaced
    try:
        os.kill(info[victim], signal.SIGKILL)

        def replaced():
            nonlocal last
            s = scrape(pool.metrics)
            assert_not_lower(last, s)
            last = s
            local = {dict(k)["worker"] for k in series(s, "tokenbroker_worker_in_flight")} - {"remote-metrics"}
            return victim not in local and len(local) == 2 and sample(s, "tokenbroker_worker_restarts_total") >= 1

        wait_until(replaced, timeout=30, what="the killed worker replaced")
        assert cache_counts(last) == kept  # the dead worker's counts stayed; no traffic went elsewhere since
        assert not [k for k in series(last, "tokenbroker_process_resident_memory_bytes") if ("process", victim) in k]

        wait_until(lambda: ("tokenbroker_worker_in_flight", frozenset({("worker", "remote-metrics")})) in scrape(pool.metrics),
                   timeout=30, what="the remote worker to join")
        c = Conn(pool.endpoint)
        try:
            sent = remote_got = 0
            while remote_got < 3 and sent < 60:  # distinct keys spread over the three workers
                r = c.call("tokenize", text=f"remote text {sent}", affinity=f"remote-{sent}")
                remote_got += r["worker"] == "remote-metrics"
                sent += 1
        finally:
            c.close()
        assert remote_got >= 3
        # Each distinct plain text: one L0 miss, then one L1 miss (no special tokens), wherever it ran;
        # L0 evictions depend on how the texts spread over the 2-entry caches, so they are left out.
        expected = {**kept, "l0.miss": kept["l0.miss"] + sent, "l1.miss": kept["l1.miss"] + sent}
        del expected["l0.evictions"]

        def lookups(s: Samples) -> dict[str, float]:
            return {k: v for k, v in cache_counts(s).items() if k != "l0.evictions"}

        def remote_counted():
            s = scrape(pool.metrics)
            return s if lookups(s) == expected else None

        last = wait_until(remote_counted, timeout=20, what="the new lookups in the totals")
        remote.send_signal(signal.SIGTERM)
        assert remote.wait(timeout=30) == 0

        def gone():
            nonlocal last
            s = scrape(pool.metrics)
            assert_not_lower(last, s)
            last = s
            return not [k for (n, k) in s if ("worker", "remote-metrics") in k or ("process", "remote-metrics") in k]

        wait_until(gone, timeout=20, what="the remote worker's gauges to go")
        assert lookups(last) == expected  # the departed remote worker's counts stayed in the totals
    finally:
        if remote.poll() is None:
            remote.kill()
            remote.wait()
