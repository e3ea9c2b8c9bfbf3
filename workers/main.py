"""The worker process: one DEALER on the broker's backend, owned by the thread that computes.

The main thread polls the socket, takes every job that has arrived (the broker sends them in
batches), runs them, and sends their results in one message: one hand-off per batch, no queue
between threads. The round is compiled code over libzmq (workers/_round.pyx): B_JOBS are held as
libzmq received them, a plain tokenize of a cache-less model is read in place, encoded and its
reply written into the W_RESULTS frame; Python serves the rest (Ops.run) and every control message. Heartbeats go out between batches; during a long batch a small beat thread
borrows the socket under a lock (the main thread holds it whenever it touches the socket, and
never while it computes), so a busy worker still says it is alive, but only while the batch is
within its budget: a compute thread stuck past its jobs' deadlines stops heartbeating, and the
broker replaces the worker (the watchdog).

Getting through to the broker, at the start and after it went silent, is workers/join.py's: a worker
that cannot (refused, broker not up yet, network down) keeps trying and says why, until SIGTERM or
--give-up-after. SIGTERM: say BYE, take what the broker sent before it read the BYE, finish, leave.

Jobs that can run long go to lanes (background.py): a chat rendered by jinja2 (a template MiniJinja
does not serve, chat/gate.py; MiniJinja renders in the round, bounded by fuel), the encode of a long
plain text and a large count run on their own threads, waiting on the render child or in the
tokenizer without the GIL, and the poll watches their pipes: the rounds go on meanwhile, and a
finished job is answered in the next turn. The broker sends a worker small jobs while it holds a long text (broker/dispatch.py).
Each turn the lanes' watchdogs run: a lane job a second past its deadline is answered and the lane
goes on with a fresh thread (its render child killed); heartbeats carry each lane's `wedged` count.

A worker whose private memory passes its ceiling (--max-memory) leaves on purpose, as on SIGTERM:
the round it was in is answered, BYE goes out, what the broker sent before it read the BYE is
served, and the process exits with EXIT_RECYCLED; the supervisor forks a fresh one from the template
at once. Nothing is lost (the broker sends a draining worker nothing new and waits for what it
holds) and nothing runs twice. Private memory comes from the same read of smaps_rollup as the PSS
that heartbeats carry (PSS_EVERY_S): the ceiling adds no read.

Models load in the background when the broker says B_LOAD (loader.py); the poll watches the
loader's pipe too, so a finished load is installed and said (W_LOADED) between two rounds. READY
is built from the registry each time it goes out: it lists the models loaded at that moment.
"""

from __future__ import annotations

import os

from tokenbroker.common.process import (EXIT_BOOT_ERROR, EXIT_RECYCLED, EXIT_UNREACHABLE, PARENT_PID_ENV, memory_figures,
                                        resident_bytes, use_one_thread)

use_one_thread()  # before tokenizers is first imported (common/process.py)

import logging
import signal
import socket
import sys
import threading
import time
import uuid
from typing import Any, cast

import zmq

from tokenbroker.common.errors import BootError
from tokenbroker.common.protocol import (
    B_HEARTBEAT,
    B_JOBS,
    B_LOAD,
    B_RESET,
    B_UNLOAD,
    HEARTBEAT_INTERVAL_S,
    HEARTBEAT_LIVENESS,
    OUTCOME_INDEX,
    PROTOCOL_VERSION,
    W_BYE,
    W_HEARTBEAT,
    W_LOADED,
    W_READY,
    W_RESULTS,
    Ready,
    pack,
    pack_results,
)

from ._round import Round
from .background import LANE_SWITCH_S, Lane
from .config import WorkerConfig
from .join import BrokerUnreachable, join
from .loader import Loader, ModelInstaller
from .ops import OFFLOAD_BYTES, Ops, PendingJob
from .registry import ModelRegistry
from .zygote import Zygote

log = logging.getLogger(__name__)

MAX_ROUND_JOBS = 256  # jobs run in one round before their results go out
WATCHDOG_GRACE_S = 2.0  # a round may run this long past its jobs' budgets before heartbeats stop
LARGE_FRAME = 1 << 16  # payloads longer than this go to Python as views of ZeroMQ's buffer, never copied
PSS_EVERY_S = 5.0  # PSS is read at most this often (a page-table walk), RSS with every heartbeat
LANE_DRAIN_S = 11.0  # leaving, a worker waits this long for its renders and encodes (a render's budget is 10 s)


