"""CURVE end to end: a real broker with a tcp:// backend, real remote workers, real client sockets.

Keys are made by `tokenbroker keys`, as an operator would (docs/security.md). A refused peer
gets nothing back, so "refused" is shown as: no reply before a deadline, and the exporter's
tokenbroker_auth_failures_total{socket} moving.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tokenbroker.common.process import EXIT_UNREACHABLE

from helpers import BERT_DIR, BrokerProcess, Conn, free_port, scrape, start_broker, wait_until

REFUSED_WAIT_S = 2.0  # a refused peer's request is given this long to be (wrongly) answered


def curve_conn(endpoint: str, server_key: Path | None, secret_key: Path | None) -> Conn:
    """A CURVE client of the broker (or a plain one with both keys None) whose sends give up after REFUSED_WAIT_S."""
    return Conn(endpoint, server_key=server_key, secret_key=secret_key, send_timeout=REFUSED_WAIT_S)


def run_keys(folder: Path, name: str) -> Path:
    out = subprocess.run([sys.executable, "-m", "tokenbroker", "keys", str(folder), name],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return folder / f"{name}.key_secret"


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> dict[str, Path]:
    """broker, clients c1 c2, admin a1, workers w1 w2, and strangers x (a client) and wx (a worker)."""
    root = tmp_path_factory.mktemp("curve")
    k = {"root": root, "broker": run_keys(root / "broker", "broker")}
    for folder, names in {"clients": ("c1", "c2"), "admins": ("a1",), "workers": ("w1", "w2"),
                          "strangers": ("x", "wx")}.items():
        for name in names:
            k[name] = run_keys(root / folder, name)
    return k


def server_key(keys: dict[str, Path]) -> Path:
    return keys["root"] / "broker" / "broker.key"


def start_curve_broker(keys: dict[str, Path], backend_port: int) -> BrokerProcess:
    """A CURVE broker without local workers, its exporter on (for tokenbroker_auth_failures_total),
    with the remote workers' model flags (else it would have them load its embedded default too)."""
    root = keys["root"]
    return start_broker("--model", f"bert={BERT_DIR}", "--curve-secret-key", str(keys["broker"]), "--curve-clients", str(root / "clients"),
                        "--curve-admins", str(root / "admins"), "--curve-workers", str(root / "workers"),
                        "--backend", f"tcp://127.0.0.1:{backend_port}", "--metrics-port", str(free_port()),
                        workers=0, timeout=60)


def start_worker(keys: dict[str, Path], port: int, name: str, key: str, *flags: str, log: Path | None = None) -> subprocess.Popen:
    """A remote worker with key `key`; its log (standard error) goes to `log` when given."""
    with open(log or os.devnull, "w") as err:  # the child holds its own copy of the descriptor
        return subprocess.Popen(
            [sys.executable, "-m", "tokenbroker", "worker", "--connect", f"tcp://127.0.0.1:{port}", "--name", name,
             "--model", f"bert={BERT_DIR}", "--curve-server-key", str(server_key(keys)), "--curve-secret-key", str(keys[key]),
             *flags], stdout=subprocess.DEVNULL, stderr=err)


