"""The worker's model registry and ops on real tokenizers, without sockets."""

from __future__ import annotations

import msgpack
import pytest

from helpers import BERT_DIR, serve_payload
from tokenbroker.common.config import CacheConfig, ModelConfig, ModelSpec
from tokenbroker.common.errors import ProtocolError
from tokenbroker.workers.ops import Ops
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