_SNDMORE = int(zmq.SNDMORE)
_raw_send: Any = zmq.backend.Socket.send  # the Cython method under pyzmq's send_multipart (10-18 us a message; this 1-2 us a frame)
_COPY_THRESHOLD = zmq.COPY_THRESHOLD


def send_frames(sock: zmq.Socket, frames: list[bytes]) -> None:
    """sock.send_multipart(frames), frame by frame through the Cython send with int flags; a frame
    of ZeroMQ's copy threshold or more goes without a copy (bytes: nothing can change it)."""
    last = len(frames) - 1
    for i, frame in enumerate(frames):
        _raw_send(sock, frame, _SNDMORE if i < last else 0, len(frame) < _COPY_THRESHOLD)


def build_ready(config: WorkerConfig, name: str, incarnation: str, registry: ModelRegistry) -> Ready:
    """READY as of now: the models loaded at this moment, with their names, fingerprints and infos."""
    return Ready(
        version=PROTOCOL_VERSION,
        capacity=config.capacity,
        name=name,
        pid=os.getpid(),
        host=socket.gethostname(),
        models=[m.name for m in registry.models],
        incarnation=incarnation,
        fingerprints={m.name: m.fingerprint for m in registry.models},
        names=[n for m in registry.models for n in m.names],
        maps=[glob for glob, _ in config.models.tokenizer_map],
        infos={m.name: m.info().to_wire() for m in registry.models},
        engine_limit=registry.engine_limit,
    )


