"""The client coalesces (contract 1.2 "Several requests in one frame"), against real brokers.

Calls made in one event-loop turn leave in one frame; each is still its own call: cancelled,
timed out, failed or answered alone; a lone call leaves alone; a broker killed under array traffic
is left and its calls are answered once by the other.
"""

from __future__ import annotations

import asyncio
import signal

import pytest

import tokenbroker as tb
from helpers import batch_ids, start_broker, until


def texts(n: int, size: int = 1) -> list[str]:
    return [f"call {i}: " + "the quick brown fox " * size for i in range(n)]


@pytest.fixture(scope="module")
def broker():
    b = start_broker("--max-client-pending", "100000", workers=1)
    yield b
    b.stop()


def test_the_calls_of_one_turn_leave_in_one_frame_and_each_gets_its_own_result(broker):
    items = texts(200)
    want = batch_ids(broker.endpoint, items)

    async def main() -> None:
        async with tb.AsyncClient(broker.endpoint) as client:
            await client.ping()
            before = client.status()[0]
            results = await asyncio.gather(*(client.tokenize(t) for t in items))
            after = client.status()[0]
            assert [r.tokens.tolist() for r in results] == want
            assert after.sent - before.sent == 200
            assert after.frames - before.frames <= 2  # 200 calls of one turn: one frame (COALESCE_MAX_CALLS 256)
            one = await client.tokenize(items[0])  # a lone call: a frame of its own, its map alone
            assert one.tokens.tolist() == want[0] and client.status()[0].frames == after.frames + 1
            assert client.pending() == 0

    asyncio.run(main())


def test_one_cancelled_one_timing_out_one_failing_among_coalesced_calls(broker):
    items = texts(60, size=2)
    want = batch_ids(broker.endpoint, items)

    async def main() -> None:
        async with tb.AsyncClient(broker.endpoint) as client:
            await client.ping()
            calls = [asyncio.ensure_future(client.tokenize(t)) for t in items]
            slow = asyncio.ensure_future(client.tokenize("word " * 100_000, timeout=0.02))  # cannot finish in time
            failing = asyncio.ensure_future(client.tokenize("x", model="no-such-model"))
            cancelled = asyncio.ensure_future(client.tokenize(items[1]))
            await asyncio.sleep(0)  # every call above has run up to its send: all in one frame
            cancelled.cancel()
            results = await asyncio.gather(*calls)
            assert [r.tokens.tolist() for r in results] == want
            with pytest.raises((tb.Timeout, tb.Unavailable)):
                await slow
            with pytest.raises(tb.TokenbrokerError) as info:
                await failing
            assert info.value.code == "unknown_model"
            with pytest.raises(asyncio.CancelledError):
                await cancelled
            await until(lambda: client.pending() == 0, what="nothing pending")
            assert (await client.tokenize(items[2])).tokens.tolist() == want[2]

    asyncio.run(main())


def test_a_call_cancelled_before_its_frame_leaves_is_never_sent(broker):
    async def main() -> None:
        async with tb.AsyncClient(broker.endpoint) as client:
            await client.ping()
            before = client.status()[0]
            task = asyncio.ensure_future(client.tokenize("never sent"))
            await asyncio.sleep(0)  # the call is made and held for this turn's frame
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await client.ping()
            after = client.status()[0]
            assert after.frames == before.frames + 1  # only the ping went out
            assert after.dropped == before.dropped  # and no late reply came for the cancelled call

    asyncio.run(main())


def test_the_sync_client_coalesces_a_map(broker):
    items = texts(100)
    want = batch_ids(broker.endpoint, items)
    with tb.Client(broker.endpoint) as client:
        client.ping()
        before = client.status()[0].frames
        results = client.map(client.aio.tokenize, items)
        assert [r.tokens.tolist() for r in results] == want
        assert client.status()[0].frames - before <= 2


def test_a_broker_killed_under_array_traffic_is_left_and_every_call_is_answered_once():
    a, b = start_broker("--max-client-pending", "100000", workers=1), start_broker("--max-client-pending", "100000", workers=1)
    try:
        items = texts(1500)
        want = batch_ids(b.endpoint, items)

        async def main() -> None:
            async with tb.AsyncClient([a.endpoint, b.endpoint], liveness_s=0.5) as client:
                calls = []
                for start in range(0, len(items), 50):  # arrays of 50 to each broker, turn after turn
                    calls += [asyncio.ensure_future(client.tokenize(t)) for t in items[start:start + 50]]
                    await asyncio.sleep(0)
                await until(lambda: client.status()[0].outstanding > 50 and sum(c.done() for c in calls) > 10,
                            what="load on both brokers")
                a.stop(signal.SIGKILL)
                results = await asyncio.gather(*calls)
                assert [r.tokens.tolist() for r in results] == want  # each future resolved once, rightly
                left, other = client.status()
                assert not left.alive and left.resent > 0 and left.outstanding == 0
                assert other.alive and other.outstanding == 0 and client.pending() == 0

        asyncio.run(main())
    finally:
        a.stop(signal.SIGKILL)
        b.stop()
