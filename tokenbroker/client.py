"""A small synchronous client, for the CLI, tests and people (one DEALER, replies matched by id)."""

from __future__ import annotations

import itertools
from typing import Any

import msgpack
import zmq

DEFAULT_ENDPOINT = "tcp://127.0.0.1:5555"


class Client:
    """>>> with Client() as c: c.call("tokenize", text="hello world")["tokens"]"""

    def __init__(self, endpoint: str = DEFAULT_ENDPOINT, *, timeout_s: float = 60.0, ctx: zmq.Context | None = None) -> None:
        self._ctx = ctx or zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(endpoint)
        self._ids = itertools.count(1)
        self.timeout_s = timeout_s

    def send(self, op: str, **fields: Any) -> int:
        """Send without waiting; returns the request id to match the reply with."""
        request_id = fields.pop("id", None) or next(self._ids)
        body = {"id": request_id, "op": op, **{k: v for k, v in fields.items() if v is not None}}
        self._sock.send_multipart([b"", msgpack.packb(body, use_bin_type=True)])
        return request_id

    def recv(self) -> dict:
        if not self._sock.poll(int(self.timeout_s * 1000)):
            raise TimeoutError(f"no reply within {self.timeout_s}s")
        frames = self._sock.recv_multipart()
        return msgpack.unpackb(frames[-1], raw=False)

    def call(self, op: str, **fields: Any) -> dict:
        request_id = self.send(op, **fields)
        while True:
            reply = self.recv()
            if reply.get("id") == request_id:
                return reply

    def close(self) -> None:
        self._sock.close(linger=0)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
