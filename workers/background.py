"""Jobs that run off the worker's round loop: a slow job never holds up the plain ones.

A chat render runs in the worker's render child (chat_process.py) and may take its whole time budget
(10 s); a 30 MB text takes seconds to encode. Served inline, every tokenize queued behind them on
that worker waited that long. Instead the worker hands each such job to a lane here: one thread that
runs the blocking call (waiting on the render child's pipe, or in the tokenizer's batch encode:
both release the GIL) while the worker goes on with its rounds. When a call is done the thread puts
the outcome in `finished()` and writes a byte to a pipe the worker's poll watches, and the worker
finishes the job (encode, reply) on its own thread, where the caches live.

Each lane keeps its order: renders go one at a time to the one render child, with their budgets, as before.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

from tokenbroker.common.process import drain_pipe

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Done:
    """A finished call: what it was for, and its result or the exception it raised."""

    key: Any
    result: Any
    error: BaseException | None


class Lane:
    """One thread with a FIFO of blocking calls and a wake-up pipe for the worker's poll."""

    def __init__(self, name: str) -> None:
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._todo: queue.SimpleQueue = queue.SimpleQueue()
        self._done: deque[Done] = deque()
        self.pending = 0  # submitted and not yet taken back; only the worker's thread touches it
        self._thread = threading.Thread(target=self._run, name=f"tokenbroker-{name}", daemon=True)
        self._thread.start()

    @property
    def fd(self) -> int:
        """Readable when a call has finished (poll it with the socket)."""
        return self._wake_r

    def submit(self, key: Any, call: Callable[[], Any]) -> None:
        """Run `call` (blocking: a result or an exception) on the lane's thread; `key` comes back with it."""
        self.pending += 1
        self._todo.put((key, call))

    def finished(self) -> list[Done]:
        """The calls done since the last look, in the order they finished."""
        drain_pipe(self._wake_r)
        out = []
        while self._done:
            out.append(self._done.popleft())
        self.pending -= len(out)
        return out

    def close(self) -> None:
        self._todo.put(None)
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass

    def _run(self) -> None:
        while True:
            item = self._todo.get()
            if item is None:
                return
            key, call = item
            try:
                result = Done(key, call(), None)
            except BaseException as e:  # noqa: BLE001 - the worker's thread answers it, whatever it is
                result = Done(key, None, e)
            self._done.append(result)
            try:
                os.write(self._wake_w, b"!")
            except BlockingIOError:  # the pipe is full of wake-ups already: the worker will look
                pass
            except OSError:  # closed: the worker is leaving
                return
