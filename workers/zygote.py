"""The template worker: loads the startup models once, then forks the local workers, which share them.

A tokenizer's vocabulary is read-only once loaded, so workers forked from one process that loaded
it share its pages: N local workers hold a model for about one copy instead of N (docs/sizing.md,
"Memory"). The broker never loads a tokenizer, so this is a process of its own, started by the
supervisor (broker/supervisor.py) with the workers' own flags; it forks before any ZeroMQ context,
socket or thread exists (it waits for any thread a load started to end: a fork with a thread
running could leave a lock held forever in the child), and each worker makes its own after the
fork (workers/main.py `run`). Python objects are moved out of the collector's sight first
(`gc.freeze`), so collections in a worker do not write to the pages it shares.

The supervisor drives it over a pipe pair (common/process.py has the words): "fork NAME" on stdin
starts a worker; "forked NAME PID" and "exit PID CODE" go back on --zygote-fd, so the supervisor
learns of every exit although the workers are this process's children. Under
--max-models-per-worker the template loads every configured model (the ones past the cap dormant),
so a forked worker's loads of them are wakes, not parses. Models a worker loads later (add_model,
a model the flags did not name) are its own, as before.
When stdin closes (the broker stops, or died), the template stops its workers (SIGTERM, then
SIGKILL after a grace), reports their exits and leaves.
"""

from __future__ import annotations

import gc
import logging
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace

from tokenbroker.common.process import (
    PARENT_PID_ENV,
    ZYGOTE_EXIT,
    ZYGOTE_FORK,
    ZYGOTE_FORKED,
    ZYGOTE_LOADED,
    drain_pipe,
    release_memory,
    signal_process,
    thread_count,
)

from .config import WorkerConfig
from .engine import pack_ranks, speed_up
from .loader import serve_fast
from .registry import ModelRegistry

log = logging.getLogger(__name__)

ServeFn = Callable[[WorkerConfig, ModelRegistry], int]  # serves as a worker with the models loaded; returns the exit code

SETTLE_WAIT_S = 120.0  # how long the template waits for its threads (a background load) to end before forking
STOP_GRACE_S = 10.0  # after stdin closes, workers that have not left by then are killed
POLL_S = 1.0  # the longest the loop sleeps: SIGCHLD and stdin wake it sooner


