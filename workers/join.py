"""Getting through to the broker: connect, say READY, and wait until the broker answers, however long that takes.

A worker may start before its broker, lose it to a restart or to the network, or be refused by it
(a CURVE key the broker does not admit, a server key that is not the broker's). None of that is a
crash: `join` keeps trying until a message from the broker waits on the socket, and says why it
cannot get through, with the endpoint, once per REPORT_EVERY_S (the first time after one heartbeat
interval, so a misconfigured worker says so at once). The reason comes from the socket's monitor
(ZeroMQ's connection and handshake events): a refused key, a failed handshake, nothing listening,
or a broker that took the connection and does not answer READY (its log says why: a fingerprint it
does not expect, docs/protocol.md "Worker admission").

An attempt is one socket: READY is queued on it at once (ZeroMQ sends it when a connection is made,
and reconnects on its own meanwhile), and after HEARTBEAT_LIVENESS heartbeat intervals with no
answer the socket is closed and a fresh one made after a doubling backoff, as the Paranoid Pirate
worker does: a broker that restarted gets a READY of its own, never one queued for its predecessor.

It ends three ways: joined (the socket, with the broker's first message unread: it may be jobs);
`stop()` true (SIGTERM, or the broker that started this worker is gone): None; or --give-up-after
seconds without getting through: BrokerUnreachable, which the worker reports and exits on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import zmq
from zmq.utils.monitor import recv_monitor_message

from tokenbroker.common.curve import apply_client_curve
from tokenbroker.common.protocol import HEARTBEAT_INTERVAL_S, HEARTBEAT_LIVENESS, W_READY

log = logging.getLogger(__name__)

RECONNECT_INIT_S = 0.1
RECONNECT_MAX_S = 5.0
ATTEMPT_S = HEARTBEAT_INTERVAL_S * HEARTBEAT_LIVENESS  # one socket waits this long for the broker's first message
REPORT_EVERY_S = ATTEMPT_S  # a worker that cannot get through says why this often
SLICE_S = 0.1  # the wait polls in slices: a signal handler runs inside zmq's poll without ending it (pyzmq retries on EINTR)
SNDTIMEO_MS = int(HEARTBEAT_INTERVAL_S * 1000)  # a send the socket cannot take in time raises zmq.Again (the loop drops it)

_WATCHED = (zmq.EVENT_CONNECTED | zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_DISCONNECTED
            | zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)

_REFUSALS = (zmq.EVENT_HANDSHAKE_FAILED_AUTH, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)


class BrokerUnreachable(Exception):
    """--give-up-after passed without getting through; the message says to where and why."""


def why(event: int, value: int, handshaken: bool, curve: bool) -> str | None:
    """What a monitor event says about getting through, for the log (None: an event not watched).

    >>> why(zmq.EVENT_HANDSHAKE_FAILED_AUTH, 400, False, True)
    "the broker refused this worker's CURVE key (ZAP status 400): its public .key is not in the broker's --curve-workers folder"
    """
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return (f"the broker refused this worker's CURVE key (ZAP status {value}): its public .key is not in the "
                f"broker's --curve-workers folder")
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        if value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            return "the handshake failed: CURVE on one side only (the broker's --curve-secret-key, this worker's --curve-server-key)"
        if value == zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC:
            return "the handshake failed on its cryptography: a --curve-server-key that is not the broker's?"
        return f"the handshake failed (ZeroMQ protocol error {value:#x})"
    # the peer hung up mid-handshake: under CURVE most likely a server key it cannot answer
    suspect = "a --curve-server-key that is not the broker's?" if curve else "is a tokenbroker backend listening there?"
    if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
        return f"the handshake failed with no detail from ZeroMQ: {suspect}"
    if event == zmq.EVENT_CONNECT_RETRIED:
        return "the connection was refused or failed: no broker listening there yet, or the network is down"
    if event == zmq.EVENT_DISCONNECTED:
        if handshaken:
            return "the broker closed the connection"
        return f"the peer closed the connection during the handshake: {suspect}"
    if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
        return "connected, but the broker has not answered READY (its log says why: a model fingerprint it does not expect?)"
    if event == zmq.EVENT_CONNECTED:
        return "connected, but the handshake has not finished"
    return None


class Attempt:
    """One socket trying to get through: connected, READY queued, its monitor read for the reason."""

    def __init__(self, ctx: zmq.Context, endpoint: str, curve: tuple[str | None, str | None], ready: bytes) -> None:
        self.sock: zmq.Socket = ctx.socket(zmq.DEALER)  # ZeroMQ picks the identity: one per connection
        self.sock.setsockopt(zmq.LINGER, 2000)
        self.sock.setsockopt(zmq.SNDTIMEO, SNDTIMEO_MS)
        self.curve = apply_client_curve(self.sock, *curve) is not None  # common/curve.py
        self.monitor: zmq.Socket = self.sock.get_monitor_socket(_WATCHED)
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.poller.register(self.monitor, zmq.POLLIN)
        self.reason = "no connection made yet (the endpoint may be unreachable)"
        self.refused = False  # the reason is a refusal: a reconnect after it (ZeroMQ retries on its own) keeps it
        self.handshaken = False  # on the current connection
        self.ready: bytes | None = ready  # until ZeroMQ has taken it
        self.sock.connect(endpoint)
        self._say_ready()

    def _say_ready(self) -> None:
        """Queue READY without waiting: a socket with no pipe yet (some transports make it only once
        connected) takes it on a later turn."""
        if self.ready is None:
            return
        try:
            self.sock.send_multipart([W_READY, self.ready], zmq.NOBLOCK)
            self.ready = None
        except zmq.Again:
            pass

    def wait(self, timeout_s: float) -> bool:
        """Up to `timeout_s`: True once a message from the broker waits on the socket (left unread)."""
        events = dict(self.poller.poll(int(timeout_s * 1000)))
        if self.monitor in events:
            self._read_monitor()
        self._say_ready()
        return self.sock in events

    def _read_monitor(self) -> None:
        while True:
            try:
                event = recv_monitor_message(self.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            kind, value = int(event["event"]), int(event["value"])
            if kind == zmq.EVENT_CONNECTED:
                self.handshaken = False
            reason = why(kind, value, self.handshaken, self.curve)
            if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.handshaken, self.refused = True, False
            if reason is None:
                continue
            if kind in _REFUSALS or (kind == zmq.EVENT_DISCONNECTED and not self.handshaken):
                if not self.refused or kind in _REFUSALS:  # ZeroMQ's own detail beats a dropped connection
                    self.reason, self.refused = reason, True
            elif not self.refused:
                self.reason = reason

    def joined(self) -> zmq.Socket:
        """The socket, its monitor stopped (the round loop watches no connection events)."""
        self.sock.disable_monitor()
        self.monitor.close(linger=0)
        return self.sock

    def close(self) -> None:
        self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.sock.close(linger=0)


class Patience:
    """How long a worker has been trying to get through: says why once per REPORT_EVERY_S (the first
    time after one heartbeat interval), and gives up after --give-up-after seconds (0: never)."""

    def __init__(self, endpoint: str, give_up_after: float) -> None:
        self.endpoint = endpoint
        self.give_up_after = give_up_after
        self.started = time.monotonic()
        self.report_at = self.started + HEARTBEAT_INTERVAL_S

    def note(self, reason: str) -> None:
        """Called every slice while not through: logs `reason` when due; BrokerUnreachable past the limit."""
        now = time.monotonic()
        if self.give_up_after and now - self.started >= self.give_up_after:
            raise BrokerUnreachable(f"could not get through to the broker at {self.endpoint} in {self.give_up_after:g}s "
                                    f"(--give-up-after): {reason}")
        if now >= self.report_at:
            log.warning("cannot get through to the broker at %s: %s (still trying, %.0fs so far)", self.endpoint, reason,
                        now - self.started)
            self.report_at = now + REPORT_EVERY_S

    def joined(self) -> None:
        waited = time.monotonic() - self.started
        if waited >= HEARTBEAT_INTERVAL_S:  # said only after a wait worth saying
            log.info("joined the broker at %s after %.1fs", self.endpoint, waited)


def join(ctx: zmq.Context, endpoint: str, curve: tuple[str | None, str | None], ready: Callable[[], bytes],
         stop: Callable[[], bool], give_up_after: float = 0.0) -> zmq.Socket | None:
    """A socket on `endpoint` whose broker has answered READY (its first message unread); None when
    `stop()` turned true first. Raises BrokerUnreachable after `give_up_after` seconds (0: never).
    `ready` builds READY afresh for each attempt (the models loaded at that moment)."""
    patience = Patience(endpoint, give_up_after)
    backoff = RECONNECT_INIT_S
    while True:
        attempt = Attempt(ctx, endpoint, curve, ready())
        ends = time.monotonic() + ATTEMPT_S
        try:
            while time.monotonic() < ends and not stop():
                if attempt.wait(SLICE_S):
                    patience.joined()
                    return attempt.joined()
                patience.note(attempt.reason)
        except BrokerUnreachable:
            attempt.close()
            raise
        attempt.close()
        pause_ends = time.monotonic() + backoff  # a fresh socket after a doubling backoff
        while time.monotonic() < pause_ends and not stop():
            time.sleep(SLICE_S)
            patience.note(attempt.reason)
        if stop():
            return None
        backoff = min(backoff * 2, RECONNECT_MAX_S)
