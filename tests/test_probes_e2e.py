"""The orchestrator's probes on the exporter's port (docs/deploy.md "Probes"): /live while the loop
turns, /ready while it turns and is not stopping; /metrics unchanged beside them."""

from __future__ import annotations

import json
import signal
import urllib.error
import urllib.request

from helpers import Conn, free_port, start_broker, wait_until


def probe(base: str, path: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(base + path, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_live_and_ready_pass_on_a_serving_broker_and_ready_fails_while_it_drains() -> None:
    # No worker: a request stays queued until its deadline, which holds the draining broker that long.
    broker = start_broker("--metrics-port", str(free_port()), workers=0)
    base = broker.metrics.removesuffix("/metrics")
    c = Conn(broker.endpoint)
    try:
        status, body = wait_until(lambda: (r := probe(base, "/ready"))[0] == 200 and r, what="ready")
        assert body["live"] and body["ready"] and not body["stopping"] and body["workers"] == 0
        assert 0 <= body["loop_age_s"] <= 5
        assert probe(base, "/live")[0] == 200
        with urllib.request.urlopen(broker.metrics, timeout=10) as r:
            assert b"tokenbroker_queue_depth" in r.read()  # every other path is still the exposition
        c.send({"id": "held", "op": "tokenize", "text": "Hello", "deadline_ms": 4000})
        wait_until(lambda: probe(base, "/ready")[1]["queue_depth"] == 1, what="the request queued")
        broker.proc.send_signal(signal.SIGTERM)
        status, body = wait_until(lambda: (r := probe(base, "/ready"))[0] == 503 and r, what="not ready while draining")
        assert body["stopping"] and not body["ready"]
        assert probe(base, "/live")[0] == 200  # still turning: it answers what it holds
        reply = c.recv()
        assert reply["id"] == "held" and reply["error"]["code"] == "timeout", reply  # answered, not dropped
        assert broker.proc.wait(30) == 0
    finally:
        c.close()
        broker.stop()
