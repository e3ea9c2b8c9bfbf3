"""Prometheus exporter for the pool: request counts and latency, pool gauges, and the workers' cache counters.

The loop calls the event methods and `publish()`s a PoolSnapshot (broker/snapshot.py) each turn;
scrapes run on the HTTP thread and read only that snapshot (never live loop structures). Workers send cumulative counters
per incarnation (one worker process) with their heartbeats; `Ledger` keeps the highest seen per
incarnation, so a repeated or late report does no harm and a departed worker's counts stay in the
totals while its gauges go: counters never fall. docs/metrics.md lists the series and the queries.

The same HTTP server answers the orchestrator's probes (docs/deploy.md "Probes"): `/live` while the
loop turns (it published within LIVE_WITHIN_S), `/ready` while it turns and is not stopping. The
server starts only once every local worker has loaded its tokenizers and the frontend is bound,
so a broker still booting answers neither.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections import OrderedDict
from socketserver import ThreadingMixIn
from typing import Any, Callable, Iterable, Iterator, Mapping
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from bisect import bisect_left

from prometheus_client import CollectorRegistry, Counter, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from tokenbroker.common.process import proportional_bytes, resident_bytes

from ._counters import count_request
from .catalog import backend_counts
from .snapshot import ModelView, PoolSnapshot, WorkerView

__all__ = ["PoolMetrics", "PoolCollector", "Ledger", "LATENCY_BUCKETS", "CACHE_LAYERS"]

CACHE_LAYERS = ("l0", "l1")
CACHE_COUNTERS = ("hits", "misses", "evictions", "reused_bytes")  # cumulative within an incarnation
CACHE_GAUGES = ("entries", "bytes")  # the layer's size now
WORKER_STATES = ("idle", "busy", "draining")
# Tokenizing one request takes from tens of microseconds (a cache hit) to seconds (a book).
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                   1.0, 2.5, 5.0, 10.0, 30.0, float("inf"))
LOAD_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, float("inf"))  # a tokenizer load
RETIRED_KEEP = 4096  # departed incarnations remembered one by one; older ones fold into a baseline
LIVE_WITHIN_S = 5.0  # the loop publishes at least once a second (its poll wakes every second): older means stuck
PROBES = ("/live", "/ready")
# Router counters exported as tokenbroker_router_picks_total{how}: stats key -> label value.
ROUTER_PICKS = {"affinity_hits": "affinity", "rendezvous": "rendezvous", "spills": "spill",
                "overflows": "overflow", "unkeyed": "unkeyed"}


def _int(value: Any) -> int:
    """A counter value from a worker report; anything malformed counts as 0 rather than breaking a scrape."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def report_counters(report: Mapping[str, Any]) -> dict[str, int]:
    """The cumulative counters in one heartbeat body, flat: {"served": n, "l0.hits": n, ...}.

    >>> report_counters({"served": 3, "caches": {"l0": {"hits": 2, "entries": 9}}})["l0.hits"]
    2
    """
    out = {"served": _int(report.get("served"))}
    caches = report.get("caches")
    caches = caches if isinstance(caches, Mapping) else {}
    for layer in CACHE_LAYERS:
        stats = caches.get(layer)
        stats = stats if isinstance(stats, Mapping) else {}
        for key in CACHE_COUNTERS:
            out[f"{layer}.{key}"] = _int(stats.get(key))
    return out


