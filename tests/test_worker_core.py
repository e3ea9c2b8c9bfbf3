"""The worker's compiled per-item path (workers/_core.pyx) against the general one, on real tokenizers.

`read_plain` must take exactly what parse_request would serve as a plain tokenize (and read the
same fields from it), and never fail on any bytes; a round served by the compiled path must give,
byte for byte, the replies of the same requests served one by one through `_serve`: single texts
and batches, `list` and `u32`, every id form, every reply-budget edge.
"""

from __future__ import annotations

import time
from array import array
from dataclasses import replace

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import BERT_DIR
from tokenbroker.common.config import CacheConfig, ModelConfig, ModelSpec
from tokenbroker.common.errors import ProtocolError
from tokenbroker.common.protocol import (B_JOBS, NIL, OUTCOME_INDEX, W_RESULTS, pack_jobs, parse_request, raw_id,
                                         unpack_results)
from tokenbroker.workers._core import pack_tokens, read_plain
from tokenbroker.workers._round import Round
from tokenbroker.workers.engine import build_fast
from tokenbroker.workers.ops import Ops, PendingJob
from tokenbroker.workers.registry import ModelRegistry
from tokenbroker.workers.tokenin import asks_extras

KEYS = ["id", "op", "model", "text", "tokens_format", "add_special_tokens", "deadline_ms", "affinity", "offsets",
        "return_offsets", "truncate_prompt_tokens", "x"]
VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1), st.floats(allow_nan=False), st.text(max_size=20),
    st.binary(max_size=8), st.lists(st.text(max_size=8), max_size=4), st.lists(st.integers(0, 300), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(-9, 9), max_size=2),
    st.sampled_from(["tokenize", "detokenize", "list", "u32", "m", "chat"]),
)


def _expected(payload: bytes) -> tuple | None:
    """What read_plain must say of `payload`, from the general path's own reading of it."""
    try:
        request = parse_request(payload)
    except ProtocolError:
        return None
    p = request.payload
    if request.op != "tokenize" or set(p) - {"id", "op", "model", "text", "tokens_format", "add_special_tokens",
                                             "deadline_ms", "affinity"}:
        return None
    text, special = p.get("text"), p.get("add_special_tokens")
    if not (type(text) is str or (type(text) is list and all(type(t) is str for t in text))):
        return None
    if special is not None and type(special) is not bool:
        return None
    assert not asks_extras(p)
    return text, request.model, request.tokens_format == "u32", special is not False, request.raw_id


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(KEYS), VALUES, max_size=6), st.booleans(), st.booleans())
def test_read_plain_reads_what_parse_request_reads(fields, with_op, with_text):
    if with_op:
        fields.setdefault("op", "tokenize")
    if with_text:
        fields.setdefault("text", "hello")
    payload = msgpack.packb(fields, use_bin_type=True)
    got, want = read_plain(payload), _expected(payload)
    if want is None:
        assert got is None
    elif got is not None:  # the reader may leave a servable payload to the general path; then it is None
        assert got == want
    else:
        pytest.fail(f"read_plain left a plain tokenize to the general path: {fields!r}")


@settings(max_examples=1500, deadline=None)
@given(st.binary(max_size=64), st.integers(0, 40))
def test_read_plain_never_fails_on_any_bytes(noise, cut):
    base = msgpack.packb({"id": 1, "op": "tokenize", "text": "hi", "tokens_format": "u32"}, use_bin_type=True)
    for payload in (noise, base[:cut] + noise, base + noise, base[:cut], b"\x87" + noise):
        got = read_plain(payload)
        assert got is None or got == _expected(payload)


def test_read_plain_hands_edge_forms_to_the_general_path():
    good = {"op": "tokenize", "text": "hi"}
    pack = msgpack.packb
    cases = [
        pack(good) + b"\xc0",  # a second value after the map
        b"\x82\xa2op\xa8tokenize\xa4text\xa2\xff\xfe",  # text not UTF-8
        b"\x83\xa2op\xa8tokenize\xa4text\xa2hi\xa2id\xa2\xc3\x28",  # id not UTF-8
        b"\x82\xa2op\xa8tokenize\xa4text\xa2hi"[:-1],  # truncated
        b"\x83\xa2op\xa8tokenize\xa4text\xa2hi\xa4text\xa2ho",  # a key twice (the last wins there)
        b"\x83\xa2op\xa8tokenize\xa4text\xa2hi\x01\x02",  # a key that is no str
        pack({**good, "id": [1]}), pack({**good, "id": {"a": 1}}), b"\x83\xa2op\xa8tokenize\xa4text\xa2hi\xa2id\xd4\x01\x00",
        pack({**good, "deadline_ms": 0}), pack({**good, "deadline_ms": -5}), pack({**good, "deadline_ms": 1.5}),
        pack({**good, "tokens_format": "u16"}), pack({**good, "add_special_tokens": 1}), pack({**good, "model": 3}),
        pack({**good, "text": ["a", 3]}), pack({"op": "tokenize"}), pack({"text": "hi"}), pack([good]), b"",
        pack({**good, "return_offsets": None}),
    ]
    for payload in cases:
        assert read_plain(payload) is None, payload
    assert read_plain(bytearray(pack(good))) is None  # only bytes: the worker hands it nothing else
    assert read_plain(pack({**good, "deadline_ms": 2**64 - 1, "affinity": None, "model": None, "id": None})) == (
        "hi", None, False, True, NIL)
    assert read_plain(b"\x83\xa2op\xa8tokenize\xa4text\xa2hi\xa2id\xd0\x05")[4] == b"\xd0\x05"  # as it came


