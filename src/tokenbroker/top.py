"""`tokenbroker top`: a live terminal view of a broker's exporter, over plain HTTP.

Each frame compares two scrapes: the oldest kept within `--window` and the newest. Rates are
counter increases over that span, and a layer's hit ratio is its hits' increase over its lookups'
increase, summed over every series of the layer: what
`sum by (layer) (rate(smg_tokenizer_cache_lookups_total{result="hit"}[5m])) / sum by (layer) (rate(smg_tokenizer_cache_lookups_total[5m]))`
computes for the same span. The first frame (and `--once`) has a single scrape: it spans the
broker's whole life, from `tokenbroker_start_time_seconds` with every counter at zero.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import urllib.request
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping

from prometheus_client.parser import text_string_to_metric_families

QUANTILES = (0.5, 0.9, 0.99)
CLEAR = "\x1b[H\x1b[J"

Labels = frozenset  # frozenset of (label, value) pairs


@dataclass(frozen=True)
class Scrape:
    """One parsed exposition: sample name -> {labels: value}, and when it was taken (Unix seconds)."""

    at: float
    samples: Mapping[str, Mapping[Labels, float]]

    @classmethod
    def parse(cls, text: str, at: float) -> "Scrape":
        samples: dict[str, dict[Labels, float]] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                samples.setdefault(s.name, {})[frozenset(s.labels.items())] = s.value
        return cls(at, samples)

    def series(self, name: str, **match: str) -> dict[Labels, float]:
        """The samples of `name` whose labels include `match`."""
        want = set(match.items())
        return {k: v for k, v in self.samples.get(name, {}).items() if want <= k}

    def value(self, name: str, default: float = 0.0) -> float:
        return sum(self.series(name).values()) if name in self.samples else default


def _increase(new: float, old: float | None) -> float:
    """A counter's increase; a drop means the counter restarted (a new broker), as Prometheus reads it."""
    if old is None:
        return new
    return new - old if new >= old else new