class Worker:
    def __init__(self, ctx: zmq.Context, config: WorkerConfig, name: str, ops: Ops, registry: ModelRegistry) -> None:
        self.ctx = ctx
        self.config = config
        self.name = name
        self.incarnation = uuid.uuid4().hex  # a reconnect of this process keeps it
        self.ops = ops
        self.registry = registry
        self.loader = Loader(config.models.cache)
        # jinja2 chats render, and long texts and large counts encode, while the rounds go on (workers/background.py).
        sys.setswitchinterval(LANE_SWITCH_S)  # a process setting, for the lanes (workers/background.py LANE_SWITCH_S)
        self.lanes = (Lane("render"), Lane("encode"))
        ops.renders, ops.encodes = self.lanes
        self.installer = ModelInstaller(registry, self.loader, config.models.max_models)
        self.lock = threading.Lock()  # held by whoever touches `sock`
        self.round = Round(B_JOBS, W_RESULTS, OUTCOME_INDEX)  # workers/_round.pyx
        self.sock: zmq.Socket | None = None
        self.poller: zmq.Poller | None = None
        self.unloads: list[bytes] = []  # B_UNLOAD bodies, applied after the jobs that came before them
        self.leaving = threading.Event()  # set on SIGTERM or SIGINT
        self.served = 0
        self.stats: dict = registry.cache_stats()
        self.backends: dict[str, str] = registry.backends()  # model -> engine, as the switch to fastokens comes later
        self.engines: dict[str, int] = registry.engines()  # fast engines: limit, served, threads (workers/engine.py)
        self.next_beat = 0.0
        self.pss: int | None = None  # proportional set size as last read (PSS_EVERY_S)
        self.private: int | None = None  # private memory as last read, with PSS: what --max-memory bounds
        self.recycled = False  # left because its memory passed --max-memory
        self.unreachable = False  # gave up getting through to the broker (--give-up-after)
        self.pss_at = 0.0
        self.round_until: float | None = None  # while a round computes: when it is overdue
        self.stuck_logged = False
        parent = os.environ.get(PARENT_PID_ENV, "")
        self.parent_pid = int(parent) if parent.isdigit() else None

    # --- the socket ----------------------------------------------------------------------

    def _connect(self) -> zmq.Socket | None:
        """A socket the broker has answered (workers/join.py: however long that takes, saying why
        meanwhile), polled with the loader's and the lanes' pipes; None when the worker leaves
        first (SIGTERM, its broker gone) or gave up (--give-up-after: `unreachable` says so)."""
        curve = (self.config.curve_server_key, self.config.curve_secret_key)
        try:
            sock = join(self.ctx, self.config.connect, curve, self._ready, self._stopping, self.config.give_up_after)
        except BrokerUnreachable as e:
            log.error("leaving: %s", e)
            self.unreachable = True
            return None
        if sock is None:
            return None
        self.poller = zmq.Poller()
        self.poller.register(sock, zmq.POLLIN)
        self.poller.register(self.loader.fd, zmq.POLLIN)
        for lane in self.lanes:
            self.poller.register(lane.fd, zmq.POLLIN)
        return sock

    def _stopping(self) -> bool:
        """Whether a worker still getting through should stop trying: SIGTERM, or its broker is gone."""
        if self.orphaned() and not self.leaving.is_set():
            log.warning("the broker that started this worker (pid %s) is gone: leaving", self.parent_pid)
            self.leaving.set()
        return self.leaving.is_set()

    def _ready(self) -> bytes:
        return build_ready(self.config, self.name, self.incarnation, self.registry).to_wire()

    def _heartbeat(self) -> list[bytes]:
        now = time.monotonic()
        if now >= self.pss_at:
            self.pss, self.private = memory_figures() or (None, None)
            self.pss_at = now + PSS_EVERY_S
        body = {
            "incarnation": self.incarnation,
            "pid": os.getpid(),
            "rss": resident_bytes(),
            "pss": self.pss,  # None where /proc/self/smaps_rollup is not there
            "private": self.private,  # pages no other process maps: what --max-memory bounds
            "served": self.served,
            "caches": self.stats,
            "backends": self.backends,
            "engines": self.engines,  # the fast engines' per-thread limit, how many, threads of their own
            "lanes": {lane.name: lane.report() for lane in self.lanes},  # "wedged": threads given up on, still in a call
        }
        return [W_HEARTBEAT, pack(body)]

    def _send(self, frames: list[bytes]) -> None:
        """Send with the lock held; a message that cannot go out in time is dropped (the broker
        retries what it never hears of, once it gives up on this worker)."""
        if self.sock is None:  # left while getting through again: no broker to tell
            return
        try:
            send_frames(self.sock, frames)
        except zmq.Again:
            log.warning("could not send to the broker within %.1fs: a message was dropped", HEARTBEAT_INTERVAL_S)

    def orphaned(self) -> bool:
        """A local worker outlives a killed broker otherwise (it would reconnect forever)."""
        return self.parent_pid is not None and os.getppid() != self.parent_pid

    # --- the loop ------------------------------------------------------------------------

    def run(self) -> None:
        with self.lock:
            self.sock = self._connect()
        beat = threading.Thread(target=self._beat_while_busy, name="tokenbroker-beat", daemon=True)
        beat.start()
        liveness, heard = HEARTBEAT_LIVENESS, False
        self.next_beat = time.monotonic() + HEARTBEAT_INTERVAL_S
        bye_at: float | None = None  # when BYE went out
        drained = False  # the broker has read our BYE: nothing more is on its way
        fds = [self.loader.fd, *(lane.fd for lane in self.lanes)]  # what Round.spin polls beside the socket
        while self.sock is not None:  # None: left (or gave up) while getting through again
            with self.lock:
                if self.leaving.is_set() and bye_at is None:
                    self._send([W_BYE])
                    bye_at = time.monotonic()
                busy = any(lane.pending for lane in self.lanes)
                drain_s = 2 * HEARTBEAT_INTERVAL_S + (LANE_DRAIN_S if busy else 0.0)
                if bye_at is not None and ((drained and not busy) or time.monotonic() - bye_at > drain_s):
                    break
                rest, spun, stop = None, False, False
                if bye_at is None and not self.round.jobs:  # the rounds in C, until Python is needed
                    rest, spun, stop = self._spin(fds)
                timeout_ms = 0 if spun else int(max(0.0, self.next_beat - time.monotonic()) * 1000)  # as Poller.poll rounds a float
                events = dict(cast(zmq.Poller, self.poller).poll(timeout_ms))
                if spun or self.sock in events:
                    liveness, heard = HEARTBEAT_LIVENESS, True
                if self.sock in events and rest is None and not stop:  # (a served round is sent before more is taken)
                    drained |= self._take(bye_at is not None)
                if self.loader.fd in events:
                    for loaded in self.installer.finished():
                        self._send([W_LOADED, loaded.to_wire()])
                now = time.monotonic()
                for lane in self.lanes:
                    lane.watch(now)  # a job past its deadline is answered there; the lane goes on
                finished = [lane for lane in self.lanes if lane.fd in events]
                if now >= self.next_beat:
                    self._stopping()  # its broker gone: leaving is set, and said once
                    self.stats = self.registry.cache_stats()
                    self.backends = self.registry.backends()
                    self.engines = self.registry.engines()
                    self._send(self._heartbeat())
                    self.next_beat = now + HEARTBEAT_INTERVAL_S
                    if self._past_ceiling():
                        self.leaving.set()  # BYE at the next turn: the rounds taken are served first
                    if not heard:
                        liveness -= 1
                    heard = False
                    if liveness <= 0 and bye_at is None:
                        log.warning("broker silent for %.1fs; reconnecting", HEARTBEAT_INTERVAL_S * HEARTBEAT_LIVENESS)
                        self.sock.close(linger=0)
                        self.sock = self._connect()
                        liveness = HEARTBEAT_LIVENESS
            for lane in finished:
                self._send_results(self.ops.finish_deferred(lane))
            if self.round.jobs:
                self._run_round(rest)
            while self.unloads:
                self.installer.unload(self.unloads.pop(0))
        self.loader.close()
        for lane in self.lanes:
            lane.close()
        with self.lock:
            if self.sock is not None:
                self.sock.close(linger=2000)
            self.sock = None

    def _past_ceiling(self) -> bool:
        """Whether private memory, as the heartbeat last read it with PSS, has passed --max-memory;
        says so once, and marks the exit as a recycle."""
        ceiling = self.config.max_memory
        if not ceiling or self.recycled or self.leaving.is_set() or self.private is None or self.private < ceiling:
            return False
        log.warning("private memory %d MiB is past the ceiling of %d MiB (--max-memory) after %d jobs: leaving, "
                    "a fresh worker takes this one's place", self.private >> 20, ceiling >> 20, self.served)
        self.recycled = True
        return True

    def _take(self, after_bye: bool) -> bool:
        """Read what has arrived (up to a round's worth); True when a heartbeat followed our BYE.

        B_JOBS are taken by the compiled round (workers/_round.pyx: held as libzmq received them,
        read in place); every other message comes back here (`_control`)."""
        drained = False
        sock = cast(zmq.Socket, self.sock)
        while True:
            try:
                frames = self.round.take(sock, MAX_ROUND_JOBS)
            except ValueError as e:
                log.warning("ignoring a malformed job batch: %s", e)
                continue
            if frames is None:
                return drained
            heard_bye, stop = self._control(frames, after_bye)
            drained |= heard_bye
            if stop:
                return drained

    def _control(self, frames: list[bytes], after_bye: bool) -> tuple[bool, bool]:
        """A message from the broker other than B_JOBS: (a heartbeat followed our BYE, stop reading).
        An UNLOAD stops the reading: the jobs before it are served with the model, and what follows
        it is read once the model is gone (the broker sends in order)."""
        kind = frames[0]
        if kind == B_HEARTBEAT or (kind == B_RESET and after_bye):
            # the broker sends in order: every job it sent before is here (a RESET after our BYE: it
            # has let this worker go, so nothing more is on its way)
            return after_bye, False
        if kind == B_RESET and not after_bye:
            log.warning("the broker had forgotten this worker (it was silent): saying READY again")
            self._send([W_READY, self._ready()])
        elif kind == B_LOAD and len(frames) == 2:
            for loaded in self.installer.load(frames[1], leaving=after_bye or self.leaving.is_set()):
                self._send([W_LOADED, loaded.to_wire()])
        elif kind == B_UNLOAD and len(frames) == 2:
            self.unloads.append(frames[1])
            return False, True
        else:
            log.warning("ignoring a backend message of kind %r with %d frames", kind[:8], len(frames))
        return False, False

    def _spin(self, fds: list[int]) -> tuple[list | None, bool, bool]:
        """Serve rounds in C until Python is needed or the next heartbeat is due (Round.spin, which
        polls the socket and `fds`): (the jobs a round left for Ops.run, or None; anything arrived;
        an UNLOAD came, so nothing more is read this turn)."""
        ops = self.ops
        try:
            frames, rest, sent, heard, dropped = self.round.spin(
                cast(zmq.Socket, self.sock), fds, self.next_beat, ops.plain_engine, ops.alone, OFFLOAD_BYTES,
                LARGE_FRAME, ops.limits.max_reply_bytes, MAX_ROUND_JOBS)
        except ValueError as e:
            log.warning("ignoring a malformed job batch: %s", e)
            return None, True, False
        self.served += sent
        for _ in range(dropped):
            log.warning("could not send to the broker within %.1fs: a message was dropped", HEARTBEAT_INTERVAL_S)
        stop = frames is not None and self._control(frames, False)[1]
        return rest, heard, stop

    def _run_round(self, rest: list | None = None) -> None:
        """Serve the round taken: the compiled round answers the plain tokenizes of cache-less models
        in place, Ops.run the jobs it hands back (`rest`, when Round.spin has served the round
        already); one W_RESULTS for them all."""
        rnd, ops = self.round, self.ops
        self.round_until = time.monotonic() + rnd.max_budget_ms / 1000 + WATCHDOG_GRACE_S
        try:
            if rest is None:
                rest = rnd.serve(ops.plain_engine, ops.alone, OFFLOAD_BYTES, LARGE_FRAME, ops.limits.max_reply_bytes)
            if rest:
                rnd.add(ops.run([PendingJob(*job) for job in rest]))
        finally:
            self.round_until = None
            self.stuck_logged = False
            self.served += rnd.results
            with self.lock:
                if rnd.send(cast(zmq.Socket, self.sock)) < 0:
                    log.warning("could not send to the broker within %.1fs: a message was dropped", HEARTBEAT_INTERVAL_S)

    def _send_results(self, results: list) -> None:
        """One W_RESULTS message (none when a round only started renders)."""
        if not results:
            return
        self.served += len(results)
        with self.lock:
            self._send(pack_results(results))

    def _beat_while_busy(self) -> None:
        """Heartbeats while a round computes; none once it is overdue, so the broker replaces us."""
        while self.sock is not None or not self.leaving.is_set():
            time.sleep(HEARTBEAT_INTERVAL_S / 4)
            until = self.round_until
            if until is None or time.monotonic() < self.next_beat:
                continue
            if time.monotonic() > until:
                if not self.stuck_logged:
                    log.error("a batch of jobs is running past its deadline: heartbeats stop so the broker replaces this worker")
                    self.stuck_logged = True
                continue
            if not self.lock.acquire(blocking=False):
                continue  # the main thread has the socket: it beats itself
            try:
                if self.sock is not None and self.round_until is not None:
                    self._send(self._heartbeat())
                    self.next_beat = time.monotonic() + HEARTBEAT_INTERVAL_S
            finally:
                self.lock.release()