def test_pack_tokens_refuses_ends_outside_the_buffer():
    flat = array("I", [1, 2, 3]).tobytes()
    for ends, first, n in (([0, 4], 0, 1), ([0, 2, 1], 0, 2), ([0, 1], 1, 1), ([0, 1], 0, 2), ([0, 1], -1, 1)):
        with pytest.raises(ValueError):
            pack_tokens(flat, array("Q", ends).tobytes(), first, n, True, True, NIL, b"", 1 << 20)
    with pytest.raises(ValueError):
        pack_tokens(flat, array("Q", [0, 1, 2]).tobytes(), 0, 2, False, True, NIL, b"", 1 << 20)  # one text unless a batch


@pytest.fixture(scope="module", params=[str(BERT_DIR), "embedded:deepseek", "o200k_base"], ids=["reference", "fastokens", "tiktoken"])
def registry(request) -> ModelRegistry:
    registry = ModelRegistry(ModelConfig(models=(ModelSpec("m", request.param),)))
    if request.param != str(BERT_DIR):
        registry.models[0].tokenizer.fast = build_fast(registry.models[0].tokenizer)
    return registry


TEXTS = ["", "a", "hello world " * 30, "x" * 300, "é" * 20000, "<|endoftext|> ok", "日本語 " * 200]
IDS = [None, 1, 300, -3, 2**40, 2.5, "abc", "é" * 40, b"\x01\x02", True]


def _payloads() -> list[bytes]:
    out = []
    for k, rid in enumerate(IDS):
        for fmt in (None, "list", "u32"):
            for special in (None, True, False):
                texts = [TEXTS[(k + j) % len(TEXTS)] for j in range(k % 4)]
                for text in (TEXTS[k % len(TEXTS)], texts, TEXTS * 3):
                    body = {"op": "tokenize", "text": text, "model": "m" if k % 3 else None}
                    if fmt is not None:
                        body["tokens_format"] = fmt
                    if special is not None:
                        body["add_special_tokens"] = special
                    if rid is not None:
                        body = {"id": rid, **body} if k % 2 else {**body, "id": rid}
                    out.append(msgpack.packb(body, use_bin_type=True))
    return out


def test_a_round_through_the_compiled_path_equals_each_request_served_alone(registry):
    payloads = _payloads()
    assert all(read_plain(p) is not None for p in payloads)
    ops = Ops(registry, "w")
    out = ops.run([PendingJob(i, 0, time.monotonic(), p) for i, p in enumerate(payloads)])
    assert [job_id for job_id, _, _ in out] == list(range(len(payloads)))
    alone = Ops(registry, "w")
    for (_, outcome, reply), payload in zip(out, payloads):
        assert (reply, outcome) == alone._serve(parse_request(payload), len(payload)), msgpack.unpackb(payload)
    assert all(outcome == "ok" for _, outcome, _ in out)