@dataclass(frozen=True)
class Span:
    """Two scrapes of one exporter; `old` None means "since the broker started, from zero"."""

    new: Scrape
    old: Scrape | None = None

    @property
    def seconds(self) -> float:
        start = self.old.at if self.old is not None else self.new.value("tokenbroker_start_time_seconds", self.new.at)
        return max(self.new.at - start, 1e-9)

    def increase(self, name: str, **match: str) -> float:
        """Summed increase of every series of `name` matching `match` (the `sum(increase(...))` of PromQL)."""
        old = self.old.series(name, **match) if self.old is not None else {}
        return sum(_increase(v, old.get(k, 0.0) if self.old is not None else None) for k, v in self.new.series(name, **match).items())

    def rate(self, name: str, **match: str) -> float:
        return self.increase(name, **match) / self.seconds

    def hit_ratio(self, layer: str) -> float | None:
        """sum(rate(hits)) / sum(rate(lookups)) for one layer; None when it had no lookups in the span."""
        lookups = self.increase("smg_tokenizer_cache_lookups_total", layer=layer)
        if lookups <= 0:
            return None
        return self.increase("smg_tokenizer_cache_lookups_total", layer=layer, result="hit") / lookups

    def quantile(self, q: float, histogram: str, **match: str) -> float | None:
        """histogram_quantile(q, sum by (le) (increase(histogram_bucket[span]))); None without observations."""
        buckets: dict[float, float] = {}
        old = self.old.series(f"{histogram}_bucket", **match) if self.old is not None else {}
        for labels, v in self.new.series(f"{histogram}_bucket", **match).items():
            le = float(dict(labels)["le"])
            buckets[le] = buckets.get(le, 0.0) + _increase(v, old.get(labels, 0.0) if self.old is not None else None)
        return histogram_quantile(q, sorted(buckets.items()))


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Prometheus's estimate from cumulative (upper bound, count) buckets sorted by bound.

    >>> histogram_quantile(0.5, [(1.0, 0.0), (2.0, 10.0), (math.inf, 10.0)])
    1.5
    """
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for upper, count in buckets:
        if count >= rank:
            if math.isinf(upper):
                return lower  # in the open bucket: the highest finite bound, as Prometheus answers
            if count == below:
                return upper
            return lower + (upper - lower) * (rank - below) / (count - below)
        lower, below = upper, count
    return lower


# --- rendering --------------------------------------------------------------------------------------


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _seconds(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s * 1000:.2f}ms" if s < 1 else f"{s:.2f}s"


def _ratio(r: float | None) -> str:
    return "-" if r is None else f"{r:.3f}"


def _label(labels: Labels, key: str) -> str:
    return dict(labels).get(key, "")


def render(span: Span, url: str) -> str:
    """One frame of text: pool, requests by op, workers, cache layers."""
    new = span.new
    window = "since broker start" if span.old is None else "last"
    lines = [
        f"tokenbroker top  {url}  {window} {span.seconds:.1f}s",
        f"queue {new.value('tokenbroker_queue_depth'):.0f}  held {new.value('tokenbroker_requests_held'):.0f}  "
        + "workers " + " ".join(f"{_label(k, 'state')} {v:.0f}" for k, v in sorted(new.series("tokenbroker_workers").items(), key=lambda kv: _label(kv[0], "state")))
        + f"  restarts {new.value('tokenbroker_worker_restarts_total'):.0f}"
        + f"  pool memory {_bytes(new.value('smg_allocator_allocated_bytes'))} rss"
        + (f", {_bytes(new.value('tokenbroker_pool_proportional_memory_bytes'))} pss"
           if new.series("tokenbroker_pool_proportional_memory_bytes") else ""),
        "",
        f"{'op':<12}{'req/s':>10}{'errors/s':>10}" + "".join(f"{'p' + format(q * 100, 'g'):>10}" for q in QUANTILES),
    ]
    ops = sorted({_label(k, "op") for k in new.series("tokenbroker_requests_total")})
    for op in ops:
        total = span.rate("tokenbroker_requests_total", op=op)
        errors = total - span.rate("tokenbroker_requests_total", op=op, outcome="ok")
        qs = "".join(f"{_seconds(span.quantile(q, 'tokenbroker_request_duration_seconds', op=op)):>10}" for q in QUANTILES)
        lines.append(f"{op:<12}{total:>10.1f}{errors:>10.1f}{qs}")
    if not ops:
        lines.append("(no requests yet)")
    lines += ["", f"{'process':<28}{'in-flight':>10}{'capacity':>10}{'memory':>12}{'pss':>12}"]
    in_flight = {_label(k, "worker"): v for k, v in new.series("tokenbroker_worker_in_flight").items()}
    capacity = {_label(k, "worker"): v for k, v in new.series("tokenbroker_worker_capacity").items()}
    memory = {_label(k, "process"): v for k, v in new.series("tokenbroker_process_resident_memory_bytes").items()}
    pss = {_label(k, "process"): v for k, v in new.series("tokenbroker_process_proportional_memory_bytes").items()}
    for name in ["broker", *(["template"] if "template" in pss else []), *sorted(set(in_flight) | (set(memory) - {"broker"}))]:
        flight = f"{in_flight[name]:.0f}" if name in in_flight else ""
        cap = f"{capacity[name]:.0f}" if name in capacity else ""
        mem = _bytes(memory[name]) if name in memory else "-"
        shared = _bytes(pss[name]) if name in pss else "-"
        lines.append(f"{name:<28}{flight:>10}{cap:>10}{mem:>12}{shared:>12}")
    lines += ["", f"{'cache':<8}{'hit ratio':>10}{'lookups/s':>11}{'evictions/s':>13}{'reused/s':>14}{'entries':>10}{'bytes':>12}"]
    layers = sorted({_label(k, "layer") for k in new.series("smg_tokenizer_cache_lookups_total")})
    for layer in layers:
        entries = sum(new.series("tokenbroker_cache_entries", layer=layer).values())
        charged = sum(new.series("tokenbroker_cache_bytes", layer=layer).values())
        lines.append(
            f"{layer:<8}{_ratio(span.hit_ratio(layer)):>10}"
            f"{span.rate('smg_tokenizer_cache_lookups_total', layer=layer):>11.1f}"
            f"{span.rate('smg_tokenizer_cache_evictions_total', layer=layer):>13.1f}"
            f"{_bytes(span.rate('smg_tokenizer_cache_reused_bytes_total', layer=layer)) + '/s':>14}"
            f"{entries:>10.0f}{_bytes(charged):>12}"
        )
    return "\n".join(lines) + "\n"


# --- the command ------------------------------------------------------------------------------------


def fetch(url: str, timeout: float) -> Scrape:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        text = response.read().decode("utf-8")
    return Scrape.parse(text, time.time())


@dataclass
class History:
    """Scrapes within `window` seconds of the newest; a frame spans the oldest kept to the newest."""

    window: float
    scrapes: deque[Scrape] = field(default_factory=deque)

    def add(self, scrape: Scrape) -> Span:
        self.scrapes.append(scrape)
        while len(self.scrapes) > 2 and scrape.at - self.scrapes[1].at >= self.window:
            self.scrapes.popleft()
        old = self.scrapes[0] if len(self.scrapes) > 1 else None
        return Span(scrape, old)


def add_top_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("top", help="tail a broker's metrics exporter", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:9464/metrics", help="the broker's exporter")
    p.add_argument("--once", action="store_true", help="print one frame (since the broker started) and exit")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between frames")
    p.add_argument("--window", type=float, default=300.0, help="seconds a frame's rates span at most (300: the [5m] of the queries)")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for a scrape")


def run_top(args: argparse.Namespace, *, out=None, sleep: Callable[[float], None] = time.sleep) -> int:
    out = out or sys.stdout
    if args.once:
        try:
            out.write(render(Span(fetch(args.url, args.timeout)), args.url))
        except (OSError, ValueError) as e:
            print(f"tokenbroker top: cannot scrape {args.url}: {e}", file=sys.stderr)
            return 2
        return 0
    history = History(args.window)
    clear = CLEAR if out.isatty() else ""
    try:
        while True:
            try:
                frame = render(history.add(fetch(args.url, args.timeout)), args.url)
            except (OSError, ValueError) as e:
                frame = f"tokenbroker top  {args.url}  cannot scrape: {e}\n"
            out.write(clear + frame + ("" if clear else "\n"))
            out.flush()
            sleep(args.interval)
    except KeyboardInterrupt:
        return 0


def frames(texts: Iterable[tuple[float, str]], url: str = "", window: float = 300.0) -> list[str]:
    """Frames for a sequence of (time, exposition text): what the live view shows, for tests and scripts."""
    history = History(window)
    return [render(history.add(Scrape.parse(text, at)), url) for at, text in texts]
