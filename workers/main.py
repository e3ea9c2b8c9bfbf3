"""The worker process: a DEALER on the broker's backend, one I/O thread and one compute thread.

The I/O thread owns the socket: it says READY, takes jobs into a queue, sends results and
heartbeats on time even while a long job runs, and reconnects with doubling backoff (the
Paranoid Pirate worker) when the broker goes silent. The main thread only computes.
SIGTERM: say BYE (no new jobs), finish the jobs held, send their results, leave.
"""

from __future__ import annotations

import os

# One worker uses one core: the tokenizers library's thread pool must not fan out (set before import).
os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("RAYON_RS_NUM_CPUS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import logging
import queue
import signal
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field

import msgpack
import zmq

from tokenbroker.common.config import WorkerConfig
from tokenbroker.common.curve import apply_client_curve
from tokenbroker.common.errors import BootError
from tokenbroker.common.process import resident_bytes
from tokenbroker.common.protocol import (
    B_HEARTBEAT,
    B_JOB,
    EXIT_BOOT_ERROR,
    HEARTBEAT_INTERVAL_S,
    HEARTBEAT_LIVENESS,
    PARENT_PID_ENV,
    PROTOCOL_VERSION,
    W_BYE,
    W_HEARTBEAT,
    W_READY,
    W_RESULT,
    Ready,
    pack,
)

from .ops import Ops
from .registry import ModelRegistry

log = logging.getLogger(__name__)

RECONNECT_INIT_S = 0.1
RECONNECT_MAX_S = 5.0
STATS_EVERY_S = 0.2


@dataclass
class Job:
    job_id: bytes
    budget_ms: int
    received: float
    payload: bytes


@dataclass
class Shared:
    """What the two threads share; each field has one writer."""

    jobs: "queue.Queue[Job | None]" = field(default_factory=queue.Queue)
    stats: dict = field(default_factory=dict)  # written by the compute thread
    served: int = 0  # written by the compute thread
    leaving: threading.Event = field(default_factory=threading.Event)  # set on SIGTERM or SIGINT
    held: int = 0  # jobs received and not yet answered; written by the I/O thread only


class IoThread(threading.Thread):
    def __init__(self, ctx: zmq.Context, config: WorkerConfig, name: str, ready: Ready, shared: Shared) -> None:
        super().__init__(name="tokenbroker-io", daemon=True)
        self.ctx = ctx
        self.config = config
        self.worker_name = name
        self.ready = ready
        self.shared = shared
        self.results_endpoint = f"inproc://results-{id(self)}"
        self.results = ctx.socket(zmq.PULL)
        self.results.bind(self.results_endpoint)
        self.incarnation = uuid.uuid4().hex
        self.done = threading.Event()
        parent = os.environ.get(PARENT_PID_ENV, "")
        self.parent_pid = int(parent) if parent.isdigit() else None

    def orphaned(self) -> bool:
        """A local worker outlives a killed broker otherwise (it would reconnect forever)."""
        return self.parent_pid is not None and os.getppid() != self.parent_pid

    def _connect(self) -> zmq.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, self.worker_name.encode())
        sock.setsockopt(zmq.LINGER, 2000)
        apply_client_curve(sock, self.config.curve_server_key, self.config.curve_secret_key)  # common/curve.py
        sock.connect(self.config.connect)
        sock.send_multipart([W_READY, self.ready.to_wire()])
        return sock

    def _heartbeat(self) -> list[bytes]:
        body = {
            "incarnation": self.incarnation,
            "pid": os.getpid(),
            "rss": resident_bytes(),
            "served": self.shared.served,
            "caches": self.shared.stats,
        }
        return [W_HEARTBEAT, pack(body)]

    def run(self) -> None:
        sock = self._connect()
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self.results, zmq.POLLIN)
        interval = HEARTBEAT_INTERVAL_S
        liveness = HEARTBEAT_LIVENESS
        backoff = RECONNECT_INIT_S
        next_beat = time.monotonic() + interval
        said_bye = False
        while True:
            if self.shared.leaving.is_set() and not said_bye:
                sock.send_multipart([W_BYE])
                said_bye = True
            if said_bye and self.shared.held == 0:
                break
            events = dict(poller.poll(max(0.0, next_beat - time.monotonic()) * 1000))
            now = time.monotonic()
            if self.results in events:
                while True:
                    try:
                        frames = self.results.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    sock.send_multipart([W_RESULT, *frames])
                    self.shared.held -= 1
            if sock in events:
                liveness = HEARTBEAT_LIVENESS
                backoff = RECONNECT_INIT_S
                while True:
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._on_broker(frames, now)
            if now >= next_beat:
                if self.orphaned():
                    log.warning("the broker that started this worker (pid %s) is gone: leaving", self.parent_pid)
                    self.shared.leaving.set()
                sock.send_multipart(self._heartbeat())
                next_beat = now + interval
                if sock not in events:
                    liveness -= 1
                if liveness <= 0 and not said_bye:
                    log.warning("broker silent for %.1fs; reconnecting in %.1fs", interval * HEARTBEAT_LIVENESS, backoff)
                    poller.unregister(sock)
                    sock.close(linger=0)
                    time.sleep(backoff)
                    backoff = min(backoff * 2, RECONNECT_MAX_S)
                    sock = self._connect()
                    poller.register(sock, zmq.POLLIN)
                    liveness = HEARTBEAT_LIVENESS
        sock.close(linger=2000)
        self.results.close(linger=0)
        self.shared.jobs.put(None)
        self.done.set()

    def _on_broker(self, frames: list[bytes], now: float) -> None:
        kind = frames[0]
        if kind == B_JOB and len(frames) == 4:
            _, job_id, meta, payload = frames
            try:
                budget = int(msgpack.unpackb(meta).get("budget_ms", 0))
            except Exception:
                budget = 0
            self.shared.held += 1
            self.shared.jobs.put(Job(job_id, budget, now, payload))
        elif kind != B_HEARTBEAT:
            log.warning("ignoring a backend message of kind %r with %d frames", kind, len(frames))