def serve(config: WorkerConfig) -> int:
    """`tokenbroker worker`: load the startup models, then serve (or, with --zygote-fd, be the
    template that local workers are forked from: workers/zygote.py)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s worker %(process)d %(levelname)s %(name)s: %(message)s")
    try:
        registry = ModelRegistry(config.models)
    except BootError as e:
        print(f"tokenbroker worker: cannot load tokenizers: {e}", file=sys.stderr, flush=True)
        return EXIT_BOOT_ERROR
    if config.zygote_fd is not None:
        return Zygote(config, registry, run).run()
    return run(config, registry)


def run(config: WorkerConfig, registry: ModelRegistry) -> int:
    """Serve with models already loaded: here, or in the template this process was forked from, which
    created no ZeroMQ context, socket or thread (each worker makes its own here)."""
    name = config.name or f"{socket.gethostname()}-{os.getpid()}"
    ctx = zmq.Context()
    worker = Worker(ctx, config, name, Ops(registry, name), registry)
    def leave(*_: object) -> None:
        worker.leaving.set()
        worker.loader.wake()

    signal.signal(signal.SIGTERM, leave)
    signal.signal(signal.SIGINT, leave)
    worker.run()
    code = EXIT_RECYCLED if worker.recycled else EXIT_UNREACHABLE if worker.unreachable else 0
    ctx.term()
    if not worker.loader.idle(timeout=1.0):
        # The loader thread is inside a library call (building or probing a fast engine): a daemon
        # thread unwound at interpreter exit through Rust frames aborts the process. Nothing of it
        # is needed any more: leave without finalizing.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code
