"""The asyncio engine under both clients: pipelined calls over one DEALER per broker, failing over.

Each call gets an id from this client's counter and one future in `_calls`; replies come back in
completion order and are matched by id (a reply whose id is no longer pending is dropped). The
sockets are plain ZeroMQ sockets: the event loop watches each one's descriptor (`add_reader`)
and the engine sends and receives without blocking, so neither a call nor a receive costs a
future or a task of its own (`zmq.asyncio` spends one of each per receive). A call is sent to the live broker with the fewest calls outstanding,
with `deadline_ms` set to what is left of its deadline, and is failed locally as `Unavailable`
shortly after that deadline if no reply came.

Liveness is the ZeroMQ Guide's Freelance / Lazy Pirate pattern seen from the client: a broker
silent for half the liveness window while calls are outstanding is sent a `ping` (the broker
answers it itself); silent for the whole window, it is left: its socket is closed and opened
again (so stale replies and queued requests die with it), its outstanding calls are re-sent to
another live broker (every op is idempotent), and it is probed until it answers again.
`overloaded` replies are retried with full-jitter exponential backoff while the deadline allows.

Coalescing (contract 1.2): the calls of one event-loop turn are held on their link and leave
together when the turn ends (`loop.call_soon`), as one frame holding a MessagePack array of
their maps (a lone call as its map). The broker answers such a connection with arrays of reply
maps, decoded here in one go; each reply still settles its own call by id. A receive that
settles calls schedules the link's send at once, behind the callers it wakes: the calls they make
next leave in the same loop turn as they are made, not one turn later.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import random
from threading import get_ident
from typing import Any, Sequence, cast

import msgpack
import msgspec
import zmq

from tokenbroker.common.config import DEFAULT_FRONTEND
from tokenbroker.common.protocol import MAX_DEADLINE_MS

from ._client_errors import Unavailable
from ._client_keys import CurveKeys
from ._client_link import Call, EndpointStatus, Link

DEFAULT_ENDPOINT = DEFAULT_FRONTEND  # the broker's own default frontend
DEFAULT_TIMEOUT_S = 30.0
DEFAULT_LIVENESS_S = 2.0
# The broker answers `timeout` at the deadline it was sent; give that reply this long to arrive
# before failing the call locally, so a live broker's own answer wins.
LOCAL_GRACE_S = 0.05
BACKOFF_BASE_S = 0.005  # first `overloaded` retry waits up to this; each next one up to twice as long
BACKOFF_MAX_S = 0.25
COALESCE_MAX_CALLS = 256  # requests gathered in one frame, at most
COALESCE_MAX_BYTES = 1024 * 1024  # and bytes (a request larger than this goes alone)
_EVENTS, _POLLIN, _NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK)  # ints: enum flags cost a Python call per `&`

# The codec of the per-call path is msgspec's: it decodes a reply map in about a third of
# `msgpack.unpackb`'s time (and a packed array of them in two thirds) and packs a plain body in
# half of `Packer.pack`'s, with the same bytes (the broker stays on msgpack). Replies decode to the
# values `msgpack.unpackb(raw=False, strict_map_key=False)` gives: bins as bytes, str keys, int keys
# (columnar `stops`); ext types come back as msgpack's `ExtType` through the hook (the timestamp
# ext -1, which the contract never sends, as a datetime where msgpack gives its Timestamp).
# msgspec packs some types msgpack refuses (datetime, set, dataclasses...), so only bodies the
# client built from plain values (`Call.plain`) take it; the rest go through msgpack's Packer.
_decode = msgspec.msgpack.Decoder(ext_hook=lambda code, data: msgpack.ExtType(code, bytes(data))).decode
_encode = msgspec.msgpack.Encoder().encode


class Core:
    """Calls in, reply maps out; knows the wire's envelope and liveness, nothing of any op's fields."""

    def __init__(self, endpoints: Sequence[str], *, context: zmq.Context[Any] | None,
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

    def submit(self, body: dict, timeout: float, plain: bool = False) -> Call:
        """Send `body` (an op's fields); its `future` gets the reply map, ok or not, or `Unavailable`.

        `plain`: every value in `body` is an exact str, bytes, int, bool, float or None, or a list or
        dict of them (the client built it), so msgspec packs it byte for byte as msgpack would.

        Raises at once for a body MessagePack cannot hold (nothing stays pending). The caller
        awaits `future` and calls `discard` if that await ends otherwise (cancelled)."""
        loop = self._loop
        # On the loop's own thread while it runs, the loop is ours: `get_running_loop()` costs a
        # getpid() system call on CPython 3.11, so it is asked only when that does not hold.
        if self._closed or loop is None or getattr(loop, "_thread_id", None) != get_ident():
            loop = self._enter()
        rid = next(self._ids)
        body["id"] = rid
        now = loop.time()
        call = Call(rid, body, loop.create_future(), now + timeout, timeout, plain=plain)
        self._calls[rid] = call
        live = self._live
        try:
            self._send(call, live[0] if len(live) == 1 else self._pick(), now)
        except BaseException:
            self.discard(call)
            raise
        # One timer for all calls, at the earliest deadline (a timer per call costs more than the call).
        expiry = call.deadline + LOCAL_GRACE_S
        heap = self._deadlines
        heapq.heappush(heap, (expiry, rid))
        if expiry < self._timer_at:
            self._arm(expiry)
        elif len(heap) > 4 * len(self._calls) + 4096:  # answered calls' entries: drop them now and then
            heap[:] = [(c.deadline + LOCAL_GRACE_S, c.id) for c in self._calls.values()]
            heapq.heapify(heap)
        return call

    async def call(self, body: dict, timeout: float, plain: bool = False) -> dict:
        """`submit`, then the reply map, ok or not; `Unavailable` if none came."""
        call = self.submit(body, timeout, plain)
        try:
            return await call.future
        except BaseException:
            self.discard(call)
            raise

    def discard(self, call: Call) -> None:
        """Forget a call whose caller stopped waiting (cancelled); nothing if it is settled already."""
        if self._calls.pop(call.id, None) is not None:
            self._forget(call)

    def _enter(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        if loop is not self._loop or self._closed:
            self._start(loop)
        return loop

    def _pick(self) -> Link:
        live = self._live
        if len(live) == 1:
            return live[0]
        if not live:  # every broker is silent: keep trying them all, the first to answer wins
            return self._rng.choice(self._links)
        return min(live, key=lambda link: len(link.outstanding))

    def _send(self, call: Call, link: Link, now: float) -> None:
        body = call.body
        ms = int((call.deadline - now) * 1000)
        body["deadline_ms"] = ms if 0 < ms <= MAX_DEADLINE_MS else (1 if ms < 1 else MAX_DEADLINE_MS)
        payload = _encode(body) if call.plain else self._packer.pack(body)
        if not link.outstanding:
            link.busy_since = now
        link.outstanding[call.id] = call
        call.link = link
        link.sent += 1
        self._queue(link, call, payload)

    def _queue(self, link: Link, call: Call | None, payload: bytes) -> None:
        """Hold a request for this loop turn's frame to the link; the first one schedules the flush.

        A frame holds at most COALESCE_MAX_CALLS requests and COALESCE_MAX_BYTES bytes (a larger
        request goes alone), so it stays far under any broker's --max-request-bytes."""
        if link.outbox and (len(link.outbox) >= COALESCE_MAX_CALLS or link.outbox_bytes + len(payload) > COALESCE_MAX_BYTES):
            self._flush(link)
        link.outbox.append(payload)
        link.outbox_calls.append(call)
        link.outbox_bytes += len(payload)
        if not link.kick:
            link.kick = True
            self._loop.call_soon(self._kick, link)  # type: ignore[union-attr]

    def _flush(self, link: Link) -> None:
        """Send what the link holds: one request as its map, several as one MessagePack array of
        them (contract 1.2), built from their packed bytes. Calls cancelled or expired since go not."""
        pending = self._calls
        # A cancelled call's future is done at once, before its task has run to forget it.
        payloads = [p for c, p in zip(link.outbox_calls, link.outbox) if c is None or (c.id in pending and not c.future.done())]
        link.outbox, link.outbox_calls, link.outbox_bytes = [], [], 0
        if not payloads:
            return
        frame = payloads[0] if len(payloads) == 1 else self._packer.pack_array_header(len(payloads)) + b"".join(payloads)
        link.frames += 1
        try:  # one frame, no delimiter frame: the reply then has one frame too, half the frames
            link.sock.send(frame, _NOBLOCK)  # type: ignore[union-attr]
        except zmq.Again:  # not with a connected DEALER and SNDHWM 0; were it so, the frame is lost
            pass  # like one the network lost: liveness re-sends its calls, or their deadlines fail them

    def _kick(self, link: Link) -> None:
        """Once per loop turn after calls were made: send them (one frame), then, since ZeroMQ's
        descriptor is edge-triggered and a send may take in a reply without the descriptor saying
        so, read EVENTS (which re-arms it) and take in whatever is waiting."""
        link.kick = False
        sock = link.sock
        if sock is not None and link.outbox:
            self._flush(link)
            if cast(int, sock.get(_EVENTS)) & _POLLIN:
                self._drain(link)

    def _drain(self, link: Link) -> None:
        """Take in every frame waiting (the loop's reader calls this when the descriptor is
        readable). Receiving until `Again` leaves the descriptor armed for the next frame; a
        receive that settled calls schedules the link's send behind the callers it woke (see
        the module's docstring)."""
        sock = link.sock
        if sock is None:
            return
        recv = sock.recv
        settled = 0
        while True:
            try:
                payload = recv(_NOBLOCK)
            except zmq.Again:
                break
            settled += self._on_frame(link, payload)
            if link.sock is not sock:  # pragma: no cover - nothing on the receive path reconnects
                return
        if settled and not link.kick:
            link.kick = True
            self._loop.call_soon(self._kick, link)  # type: ignore[union-attr]

    def _on_frame(self, link: Link, payload: bytes) -> int:
        """One frame: a reply map, or (to a client that sent arrays) an array of them, decoded in
        one go; how many calls it settled. Requests go without a delimiter, so each frame is a
        payload alone."""
        now = self._loop.time()  # type: ignore[union-attr]
        link.heard = now
        if not payload:  # a delimiter: not ours to send, yet harmless to skip
            return 0
        if not link.alive:
            self._revive(link)
        try:
            replies = _decode(payload)  # int keys too: columnar stream replies key `stops` by index
        except Exception:  # not ours to judge: a reply we cannot read is dropped like a stray one
            link.dropped += 1
            return 0
        if type(replies) is dict:
            replies = (replies,)
        elif type(replies) is not list:
            link.dropped += 1
            return 0
        calls = self._calls
        settled = 0
        for reply in replies:
            if type(reply) is not dict:
                link.dropped += 1
                continue
            rid: Any = reply.get("id")
            try:
                call = calls.get(rid)
            except TypeError:  # an unhashable id: not one of ours
                call = None
            if call is None:
                if rid is not None and rid == link.probe_id:
                    link.probe_id = None
                else:
                    link.dropped += 1
                continue
            if reply.get("ok") is not True and (reply.get("error") or {}).get("code") == "overloaded":
                if self._backoff(call, link, now):
                    continue
            del calls[rid]
            owner = call.link
            if owner is not None:
                owner.outstanding.pop(rid, None)
            if call.retry is not None:
                call.retry.cancel()
            future = call.future
            if not future.done():
                future.set_result(reply)
                settled += 1
        return settled

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

    def _arm(self, expiry: float) -> None:
        """The one deadline timer, moved earlier to `expiry`."""
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
        self._queue(link, None, self._packer.pack(ping))

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
        link.close(self._loop)
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
            self._context = zmq.Context.instance()
        for link in self._links:
            self._open_link(link)
        self._watcher = self._loop.create_task(self._watch())

    def _open_link(self, link: Link) -> None:
        link.open(self._context, self._curve)  # type: ignore[arg-type]
        sock, loop = link.sock, self._loop
        assert sock is not None and loop is not None  # open() made the socket; the loop is running
        fd = cast(int, sock.getsockopt(zmq.FD))
        try:
            loop.add_reader(fd, self._drain, link)
            link.fd = fd
        except NotImplementedError:  # a loop that cannot watch descriptors (Windows' proactor)
            link.poller = loop.create_task(self._poll(link, sock))

    async def _poll(self, link: Link, sock: zmq.Socket) -> None:
        """Where the loop has no `add_reader`: wait with `zmq.asyncio` (its own selector thread), drain as the reader would."""
        import zmq.asyncio

        watched = zmq.asyncio.Socket.shadow(sock.underlying)
        while True:
            await watched.poll(None, zmq.POLLIN)  # type: ignore[call-arg]  # pyzmq's stub omits the flags
            self._drain(link)

    def status(self) -> list[EndpointStatus]:
        return [link.status() for link in self._links]

    def pending(self) -> int:
        """Calls neither answered, expired nor cancelled (0 once every call's task has finished)."""
        return len(self._calls)

    async def aclose(self) -> None:
        """Fail what is pending as `Unavailable`, stop watching, close the sockets."""
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
        tasks = [t for t in [self._watcher, *(link.poller for link in self._links)] if t is not None]
        for link in self._links:
            link.close(self._loop)
        self._watcher = None
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
