"""Local worker processes: spawn, reap, respawn with backoff, stop. Never sees a request.

Two ways to start them (`--worker-start`):

- fork (the default where the OS forks): one template process (workers/zygote.py), a fresh
  interpreter with the workers' flags, loads the startup models once and forks each worker on
  request, so every local worker shares the template's copy of those models (docs/sizing.md,
  "Memory"). The broker itself never loads a tokenizer and never forks: it has threads. The workers
  are the template's children, so the template reports their pids and exits over a pipe; should the
  template die, its workers are killed and replaced through a new template.
- exec: each worker a fresh interpreter (`python -m tokenbroker worker ...`) that loads its own copy.

A worker whose private memory passed its ceiling (--worker-max-memory) leaves on purpose with
EXIT_RECYCLED once the broker has what it held: it is replaced at once and counted as a recycle, not
a restart (a worker that passes it within STABLE_S of its start is replaced with the crash backoff:
its ceiling is too low for what it loads).

A worker that cannot load its tokenizers exits with EXIT_BOOT_ERROR (in fork mode the template
does, for all of them): that is a configuration error, not a crash, so it is not respawned (the
broker refuses to start, or logs and runs short).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from tokenbroker.common.process import (
    EXIT_BOOT_ERROR,
    EXIT_RECYCLED,
    ONE_THREAD_ENV,
    PARENT_PID_ENV,
    ZYGOTE_EXIT,
    ZYGOTE_FORK,
    ZYGOTE_FORKED,
    ZYGOTE_LOADED,
    signal_process,
)

log = logging.getLogger(__name__)

BACKOFF_INIT_S = 0.5
BACKOFF_MAX_S = 30.0
STABLE_S = 10.0  # a worker that lived this long died of something new: respawn at once
WORKER_START_MODES = ("fork", "exec")


class Spawned:
    """A worker started as its own interpreter: a Popen."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc

    @property
    def pid(self) -> int | None:
        return self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()

    def signal(self, sig: int) -> None:
        signal_process(self.proc.pid, sig)


@dataclass(eq=False)
class Forked:
    """A worker the template forks: its pid once the template said it, its code once it said it left."""

    name: str
    pid: int | None = None
    returncode: int | None = None
    note: str = ""  # why it was stopped, when the template died under it

    def poll(self) -> int | None:
        return self.returncode

    def signal(self, sig: int) -> None:
        if self.pid and self.returncode is None:
            signal_process(self.pid, sig)


