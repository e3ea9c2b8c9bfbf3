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
import functools
import heapq
import math
import random
import time
from threading import get_ident
from typing import Any, Callable, Sequence, cast

import msgpack
import zmq

from tokenbroker.common.config import DEFAULT_FRONTEND
from tokenbroker.common.protocol import MAX_DEADLINE_MS

from . import _codec
from ._client_errors import Unavailable
from ._client_keys import CurveKeys
from ._client_link import EndpointStatus, Link
from ._codec import Batch, Call

DEFAULT_ENDPOINT: str = DEFAULT_FRONTEND  # the broker's own default frontend
DEFAULT_TIMEOUT_S = 30.0
DEFAULT_LIVENESS_S = 2.0
# The broker answers `timeout` at the deadline it was sent; give that reply this long to arrive
# before failing the call locally, so a live broker's own answer wins.
LOCAL_GRACE_S = 0.05
BACKOFF_BASE_S = 0.005  # first `overloaded` retry waits up to this; each next one up to twice as long
BACKOFF_MAX_S = 0.25
COALESCE_MAX_CALLS = 256  # requests gathered in one frame, at most
COALESCE_MAX_BYTES = 1024 * 1024  # and bytes (a request larger than this goes alone)

# The per-call path is compiled (`_codec`, Cython, over libzmq's C API on the sockets pyzmq opens):
# a request's fields are packed once into its `head`, its id and deadline written at each send
# into the message libzmq sends; a burst of reply frames is read straight from libzmq's messages
# into results (`Tokens`, `Text`, `ChatTokens`) and settles its calls in one call. The bytes are
# msgpack's.
_codec.configure(MAX_DEADLINE_MS)
_PING = _codec.pack_entries({"op": "ping"})


def head_of(body: dict) -> tuple[bytes, int]:
    """A request's fields packed as `Call.head` (without `id` and `deadline_ms`, which each send
    writes): compiled for plain values, msgpack's Packer for anything else it packs."""
    if "id" in body or "deadline_ms" in body:
        body = {k: v for k, v in body.items() if k != "id" and k != "deadline_ms"}
    try:
        return _codec.pack_entries(body), len(body)
    except TypeError:  # a type the compiled packer does not take (a str subclass, a memoryview...)
        packed = msgpack.Packer(use_bin_type=True).pack(body)
        n = len(body)
        return packed[1 if n < 16 else 3 if n < 65536 else 5:], n