class Zygote:
    """One template process: `run` forks workers on command until stdin closes, then stops them."""

    def __init__(self, config: WorkerConfig, registry: ModelRegistry, serve: ServeFn) -> None:
        assert config.zygote_fd is not None
        self.config = config
        self.registry = registry
        self.serve = serve  # what a forked worker runs (workers/main.py `run`): given, so this module need not import main
        self.report_fd = config.zygote_fd
        self.children: set[int] = set()
        self.closing_at: float | None = None  # when stdin closed
        self._wake_r, self._wake_w = os.pipe()
        for fd in (self._wake_r, self._wake_w, 0):
            os.set_blocking(fd, False)
        self._pending = b""

    # --- before the first fork -----------------------------------------------------------

    def settle(self) -> None:
        """Compute, before forking, what every worker would compute alike after it: the fingerprints
        (a hash of each vocabulary) and the infos READY carries; wait for any thread loading runs (a
        faster engine loaded in the background) to end; then freeze the heap's objects.

        Under --max-models-per-worker the template loads the models the cap left out too, dormant
        (workers/registry.py `preload`): a forked worker wakes one when the broker places it there,
        with no parse; the pool holds each for one shared copy (docs/sizing.md, "What the cap means")."""
        if self.config.models.max_models > 0:
            added = self.registry.preload()
            log.info("template: %d more tokenizers loaded dormant for the capped workers", added)
        deadline = time.monotonic() + SETTLE_WAIT_S
        while thread_count() > 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        if thread_count() > 1:  # forked anyway, as os.fork does (a lock one of them holds stays held in a worker)
            log.warning("template: %d threads still run after %.0fs (%s): forking the workers regardless",
                        thread_count(), SETTLE_WAIT_S, ", ".join(t.name for t in threading.enumerate()))
        self._speed_up()
        held = (*self.registry.models, *self.registry.dormant.values())
        for model in held:
            model.fingerprint  # noqa: B018 - computed once and kept on the model
            model.info()
        # What was built from tiktoken's Python dict of ranks is built now (fingerprints, fast
        # engines): packed, the pool holds 26-54 MiB less per encoding (workers/engine.py PackedRanks).
        packed = sum(pack_ranks(t) for t in {id(m.tokenizer): m.tokenizer for m in held}.values())
        log.debug("template: %d tiktoken ranks packed", packed)
        gc.collect()
        release_memory()  # the heap loading left free goes back before the fork: 1,154 -> 1,106 MiB pool PSS (9 tokenizers)
        gc.freeze()  # what exists now is never scanned (nor written to) by a worker's collector

    def _speed_up(self) -> None:
        """Build and probe the fast engine of every startup tokenizer here, before the first fork, so
        the workers share its pages too (DeepSeek's fastokens is ~118 MiB: built after the fork, every
        worker would hold its own copy and spend its own seconds of CPU building it). The pool is
        ready a few seconds later; a forked worker then has nothing to build (its loader sees `fast`
        set, or the refusal in `registry.engine_refused`)."""
        mode = self.registry.backend_mode
        if mode == "reference":
            return
        # Built and probed on a thread of its own, joined before the fork: fastokens keeps, per
        # thread, a word cache for each of the last few models that thread encoded with (16 MiB for
        # a ~100k vocabulary, 32 MiB for o200k). Probed here on the main thread, the template kept
        # ~100 MiB of them that no worker reads (a worker's main thread builds its own at its first
        # encodes, private whatever the template holds); the thread's end frees them.
        failure: list[BaseException] = []

        def build() -> None:
            try:
                # One model per tokenizer names it: its tokenizer fingerprint keys the probes' verdict on
                # disk (workers/engine.py verdict_dir), so the next start builds without re-probing.
                held = {id(m.tokenizer): m for m in (*self.registry.models, *self.registry.dormant.values())}
                for model in held.values():
                    tok = model.tokenizer
                    if tok.fast is None and tok not in self.registry.engine_refused:
                        engine, why = speed_up(tok, mode, name=model.name, fingerprint=model.tokenizer_fingerprint)
                        if engine is not None:
                            serve_fast(self.registry, tok, engine)
                        else:  # the workers inherit the verdict: none of them builds it again
                            self.registry.engine_refused[tok] = why or "refused"
            except BaseException as e:  # raised in the template, as before
                failure.append(e)

        builder = threading.Thread(target=build, name="tokenbroker-speed-up")
        builder.start()
        builder.join()
        if failure:
            raise failure[0]

    # --- the loop ------------------------------------------------------------------------

    def run(self) -> int:
        started = time.monotonic()
        self.settle()
        signal.set_wakeup_fd(self._wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the select through the wakeup fd
        signal.signal(signal.SIGTERM, lambda *_: self._close())
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the broker says when to stop (it closes stdin)
        self._report(f"{ZYGOTE_LOADED} {time.monotonic() - started:.3f}")  # settling: fingerprints, freeze
        while self.closing_at is None or self.children:
            watch = [self._wake_r] if self.closing_at is not None else [0, self._wake_r]
            ready, _, _ = select.select(watch, [], [], POLL_S)
            if 0 in ready:
                self._read_commands()
            if self._wake_r in ready:
                drain_pipe(self._wake_r)
            self._reap()
            if self.closing_at is not None and time.monotonic() - self.closing_at > STOP_GRACE_S:
                for pid in self.children:
                    log.warning("worker pid %d did not stop in %.0fs: killing it", pid, STOP_GRACE_S)
                    signal_process(pid, signal.SIGKILL)
                self.closing_at = time.monotonic()  # and wait for their exits
        return 0

    def _read_commands(self) -> None:
        try:
            data = os.read(0, 65536)
        except BlockingIOError:
            return
        if not data:
            self._close()
            return
        self._pending += data
        *lines, self._pending = self._pending.split(b"\n")
        for line in lines:
            words = line.decode("utf-8", "replace").split()
            if len(words) == 2 and words[0] == ZYGOTE_FORK:
                self._fork(words[1])
            elif words:
                log.warning("template: ignoring the command %r", line[:80])

    def _close(self) -> None:
        """Stdin closed or SIGTERM: fork no more, stop the workers, leave once they have."""
        if self.closing_at is not None:
            return
        self.closing_at = time.monotonic()
        for pid in self.children:
            signal_process(pid, signal.SIGTERM)

    def _reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.children.discard(pid)
            self._report(f"{ZYGOTE_EXIT} {pid} {os.waitstatus_to_exitcode(status)}")

    def _report(self, line: str) -> None:
        try:
            os.write(self.report_fd, (line + "\n").encode())
        except OSError:  # the supervisor is gone: stdin closes too, and the loop winds down
            pass

    # --- a worker ------------------------------------------------------------------------

    def _fork(self, name: str) -> None:
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = self._child(name)
            except BaseException:  # a worker's failure must never come back into the template's loop
                log.exception("worker %s failed", name)
            finally:
                logging.shutdown()
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        self.children.add(pid)
        self._report(f"{ZYGOTE_FORKED} {name} {pid}")

    def _child(self, name: str) -> int:
        """In the forked worker: drop the template's signals and pipes, then serve as any worker."""
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL)
        for fd in (self._wake_r, self._wake_w, self.report_fd):
            os.close(fd)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        os.environ[PARENT_PID_ENV] = str(os.getppid())  # it leaves when the template is gone
        return self.serve(replace(self.config, name=name, zygote_fd=None), self.registry)
