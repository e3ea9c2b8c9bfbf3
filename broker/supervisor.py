"""Local worker processes: spawn, reap, respawn with backoff, stop. Never sees a request.

Workers are started as fresh interpreters (`python -m tokenbroker worker ...`) from a spec of
flags, never forked from a broker that has started threads. A worker that cannot load its
tokenizers exits with EXIT_BOOT_ERROR: that is a configuration error, not a crash, so it is not
respawned (the broker refuses to start, or logs and runs short).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from tokenbroker.common.process import EXIT_BOOT_ERROR, ONE_THREAD_ENV, PARENT_PID_ENV

log = logging.getLogger(__name__)

BACKOFF_INIT_S = 0.5
BACKOFF_MAX_S = 30.0
STABLE_S = 10.0  # a worker that lived this long died of something new: respawn at once


@dataclass
class Child:
    slot: int
    name: str
    proc: subprocess.Popen
    started: float


@dataclass(frozen=True)
class Exit:
    slot: int
    name: str
    pid: int
    returncode: int
    killed_as_hung: bool = False  # the supervisor killed it for not answering heartbeats

    @property
    def boot_error(self) -> bool:
        return self.returncode == EXIT_BOOT_ERROR

    def describe(self) -> str:
        if self.killed_as_hung:
            return f"worker {self.name} (pid {self.pid}) was killed for not answering heartbeats"
        if self.returncode < 0:
            try:
                sig = signal.Signals(-self.returncode).name
            except ValueError:  # a real-time signal or one Python has no name for
                sig = f"signal {-self.returncode}"
            hint = " (killed: out of memory?)" if self.returncode == -signal.SIGKILL else ""
            return f"worker {self.name} (pid {self.pid}) was killed by {sig}{hint}"
        return f"worker {self.name} (pid {self.pid}) exited with status {self.returncode}"


class Supervisor:
    """Keeps `count` local workers alive, each connected to `connect` with `worker_argv`."""

    def __init__(self, *, count: int, connect: str, worker_argv: list[str], name_prefix: str) -> None:
        self.count = count
        self.connect = connect
        self.worker_argv = worker_argv
        self.name_prefix = name_prefix
        self.children: dict[int, Child] = {}
        self.respawn_at: dict[int, float] = {}
        self.backoff: dict[int, float] = {}
        self.generation = 0
        self.restarts = 0
        self.stopping = False
        self.killed_as_hung: set[str] = set()

    def start(self) -> None:
        for slot in range(self.count):
            self.spawn(slot)

    def spawn(self, slot: int) -> Child:
        self.generation += 1
        name = f"{self.name_prefix}-{slot}.{self.generation}"
        argv = [sys.executable, "-m", "tokenbroker", "worker", "--connect", self.connect, "--name", name, *self.worker_argv]
        env = {**os.environ, **ONE_THREAD_ENV}
        env[PARENT_PID_ENV] = str(os.getpid())  # the worker leaves when its broker is gone, even by SIGKILL
        proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, start_new_session=True)
        child = Child(slot, name, proc, time.monotonic())
        self.children[slot] = child
        log.info("started worker %s (pid %d)", name, proc.pid)
        return child

    def reap(self, now: float) -> list[Exit]:
        """Collect dead children and schedule their respawn (boot errors are not respawned)."""
        exits = []
        for slot, child in list(self.children.items()):
            code = child.proc.poll()
            if code is None:
                continue
            del self.children[slot]
            ex = Exit(slot, child.name, child.proc.pid, code, killed_as_hung=child.name in self.killed_as_hung)
            self.killed_as_hung.discard(child.name)
            exits.append(ex)
            if self.stopping:
                continue
            if ex.boot_error:
                log.error("%s: it cannot load its tokenizers; not restarting it", ex.describe())
                continue
            log.error("%s; restarting it", ex.describe())
            lived = now - child.started
            delay = 0.0 if lived > STABLE_S else min(self.backoff.get(slot, BACKOFF_INIT_S / 2) * 2, BACKOFF_MAX_S)
            self.backoff[slot] = delay if delay else BACKOFF_INIT_S / 2
            self.respawn_at[slot] = now + delay
        return exits

    def tick(self, now: float) -> None:
        for slot, at in list(self.respawn_at.items()):
            if now >= at and not self.stopping:
                del self.respawn_at[slot]
                self.restarts += 1
                self.spawn(slot)

    def kill(self, name: str) -> None:
        """A local worker that stopped answering heartbeats is hung: kill it so it is replaced."""
        for child in self.children.values():
            if child.name == name:
                log.error("worker %s (pid %d) stopped answering: killing it", name, child.proc.pid)
                self.killed_as_hung.add(name)
                _signal(child.proc, signal.SIGKILL)

    def terminate(self) -> None:
        self.stopping = True
        self.respawn_at.clear()
        for child in self.children.values():
            _signal(child.proc, signal.SIGTERM)

    def wait(self, timeout: float) -> None:
        """Wait for every child; SIGKILL the ones still there after `timeout`."""
        deadline = time.monotonic() + timeout
        for child in self.children.values():
            try:
                child.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("worker %s did not stop in time: killing it", child.name)
                _signal(child.proc, signal.SIGKILL)
                child.proc.wait()
        self.children.clear()


def _signal(proc: subprocess.Popen, sig: int) -> None:
    try:
        proc.send_signal(sig)
    except ProcessLookupError:
        pass
