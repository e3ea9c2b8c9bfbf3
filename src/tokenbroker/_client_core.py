"""The asyncio engine under both clients: pipelined calls over one DEALER per broker, failing over.

Each call gets an id from this client's counter and one future in `_calls`; replies come back in
completion order and one reader task per socket matches them by id (a reply whose id is no
longer pending is dropped). A call is sent to the live broker with the fewest calls outstanding,
with `deadline_ms` set to what is left of its deadline, and is failed locally as `Unavailable`
shortly after that deadline if no reply came.

Liveness is the ZeroMQ Guide's Freelance / Lazy Pirate pattern seen from the client: a broker
silent for half the liveness window while calls are outstanding is sent a `ping` (the broker
answers it itself); silent for the whole window, it is left: its socket is closed and opened
again (so stale replies and queued requests die with it), its outstanding calls are re-sent to
another live broker (every op is idempotent), and it is probed until it answers again.
`overloaded` replies are retried with full-jitter exponential backoff while the deadline allows.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import random
from typing import Sequence

import msgpack
import zmq
import zmq.asyncio

from ._client_errors import Unavailable
from ._client_keys import CurveKeys
from ._client_link import Call, EndpointStatus, Link

DEFAULT_ENDPOINT = "tcp://127.0.0.1:5555"
DEFAULT_TIMEOUT_S = 30.0
DEFAULT_LIVENESS_S = 2.0
# The broker answers `timeout` at the deadline it was sent; give that reply this long to arrive
# before failing the call locally, so a live broker's own answer wins.
LOCAL_GRACE_S = 0.05
BACKOFF_BASE_S = 0.005  # first `overloaded` retry waits up to this; each next one up to twice as long
BACKOFF_MAX_S = 0.25
MAX_DEADLINE_MS = 2**31 - 1  # the broker takes larger values as this


class Core:
    """Calls in, reply maps out; knows the wire's envelope and liveness, nothing of any op's fields."""

    def __init__(self, endpoints: Sequence[str], *, context: zmq.asyncio.Context | None,
                 curve: CurveKeys | None, liveness_s: float) -> None:
        if not endpoints:
            raise ValueError("endpoints: give at least one broker endpoint")
        if liveness_s <= 0:
            raise ValueError(f"liveness_s must be > 0, got {liveness_s}")
        self._links = [Link(e) for e in dict.fromkeys(endpoints)]
        self._live = list(self._links)
        self._context = context
        self._curve = curve
        self._liveness = liveness_s
        self._ids = itertools.count(1)
        self._calls: dict[int, Call] = {}
        self._deadlines: list[tuple[float, int]] = []  # (expiry, id), answered calls' entries included
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf
        self._loop: asyncio.AbstractEventLoop | None = None
        self._watcher: asyncio.Task | None = None
        self._packer = msgpack.Packer(use_bin_type=True)
        self._rng = random.Random()
        self._closed = False

    # --- the hot path --------------------------------------------------------------------

    async def call(self, body: dict, timeout: float) -> dict:
        """Send `body` (an op's fields) and return the reply map, ok or not; `Unavailable` if none came."""
        loop = asyncio.get_running_loop()
        if loop is not self._loop or self._closed:
            self._start(loop)
        rid = next(self._ids)
        body["id"] = rid
        now = loop.time()
        call = Call(rid, body, loop.create_future(), now + timeout, timeout)
        self._calls[rid] = call
        try:
            self._send(call, self._pick(), now)  # raises for a body MessagePack cannot hold
            self._watch_deadline(call)
            return await call.future
        finally:
            if self._calls.pop(rid, None) is not None:  # cancelled: nothing else removed it
                self._forget(call)

    def _pick(self) -> Link:
        live = self._live
        if len(live) == 1:
            return live[0]
        if not live:  # every broker is silent: keep trying them all, the first to answer wins
            return self._rng.choice(self._links)
        return min(live, key=lambda link: len(link.outstanding))

    def _send(self, call: Call, link: Link, now: float) -> None:
        body = call.body
        body["deadline_ms"] = min(MAX_DEADLINE_MS, max(1, int((call.deadline - now) * 1000)))
        payload = self._packer.pack(body)
        if not link.outstanding:
            link.busy_since = now
        link.outstanding[call.id] = call
        call.link = link
        link.sent += 1
        self._write(link, payload)

    def _write(self, link: Link, payload: bytes) -> None:
        """Send one payload (no delimiter frame: the reply then has one frame too, half the frames)."""
        try:
            link.shadow.send(payload, zmq.NOBLOCK)  # type: ignore[union-attr]
        except zmq.Again:  # not with an unbounded send queue, but if so let pyzmq queue it
            link.sock.send(payload)  # type: ignore[union-attr]
        if not link.kick:
            link.kick = True
            self._loop.call_soon(self._kick, link)  # type: ignore[union-attr]

    def _kick(self, link: Link) -> None:
        """Once per loop turn after sending: ZeroMQ's descriptor is edge-triggered, and a send on the
        shadow socket may take in a reply without the descriptor saying so; read EVENTS (which
        re-arms it) and take in whatever is waiting."""
        link.kick = False
        if link.shadow is not None:
            self._drain(link, link.shadow)

    async def _read(self, link: Link, sock: zmq.asyncio.Socket, shadow: zmq.Socket) -> None:
        """The one reader task of `sock`: wait for a reply, then drain every one already there."""
        while True:
            self._on_reply(link, await sock.recv())  # type: ignore[arg-type]
            self._drain(link, shadow)

    def _drain(self, link: Link, shadow: zmq.Socket) -> None:
        """Take in every reply already waiting. EVENTS first: reading it is half the cost of the
        `Again` a recv with nothing there raises, and most turns find at most one reply."""
        if not shadow.get(zmq.EVENTS) & zmq.POLLIN:
            return
        while True:
            try:
                payload = shadow.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._on_reply(link, payload)

    def _on_reply(self, link: Link, payload: bytes) -> None:
        """One frame: requests go without a delimiter, so each reply is its payload alone."""
        now = self._loop.time()  # type: ignore[union-attr]
        link.heard = now
        if not payload:  # a delimiter: not ours to send, yet harmless to skip
            return
        if not link.alive:
            self._revive(link)
        try:
            reply = msgpack.unpackb(payload, raw=False, strict_map_key=False)  # columnar stream replies key `stops` by index
            rid = reply.get("id")
        except Exception:  # not ours to judge: a reply we cannot read is dropped like a stray one
            link.dropped += 1
            return
        if rid is not None and rid == link.probe_id:
            link.probe_id = None
            return
        call = self._calls.get(rid)
        if call is None:
            link.dropped += 1
            return
        if reply.get("ok") is not True and (reply.get("error") or {}).get("code") == "overloaded":
            if self._backoff(call, link, now):
                return
        del self._calls[rid]
        self._forget(call)
        if not call.future.done():
            call.future.set_result(reply)

    def _forget(self, call: Call) -> None:
        """Drop every reference the engine holds to a call that is answered, expired or cancelled."""
        if call.link is not None:
            call.link.outstanding.pop(call.id, None)
            call.link = None
        if call.retry is not None:
            call.retry.cancel()

    # --- overloaded, deadlines -----------------------------------------------------------

    def _backoff(self, call: Call, link: Link, now: float) -> bool:
        """Schedule another attempt after a jittered wait if the deadline allows; False to give up."""
        delay = self._rng.uniform(0, min(BACKOFF_MAX_S, BACKOFF_BASE_S * 2**call.attempts))
        if now + delay >= call.deadline:
            return False
        call.attempts += 1
        link.retried += 1
        link.outstanding.pop(call.id, None)
        call.link = None
        call.retry = self._loop.call_at(now + delay, self._resend, call, link)  # type: ignore[union-attr]
        return True

    def _resend(self, call: Call, full: Link) -> None:
        """Another attempt, on another live broker if there is one (a broker shutting down says overloaded too)."""
        call.retry = None
        if call.id not in self._calls:
            return
        others = [link for link in self._live if link is not full]
        target = min(others, key=lambda link: len(link.outstanding)) if others else self._pick()
        self._send(call, target, self._loop.time())  # type: ignore[union-attr]

    def _watch_deadline(self, call: Call) -> None:
        """One timer for all calls, at the earliest deadline (a timer per call costs more than the call)."""
        expiry = call.deadline + LOCAL_GRACE_S
        heap = self._deadlines
        heapq.heappush(heap, (expiry, call.id))
        if len(heap) > 4 * len(self._calls) + 4096:  # answered calls' entries: drop them now and then
            heap[:] = [(c.deadline + LOCAL_GRACE_S, c.id) for c in self._calls.values()]
            heapq.heapify(heap)
        if expiry < self._timer_at:
            if self._timer is not None:
                self._timer.cancel()
            self._timer_at = expiry
            self._timer = self._loop.call_at(expiry, self._on_deadlines)  # type: ignore[union-attr]

    def _on_deadlines(self) -> None:
        self._timer, self._timer_at = None, math.inf
        now = self._loop.time()  # type: ignore[union-attr]
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            _, rid = heapq.heappop(heap)
            call = self._calls.get(rid)
            if call is not None and call.deadline + LOCAL_GRACE_S <= now:
                self._expire(call)
        if heap:
            self._timer_at = heap[0][0]
            self._timer = self._loop.call_at(self._timer_at, self._on_deadlines)  # type: ignore[union-attr]

    def _expire(self, call: Call) -> None:
        del self._calls[call.id]
        self._forget(call)
        if not call.future.done():
            tried = ", ".join(link.endpoint for link in self._links)
            call.future.set_exception(Unavailable(
                "unavailable", f"no broker answered {call.body.get('op')!r} within {call.timeout:g} s (tried {tried})"))

    # --- liveness ------------------------------------------------------------------------

    async def _watch(self) -> None:
        """Probe quiet brokers, leave silent ones, reconnect and probe the ones left."""
        loop = self._loop
        interval = self._liveness / 4
        while True:
            await asyncio.sleep(interval)
            now = loop.time()  # type: ignore[union-attr]
            for link in self._links:
                self._check(link, now)

    def _check(self, link: Link, now: float) -> None:
        half = self._liveness / 2
        if link.alive:
            if not link.outstanding and link.probe_id is None:
                return
            quiet = now - max(link.heard, link.busy_since)
            if quiet > self._liveness:
                self._leave(link, now)
            elif quiet > half and link.probe_id is None:
                self._probe(link, now)
        elif now - link.left_at > self._liveness:
            self._reconnect(link, now)  # Lazy Pirate: a fresh socket, not a queue of stale requests
            for call in list(link.outstanding.values()):
                self._send(call, link, now)
            self._probe(link, now)
        elif link.probe_id is None or now - link.probe_sent > half:
            self._probe(link, now)

    def _probe(self, link: Link, now: float) -> None:
        link.probe_id = next(self._ids)
        link.probe_sent = now
        ping = {"id": link.probe_id, "op": "ping", "deadline_ms": max(1, int(self._liveness * 1000))}
        self._write(link, self._packer.pack(ping))

    def _leave(self, link: Link, now: float) -> None:
        link.alive = False
        link.left += 1
        self._live = [x for x in self._links if x.alive]
        self._reconnect(link, now)
        moved = list(link.outstanding.values())
        link.outstanding.clear()
        for call in moved:
            call.link = None
            link.resent += 1
            self._send(call, self._pick() if self._live else link, now)
        self._probe(link, now)

    def _revive(self, link: Link) -> None:
        """A left broker answered again: serve from it, and give it the calls parked on silent ones."""
        link.alive = True
        self._live = [x for x in self._links if x.alive]
        now = self._loop.time()  # type: ignore[union-attr]
        for other in self._links:
            if not other.alive and other.outstanding:
                parked = list(other.outstanding.values())
                other.outstanding.clear()
                for call in parked:
                    call.link = None
                    other.resent += 1
                    self._send(call, link, now)

    def _reconnect(self, link: Link, now: float) -> None:
        link.close()
        self._open_link(link)
        link.left_at = now
        link.probe_id = None

    # --- sockets -------------------------------------------------------------------------

    def _start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Open the sockets on the first call, on the loop it runs on (the only loop this client serves)."""
        if self._closed:
            raise Unavailable("unavailable", "the client is closed")
        if self._loop is not None:
            raise RuntimeError("this client serves the event loop it first ran on; make one client per loop")
        self._loop = loop
        if self._context is None:
            self._context = zmq.asyncio.Context.instance()
        for link in self._links:
            self._open_link(link)
        self._watcher = self._loop.create_task(self._watch())

    def _open_link(self, link: Link) -> None:
        link.open(self._context, self._curve)  # type: ignore[arg-type]
        link.reader = self._loop.create_task(self._read(link, link.sock, link.shadow))  # type: ignore[union-attr,arg-type]

    def status(self) -> list[EndpointStatus]:
        return [link.status() for link in self._links]

    def pending(self) -> int:
        """Calls neither answered, expired nor cancelled (0 once every call's task has finished)."""
        return len(self._calls)

    async def aclose(self) -> None:
        """Fail what is pending as `Unavailable`, stop the tasks, close the sockets."""
        self._closed = True
        for call in list(self._calls.values()):
            self._calls.pop(call.id, None)
            self._forget(call)
            if not call.future.done():
                call.future.set_exception(Unavailable("unavailable", "the client was closed"))
        if self._watcher is not None:
            self._watcher.cancel()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._deadlines.clear()
        tasks = [t for t in [self._watcher, *(link.reader for link in self._links)] if t is not None]
        for link in self._links:
            link.close()
        self._watcher = None
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

