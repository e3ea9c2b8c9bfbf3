"""`count` off the round loop (workers/count_lane.py), at the worker's entry point: which counts a
round hands to the encode lane, that the lane's reply equals the inline one, and the lane count's
deadline. Real Ops, a real registry and tokenizer, a real Lane thread; the e2e side (small requests
answered before a 3,000-image count through a broker) is in test_count_e2e.py."""

from __future__ import annotations

import gc
import time

import msgpack
import pytest
from helpers import BERT_DIR
from test_count_e2e import _HUGE_IMAGE_BODIES, HUGE, _png_header

from tokenbroker.common.config import ModelConfig, ModelSpec
from tokenbroker.common.errors import ProtocolError
from tokenbroker.common.protocol import SKIPPED
from tokenbroker.workers.background import Lane
from tokenbroker.workers.count_lane import COUNT_LANE_ITEMS, Stop, count_at_head, engine_encoder, uncollected, wants_lane
from tokenbroker.workers.ops import Ops, PendingJob
from tokenbroker.workers.registry import ModelRegistry


@pytest.fixture(scope="module")
def registry() -> ModelRegistry:
    return ModelRegistry(ModelConfig(models=(ModelSpec("bert", str(BERT_DIR)),)))


def _lane_ops(registry: ModelRegistry) -> tuple[Ops, Lane]:
    ops = Ops(registry, "test")
    ops.renders, ops.encodes = Lane("render"), Lane("encode")
    return ops, ops.encodes


def _drain(ops: Ops, lane: Lane, want: int) -> list[tuple[int, str, bytes]]:
    out: list[tuple[int, str, bytes]] = []
    deadline = time.monotonic() + 60
    while len(out) < want and time.monotonic() < deadline:
        out += ops.finish_deferred(lane)
        time.sleep(0.005)
    return out


def test_counts_past_a_size_or_item_threshold_are_counted_on_the_lane_as_inline(registry: ModelRegistry) -> None:
    b64 = _png_header(HUGE, HUGE)
    inline = Ops(registry, "test")  # no lanes: counted on the round thread, through the caches
    ops, lane = _lane_ops(registry)
    try:
        jobs, want = [], {}
        for i, (fmt, model, message, _) in enumerate(_HUGE_IMAGE_BODIES):
            key = "contents" if fmt == "gemini.generate" else "messages"
            body = {key: [message(b64) for _ in range(3000)] + [{"role": "user", "content": "and some text"}]}
            payload = msgpack.packb({"id": i, "op": "count", "body": body, "format": fmt, "model": model})
            assert len(payload) > 1 << 16 and count_at_head(payload)  # taken as a view, parsed on the lane
            jobs.append(PendingJob(i, 0, time.monotonic(), memoryview(payload)))
            want[i] = inline.run([PendingJob(i, 0, time.monotonic(), payload)])[0]
        many = {"messages": [{"role": "user", "content": "x"}] * (COUNT_LANE_ITEMS + 1)}  # small, but many items
        payload = msgpack.packb({"id": 9, "op": "count", "body": many, "format": "anthropic.messages"})
        assert len(payload) < 16 * 1024 and wants_lane(msgpack.unpackb(payload), len(payload), registry)
        jobs.append(PendingJob(9, 0, time.monotonic(), payload))
        want[9] = inline.run([PendingJob(9, 0, time.monotonic(), payload)])[0]
        small = PendingJob(10, 0, time.monotonic(), msgpack.packb({"id": 10, "op": "tokenize", "text": "small"}))
        assert [r[0] for r in ops.run([*jobs, small])] == [10]  # only the small one is answered in the round
        got = {job_id: (job_id, outcome, reply) for job_id, outcome, reply in _drain(ops, lane, len(jobs))}
        assert set(got) == set(want)
        for job_id, (_, outcome, reply) in got.items():
            lane_reply, inline_reply = msgpack.unpackb(reply), msgpack.unpackb(want[job_id][2])
            assert outcome == "ok" and lane_reply["ok"], lane_reply
            assert lane_reply.pop("cache") == {"l0": "off", "l1_reused_tokens": 0}  # the lane looks nothing up
            inline_reply.pop("cache")
            assert lane_reply == inline_reply
    finally:
        for lane_ in (ops.renders, ops.encodes):
            assert lane_ is not None
            lane_.close()


