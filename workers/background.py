"""Jobs that run off the worker's round loop: a slow job never holds up the plain ones.

A jinja2 chat render runs in the worker's render child (chat/process.py) and may take its whole time
budget (10 s); a 30 MB text takes seconds to encode; a count of thousands of items takes long too
(count_lane.py). MiniJinja renders stay in the round: fuel bounds them (chat/mini.py). Served inline, every tokenize queued behind them on
that worker waited that long. Instead the worker hands each such job to a lane here: one thread that
runs the blocking call (waiting on the render child's pipe, or in the tokenizer's batch encode:
both release the GIL) while the worker goes on with its rounds. When a call is done the thread puts
the outcome in `finished()` and writes a byte to a pipe the worker's poll watches, and the worker
finishes the job (encode, reply) on its own thread, where the caches live.

Each lane keeps its order: renders go one at a time to the one render child, with their budgets, as before.

A lane thread that runs Python (a count harvesting a provider body, workers/count_lane.py) holds
the GIL between the round thread's turns: the process's switch interval is LANE_SWITCH_S, so the
round thread has it back within a millisecond of asking, not CPython's five.

A lane has a watchdog (`watch`, called by the worker every turn of its loop): a call still running
WATCH_GRACE_S past its job's deadline is given up on. Its job is answered at once (the worker sends
`timeout`: the broker has answered it already, and gets the job's slot back), the call is cancelled
where it can be (a render: its child is killed, so the thread comes back at once) and the lane goes
on with a fresh thread, so the jobs queued behind it run. A thread given up on inside a call that
cannot be stopped (an encode in the tokenizer) is counted `wedged` until its call returns, and then
ends; the worker's heartbeats say so per lane (`lanes` in the heartbeat, exported by the broker).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

from tokenbroker.common.process import drain_pipe

log = logging.getLogger(__name__)

WATCH_GRACE_S = 1.0  # a call may run this long past its job's deadline before the lane gives up on it
# How long a lane's thread may keep the GIL while the round thread waits for it. The round thread
# lets the GIL go at every poll, frame received or sent and batch encode, and a lane running Python
# (a count's harvest) takes it each time: at CPython's 5 ms the round thread had it back after p50
# 5.2 ms, p99 55 ms, and a small request pays that several times a round; at 1 ms, p50 0.6 ms,
# p99 15 ms (scripts/bench_lanes, in process). The lane pays a switch a millisecond, microseconds each.
LANE_SWITCH_S = 0.001


@dataclass(slots=True)
class Done:
    """A finished call: what it was for, and its result or the exception it raised."""

    key: Any
    result: Any
    error: BaseException | None


class Overdue(Exception):
    """The call ran (or would have started) past its job's deadline: the job is answered `timeout`."""


@dataclass(slots=True)
class _Running:
    generation: int  # of the thread running it
    key: Any
    deadline: float | None
    cancel: Callable[[], None] | None


class Lane:
    """One thread with a FIFO of blocking calls, a wake-up pipe for the worker's poll, and a watchdog."""

    def __init__(self, name: str, grace_s: float = WATCH_GRACE_S) -> None:
        self.name = name
        self.grace_s = grace_s
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._todo: queue.SimpleQueue = queue.SimpleQueue()
        self._done: deque[Done] = deque()
        self.pending = 0  # submitted and not yet taken back; only the worker's thread touches it
        self._lock = threading.Lock()  # the hand-off between a finishing call and the watchdog giving up on it
        self._generation = 0
        self._running: _Running | None = None
        self.wedged = 0  # threads given up on that are still inside their call
        self.replaced = 0  # threads given up on, ever
        self._start()

    def _start(self) -> None:
        threading.Thread(target=self._run, args=(self._generation,), name=f"tokenbroker-{self.name}", daemon=True).start()

    @property
    def fd(self) -> int:
        """Readable when a call has finished (poll it with the socket)."""
        return self._wake_r

    def submit(self, key: Any, call: Callable[[], Any], deadline: float | None = None,
               cancel: Callable[[], None] | None = None) -> None:
        """Run `call` (blocking: a result or an exception) on the lane's thread; `key` comes back with
        it. Past `deadline` (time.monotonic()) it is not started, and once it runs `grace_s` past it,
        `watch` answers it with Overdue and calls `cancel`."""
        self.pending += 1
        self._todo.put((key, call, deadline, cancel))

    def finished(self) -> list[Done]:
        """The calls done since the last look, in the order they finished."""
        drain_pipe(self._wake_r)
        out = []
        while self._done:
            out.append(self._done.popleft())
        self.pending -= len(out)
        return out

    def watch(self, now: float) -> bool:
        """Give up on the running call if it is overdue (see the module's docstring); True if it did."""
        if self._running is None:  # the round loop looks every turn: an idle lane costs no lock (a call
            return False           # that starts meanwhile is looked at next turn, long before its grace ends)
        with self._lock:
            running = self._running
            if running is None or running.deadline is None or now < running.deadline + self.grace_s:
                return False
            self._running = None
            self._generation += 1
            self.wedged += 1
            self.replaced += 1
            self._post(Done(running.key, None, Overdue(f"the {self.name} lane gave up on a job "
                                                       f"{now - running.deadline:.1f} s past its deadline")))
            self._start()
        log.warning("the %s lane gave up on a job past its deadline: a new thread takes the lane's next jobs", self.name)
        if running.cancel is not None:
            try:
                running.cancel()
            except Exception:  # noqa: BLE001 - cancelling is best effort; the thread stays counted as wedged
                log.exception("could not cancel the %s lane's overdue call", self.name)
        return True

    def report(self) -> dict[str, int]:
        """What the heartbeat says of this lane."""
        return {"pending": self.pending, "wedged": self.wedged, "replaced": self.replaced}

    def close(self) -> None:
        self._todo.put(None)
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass

    def _post(self, done: Done) -> None:
        self._done.append(done)
        try:
            os.write(self._wake_w, b"!")
        except BlockingIOError:  # the pipe is full of wake-ups already: the worker will look
            pass
        except OSError:  # closed: the worker is leaving
            pass

    def _run(self, generation: int) -> None:
        while True:
            item = self._todo.get()
            if item is None:
                return
            key, call, deadline, cancel = item
            if deadline is not None and time.monotonic() > deadline:
                with self._lock:
                    self._post(Done(key, None, Overdue("its deadline passed before it started")))
                continue
            with self._lock:
                self._running = _Running(generation, key, deadline, cancel)
            try:
                result = Done(key, call(), None)
            except BaseException as e:  # noqa: BLE001 - the worker's thread answers it, whatever it is
                result = Done(key, None, e)
            with self._lock:
                if generation != self._generation:  # given up on: answered already, a new thread has the lane
                    self.wedged -= 1
                    return
                self._running = None
                self._post(result)