class Ledger:
    """Cumulative worker counters per incarnation; `totals()` never falls.

    Keeps each incarnation's highest counters (reports are cumulative, so the highest is the
    latest; a repeat or an old report changes nothing). Departed incarnations stay remembered one
    by one, so one that comes back (a remote worker reconnecting) continues rather than counting
    twice; beyond `keep` of them the oldest fold into a baseline sum. Not thread-safe: the owner locks.
    """

    def __init__(self, keep: int = RETIRED_KEEP) -> None:
        self.keep = keep
        self._by_incarnation: OrderedDict[str, dict[str, int]] = OrderedDict()  # least recently reported first
        self._baseline: dict[str, int] = {}

    def observe(self, report: Mapping[str, Any]) -> None:
        incarnation = report.get("incarnation")
        if not isinstance(incarnation, str) or not incarnation:
            return  # an empty report (a worker gone before its first heartbeat) counted nothing
        new = report_counters(report)
        seen = self._by_incarnation.pop(incarnation, None)
        if seen is not None:
            new = {k: max(v, seen.get(k, 0)) for k, v in new.items()}
        self._by_incarnation[incarnation] = new

    def totals(self, live: Iterable[str] = ()) -> dict[str, int]:
        """Sum over every incarnation ever seen; folds the oldest departed ones beyond `keep`."""
        live = set(live)
        self._fold(live)
        total = dict(self._baseline)
        for counters in self._by_incarnation.values():
            for k, v in counters.items():
                total[k] = total.get(k, 0) + v
        return total

    def _fold(self, live: set[str]) -> None:
        excess = len(self._by_incarnation) - len(live) - self.keep
        for incarnation in list(self._by_incarnation):
            if excess <= 0:
                return
            if incarnation in live:
                continue
            for k, v in self._by_incarnation.pop(incarnation).items():
                self._baseline[k] = self._baseline.get(k, 0) + v
            excess -= 1


class PoolCollector:
    """Builds fresh families per scrape from the last published snapshot and the ledger."""

    def __init__(self, metrics: "PoolMetrics") -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        snapshot, totals = self._metrics.read()
        yield from _cache_families(snapshot.workers, totals)
        yield from _pool_families(snapshot, totals)
        yield from _process_families(snapshot.workers, self._metrics.started)
        yield from _router_families(snapshot.router)
        yield from self._metrics.request_families()
        yield from self._metrics.model_families(snapshot.models)
        yield _engine_family(snapshot.workers)
        yield from _fast_engine_families(snapshot.workers)


def _engine_family(workers: Iterable[WorkerView]) -> Metric:
    """Per model and engine: how many workers serve it with it now (heartbeat `backends`; a worker
    loads with the reference library and switches to fastokens once its probes pass)."""
    engines = GaugeMetricFamily("tokenbroker_model_engines", "Workers serving a model, by the library that encodes it",
                                labels=["model", "backend"])
    for model, counts in sorted(backend_counts(w.report for w in workers).items()):
        for backend, n in sorted(counts.items()):
            engines.add_metric([model, backend], n)
    return engines


def _fast_engine_families(workers: Iterable[WorkerView]) -> Iterator[Metric]:
    """Each worker's fast engines (heartbeat `engines`, workers/engine.py EnginePlan): how many one
    thread serves before fastokens' per-thread state thrashes (measured at its start; 0 before its
    first fast engine), how many it serves, and the threads of their own that those past it encode on."""
    limit = GaugeMetricFamily("tokenbroker_worker_engine_limit", "Fast engines one thread of a worker serves at full "
                              "speed, as measured at its start (0: no fast engine yet)", labels=["worker"])
    fast = GaugeMetricFamily("tokenbroker_worker_fast_engines", "Distinct tokenizers a worker serves with its fast "
                             "engine (models over one tokenizer share one)", labels=["worker"])
    threads = GaugeMetricFamily("tokenbroker_worker_engine_threads", "Threads of their own that a worker's fast "
                                "engines beyond its limit encode on", labels=["worker"])
    for w in workers:
        engines = w.report.get("engines")
        if isinstance(engines, Mapping):
            limit.add_metric([w.name], _int(engines.get("limit")))
            fast.add_metric([w.name], _int(engines.get("fast")))
            threads.add_metric([w.name], _int(engines.get("threads")))
    yield from (limit, fast, threads)


def _layer_sizes(workers: Iterable[WorkerView]) -> dict[str, dict[str, int]]:
    sizes = {layer: dict.fromkeys(CACHE_GAUGES, 0) for layer in CACHE_LAYERS}
    for w in workers:
        caches = w.report.get("caches")
        if not isinstance(caches, Mapping):
            continue
        for layer in CACHE_LAYERS:
            stats = caches.get(layer)
            if not isinstance(stats, Mapping):
                stats = {}
            for key in CACHE_GAUGES:
                sizes[layer][key] += _int(stats.get(key))
    return sizes


