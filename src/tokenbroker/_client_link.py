"""One broker endpoint as the engine (`_client_core`) keeps it (a pending call is `_codec.Call`).

A `Link` is a broker's DEALER socket (a plain, synchronous `zmq.Socket`: the engine waits on its
descriptor with the event loop's own reader, and sends and receives without blocking, so no call
and no receive costs a future of its own), its liveness clock and its counters.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import zmq

from ._client_keys import CurveKeys
from ._codec import Call


@dataclass(frozen=True)
class EndpointStatus:
    """One broker as this client sees it (for a scheduler's own metrics and for tests)."""

    endpoint: str
    alive: bool
    outstanding: int  # calls sent there and not yet answered
    sent: int  # requests sent there, first attempts and re-sends alike
    resent: int  # calls moved away from it when it was left
    retried: int  # `overloaded` answers from it that were retried
    dropped: int  # replies from it for ids no longer pending (late, duplicate, or a probe's)
    left: int  # times it was left for not answering
    frames: int = 0  # messages sent there: the calls of one loop turn share one (coalescing)


@dataclass(eq=False)
class Link:
    """One broker endpoint: its DEALER, how the loop watches it, and its liveness."""

    endpoint: str
    sock: zmq.Socket | None = None
    fd: int | None = None  # the descriptor the loop's reader watches (None: not watched)
    poller: asyncio.Task | None = None  # a loop without add_reader (Windows' proactor): a task polls instead
    alive: bool = True
    heard: float = 0.0  # loop time of the last frame received
    busy_since: float = 0.0  # loop time its outstanding calls went from none to some
    left_at: float = 0.0
    probe_id: int | None = None
    probe_sent: float = 0.0
    kick: bool = False  # a `_kick` is scheduled for this loop turn: it sends `outbox`, then drains
    outbox: list[bytes | None] = field(default_factory=list)  # this turn's requests: a probe's bytes, None for a
    # call (its request is written into the frame at the flush, from its head)
    outbox_calls: list[Call | None] = field(default_factory=list)  # their calls (None: a probe)
    outbox_bytes: int = 0  # about how many bytes they make
    outstanding: dict[int, Call] = field(default_factory=dict)
    sent: int = 0
    resent: int = 0
    retried: int = 0
    dropped: int = 0
    left: int = 0
    frames: int = 0

    def status(self) -> EndpointStatus:
        return EndpointStatus(self.endpoint, self.alive, len(self.outstanding), self.sent, self.resent,
                              self.retried, self.dropped, self.left, self.frames)

    def open(self, context: zmq.Context[Any], curve: CurveKeys | None) -> None:
        """A fresh DEALER connected to the endpoint (watching it is the engine's to start)."""
        sock: zmq.Socket = context.socket(zmq.DEALER, socket_class=zmq.Socket)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)  # bounded by the calls pending, which the caller bounds
        sock.setsockopt(zmq.RCVHWM, 0)
        if curve is not None:
            curve.apply(sock)
        sock.connect(self.endpoint)
        self.sock = sock

    def close(self, loop: asyncio.AbstractEventLoop | None) -> None:
        """Stop watching and close the socket: requests queued in it and late replies die with it."""
        if self.fd is not None:
            if loop is not None and not loop.is_closed():
                loop.remove_reader(self.fd)
            self.fd = None
        if self.poller is not None:
            self.poller.cancel()
            self.poller = None
        if self.sock is not None:
            self.sock.close(linger=0)
            self.sock = None
        self.outbox.clear()  # what it held is re-sent from `outstanding` by whoever closed it
        self.outbox_calls.clear()
        self.outbox_bytes = 0
