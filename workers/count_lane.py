"""`count` off the worker's round loop: which counts go to the encode lane, and how one runs there.

A provider body of thousands of messages or images is read, harvested and counted in tens to
hundreds of milliseconds (3,000 image parts with absurd PNG headers: 85-170 ms through a broker),
and the first count of an OpenAI model builds its encoding from the local file (about 1.6 s). On
the round loop every small request behind such a count waited that long. So a count whose payload
is over LANE_COUNT_BYTES (common/protocol.py: the broker sends a worker one such count at a time, and
small jobs meanwhile), or whose body has a top-level list (messages, contents, input, tools) of
more than COUNT_LANE_ITEMS items, or whose ladder would first build a tokenizer, runs on the
encode lane (background.py), as a long encode does; a payload the worker took as a view of
ZeroMQ's frame (over ops.OFFLOAD_BYTES) is even parsed there, when its `op` is readable in its
head (`count_at_head`).

On the lane a count encodes with the models' engines directly: their L0/L1 caches belong to the
round thread (a count's texts are rarely asked again; the reply's `cache` says nothing was looked
up). Its work is bounded before it starts (count/bounds.py: at most --max-batch-items list items;
images.py reads at most a header per image), and each encode first checks the job: past its
deadline, or once the lane's watchdog gave up on it, the count stops with `timeout` instead of
running on as a wedged thread (the watchdog answers the job either way, as for any lane job).
While it runs the cyclic collector is off (`uncollected`): a full collection over the body it
reads held the GIL up to 35 ms, which the round thread and its small requests waited out.
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import msgpack

from tokenbroker.common.errors import ProtocolError
from tokenbroker.common.protocol import LANE_COUNT_BYTES, seek_key

from .registry import Model, ModelRegistry

COUNT_LANE_ITEMS = 256  # or one whose body has a top-level list longer than this
_HEAD = 1 << 16  # bytes of a payload read to find its `op` without parsing it

Encoder = Callable[[str], int]
T = TypeVar("T")


def count_at_head(payload: bytes | memoryview) -> bool:
    """The payload is a map whose `op` is "count", readable within its first 64 KiB (a few
    microseconds, without parsing the rest); False when not, or not readable there."""
    head = bytes(payload[:_HEAD])
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=len(head) or 1)
    unpacker.feed(head)
    try:
        return seek_key(unpacker, "op") is not None and unpacker.unpack() == "count"
    except Exception:  # noqa: BLE001 - unreadable within its head: the round loop parses it and says why
        return False


def wants_lane(payload: dict, payload_bytes: int, registry: ModelRegistry) -> bool:
    """A parsed count request is worth the lane's hop: a long payload, a long top-level list, or a
    tokenizer its ladder would build first (an OpenAI encoding's first use, the fallback's)."""
    if payload_bytes > LANE_COUNT_BYTES:
        return True
    body = payload.get("body")
    if type(body) is dict and any(type(v) is list and len(v) > COUNT_LANE_ITEMS for v in body.values()):
        return True
    model = payload.get("model")
    if model is None and type(body) is dict:
        model = body.get("model")
    return not registry.counting_ready(model if type(model) is str else None)


def uncollected(call: Callable[[], T]) -> Callable[[], T]:
    """`call` with the cyclic collector off while it runs. A body read on the lane is tens of
    thousands of maps and lists, alive while it is counted: they pass from generation to generation
    and make the collector walk them all, up to 35 ms a full collection with the GIL held, which
    the round thread waits out. They hold no cycle (a decoded body cannot), and go by their
    reference counts once the count is done; the collector is on again then."""

    def run() -> T:
        was = gc.isenabled()  # off already (another lane call, a caller of its own): left as found
        gc.disable()
        try:
            return call()
        finally:
            if was:
                gc.enable()

    return run


class Stop:
    """When a count on the lane gives up: its job's deadline (time.monotonic()), or the watchdog's `cancel`."""

    def __init__(self, deadline: float | None) -> None:
        self.deadline = deadline
        self.cancelled = threading.Event()

    def cancel(self) -> None:
        self.cancelled.set()

    def check(self) -> None:
        if self.cancelled.is_set() or (self.deadline is not None and time.monotonic() > self.deadline):
            raise ProtocolError("timeout", "the deadline passed while the body was being counted")


def engine_encoder(stop: Stop) -> Callable[[Model], Encoder]:
    """The lane's encoders: each model's engine without its caches, the job's deadline checked first."""

    def encoder(model: Model) -> Encoder:
        tokenizer = model.tokenizer

        def encode(text: str) -> int:
            stop.check()
            return len(tokenizer.encode_u32([text], add_special_tokens=False)[0]) >> 2

        return encode

    return encoder