def _cache_families(workers: Iterable[WorkerView], totals: Mapping[str, int]) -> Iterator[Metric]:
    """The series operators already query (smg_*), then the pool's own cache gauges."""
    lookups = CounterMetricFamily("smg_tokenizer_cache_lookups", "Tokenizer cache lookups, all tokenizers and workers; an L0 hit never reaches L1",
                                  labels=["layer", "result"])
    evictions = CounterMetricFamily("smg_tokenizer_cache_evictions", "Entries evicted from a tokenizer cache layer", labels=["layer"])
    reused = CounterMetricFamily("smg_tokenizer_cache_reused_bytes", "Input bytes whose tokens came from the cache (L0: the whole text; L1: the prefix)",
                                 labels=["layer"])
    for layer in CACHE_LAYERS:
        lookups.add_metric([layer, "hit"], totals.get(f"{layer}.hits", 0))
        lookups.add_metric([layer, "miss"], totals.get(f"{layer}.misses", 0))
        evictions.add_metric([layer], totals.get(f"{layer}.evictions", 0))
        reused.add_metric([layer], totals.get(f"{layer}.reused_bytes", 0))
    yield from (lookups, evictions, reused)
    sizes = _layer_sizes(workers)
    entries = GaugeMetricFamily("tokenbroker_cache_entries", "Entries held by a cache layer, all live workers", labels=["layer"])
    charged = GaugeMetricFamily("tokenbroker_cache_bytes", "Bytes charged to a cache layer's budget, all live workers", labels=["layer"])
    for layer in CACHE_LAYERS:
        entries.add_metric([layer], sizes[layer]["entries"])
        charged.add_metric([layer], sizes[layer]["bytes"])
    yield from (entries, charged)


def _pool_families(snapshot: PoolSnapshot, totals: Mapping[str, int]) -> Iterator[Metric]:
    workers = snapshot.workers
    yield GaugeMetricFamily("tokenbroker_queue_depth", "Requests waiting for a worker", value=snapshot.queue_depth)
    yield GaugeMetricFamily("tokenbroker_requests_held", "Requests received and not yet answered (queued or at a worker)",
                            value=snapshot.held)
    yield CounterMetricFamily("tokenbroker_worker_restarts", "Local workers restarted after an exit", value=snapshot.restarts)
    yield CounterMetricFamily("tokenbroker_worker_recycles", "Local workers replaced because their private memory passed "
                              "--worker-max-memory", value=snapshot.recycled)
    yield CounterMetricFamily("tokenbroker_worker_jobs", "Jobs workers finished, all workers ever", value=totals.get("served", 0))
    states = GaugeMetricFamily("tokenbroker_workers", "Connected workers by state", labels=["state"])
    for state in WORKER_STATES:
        states.add_metric([state], sum(1 for w in workers if w.state == state))
    yield states
    in_flight = GaugeMetricFamily("tokenbroker_worker_in_flight", "Jobs a worker holds now", labels=["worker"])
    capacity = GaugeMetricFamily("tokenbroker_worker_capacity", "Jobs a worker takes at once", labels=["worker"])
    info = GaugeMetricFamily("tokenbroker_worker_info", "A connected worker: its host and pid", labels=["worker", "host", "pid"])
    for w in workers:
        in_flight.add_metric([w.name], w.in_flight)
        capacity.add_metric([w.name], w.capacity)
        info.add_metric([w.name, w.host, str(w.pid)], 1)
    yield from (in_flight, capacity, info)
    yield from _lane_families(workers)


def _lane_families(workers: Iterable[WorkerView]) -> Iterator[Metric]:
    """Each worker's background lanes (workers/background.py) from its heartbeat `lanes`: jobs held,
    and threads its watchdog gave up on (still running: `wedged`; ever, in this worker process)."""
    pending = GaugeMetricFamily("tokenbroker_worker_lane_jobs", "Jobs on a worker's background lane (chat renders, long encodes)",
                                labels=["worker", "lane"])
    wedged = GaugeMetricFamily("tokenbroker_worker_lane_wedged", "Lane threads given up on past a job's deadline and still inside their call",
                               labels=["worker", "lane"])
    replaced = GaugeMetricFamily("tokenbroker_worker_lane_replaced", "Lane threads this worker process gave up on and replaced, ever",
                                 labels=["worker", "lane"])
    for w in workers:
        lanes = w.report.get("lanes")
        if not isinstance(lanes, Mapping):
            continue
        for lane, stats in sorted(lanes.items(), key=lambda kv: str(kv[0])):
            if not isinstance(stats, Mapping):
                continue
            pending.add_metric([w.name, str(lane)], _int(stats.get("pending")))
            wedged.add_metric([w.name, str(lane)], _int(stats.get("wedged")))
            replaced.add_metric([w.name, str(lane)], _int(stats.get("replaced")))
    yield from (pending, wedged, replaced)


