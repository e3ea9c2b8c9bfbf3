"""The worker side of the broker: who is connected, what each holds, and when each was last heard.

Heartbeats the Paranoid Pirate way: any frame from a worker is proof of life, and a worker silent
for interval x liveness is gone. Unlike ppqueue, busy workers stay in the table with their jobs,
so a worker's death hands its jobs back to the loop to be retried once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import zmq

from tokenbroker.common.protocol import (
    B_HEARTBEAT,
    B_JOB,
    HEARTBEAT_INTERVAL_S,
    HEARTBEAT_LIVENESS,
    JOB_ID,
    PROTOCOL_VERSION,
    W_BYE,
    W_HEARTBEAT,
    W_READY,
    W_RESULT,
    Ready,
    pack,
    unpack,
)

log = logging.getLogger(__name__)


@dataclass
class WorkerState:
    wid: bytes
    ready: Ready
    expiry: float
    jobs: set[int] = field(default_factory=set)
    draining: bool = False
    report: dict[str, Any] = field(default_factory=dict)  # the latest heartbeat body (cumulative counters, rss)

    @property
    def name(self) -> str:
        return self.ready.name


@dataclass(frozen=True)
class Joined:
    worker: WorkerState


@dataclass(frozen=True)
class Result:
    wid: bytes
    job_id: int
    payload: bytes  # b"": the worker skipped it (its budget had passed)
    outcome: str  # "ok" or the error code, so the broker counts outcomes without decoding replies


@dataclass(frozen=True)
class Draining:
    """The worker said BYE: it finishes what it holds but takes nothing new."""

    wid: bytes


@dataclass(frozen=True)
class Left:
    wid: bytes
    why: str
    state: WorkerState | None = None  # set when the table already dropped it (a reconnect replaced it)


class Backend:
    """Wraps the ROUTER socket workers connect to, and the table of workers."""

    def __init__(self, sock: zmq.Socket) -> None:
        self.sock = sock
        self.workers: dict[bytes, WorkerState] = {}
        self.next_beat = 0.0

    @staticmethod
    def expiry(now: float) -> float:
        return now + HEARTBEAT_INTERVAL_S * HEARTBEAT_LIVENESS

    def receive(self, now: float) -> list[object]:
        """Drain the socket; returns events in arrival order."""
        events: list[object] = []
        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return events
            events.extend(self._on_frame(frames, now))

    def _on_frame(self, frames: list[bytes], now: float) -> list[object]:
        wid, kind, body = frames[0], frames[1] if len(frames) > 1 else b"", frames[2:]
        worker = self.workers.get(wid)
        if worker is not None:
            worker.expiry = self.expiry(now)
        if kind == W_READY:
            try:
                ready = Ready.from_wire(body[0])
            except Exception as e:
                log.warning("worker %r sent an unreadable READY: %s", wid, e)
                return []
            if ready.version != PROTOCOL_VERSION:
                log.error("worker %s speaks protocol %d, this broker %d: ignored", ready.name, ready.version, PROTOCOL_VERSION)
                return []
            state = WorkerState(wid=wid, ready=ready, expiry=self.expiry(now))
            self.workers[wid] = state
            if worker is not None:  # it reconnected: the old incarnation and what it held are gone
                return [Left(wid, "reconnected", worker), Joined(state)]
            return [Joined(state)]
        if worker is None:
            return []  # a worker we forgot (expired): it will say READY again after reconnecting
        if kind == W_RESULT and len(body) == 3:
            return [Result(wid, JOB_ID.unpack(body[0])[0], body[1], body[2].decode() or "ok")]
        if kind == W_HEARTBEAT and body:
            try:
                report = unpack(body[0])
            except Exception:
                return []
            if isinstance(report, dict):
                worker.report = report  # replaced, never edited: the exporter's thread reads the old one
            return []
        if kind == W_BYE:
            worker.draining = True
            return [Left(wid, "leaving") if not worker.jobs else Draining(wid)]
        log.warning("worker %s sent an unknown message kind %r", worker.name, kind)
        return []

    def send_job(self, wid: bytes, job_id: int, budget_ms: int, payload: bytes) -> None:
        self.sock.send_multipart([wid, B_JOB, JOB_ID.pack(job_id), pack({"budget_ms": budget_ms}), payload])
        self.workers[wid].jobs.add(job_id)

    def forget(self, wid: bytes) -> WorkerState | None:
        return self.workers.pop(wid, None)

    def tick(self, now: float) -> list[Left]:
        """Heartbeat every worker on time, and report the ones gone silent."""
        if now >= self.next_beat:
            for wid in self.workers:
                self._send(wid, B_HEARTBEAT)
            self.next_beat = now + HEARTBEAT_INTERVAL_S
        return [Left(w.wid, "silent") for w in self.workers.values() if w.expiry <= now]

    def _send(self, wid: bytes, kind: bytes) -> None:
        try:
            self.sock.send_multipart([wid, kind], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def ready_count(self) -> int:
        return sum(1 for w in self.workers.values() if not w.draining)
