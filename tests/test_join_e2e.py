"""A worker that cannot get through to its broker keeps trying (workers/join.py): here, a broker
that starts after its worker. The refused case (a CURVE key the broker does not admit) is in
test_security_e2e.py, beside the CURVE broker it needs."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import tokenizers

from helpers import BERT_DIR, Conn, free_port, start_broker, wait_until


def test_a_worker_started_before_its_broker_says_why_then_joins_and_serves(tmp_path: Path):
    """Nothing listens at first: the worker logs the endpoint and why, keeps trying, joins the broker
    once it is up and serves its requests; SIGTERM then ends it with 0."""
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    log = tmp_path / "worker.log"
    with open(log, "w") as err:
        worker = subprocess.Popen([sys.executable, "-m", "tokenbroker", "worker", "--connect", endpoint, "--name", "early",
                                   "--model", f"bert={BERT_DIR}"], stdout=subprocess.DEVNULL, stderr=err)
    try:
        wait_until(lambda: f"cannot get through to the broker at {endpoint}: the connection was refused" in log.read_text(),
                   timeout=60, what="the worker to say nothing listens")
        broker = start_broker("--model", f"bert={BERT_DIR}", "--backend", endpoint, workers=0, timeout=60)
        conn = Conn(broker.endpoint)
        try:
            wait_until(lambda: conn.call("ping")["workers"] == 1, timeout=60, what="the early worker to join")
            text = "joined late, served at once"
            reply = conn.call("tokenize", model="bert", text=text)
            reference = tokenizers.Tokenizer.from_file(str(BERT_DIR / "tokenizer.json"))
            reference.no_padding()  # the contract's ids: the file's own padding and truncation off
            reference.no_truncation()
            expected = reference.encode(text).ids
            assert reply["ok"] and reply["worker"] == "early" and reply["tokens"] == expected, reply
            assert f"joined the broker at {endpoint}" in log.read_text()
            worker.send_signal(signal.SIGTERM)
            assert worker.wait(30) == 0
            assert "Traceback" not in log.read_text()
        finally:
            conn.close()
            broker.stop()
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