def test_the_reply_budget_edges_are_the_general_paths(registry):
    """Each reply at its exact size, one byte under it, and a budget the ids alone pass: the compiled
    path's reply or the general path's too_large, byte for byte what the request alone gets."""
    payloads = [p for p in _payloads() if len(p) < 3000][::7]
    ops, alone = Ops(registry, "w"), Ops(registry, "w")
    sizes = [len(reply) for _, _, reply in ops.run([PendingJob(i, 0, time.monotonic(), p) for i, p in enumerate(payloads)])]
    for payload, size in zip(payloads, sizes):
        for limit in (size, size - 1, size // 2, 8):
            ops.limits = alone.limits = replace(registry.limits, max_reply_bytes=limit)
            (_, outcome, reply), = ops.run([PendingJob(0, 0, time.monotonic(), payload)])
            assert (reply, outcome) == alone._serve(parse_request(payload), len(payload)), (limit, size)
            assert outcome == ("ok" if limit >= size else "too_large")


CACHES = [CacheConfig(l0_enabled=True), CacheConfig(l1_enabled=True), CacheConfig(l0_enabled=True, l1_enabled=True)]
SHARED = "<｜begin▁of▁sentence｜>You are a careful assistant. " * 60  # an L1 prefix: ends at an added token
TURNS = [SHARED + "<｜User｜>" + "question %d " % k * 9 + "<｜Assistant｜>" for k in range(4)]


def _cached_ops(cache: CacheConfig) -> Ops:
    registry = ModelRegistry(ModelConfig(models=(ModelSpec("m", "embedded:deepseek"),), cache=cache))
    registry.models[0].tokenizer.fast = build_fast(registry.models[0].tokenizer)
    return Ops(registry, "w")


def _cached_payloads() -> list[bytes]:
    payloads = _payloads()
    for fmt in ("list", "u32"):
        for text in (*TURNS, TURNS, TURNS[::-1]):
            payloads.append(msgpack.packb({"id": 7, "op": "tokenize", "model": "m", "text": text, "tokens_format": fmt}))
    return payloads + payloads[::5]  # again: L0 hits


@pytest.mark.parametrize("cache", CACHES, ids=["l0", "l1", "l0+l1"])
def test_with_caches_the_fields_read_in_c_are_served_as_the_parsed_request(cache):
    """A model with caches: the plain requests (single and batch, list and u32) go through the cache's
    packed entry point and `pack_tokens`, and the replies (their `cache` fields too) equal the parsed
    requests' served one by one in the same order."""
    payloads = _cached_payloads()
    ops, alone = _cached_ops(cache), _cached_ops(cache)
    out = ops.run([PendingJob(i, 0, time.monotonic(), p) for i, p in enumerate(payloads)])
    for (_, outcome, reply), payload in zip(out, payloads):
        assert (reply, outcome) == alone._serve(parse_request(payload), len(payload)), msgpack.unpackb(payload)
    caches = [msgpack.unpackb(reply)["cache"] for _, _, reply in out]
    assert all(outcome == "ok" for _, outcome, _ in out)
    if cache.l0_enabled:
        assert any(c["l0"] == "hit" for c in caches) and any(c["l0"] == "miss" for c in caches)
    if cache.l1_enabled:
        assert any(c["l1_reused_tokens"] > 0 for c in caches)
    assert ops.registry.models[0].cache.stats() == alone.registry.models[0].cache.stats()  # each text looked up once


@pytest.mark.parametrize("cache", CACHES, ids=["l0", "l1", "l0+l1"])
def test_with_caches_the_reply_budget_edges_are_the_general_paths(cache):
    """With caches, at a reply's exact size, one byte under it, half and 8 bytes: the compiled path's
    reply or the general path's too_large, byte for byte (the `cache` map too) what the request alone
    gets, every text looked up once either way."""
    payloads = [p for p in _cached_payloads() if len(p) < 3000][::5]
    ops, alone = _cached_ops(cache), _cached_ops(cache)
    for payload in payloads:  # warm: from here each request meets the caches as it will below
        ops.run([PendingJob(0, 0, time.monotonic(), payload)])
        alone._serve(parse_request(payload), len(payload))
    sizes = [len(reply) for _, _, reply in ops.run([PendingJob(i, 0, time.monotonic(), p) for i, p in enumerate(payloads)])]
    for payload in payloads:
        alone._serve(parse_request(payload), len(payload))
    for payload, size in zip(payloads, sizes):
        for limit in (size, size - 1, size // 2, 8):
            ops.limits = alone.limits = replace(ops.registry.limits, max_reply_bytes=limit)
            (_, outcome, reply), = ops.run([PendingJob(0, 0, time.monotonic(), payload)])
            assert (reply, outcome) == alone._serve(parse_request(payload), len(payload)), (limit, size)
            assert outcome == ("ok" if limit >= size else "too_large")
    assert ops.registry.models[0].cache.stats() == alone.registry.models[0].cache.stats()


# --- the compiled round over libzmq (workers/_round.pyx) -------------------------------------------

GENERAL = [msgpack.packb(p, use_bin_type=True) for p in (
    {"id": 1, "op": "detokenize", "tokens": [1, 2, 3], "model": "m"},
    {"id": 2, "op": "tokenize", "text": "hi", "model": "nobody"},
    {"id": 3, "op": "tokenize", "text": "hi", "model": "m", "return_offsets": True},
    {"id": 4, "op": "tokenize", "text": ["a"] * 300, "model": "m"},
    {"id": 5, "op": "tokenize", "text": b"\xff", "model": "m"},
)] + [b"\x93\x01", msgpack.packb({"id": 6, "op": "tokenize", "text": "x"})[:-1] + b"\xff"]


@pytest.fixture()
def wire():
    """A ROUTER (the broker) and a DEALER (the worker's socket) over inproc, the DEALER's identity known."""
    ctx = zmq.Context()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    router.bind("inproc://round")
    dealer.connect("inproc://round")
    dealer.send(b"hello")
    ident, _ = router.recv_multipart()
    yield router, dealer, ident
    router.close(0)
    dealer.close(0)
    ctx.term()


def _round_trip(wire, ops: Ops, batches: list[list[tuple[int, int, bytes]]], control: list[list[bytes]] = ()) -> dict:
    """The batches as B_JOBS (and `control` messages after the first) through Round: take, serve,
    ops.run of what it hands back, add, send; the results the ROUTER reads, by job id."""
    router, dealer, ident = wire
    for k, batch in enumerate(batches):
        router.send_multipart([ident, *pack_jobs(batch)])
        if k == 0:
            for frames in control:
                router.send_multipart([ident, *frames])
    rnd = Round(B_JOBS, W_RESULTS, OUTCOME_INDEX)
    taken: list[list[bytes]] = []
    wanted = sum(len(b) for b in batches)
    while rnd.jobs < wanted or len(taken) < len(control):
        assert dealer.poll(5000)
        frames = rnd.take(dealer, 4096)
        if frames is not None:
            taken.append(frames)
    assert taken == list(control)
    time.sleep(0.01)  # past the 1 ms budget of the jobs that have one
    rest = rnd.serve(ops.plain_engine, ops.alone, 64 * 1024, 1 << 16, ops.limits.max_reply_bytes)
    rnd.add(ops.run([PendingJob(*job) for job in rest]))
    assert rnd.send(dealer) == wanted
    _, kind, *body = router.recv_multipart()
    assert kind == W_RESULTS
    return {job_id: (outcome, bytes(reply)) for job_id, outcome, reply in unpack_results(body)}


def test_a_compiled_round_answers_as_ops_run_does_byte_for_byte(registry, wire):
    """Plain tokenizes answered in C over libzmq, the rest by Ops.run, in one W_RESULTS: each reply
    is what the request served alone gets; a job past its budget is skipped; a control message
    taken between two B_JOBS comes back to Python as its frames."""
    payloads = _payloads() + GENERAL
    half = len(payloads) // 2
    batches = [[(i, 0, p) for i, p in enumerate(payloads[:half])],
               [(half + i, 0, p) for i, p in enumerate(payloads[half:])],
               [(10**6, 1, payloads[0])]]
    got = _round_trip(wire, Ops(registry, "w"), batches, control=[[b"h"], [b"u", b"m2"]])
    alone = Ops(registry, "w")
    for i, payload in enumerate(payloads):
        try:
            want = alone._serve(parse_request(payload), len(payload))
        except ProtocolError as e:
            want = alone._error(raw_id(payload), e)
        assert got[i] == (want[1], want[0]), (i, payload[:80])
    assert got[10**6] == ("skipped", b"")


def test_a_compiled_round_leaves_a_reply_past_the_budget_to_the_general_path(registry, wire):
    """Replies over --max-reply-bytes: the compiled round writes none of them, Ops.run answers
    too_large, byte for byte what each request alone gets."""
    payloads = [p for p in _payloads() if len(p) < 3000][::7]
    ops, alone = Ops(registry, "w"), Ops(registry, "w")
    ops.limits = alone.limits = replace(registry.limits, max_reply_bytes=60)
    got = _round_trip(wire, ops, [[(i, 0, p) for i, p in enumerate(payloads)]])
    for i, payload in enumerate(payloads):
        reply, outcome = alone._serve(parse_request(payload), len(payload))
        assert got[i] == (outcome, reply)
    assert {outcome for outcome, _ in got.values()} >= {"too_large"}


def test_a_malformed_job_batch_is_dropped_and_the_next_one_taken(registry, wire):
    router, dealer, ident = wire
    header, blob = pack_jobs([(1, 0, b"\x80"), (2, 0, b"\x80")])[1:]
    rnd = Round(B_JOBS, W_RESULTS, OUTCOME_INDEX)
    for frames in ([B_JOBS, header, blob + b"x"], [B_JOBS, header[:-1], blob], [B_JOBS, header], [B_JOBS, header, blob, b"x"]):
        router.send_multipart([ident, *frames])
        assert dealer.poll(5000)
        with pytest.raises(ValueError):
            rnd.take(dealer, 4096)
    assert rnd.jobs == 0
    got = _round_trip(wire, Ops(registry, "w"), [[(7, 0, _payloads()[0])]])
    assert list(got) == [7] and got[7][0] == "ok"
