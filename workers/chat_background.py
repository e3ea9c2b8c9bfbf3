"""Chat renders off the worker's round loop: a slow template never holds up the plain jobs.

A render runs in the worker's render child (chat_process.py) and may take its whole time budget
(10 s). Served inline, every tokenize queued behind it on that worker waited that long. Instead,
the worker hands each render to one thread here, which only waits on the child's pipe (the GIL is
released while it waits), and goes on with its rounds; when a render is done the thread puts the
outcome in `done` and writes a byte to a pipe the worker's poll watches, and the worker finishes
the chat job (encode, reply) on its own thread, where the caches live.

Renders keep their order and their budgets: one thread, one child, one render at a time, as before.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Rendered:
    """A finished render: what it was for, and its prompt or the exception it raised."""

    key: Any
    prompt: str | None
    error: BaseException | None


class BackgroundRenders:
    """One render thread with a FIFO of renders and a wake-up pipe for the worker's poll."""

    def __init__(self) -> None:
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._todo: queue.SimpleQueue = queue.SimpleQueue()
        self._done: deque[Rendered] = deque()
        self.pending = 0  # submitted and not yet taken back; only the worker's thread touches it
        self._thread = threading.Thread(target=self._run, name="tokenbroker-render", daemon=True)
        self._thread.start()

    @property
    def fd(self) -> int:
        """Readable when a render has finished (poll it with the socket)."""
        return self._wake_r

    def submit(self, key: Any, render: Callable[[], str]) -> None:
        """Run `render` (blocking; a prompt or an exception) on the render thread; `key` comes back with it."""
        self.pending += 1
        self._todo.put((key, render))

    def finished(self) -> list[Rendered]:
        """The renders done since the last call, in the order they finished."""
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass
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
            key, render = item
            try:
                result = Rendered(key, render(), None)
            except BaseException as e:  # noqa: BLE001 - the worker's thread answers it, whatever it is
                result = Rendered(key, None, e)
            self._done.append(result)
            try:
                os.write(self._wake_w, b"!")
            except BlockingIOError:  # the pipe is full of wake-ups already: the worker will look
                pass
            except OSError:  # closed: the worker is leaving
                return