class Template:
    """The template process (workers/zygote.py) and the workers it forked: `fork` asks for one, `pump`
    reads what it reported (pids, exits) and notices when it died."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        report_r, report_w = os.pipe()
        self.proc = subprocess.Popen([*argv, "--zygote-fd", str(report_w)], env=env, stdin=subprocess.PIPE,
                                     pass_fds=(report_w,), start_new_session=True)
        os.close(report_w)
        os.set_blocking(report_r, False)
        self.report_fd = report_r
        self.forked: dict[str, Forked] = {}  # name -> worker, until it has left
        self.by_pid: dict[int, Forked] = {}
        self._pending = b""
        self.loaded = False
        log.info("started the template worker (pid %d): it loads the models the workers share", self.proc.pid)

    @property
    def fd(self) -> int:
        """Readable when the template has reported something (or died)."""
        return self.report_fd

    def fork(self, name: str) -> Forked:
        child = Forked(name)
        self.forked[name] = child
        try:
            self.proc.stdin.write(f"{ZYGOTE_FORK} {name}\n".encode())  # type: ignore[union-attr]
            self.proc.stdin.flush()  # type: ignore[union-attr]
        except (BrokenPipeError, ValueError):  # it died: pump() says so for every worker it held
            pass
        return child

    def alive(self) -> bool:
        return self.proc.poll() is None

    def pump(self) -> None:
        """Apply every report; once the template has died, settle every worker it still held."""
        dead = self.proc.poll() is not None
        self._read()
        if dead:
            self._orphan(self.proc.returncode)

    def _read(self) -> None:
        try:
            while data := os.read(self.report_fd, 65536):
                self._pending += data
        except BlockingIOError:
            pass
        *lines, self._pending = self._pending.split(b"\n")
        for line in lines:
            words = line.decode("utf-8", "replace").split()
            if len(words) == 3 and words[0] == ZYGOTE_FORKED and words[1] in self.forked:
                child = self.forked[words[1]]
                child.pid = int(words[2])
                self.by_pid[child.pid] = child
            elif len(words) == 3 and words[0] == ZYGOTE_EXIT and int(words[1]) in self.by_pid:
                self._left(self.by_pid.pop(int(words[1])), int(words[2]))
            elif len(words) == 2 and words[0] == ZYGOTE_LOADED:
                self.loaded = True
                log.info("the template worker has its models (settled in %ss): forking the workers", words[1])

    def _left(self, child: Forked, code: int) -> None:
        child.returncode = code
        self.forked.pop(child.name, None)

    def _orphan(self, code: int) -> None:
        """The template is gone: a boot error is every unborn worker's; any other death stops the
        workers it forked (their memory lineage is gone, and they are nobody's to reap)."""
        for child in list(self.forked.values()):
            if child.pid is not None:
                signal_process(child.pid, signal.SIGKILL)
                child.note = f"its template process (pid {self.proc.pid}) died with status {code}"
                self._left(child, -signal.SIGKILL)
            else:
                self._left(child, code if code == EXIT_BOOT_ERROR else 1)
        self.by_pid.clear()

    def close(self) -> None:
        """No more forks: the template stops its workers (SIGTERM, then SIGKILL) and leaves."""
        try:
            self.proc.stdin.close()  # type: ignore[union-attr]
        except BrokenPipeError:
            pass

    def wait(self, timeout: float) -> None:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("the template worker did not stop in time: killing it")
            self.proc.kill()
            self.proc.wait()
        self.pump()
        os.close(self.report_fd)


@dataclass
class Child:
    slot: int
    name: str
    proc: Spawned | Forked
    started: float


@dataclass(frozen=True)
class Exit:
    slot: int
    name: str
    pid: int
    returncode: int
    killed_as_hung: bool = False  # the supervisor killed it for not answering heartbeats
    note: str = ""  # why it was stopped, when the supervisor did it for a reason of its own

    @property
    def boot_error(self) -> bool:
        return self.returncode == EXIT_BOOT_ERROR

    @property
    def recycled(self) -> bool:
        """It left on purpose: its memory had passed its ceiling."""
        return self.returncode == EXIT_RECYCLED and not self.killed_as_hung and not self.note

    def describe(self) -> str:
        if self.killed_as_hung:
            return f"worker {self.name} (pid {self.pid}) was killed for not answering heartbeats"
        if self.note:
            return f"worker {self.name} (pid {self.pid}) was stopped: {self.note}"
        if self.recycled:
            return f"worker {self.name} (pid {self.pid}) left at its memory ceiling (--worker-max-memory)"
        if self.returncode < 0:
            try:
                sig = signal.Signals(-self.returncode).name
            except ValueError:  # a real-time signal or one Python has no name for
                sig = f"signal {-self.returncode}"
            hint = " (killed: out of memory?)" if self.returncode == -signal.SIGKILL else ""
            return f"worker {self.name} (pid {self.pid}) was killed by {sig}{hint}"
        return f"worker {self.name} (pid {self.pid}) exited with status {self.returncode}"


class Supervisor:
    """Keeps `count` local workers alive, each connected to `connect` with `worker_argv`; `start_mode`
    says how they start (fork from one template, or exec each)."""

    def __init__(self, *, count: int, connect: str, worker_argv: list[str], name_prefix: str,
                 start_mode: str = "fork") -> None:
        if start_mode not in WORKER_START_MODES:
            raise ValueError(f"start_mode must be one of {WORKER_START_MODES}, not {start_mode!r}")
        self.count = count
        self.connect = connect
        self.worker_argv = worker_argv
        self.name_prefix = name_prefix
        self.forking = start_mode == "fork" and hasattr(os, "fork")
        self.template: Template | None = None
        self.children: dict[int, Child] = {}
        self.respawn_at: dict[int, float] = {}
        self.backoff: dict[int, float] = {}
        self.generation = 0
        self.restarts = 0
        self.recycled = 0  # workers replaced because they passed their memory ceiling (not in `restarts`)
        self.recycling: set[int] = set()  # slots whose worker left at its ceiling, until the new one starts
        self.stopping = False
        self.killed_as_hung: set[str] = set()

    def start(self) -> None:
        for slot in range(self.count):
            self.spawn(slot)

    def _argv(self, *extra: str) -> list[str]:
        return [sys.executable, "-m", "tokenbroker", "worker", "--connect", self.connect, *extra, *self.worker_argv]

    def _env(self) -> dict[str, str]:
        env = {**os.environ, **ONE_THREAD_ENV}
        env[PARENT_PID_ENV] = str(os.getpid())  # it leaves when its broker is gone, even by SIGKILL
        return env

    def spawn(self, slot: int) -> Child:
        self.generation += 1
        name = f"{self.name_prefix}-{slot}.{self.generation}"
        if self.forking:
            if self.template is None:
                self.template = Template(self._argv(), self._env())
            proc: Spawned | Forked = self.template.fork(name)
            log.info("worker %s: asked the template to fork it", name)
        else:
            proc = Spawned(subprocess.Popen(self._argv("--name", name), env=self._env(), stdin=subprocess.DEVNULL,
                                            start_new_session=True))
            log.info("started worker %s (pid %d)", name, proc.pid)
        child = Child(slot, name, proc, time.monotonic())
        self.children[slot] = child
        return child

    def _pump(self) -> None:
        """Fork mode: take the template's reports; a template that died is replaced at the next spawn."""
        if self.template is None:
            return
        self.template.pump()
        if not self.template.alive():
            code = self.template.proc.returncode
            if code != EXIT_BOOT_ERROR and not self.stopping:
                log.error("the template worker (pid %d) died with status %d: its workers are replaced",
                          self.template.proc.pid, code)
            os.close(self.template.report_fd)
            self.template = None

    def reap(self, now: float) -> list[Exit]:
        """Collect dead children and schedule their respawn (boot errors are not respawned)."""
        self._pump()
        exits = []
        for slot, child in list(self.children.items()):
            code = child.proc.poll()
            if code is None:
                continue
            del self.children[slot]
            note = child.proc.note if isinstance(child.proc, Forked) else ""
            ex = Exit(slot, child.name, child.proc.pid or 0, code, killed_as_hung=child.name in self.killed_as_hung,
                      note=note)
            self.killed_as_hung.discard(child.name)
            exits.append(ex)
            if self.stopping:
                continue
            if ex.boot_error:
                log.error("%s: it cannot load its tokenizers; not restarting it", ex.describe())
                continue
            lived = now - child.started
            if ex.recycled:
                self.recycling.add(slot)
                if lived > STABLE_S:
                    log.info("%s after %.0fs: replacing it", ex.describe(), lived)
                    self.respawn_at[slot] = now
                    continue
                log.error("%s only %.1fs after it started: raise --worker-max-memory above what a worker loads; "
                          "replacing it after a backoff", ex.describe(), lived)
            else:
                log.error("%s; restarting it", ex.describe())
            delay = 0.0 if lived > STABLE_S else min(self.backoff.get(slot, BACKOFF_INIT_S / 2) * 2, BACKOFF_MAX_S)
            self.backoff[slot] = delay if delay else BACKOFF_INIT_S / 2
            self.respawn_at[slot] = now + delay
        return exits

    def tick(self, now: float) -> None:
        for slot, at in list(self.respawn_at.items()):
            if now >= at and not self.stopping:
                del self.respawn_at[slot]
                if slot in self.recycling:
                    self.recycling.discard(slot)
                    self.recycled += 1
                else:
                    self.restarts += 1
                self.spawn(slot)

    def kill(self, name: str) -> None:
        """A local worker that stopped answering heartbeats is hung: kill it so it is replaced."""
        for child in self.children.values():
            if child.name == name:
                log.error("worker %s (pid %s) stopped answering: killing it", name, child.proc.pid)
                self.killed_as_hung.add(name)
                child.proc.signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.stopping = True
        self.respawn_at.clear()
        for child in self.children.values():
            child.proc.signal(signal.SIGTERM)
        if self.template is not None:
            self.template.close()  # it forks no more, and stops whatever it forked that is still there

    def wait(self, timeout: float) -> None:
        """Wait for every child; SIGKILL the ones still there after `timeout`."""
        deadline = time.monotonic() + timeout
        while any(c.proc.poll() is None for c in self.children.values()) and time.monotonic() < deadline:
            self._pump()
            time.sleep(0.02)
        for child in self.children.values():
            if child.proc.poll() is None:
                log.warning("worker %s did not stop in time: killing it", child.name)
                child.proc.signal(signal.SIGKILL)
            if isinstance(child.proc, Spawned):
                child.proc.proc.wait()
        if self.template is not None:
            self.template.wait(max(0.5, deadline - time.monotonic()))
            self.template = None
        self.children.clear()