def test_small_counts_stay_on_the_round_loop_unless_their_tokenizer_is_built_first(registry: ModelRegistry) -> None:
    fresh = ModelRegistry(ModelConfig(models=(ModelSpec("bert", str(BERT_DIR)),)))
    small = {"op": "count", "body": {"messages": [{"role": "user", "content": "hi"}]}}
    for name in (None, "gpt-4o", "claude-sonnet-4"):  # an encoding's or the fallback's first use: the lane
        assert wants_lane({**small, "model": name}, 100, fresh), name
    assert not wants_lane({**small, "model": "bert"}, 100, fresh)  # a loaded model serves it at once
    assert fresh.fallback() is not None and fresh.encoding("o200k_base") is not None
    for name in (None, "gpt-4o", "claude-sonnet-4"):
        assert not wants_lane({**small, "model": name}, 100, fresh), name
    assert wants_lane({**small, "model": "gpt-4"}, 100, fresh)  # cl100k_base is not built yet
    assert not wants_lane({"op": "count", "body": "x" * 100}, 200, fresh)
    assert wants_lane({"op": "count", "body": "x" * 20_000}, 20_010, fresh)


def test_a_count_whose_op_is_in_its_head_is_read_on_the_lane() -> None:
    big = {"body": "x" * 70_000}
    assert not count_at_head(msgpack.packb({**big, "op": "count"}))  # `op` past the head: parsed on the loop
    assert count_at_head(msgpack.packb({"op": "count", **big}))
    assert not count_at_head(msgpack.packb({"op": "tokenize", "text": "x" * 70_000}))
    assert not count_at_head(b"\xc1" * 10)


def test_a_lane_count_stops_at_its_deadline_or_when_the_watchdog_cancels_it(registry: ModelRegistry) -> None:
    bert = registry.get("bert")
    assert bert is not None
    assert engine_encoder(Stop(None))(bert)("hello world") == len(bert.tokenizer.encode("hello world", add_special_tokens=False))
    for stop in (Stop(time.monotonic() - 0.001), Stop(None)):
        if stop.deadline is None:
            stop.cancel()
        with pytest.raises(ProtocolError) as e:
            engine_encoder(stop)(bert)("hello")
        assert e.value.code == "timeout"
    ops, lane = _lane_ops(registry)
    try:
        body = {"messages": [{"role": "user", "content": "word " * 50}] * (COUNT_LANE_ITEMS + 1)}
        job = PendingJob(1, 1, time.monotonic() - 1, msgpack.packb({"id": 1, "op": "count", "body": body}))
        assert ops.run([job]) == [(1, SKIPPED, b"")]  # past its budget on arrival: the broker answers it
        job = PendingJob(2, 50, time.monotonic(), msgpack.packb({"id": 2, "op": "count", "body": body}))
        assert ops.run([job]) == []
        time.sleep(0.06)
        assert _drain(ops, lane, 1) == [(2, SKIPPED, b"")]  # its deadline passed: the broker has answered timeout
    finally:
        for lane_ in (ops.renders, ops.encodes):
            assert lane_ is not None
            lane_.close()


def test_a_lane_count_runs_with_the_collector_off_and_leaves_it_as_it_found_it() -> None:
    """The body a lane count reads is never walked by the cyclic collector while it is counted
    (a full collection held the GIL up to 35 ms); the collector is on again after, error or not,
    and a collector someone else turned off stays off."""
    assert gc.isenabled()
    seen: list[bool] = []
    assert uncollected(lambda: seen.append(gc.isenabled()) or 7)() == 7
    assert seen == [False] and gc.isenabled()
    with pytest.raises(ZeroDivisionError):
        uncollected(lambda: 1 // 0)()
    assert gc.isenabled()
    gc.disable()
    try:
        uncollected(lambda: None)()
        assert not gc.isenabled()
    finally:
        gc.enable()