def serve(config: WorkerConfig) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s worker %(process)d %(levelname)s %(name)s: %(message)s")
    name = config.name or f"{socket.gethostname()}-{os.getpid()}"
    try:
        registry = ModelRegistry(config.models)
    except BootError as e:
        print(f"tokenbroker worker: cannot load tokenizers: {e}", file=sys.stderr, flush=True)
        return EXIT_BOOT_ERROR
    shared = Shared(stats=registry.cache_stats())
    signal.signal(signal.SIGTERM, lambda *_: shared.leaving.set())
    signal.signal(signal.SIGINT, lambda *_: shared.leaving.set())
    ready = Ready(
        version=PROTOCOL_VERSION,
        capacity=config.capacity,
        name=name,
        pid=os.getpid(),
        host=socket.gethostname(),
        models=[m.name for m in registry.models],
    )
    ctx = zmq.Context()
    io = IoThread(ctx, config, name, ready, shared)
    out = ctx.socket(zmq.PUSH)
    out.connect(io.results_endpoint)
    io.start()
    ops = Ops(registry, name)
    last_stats = 0.0
    while True:
        try:
            job = shared.jobs.get(timeout=0.5)
        except queue.Empty:
            shared.stats = registry.cache_stats()
            if io.done.is_set():
                break
            continue
        if job is None:
            break
        if job.budget_ms and (time.monotonic() - job.received) * 1000 > job.budget_ms:
            # the broker answers `timeout` (now or already): don't spend the core on it
            out.send_multipart([job.job_id, b"", b"skipped"])
        else:
            payload, outcome = ops.handle(job.payload)
            out.send_multipart([job.job_id, payload, b"" if outcome == "ok" else outcome.encode()])
        shared.served += 1
        now = time.monotonic()
        if now - last_stats >= STATS_EVERY_S or shared.jobs.empty():
            shared.stats = registry.cache_stats()
            last_stats = now
    io.join(timeout=5)
    out.close(linger=0)
    ctx.term()
    return 0
