"""Prometheus exporter for the pool (first cut: request counts and latency; the full set follows).

The loop calls the event methods; `publish()` hands over a snapshot copy that scrapes read from
the HTTP thread, so a scrape never touches live loop structures.
"""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server


class PoolMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("tokenbroker_requests", "Requests answered, by op and outcome",
                                ["op", "outcome"], registry=self.registry)
        self.latency = Histogram("tokenbroker_request_duration_seconds", "Time from receipt to reply, by op",
                                 ["op"], registry=self.registry)
        self._snapshot: dict = {}
        self._lock = threading.Lock()

    def request_done(self, op: str, outcome: str, seconds: float) -> None:
        self.requests.labels(op, outcome).inc()
        self.latency.labels(op).observe(seconds)

    def worker_joined(self, name: str) -> None:
        pass

    def worker_left(self, name: str, last_report: dict) -> None:
        pass

    def publish(self, snapshot: dict) -> None:
        with self._lock:
            self._snapshot = snapshot

    def serve(self, host: str, port: int) -> str:
        server, _ = start_http_server(port, addr=host, registry=self.registry)
        bound = server.server_address[1]
        return f"http://{host}:{bound}/metrics"