def _process_families(workers: Iterable[WorkerView], started: float) -> Iterator[Metric]:
    """Resident memory per process, and the pool's total as smg_allocator_allocated_bytes."""
    memory = GaugeMetricFamily("tokenbroker_process_resident_memory_bytes", "Resident memory of the broker and of each live worker (from its last heartbeat)",
                               labels=["process"])
    own = resident_bytes()
    memory.add_metric(["broker"], own)
    total = own
    for w in workers:
        rss = _int(w.report.get("rss"))
        if rss:  # none before the worker's first heartbeat: unknown, not zero
            memory.add_metric([w.name], rss)
            total += rss
    yield memory
    yield GaugeMetricFamily("smg_allocator_allocated_bytes", "Memory the pool holds: resident memory of the broker and its live workers",
                            value=total)
    yield GaugeMetricFamily("tokenbroker_start_time_seconds", "When the broker started, in seconds since the Unix epoch", value=started)
    yield from _proportional_families(workers, own)


def _proportional_families(workers: Iterable[WorkerView], own_rss: int) -> Iterator[Metric]:
    """PSS per process (the broker's and the template's read at scrape time, each worker's from its
    heartbeat) and their sum: what the pool holds, shared pages counted once (RSS counts a forked
    pool's shared tokenizers once per worker). A worker that reports no PSS counts its RSS."""
    pss = GaugeMetricFamily("tokenbroker_process_proportional_memory_bytes",
                            "Proportional set size (PSS) of the broker, the template local workers fork from, and each live worker",
                            labels=["process"])
    own = proportional_bytes()
    total = own if own is not None else own_rss
    pss.add_metric(["broker"], total)
    template = _template_pid()
    if template is not None and (size := proportional_bytes(template)) is not None:
        pss.add_metric(["template"], size)
        total += size
    for w in workers:
        size = _int(w.report.get("pss"))
        if size:
            pss.add_metric([w.name], size)
        total += size or _int(w.report.get("rss"))
    yield pss
    yield GaugeMetricFamily("tokenbroker_pool_proportional_memory_bytes",
                            "Memory the pool holds, shared pages counted once: the sum of the PSS series (RSS for a worker without PSS)",
                            value=total)


