"""`tokenbroker top` on expositions built by the real exporter (PoolMetrics), no broker needed.

The live-broker check (`top --once` against a running pool) is in test_metrics_e2e.py.
"""

from __future__ import annotations

import argparse
import io
import math

import pytest
from prometheus_client import generate_latest

from tokenbroker.broker.metrics import PoolMetrics
from tokenbroker.top import Scrape, Span, frames, histogram_quantile, run_top

from test_metrics import report, snapshot, worker


def exposition(m: PoolMetrics) -> str:
    return generate_latest(m.registry).decode()


def rows(frame: str, first: str) -> list[str]:
    """The cells of the frame's line starting with `first`."""
    return next(line.split() for line in frame.splitlines() if line.split()[:1] == [first])


def test_first_frame_spans_the_broker_life_and_later_frames_the_window_between_scrapes():
    m = PoolMetrics()
    m.publish(snapshot(worker("w1", report("a", rss=2 << 20, l0={"hits": 1, "misses": 3, "reused_bytes": 100}))))
    first = exposition(m)
    m.publish(snapshot(worker("w1", report("a", rss=2 << 20,
                                            l0={"hits": 9, "misses": 5, "evictions": 4, "reused_bytes": 900},
                                            l1={"hits": 1, "misses": 1, "reused_bytes": 50}))))
    second = exposition(m)
    start = m.started
    one, two = frames([(start + 10, first), (start + 20, second)])
    assert "since broker start 10.0s" in one
    assert rows(one, "l0")[1] == "0.250"  # 1 hit of 4 lookups since start
    assert rows(one, "l1")[1] == "-"  # no lookups: no ratio, not a made-up 0
    assert "last 10.0s" in two
    l0 = rows(two, "l0")
    assert l0[1] == "0.800"  # (9 - 1) / (14 - 4): the increase of hits over the increase of lookups
    assert l0[2] == "1.0" and l0[3] == "0.4"  # lookups/s and evictions/s over the 10 s between scrapes
    assert l0[4:6] == ["80", "B/s"]  # (900 - 100) reused bytes / 10 s
    assert rows(two, "l1")[1] == "0.500"
    assert rows(two, "w1")[-3:] == ["2.0", "MiB", "-"]  # RSS; no PSS reported


def test_requests_per_second_and_latency_quantiles_by_op():
    m = PoolMetrics()
    before = exposition(m)
    for _ in range(90):
        m.request_done("tokenize", "ok", 0.0007)  # bucket (0.0005, 0.001]
    for _ in range(10):
        m.request_done("tokenize", "timeout", 4.0)  # bucket (2.5, 5]
    _, frame = frames([(m.started + 1, before), (m.started + 11, exposition(m))])
    op, rate, errors, p50, p90, p99 = rows(frame, "tokenize")
    assert (rate, errors) == ("10.0", "1.0")
    assert p50 == "0.78ms"  # 0.0005 + 0.0005 * 50/90, as histogram_quantile interpolates
    assert p90 == "1.00ms"
    assert p99 == "4.75s"  # 2.5 + 2.5 * (99 - 90) / 10


def test_histogram_quantile_matches_prometheus_rules():
    buckets = [(0.1, 0.0), (0.2, 4.0), (0.4, 8.0), (math.inf, 10.0)]
    assert histogram_quantile(0.4, buckets) == pytest.approx(0.2)  # rank 4: the top of (0.1, 0.2]
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.25)  # rank 5: a quarter into (0.2, 0.4]
    assert histogram_quantile(0.2, buckets) == pytest.approx(0.15)
    assert histogram_quantile(0.99, buckets) == 0.4  # the open bucket answers the highest finite bound
    assert histogram_quantile(0.5, [(0.1, 0.0), (math.inf, 0.0)]) is None


def test_counter_that_restarted_counts_from_zero_like_prometheus():
    old = Scrape.parse('# TYPE x_total counter\nx_total 50\n', 0.0)
    new = Scrape.parse('# TYPE x_total counter\nx_total 7\n', 10.0)
    assert Span(new, old).increase("x_total") == 7


def test_workers_rows_show_in_flight_capacity_and_memory():
    m = PoolMetrics()
    m.publish(snapshot(worker("w1", {**report("a", rss=3 << 20), "pss": 2 << 20}, state="busy", in_flight=3),
                       worker("w2", report("b", rss=1 << 20))))
    (frame,) = frames([(m.started + 1, exposition(m))])
    assert rows(frame, "w1")[1:] == ["3", "4", "3.0", "MiB", "2.0", "MiB"]  # RSS, then PSS
    assert rows(frame, "w2")[1:] == ["0", "4", "1.0", "MiB", "-"]  # no PSS in its heartbeat
    assert rows(frame, "broker")[-1] in ("MiB", "GiB")  # this test process's own memory, whatever the suite has loaded
    assert "busy 1" in frame and "idle 1" in frame


def test_once_against_an_unreachable_exporter_says_so_and_fails(capsys):
    args = argparse.Namespace(url="http://127.0.0.1:9/metrics", once=True, timeout=2.0)
    assert run_top(args, out=io.StringIO()) == 2
    assert "cannot scrape http://127.0.0.1:9/metrics" in capsys.readouterr().err


def test_live_view_keeps_drawing_when_a_scrape_fails_and_stops_on_ctrl_c():
    out = io.StringIO()
    calls = []

    def sleep(seconds: float) -> None:
        calls.append(seconds)
        if len(calls) == 2:
            raise KeyboardInterrupt

    args = argparse.Namespace(url="http://127.0.0.1:9/metrics", once=False, timeout=2.0, interval=0.5, window=300.0)
    assert run_top(args, out=out, sleep=sleep) == 0
    assert out.getvalue().count("cannot scrape") == 2 and calls == [0.5, 0.5]