def _clock_and_futures(loop: asyncio.AbstractEventLoop) -> tuple[Callable[[], float], Callable[[], asyncio.Future[Any]]]:
    """`loop.time` and `loop.create_future`, or for asyncio's own loops what those methods call
    (`time.monotonic`, `asyncio.Future(loop=loop)`): each is a Python frame per call otherwise,
    and a call takes one of each."""
    base = asyncio.BaseEventLoop
    clock = time.monotonic if type(loop).time is base.time else loop.time
    futures = functools.partial(asyncio.Future, loop=loop) if type(loop).create_future is base.create_future \
        else loop.create_future
    return clock, futures


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
        self._next_id = 1
        self._calls: dict[int, Call] = {}
        self._deadlines: list[tuple[float, int]] = []  # (expiry, id), answered calls' entries included;
        # a batch has one entry, (expiry, -its first id), and is in `_batches` until it settles
        self._batches: dict[int, Batch] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf
        self._loop: asyncio.AbstractEventLoop | None = None
        self._time: Callable[[], float] = time.monotonic  # the loop's clock and future factory (`_start`)
        self._future: Callable[[], asyncio.Future[Any]] = asyncio.Future
        self._watcher: asyncio.Task | None = None
        self._rng = random.Random()
        self._closed = False

    # --- the hot path --------------------------------------------------------------------

    def submit(self, head: bytes, nkeys: int, kind: int, op: str, timeout: float) -> Call:
        """Send a request whose fields are packed in `head` (`head_of`); its `future` gets the result
        (`kind`: see `_codec`), or the reply map, ok or not, or `Unavailable`.

        The caller awaits `future` and calls `discard` if that await ends otherwise (cancelled)."""
        loop = self._loop
        # On the loop's own thread while it runs, the loop is ours: `get_running_loop()` costs a
        # getpid() system call on CPython 3.11, so it is asked only when that does not hold.
        if self._closed or loop is None or getattr(loop, "_thread_id", None) != get_ident():
            loop = self._enter()
        rid = self._next_id
        self._next_id = rid + 1
        now = self._time()
        live = self._live
        link = live[0] if len(live) == 1 else self._pick()
        call = _codec.submit_one(head, nkeys, kind, op, self._future(), rid, now + timeout, timeout, now,
                                 self._calls, link, self._deadlines, LOCAL_GRACE_S)
        if not link.kick:
            link.kick = True
            loop.call_soon(self._kick, link)
        # One timer for all calls, at the earliest deadline (a timer per call costs more than the call).
        expiry = call.deadline + LOCAL_GRACE_S
        if expiry < self._timer_at:
            self._arm(expiry)
        elif len(self._deadlines) > 4 * len(self._calls) + 4096:
            self._compact()
        return call

    def submit_batch(self, heads: list[bytes], nkeys: int, kind: int, op: str, timeout: float) -> Batch:
        """Many independent requests (fields packed in `heads`, one each), each its own call routed
        on its own; the batch's `future` gets the batch when every one is settled (`Batch.results`,
        in the order given). The caller calls `discard_batch` if its await ends otherwise."""
        loop = self._loop
        if self._closed or loop is None or getattr(loop, "_thread_id", None) != get_ident():
            loop = self._enter()
        n = len(heads)
        batch = Batch(self._future(), n)
        batch.first = rid = self._next_id
        now = self._time()
        deadline = now + timeout
        start = 0
        for link, share in self._shares(n):
            if not share:
                continue
            if not link.outstanding:
                link.busy_since = now
            rid = _codec.submit_batch(heads[start:start + share] if share != n else heads, nkeys, kind, op, batch,
                                      start, rid, deadline, timeout, now, self._calls, link)
            start += share
            if not link.kick:
                link.kick = True
                loop.call_soon(self._kick, link)
        self._next_id = rid
        expiry = deadline + LOCAL_GRACE_S
        self._batches[batch.first] = batch
        heapq.heappush(self._deadlines, (expiry, -batch.first))
        if expiry < self._timer_at:
            self._arm(expiry)
        elif len(self._deadlines) > 4 * len(self._calls) + 4096:
            self._compact()
        return batch

    def _shares(self, n: int) -> list[tuple[Link, int]]:
        """How many of `n` new calls each live broker gets: the fewest outstanding first (water-filling)."""
        live = self._live
        if len(live) == 1:
            return [(live[0], n)]
        if not live:
            return [(self._rng.choice(self._links), n)]
        loads = sorted(live, key=lambda link: len(link.outstanding))
        level = (sum(len(link.outstanding) for link in loads) + n) / len(loads)
        shares, left = [], n
        for link in loads:
            share = min(left, max(0, int(level - len(link.outstanding))))
            shares.append(share)
            left -= share
        shares[0] += left  # what rounding down left over goes to the least loaded
        return list(zip(loads, shares))

    def _compact(self) -> None:
        """Answered calls' deadline entries, dropped now and then."""
        heap = self._deadlines
        heap[:] = [(c.deadline + LOCAL_GRACE_S, c.id) for c in self._calls.values()]
        self._batches.clear()  # their calls have entries of their own now
        heapq.heapify(heap)

    def new_id(self) -> int:
        rid = self._next_id
        self._next_id = rid + 1
        return rid

    async def call(self, body: dict, timeout: float) -> dict:
        """Any request body (an op's fields); the reply map, ok or not; `Unavailable` if none came."""
        call = self.submit(*head_of(body), _codec.KIND_RAW, str(body.get("op")), timeout)
        try:
            return await call.future
        except BaseException:
            self.discard(call)
            raise

    def discard(self, call: Call) -> None:
        """Forget a call whose caller stopped waiting (cancelled); nothing if it is settled already."""
        if self._calls.pop(call.id, None) is not None:
            self._forget(call)

    def settled_batch(self, batch: Batch) -> None:
        """A batch whose every call settled: its deadline entry goes."""
        self._batches.pop(batch.first, None)

    def discard_batch(self, batch: Batch) -> None:
        """Forget the calls of a batch whose caller stopped waiting (cancelled)."""
        self._batches.pop(batch.first, None)
        calls = self._calls
        for rid in range(batch.first, batch.first + len(batch.results)):
            call = calls.pop(rid, None)
            if call is not None:
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
        if not link.outstanding:
            link.busy_since = now
        link.outstanding[call.id] = call
        call.link = link
        link.sent += 1
        self._queue(link, call, None)  # its fields as packed once, its id, what is left of its deadline at the flush

    def _queue(self, link: Link, call: Call | None, payload: bytes | None) -> None:
        """Hold a request for this loop turn's frames to the link (a call's is written at the
        flush: payload None); the first one schedules the flush."""
        link.outbox.append(payload)
        link.outbox_calls.append(call)
        link.outbox_bytes += len(payload) if payload is not None else len(call.head) + 32  # type: ignore[union-attr]
        if not link.kick:
            link.kick = True
            self._loop.call_soon(self._kick, link)  # type: ignore[union-attr]

    def _flush(self, link: Link) -> None:
        """Send what the link holds: one request as its map, several as MessagePack arrays of them
        (contract 1.2), each frame at most COALESCE_MAX_CALLS requests and COALESCE_MAX_BYTES bytes
        (a larger request goes alone), so it stays far under any broker's --max-request-bytes.
        Calls cancelled or expired since go not. Each frame is written straight into the message
        libzmq sends (`_codec.send`); one frame, no delimiter frame: the reply has one frame too."""
        outbox, calls_out = link.outbox, link.outbox_calls
        link.outbox, link.outbox_calls, link.outbox_bytes = [], [], 0
        link.frames += _codec.send(link.sock, calls_out, outbox, self._calls, COALESCE_MAX_CALLS, COALESCE_MAX_BYTES,
                                   self._time())

    def _kick(self, link: Link) -> None:
        """Once per loop turn after calls were made: send them, then take in whatever is waiting
        (ZeroMQ's descriptor is edge-triggered and a send may take in a reply without the
        descriptor saying so; a receive that finds nothing re-arms it)."""
        link.kick = False
        if link.sock is not None and link.outbox:
            self._flush(link)
            self._drain(link)

    def _drain(self, link: Link) -> None:
        """Take in every frame waiting (the loop's reader calls this when the descriptor is
        readable): read and settled in compiled code straight from libzmq's messages
        (`_codec.drain`), one pass per wake-up; what needs policy comes back here: ids not pending
        (probes, late replies) and `overloaded`. A receive that settled calls schedules the link's
        send behind the callers it woke (see the module's docstring)."""
        sock = link.sock
        if sock is None:
            return
        odd: list = []
        frames, settled = _codec.drain(sock, self._calls, odd, link)
        if not frames:
            return
        now = self._time()
        link.heard = now
        if not link.alive:
            self._revive(link)
        for rid, reply in odd:
            call = self._calls.get(rid) if type(rid) is int else None
            if call is not None:  # overloaded: retried after a backoff while the deadline allows
                if self._backoff(call, link, now):
                    continue
                del self._calls[rid]
                self._forget(call)
                call.settle(reply)
                settled += 1
            elif rid is not None and rid == link.probe_id:
                link.probe_id = None
            else:
                link.dropped += 1
        if settled and not link.kick:
            link.kick = True
            self._loop.call_soon(self._kick, link)  # type: ignore[union-attr]

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
            if rid < 0:  # a batch's calls share its deadline
                batch = self._batches.pop(-rid, None)
                if batch is not None:
                    for each in range(batch.first, batch.first + len(batch.results)):
                        call = self._calls.get(each)
                        if call is not None and call.deadline + LOCAL_GRACE_S <= now:
                            self._expire(call)
                continue
            call = self._calls.get(rid)
            if call is not None and call.deadline + LOCAL_GRACE_S <= now:
                self._expire(call)
        if heap:
            self._timer_at = heap[0][0]
            self._timer = self._loop.call_at(self._timer_at, self._on_deadlines)  # type: ignore[union-attr]

    def _expire(self, call: Call) -> None:
        del self._calls[call.id]
        self._forget(call)
        tried = ", ".join(link.endpoint for link in self._links)
        call.fail(Unavailable("unavailable", f"no broker answered {call.op!r} within {call.timeout:g} s (tried {tried})"))

    # --- liveness ------------------------------------------------------------------------

    def _start_watch(self) -> None:
        """Check the brokers every quarter of the liveness window, from now on (a task on asyncio)."""
        self._watcher = self._loop.create_task(self._watch())  # type: ignore[union-attr]

    async def _watch(self) -> None:
        interval = self._liveness / 4
        while True:
            await asyncio.sleep(interval)
            self._check_all()

    def _check_all(self) -> None:
        """Probe quiet brokers, leave silent ones, reconnect and probe the ones left."""
        now = self._loop.time()  # type: ignore[union-attr]
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
        link.probe_id = self.new_id()
        link.probe_sent = now
        self._queue(link, None, _codec.request(_PING, 1, link.probe_id, max(1, int(self._liveness * 1000))))

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
        self._time, self._future = _clock_and_futures(loop)
        if self._context is None:
            self._context = zmq.Context.instance()
        for link in self._links:
            self._open_link(link)
        self._start_watch()

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
            call.fail(Unavailable("unavailable", "the client was closed"))
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