def _template_pid() -> int | None:
    """The template process (workers/zygote.py) among this broker's children, if there is one."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/children") as f:
                kids = f.read().split()
        except OSError:
            continue
        for kid in kids:
            try:
                with open(f"/proc/{kid}/cmdline", "rb") as f:
                    if b"--zygote-fd" in f.read():
                        return int(kid)
            except (OSError, ValueError):
                continue
    return None


def _router_families(stats: Mapping[str, int]) -> Iterator[Metric]:
    picks = CounterMetricFamily("tokenbroker_router_picks", "Jobs routed, by how the worker was chosen", labels=["how"])
    for key, how in ROUTER_PICKS.items():
        picks.add_metric([how], stats.get(key, 0))
    yield picks
    yield CounterMetricFamily("tokenbroker_router_full", "Routing attempts that found every worker full", value=stats.get("full", 0))
    yield GaugeMetricFamily("tokenbroker_router_index_entries", "Prefix blocks in the router's affinity index",
                            value=stats.get("index_entries", 0))


def _observe(table: dict[str, list[float]], key: str, bounds: tuple[float, ...], seconds: float) -> None:
    """One observation into a plain histogram: per-bucket counts (not cumulative), then the sum."""
    counts = table.get(key)
    if counts is None:
        counts = table[key] = [0.0] * (len(bounds) + 1)
    seconds = max(0.0, seconds)
    counts[bisect_left(bounds, seconds)] += 1
    counts[-1] += seconds


def _cumulative(bounds: tuple[float, ...], counts: list[float]) -> list[tuple[str, float]]:
    """Prometheus buckets from per-bucket counts."""
    cumulative, buckets = 0.0, []
    for bound, n in zip(bounds, counts):
        cumulative += n
        buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
    return buckets


class PoolMetrics:
    """What the loop reports to; owns the broker's own CollectorRegistry (never the global one)."""

    def __init__(self, *, retired_keep: int = RETIRED_KEEP) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        # Plain counts, bumped by the loop per request (a label lookup per request costs more than
        # the rest of the hop); scrapes copy them, which the GIL makes atomic for dicts of ints.
        self._requests: dict[tuple[str, str], int] = {}
        self._latency: dict[str, list[float]] = {}  # op -> per-bucket counts (not cumulative), then the sum
        self._model_requests: dict[str, int] = {}  # catalog model -> requests received for it
        self._loads: dict[str, list[float]] = {}  # model -> per-bucket load durations, then the sum
        self._load_failures: dict[str, int] = {}
        self.auth_failures = Counter("tokenbroker_auth_failures", "CURVE handshakes the broker refused, by socket (docs/security.md)",
                                     ["socket"], registry=self.registry)
        for sock in ("frontend", "backend"):
            self.auth_failures.labels(sock)  # both series exist from the start, at 0
        self.started = time.time()
        self._snapshot = PoolSnapshot()
        self._published_at: float | None = None  # monotonic time of the loop's last publish: /live
        self._ledger = Ledger(retired_keep)
        self._lock = threading.Lock()
        self._server: Any = None
        self.registry.register(PoolCollector(self))

    # --- called by the loop ------------------------------------------------------------

    def request_done(self, op: str, outcome: str, seconds: float) -> None:
        """One request answered. `op` and `outcome` come from closed sets (the ops, the error codes)."""
        count_request(self._requests, self._latency, LATENCY_BUCKETS, op, outcome, seconds)

    def request_families(self) -> Iterator[Metric]:
        """Requests and their latency, from the plain counts (called on the HTTP thread)."""
        requests = CounterMetricFamily("tokenbroker_requests", "Requests answered, by op and outcome (ok or the error code)",
                                       labels=["op", "outcome"])
        for (op, outcome), n in sorted(self._requests.copy().items()):
            requests.add_metric([op, outcome], n)
        yield requests
        latency = HistogramMetricFamily("tokenbroker_request_duration_seconds", "Time from receipt to reply, by op",
                                        labels=["op"])
        for op, counts in sorted(self._latency.copy().items()):
            counts = list(counts)
            latency.add_metric([op], _cumulative(LATENCY_BUCKETS, counts), sum_value=counts[-1])
        yield latency

    def model_request(self, model: str) -> None:
        """A request for a catalog model was received (model names come from the catalog only)."""
        self._model_requests[model] = self._model_requests.get(model, 0) + 1

    def model_loaded(self, model: str, seconds: float) -> None:
        _observe(self._loads, model, LOAD_BUCKETS, seconds)

    def model_load_failed(self, model: str) -> None:
        self._load_failures[model] = self._load_failures.get(model, 0) + 1

    def model_families(self, models: Mapping[str, ModelView]) -> Iterator[Metric]:
        """Per model: replicas now (from the snapshot), loads and their duration, failures, requests."""
        replicas = GaugeMetricFamily("tokenbroker_model_replicas", "Workers holding a catalog model loaded", labels=["model"])
        queued = GaugeMetricFamily("tokenbroker_model_queued", "Requests queued for a catalog model", labels=["model"])
        for name, m in sorted(models.items()):
            replicas.add_metric([name], m.replicas)
            queued.add_metric([name], m.queued)
        yield from (replicas, queued)
        loads = HistogramMetricFamily("tokenbroker_model_load_seconds", "Tokenizer loads a worker finished, by model, and how long each took",
                                      labels=["model"])
        for name, counts in sorted(self._loads.copy().items()):
            loads.add_metric([name], _cumulative(LOAD_BUCKETS, list(counts)), sum_value=counts[-1])
        yield loads
        total = CounterMetricFamily("tokenbroker_model_loads", "Tokenizer loads finished, by model", labels=["model"])
        for name, counts in sorted(self._loads.copy().items()):
            total.add_metric([name], sum(counts[:-1]))
        yield total
        failures = CounterMetricFamily("tokenbroker_model_load_failures", "Tokenizer loads that failed, by model", labels=["model"])
        for name, n in sorted(self._load_failures.copy().items()):
            failures.add_metric([name], n)
        yield failures
        requests = CounterMetricFamily("tokenbroker_model_requests", "Requests received for a catalog model", labels=["model"])
        for name, n in sorted(self._model_requests.copy().items()):
            requests.add_metric([name], n)
        yield requests

    def auth_failed(self, socket: str) -> None:
        """Called on the ZAP thread (broker/security.py); prometheus-client counters are thread-safe."""
        self.auth_failures.labels(socket).inc()

    def worker_joined(self, name: str) -> None:
        """Nothing to do: a worker's series appear with the next snapshot."""

    def worker_left(self, name: str, last_report: dict) -> None:
        """Keep the departed worker's counts (its gauges go with the next snapshot)."""
        with self._lock:
            self._ledger.observe(last_report or {})

    def publish(self, snapshot: PoolSnapshot) -> None:
        """Called every loop turn: only swaps a reference; scrapes do the work."""
        self._snapshot = snapshot
        self._published_at = time.monotonic()

    # --- probes (HTTP thread) -----------------------------------------------------------

    def health(self, path: str) -> tuple[bool, dict[str, Any]]:
        """`/live` or `/ready`: whether it passes, and what it saw (the probe's JSON body).

        Live: the loop published within LIVE_WITHIN_S. Ready: live, and not stopping (a broker
        draining after SIGTERM answers what it holds but takes nothing new, so it leaves the Service).
        """
        snapshot, at = self._snapshot, self._published_at
        age = None if at is None else time.monotonic() - at
        live = age is not None and age <= LIVE_WITHIN_S
        ready = live and not snapshot.stopping
        body = {"live": live, "ready": ready, "stopping": snapshot.stopping,
                "loop_age_s": None if age is None else round(age, 3),
                "workers": sum(1 for w in snapshot.workers if w.state != "draining"),
                "queue_depth": snapshot.queue_depth}
        return (live if path == "/live" else ready), body

    def _app(self) -> Callable:
        """The exporter's WSGI app: the probes, and the metrics on every other path (as before)."""
        metrics = make_wsgi_app(self.registry)

        def app(environ: dict, start_response: Callable) -> list[bytes]:
            path = environ.get("PATH_INFO", "")
            if path not in PROBES:
                return metrics(environ, start_response)
            ok, body = self.health(path)
            data = json.dumps(body).encode() + b"\n"
            start_response("200 OK" if ok else "503 Service Unavailable",
                           [("Content-Type", "application/json"), ("Content-Length", str(len(data))),
                            ("Cache-Control", "no-store")])
            return [data]

        return app

    # --- read by scrapes (HTTP thread) -------------------------------------------------

    def read(self) -> tuple[PoolSnapshot, dict[str, int]]:
        """The last snapshot and the worker counter totals, its live reports folded into the ledger."""
        snapshot = self._snapshot  # one reference read: the loop replaces, never mutates, a published snapshot
        live = []
        with self._lock:
            for w in snapshot.workers:
                self._ledger.observe(w.report)
                live.append(w.report.get("incarnation"))
            totals = self._ledger.totals(x for x in live if isinstance(x, str))
        return snapshot, totals

    def serve(self, host: str, port: int) -> str:
        """Start the HTTP exporter (metrics and probes) on a daemon thread; returns the metrics URL."""
        family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        server_class = type("ExporterServer", (_ExporterServer,), {"address_family": family})
        self._server = make_server(str(sockaddr[0]), port, self._app(), server_class, handler_class=_QuietHandler)
        threading.Thread(target=self._server.serve_forever, name="tokenbroker-exporter", daemon=True).start()
        bound = self._server.server_address[1]
        shown = f"[{host}]" if ":" in host else host
        return f"http://{shown}:{bound}/metrics"

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class _ExporterServer(ThreadingMixIn, WSGIServer):
    """One thread per scrape or probe, none of them keeping the process alive."""

    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    """No access log: a probe every few seconds would fill the broker's log."""

    def log_message(self, format: str, *args: Any) -> None:
        pass
