"""The engine's turns for `Client`, run by the caller's own thread: no asyncio loop, no I/O thread.

The engine (`_client_core.Core`: failover, deadlines, `overloaded` retries, liveness) asks a loop
for few things: its clock, `call_soon` (a link's send once the turn's calls are made), `call_at`
(a retry, the deadline timer, the liveness tick), `add_reader` on each socket's descriptor, and
futures. `Turns` is exactly that, and nothing runs it but a caller waiting for its call:

- a call is an `AsyncClient` coroutine (both clients share every op's code), stepped by hand to the
  future it awaits (no Task: `send(None)` hands the future back);
- the turns then run (callbacks due; the sockets' descriptors polled until the next timer; each
  readable one drained in compiled code, `_codec.drain`) until that future is done, and the
  coroutine is resumed to its result.

So a call costs the caller's thread its own work only: no wake-up of another thread, no event
loop's selector or task machinery per call. `map` runs many coroutines as small tasks driven the
same way (their requests leave in one frame), `submit` starts one and returns a
`concurrent.futures.Future` that the next wait of this client (its `result()`, or any call) moves on.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import heapq
import itertools
import logging
import select
import time
from collections.abc import Callable, Coroutine
from threading import RLock, get_ident
from typing import Any, TypeVar

from ._client_core import Core

T = TypeVar("T")


class _Timer:
    """A `call_at` entry (what the engine keeps of it: `cancel()`)."""

    __slots__ = ("when", "seq", "fn", "args", "cancelled")

    def __init__(self, when: float, seq: int, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.when, self.seq, self.fn, self.args, self.cancelled = when, seq, fn, args, False

    def __lt__(self, other: _Timer) -> bool:
        return (self.when, self.seq) < (other.when, other.seq)

    def cancel(self) -> None:
        self.cancelled = True


class Turns:
    """What `Core` asks of an event loop, run in whichever thread waits (one at a time).

    One at a time is enforced, not asked: every entry (`run`, `run_all`, `start`, waiting on a
    `Started`) holds `lock`, so threads sharing one `Client` take turns, each call whole (a
    ZeroMQ socket used by two threads at once is undefined behaviour, not an error). Uncontended,
    the lock costs tens of nanoseconds a call; a thread that wants its own pipelining uses its own
    `Client`."""

    def __init__(self) -> None:
        self.lock = RLock()
        self._soon: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []
        self._timers: list[_Timer] = []
        self._seq = itertools.count()
        self._poll = select.poll()
        self._readers: dict[int, tuple[Callable[..., Any], tuple[Any, ...]]] = {}
        self._closed = False

    @property
    def _thread_id(self) -> int:
        """The engine serves a loop on that loop's thread: these turns run on the caller's, whichever."""
        return get_ident()

    # --- the loop methods the engine and asyncio's futures call ---------------------------

    time = staticmethod(time.monotonic)

    def get_debug(self) -> bool:
        return False

    def is_closed(self) -> bool:
        return self._closed

    # asyncio's own (`asyncio.Future(loop=self)`): the engine's `_clock_and_futures` recognizes it and
    # makes a call's future with no Python method per call, as on asyncio's loops.
    create_future = asyncio.BaseEventLoop.create_future

    def call_soon(self, fn: Callable[..., Any], *args: Any, context: Any = None) -> None:
        self._soon.append((fn, args))

    def call_at(self, when: float, fn: Callable[..., Any], *args: Any, context: Any = None) -> _Timer:
        timer = _Timer(when, next(self._seq), fn, args)
        heapq.heappush(self._timers, timer)
        return timer

    def call_later(self, delay: float, fn: Callable[..., Any], *args: Any, context: Any = None) -> _Timer:
        return self.call_at(time.monotonic() + delay, fn, *args)

    def add_reader(self, fd: int, fn: Callable[..., Any], *args: Any) -> None:
        self._readers[fd] = (fn, args)
        self._poll.register(fd, select.POLLIN)

    def remove_reader(self, fd: int) -> bool:
        if self._readers.pop(fd, None) is None:
            return False
        self._poll.unregister(fd)
        return True

    def call_exception_handler(self, context: dict[str, Any]) -> None:
        """An error nobody retrieved (a future dropped with its exception), as asyncio reports it."""
        logging.getLogger("asyncio").debug("%s", context.get("message"))

    def close(self) -> None:
        self._closed = True
        self._soon.clear()
        self._timers.clear()

    # --- running ----------------------------------------------------------------------------

    def run_until(self, done: Callable[[], bool], deadline: float | None = None) -> None:
        """Run turns until `done()` (or the monotonic `deadline` passes): the callbacks made so far,
        then a wait on the sockets no longer than the next timer, then what is readable, then the
        timers due."""
        soon, timers = self._soon, self._timers
        while True:
            while soon:
                batch = soon[:]
                soon.clear()
                for fn, args in batch:
                    fn(*args)
            if done():
                return
            while timers and timers[0].cancelled:
                heapq.heappop(timers)
            wake = timers[0].when if timers else None
            if deadline is not None:
                if time.monotonic() >= deadline:
                    return
                wake = deadline if wake is None else min(wake, deadline)
            wait_ms = -1 if wake is None else max(0, int((wake - time.monotonic()) * 1000) + 1)
            readers = self._readers
            for fd, _ in self._poll.poll(wait_ms):
                reader = readers.get(fd)
                if reader is not None:
                    reader[0](*reader[1])
            now = time.monotonic()
            while timers and (timers[0].cancelled or timers[0].when <= now):
                timer = heapq.heappop(timers)
                if not timer.cancelled:
                    timer.fn(*timer.args)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """A coroutine (an `AsyncClient` method) run to its result, stepped by hand: each future it
        awaits is waited for by running turns. A KeyboardInterrupt (or any exception) while waiting
        closes the coroutine, so the engine forgets its call, and is raised."""
        send = coro.send
        with self.lock:
            try:
                while True:
                    future = send(None)
                    if future is not None:
                        self.run_until(future.done)
            except StopIteration as stop:
                return stop.value
            except BaseException:
                coro.close()
                raise

    def run_all(self, coros: list[Coroutine[Any, Any, Any]]) -> list[tuple[bool, Any]]:
        """Many coroutines run together to their outcomes, in order: (True, result) or (False, the
        exception). Each is a small task (stepped on its future's done callback), with no future of
        its own: `map`'s path, where a `Started` per item costs a lock and a condition each."""
        out: list[tuple[bool, Any]] = [(False, None)] * len(coros)
        left = [len(coros)]

        def finisher(i: int) -> Callable[[bool, Any], None]:
            def finish(ok: bool, value: Any) -> None:
                out[i] = (ok, value)
                left[0] -= 1

            return finish

        try:
            with self.lock:
                for i, coro in enumerate(coros):
                    self._drive(coro, finisher(i))
                self.run_until(lambda: left[0] == 0)
        except BaseException:  # interrupted while waiting: the engine forgets what is still pending
            for coro in coros:
                coro.close()
            raise
        return out

    def start(self, coro: Coroutine[Any, Any, T]) -> Started[T]:
        """A coroutine as a small task: stepped now to its first wait, then on each future's done
        callback; its outcome in the returned future."""
        out: Started[T] = Started(self)
        out.set_running_or_notify_cancel()
        with self.lock:
            self._drive(coro, lambda ok, value: out.set_result(value) if ok else out.set_exception(value))
        return out

    def _drive(self, coro: Coroutine[Any, Any, Any], finish: Callable[[bool, Any], None]) -> None:
        """Step `coro` now to its first wait, then again on each awaited future's done callback (or
        at the next turn when it yields nothing), and hand its outcome to `finish(ok, value)`: the one
        stepper of `run_all`'s tasks and `start`'s."""
        send = coro.send

        def step(_: object = None) -> None:
            try:
                future = send(None)
            except StopIteration as stop:
                finish(True, stop.value)
            except BaseException as e:  # noqa: BLE001 - the task's outcome, whatever it is
                finish(False, e)
            else:
                if future is None:
                    self.call_soon(step)
                else:
                    future.add_done_callback(step)

        step()


class Started(concurrent.futures.Future[T]):
    """A started coroutine's outcome (`Turns.start`): waiting for it runs the turns that bring it."""

    def __init__(self, turns: Turns) -> None:
        super().__init__()
        self._turns = turns

    def result(self, timeout: float | None = None) -> T:
        """As `concurrent.futures.Future.result`: TimeoutError when not done within `timeout`."""
        self._wait(timeout)
        return super().result(None if timeout is None else 0)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._wait(timeout)
        return super().exception(None if timeout is None else 0)

    def _wait(self, timeout: float | None) -> None:
        """Run the turns that bring this outcome, for at most `timeout` seconds (the turns' lock
        included: another thread running them may be the one that settles it)."""
        if self.done():
            return
        if timeout is None:
            with self._turns.lock:
                self._turns.run_until(self.done)
            return
        deadline = time.monotonic() + max(0.0, timeout)
        if not self._turns.lock.acquire(timeout=max(0.0, timeout)):
            return
        try:
            self._turns.run_until(self.done, deadline)
        finally:
            self._turns.lock.release()


class BlockingCore(Core):
    """The engine on `Turns`: its loop is the caller's thread; liveness is a timer, not a task."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.turns = Turns()

    def _enter(self) -> asyncio.AbstractEventLoop:
        if self._loop is None or self._closed:
            self._start(self.turns)  # type: ignore[arg-type]
        return self._loop  # type: ignore[return-value]

    def _start_watch(self) -> None:
        self._loop.call_later(self._liveness / 4, self._tick)  # type: ignore[union-attr]

    def _tick(self) -> None:
        if self._closed:
            return
        self._check_all()
        self._start_watch()