def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    """Send `sig` (a refused worker leaves at SIGTERM at once, test_a_refused_worker_keeps_trying...), then SIGKILL after 30 s."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def auth_failures(broker, socket: str) -> float:
    return scrape(broker.metrics)[("tokenbroker_auth_failures_total", frozenset({("socket", socket)}))]


@pytest.fixture(scope="module")
def pool(keys):
    """A CURVE broker (no local workers) and one admitted remote worker, w1, serving bert."""
    port = free_port()
    broker = start_curve_broker(keys, port)
    worker = start_worker(keys, port, "remote-w1", "w1")
    c1 = curve_conn(broker.endpoint, server_key(keys), keys["c1"])
    try:
        wait_until(lambda: c1.call("ping")["workers"] == 1, timeout=90, what="w1 to join over CURVE")
        yield broker, port, c1
    finally:
        c1.close()
        stop(worker)
        broker.stop()


def test_an_authorized_client_is_served_by_an_authorized_remote_worker(pool):
    broker, _, c1 = pool
    reply = c1.call("tokenize", text="hello remote")
    assert reply["ok"] and reply["worker"] == "remote-w1"
    assert reply["tokens"][0] == 101 and reply["tokens"][-1] == 102  # bert's [CLS] ... [SEP]


def test_an_admin_key_is_admitted_as_a_client(pool, keys):
    broker, _, _ = pool
    admin = curve_conn(broker.endpoint, server_key(keys), keys["a1"])
    try:
        assert admin.answered(timeout=30)
    finally:
        admin.close()


def test_an_unauthorized_client_gets_no_reply_and_is_counted(pool, keys):
    broker, _, c1 = pool
    before = auth_failures(broker, "frontend")
    stranger = curve_conn(broker.endpoint, server_key(keys), keys["x"])
    try:
        assert not stranger.answered("tokenize", timeout=REFUSED_WAIT_S, text="let me in")
        wait_until(lambda: auth_failures(broker, "frontend") > before, what="the refusal to be counted")
    finally:
        stranger.close()
    assert c1.answered(timeout=30)  # the broker goes on serving the others
    x_public = (keys["root"] / "strangers" / "x.key").read_text().split('public-key = "')[1][:40]
    wait_until(lambda: f"refused a frontend peer: its CURVE key {x_public} is not in --curve-clients"
               in "".join(broker.log), what="the refusal in the broker's log")


@pytest.mark.parametrize("how", ["plain", "wrong-server-key"])
def test_a_client_without_the_brokers_key_gets_no_reply(pool, keys, how):
    broker, _, c1 = pool
    wrong_server = keys["root"] / "strangers" / "x.key"  # a valid key, but not the broker's
    client = curve_conn(broker.endpoint, None if how == "plain" else wrong_server,
                       None if how == "plain" else keys["c1"])
    before = auth_failures(broker, "frontend")
    try:
        assert not client.answered(timeout=REFUSED_WAIT_S)
    finally:
        client.close()
    assert c1.answered(timeout=30)
    if how == "wrong-server-key":  # the broker cannot read its HELLO: a protocol failure, always seen
        wait_until(lambda: auth_failures(broker, "frontend") > before, what="the failed handshake to be counted")
    # A plain client is counted only when the broker reads its greeting before the client hangs up
    # on the broker's own (both see the mismatch at once), so that count is not asserted.


def test_a_client_key_removed_plus_sighup_is_locked_out(pool, keys):
    broker, _, c1 = pool
    before_removal = curve_conn(broker.endpoint, server_key(keys), keys["c2"])
    try:
        assert before_removal.answered(timeout=30)
        (keys["root"] / "clients" / "c2.key").unlink()
        broker.proc.send_signal(signal.SIGHUP)
        before = auth_failures(broker, "frontend")

        def refused() -> bool:
            fresh = curve_conn(broker.endpoint, server_key(keys), keys["c2"])
            try:
                return not fresh.answered(timeout=1.0)
            finally:
                fresh.close()

        wait_until(refused, timeout=30, what="a new c2 connection to be refused after SIGHUP")
        assert auth_failures(broker, "frontend") > before
        assert broker.proc.poll() is None  # SIGHUP no longer ends the broker
        assert c1.answered(timeout=30)
    finally:
        before_removal.close()


def test_a_worker_key_removed_plus_sighup_keeps_that_worker_out(pool, keys):
    broker, port, c1 = pool
    w2 = start_worker(keys, port, "remote-w2", "w2")
    try:
        wait_until(lambda: c1.call("ping")["workers"] == 2, timeout=90, what="w2 to join")
        (keys["root"] / "workers" / "w2.key").unlink()
        broker.proc.send_signal(signal.SIGHUP)
        stop(w2)
        wait_until(lambda: c1.call("ping")["workers"] == 1, timeout=30, what="w2 to leave")
        before = auth_failures(broker, "backend")
        w2 = start_worker(keys, port, "remote-w2", "w2")
        wait_until(lambda: auth_failures(broker, "backend") > before, timeout=90, what="w2's comeback to be refused")
        assert w2.poll() is None  # refused, it keeps trying
        assert c1.call("ping")["workers"] == 1
        assert {c1.call("tokenize", text=f"t{i}")["worker"] for i in range(8)} == {"remote-w1"}
    finally:
        stop(w2, signal.SIGKILL)


def test_an_unauthorized_worker_gets_no_job(keys):
    port = free_port()
    broker = start_curve_broker(keys, port)
    worker = start_worker(keys, port, "rogue", "wx")
    c1 = curve_conn(broker.endpoint, server_key(keys), keys["c1"])
    try:
        wait_until(lambda: auth_failures(broker, "backend") >= 1, timeout=90, what="the rogue worker to be refused")
        assert c1.call("ping")["workers"] == 0
        reply = c1.call("tokenize", text="my secret prompt", deadline_ms=1000)
        assert not reply["ok"] and reply["error"]["code"] == "timeout"
        assert worker.poll() is None  # it kept trying: refused, not crashed
    finally:
        c1.close()
        stop(worker, signal.SIGKILL)
        broker.stop()


def test_a_refused_worker_keeps_trying_says_why_and_leaves_cleanly(pool, keys, tmp_path):
    """Two workers with a key the broker refuses, beside the admitted w1: each keeps trying and logs
    the endpoint and the refusal (the first time after one heartbeat interval); --give-up-after ends
    one with EXIT_UNREACHABLE, SIGTERM ends the other with 0; neither prints a traceback, and w1
    serves throughout."""
    _, port, c1 = pool
    endpoint = f"tcp://127.0.0.1:{port}"
    refusal = "the broker refused this worker's CURVE key"
    logs = {"patient": tmp_path / "patient.log", "limited": tmp_path / "limited.log"}
    patient = start_worker(keys, port, "rogue-patient", "wx", log=logs["patient"])
    limited = start_worker(keys, port, "rogue-limited", "wx", "--give-up-after", "1.5", log=logs["limited"])
    try:
        assert limited.wait(60) == EXIT_UNREACHABLE
        said = logs["limited"].read_text()
        assert f"could not get through to the broker at {endpoint} in 1.5s (--give-up-after): {refusal}" in said, said
        wait_until(lambda: f"cannot get through to the broker at {endpoint}: {refusal}" in logs["patient"].read_text(),
                   timeout=60, what="the refused worker to say why")
        assert patient.poll() is None
        assert c1.call("ping")["workers"] == 1 and c1.call("tokenize", text="still served")["worker"] == "remote-w1"
        patient.send_signal(signal.SIGTERM)
        assert patient.wait(30) == 0
        assert "Traceback" not in said and "Traceback" not in logs["patient"].read_text()
    finally:
        stop(patient, signal.SIGKILL)
        stop(limited, signal.SIGKILL)


@pytest.mark.parametrize("flags", [
    ("--frontend", "tcp://0.0.0.0:{port}"),
    ("--frontend", "tcp://127.0.0.1:*", "--backend", "tcp://0.0.0.0:{port}"),
], ids=["frontend", "backend"])
def test_plain_tcp_on_a_non_loopback_address_is_refused_without_insecure(flags):
    """The check runs before any bind, so nothing ever listens on 0.0.0.0 here."""
    port = free_port()
    argv = [sys.executable, "-m", "tokenbroker", "serve", "--workers", "0", "--metrics-port", "0",
            *(f.format(port=port) for f in flags)]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "not a loopback address" in lines[0]
    assert "--curve-secret-key" in lines[0] and "--insecure" in lines[0]
    assert "ready" not in out.stdout


def test_a_tcp_backend_under_curve_needs_the_worker_folder(keys):
    port = free_port()
    out = subprocess.run([sys.executable, "-m", "tokenbroker", "serve", "--workers", "0", "--metrics-port", "0",
                          "--frontend", "tcp://127.0.0.1:*", "--backend", f"tcp://127.0.0.1:{port}",
                          "--curve-secret-key", str(keys["broker"])], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert out.stderr.strip().splitlines() == [
        f"tokenbroker: the backend tcp://127.0.0.1:{port} under --curve-secret-key needs --curve-workers DIR "
        f"(the public .key files of the workers it admits)"]


def test_local_workers_join_a_curve_tcp_backend_with_a_throwaway_key(keys):
    """--workers N with a CURVE tcp:// backend: the broker's own workers are admitted without a folder entry."""
    port = free_port()
    root = keys["root"]
    broker = start_broker("--curve-secret-key", str(keys["broker"]), "--curve-workers", str(root / "workers"),
                          "--backend", f"tcp://127.0.0.1:{port}", "--model", f"bert={BERT_DIR}", workers=1)
    c = curve_conn(broker.endpoint, server_key(keys), keys["x"])  # no --curve-clients: any client key
    try:
        reply = c.call("tokenize", text="hello local")
        assert reply["ok"] and reply["tokens"][0] == 101
    finally:
        c.close()
    assert broker.stop() == 0  # the ZAP and monitor threads stop before the context ends
