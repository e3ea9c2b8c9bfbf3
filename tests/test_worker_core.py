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
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import BERT_DIR
from tokenbroker.common.config import CacheConfig, ModelConfig, ModelSpec
from tokenbroker.common.errors import ProtocolError
from tokenbroker.common.protocol import NIL, parse_request
from tokenbroker.workers._core import pack_tokens, read_plain
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
