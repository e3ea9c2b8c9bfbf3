"""Routing keys derived from requests: prefixes share blocks, hashing is linear and done by hashlib."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenbroker.broker import _routekey
from tokenbroker.broker._routekey import BOUNDARIES, MAX_BLOCKS, MAX_HASHED_BYTES, RouteKey, route_key
from tokenbroker.broker.frontend import Peek, peek_request
from tokenbroker.common.protocol import pack

SYSTEM = "You are a careful assistant. Answer in full sentences and cite the documents you use. " * 40


def request(op: str, model: str | None = None, affinity_field: str | None = None, **fields: Any) -> Peek:
    """The request as the broker's frontend reads it off the wire."""
    return peek_request(pack({"id": 1, "op": op, "model": model, "affinity": affinity_field, **fields}))


def tokenize_key(text: Any, model: str | None = None) -> RouteKey:
    key = route_key(request("tokenize", model, text=text))
    assert key is not None
    return key


def full_blocks(data: bytes) -> int:
    """How many boundaries a byte string reaches: the blocks any longer text starting with it shares."""
    return sum(1 for end in BOUNDARIES if end <= len(data))


def conversation_texts(turns: int, user: str = "user-1") -> list[str]:
    """Rendered prompts of one conversation: each turn's text starts with the previous one."""
    text = f"<|system|>{SYSTEM}<|end|>"
    out = []
    for k in range(turns):
        text += f"<|user|>{user} asks question {k}: " + "why? " * (40 + 13 * k) + "<|end|><|assistant|>"
        out.append(text)
        text += f"answer {k} for {user} " * (30 + 7 * k) + "<|end|>"
    return out


@pytest.mark.parametrize("op", ["detokenize", "models", "ping"])
def test_ops_that_touch_no_cache_need_no_key(op: str) -> None:
    assert route_key(request(op, tokens=[1, 2, 3])) is None


def test_affinity_field_is_the_key_whatever_the_input() -> None:
    a = route_key(request("tokenize", "m1", "session-7", text="hello"))
    b = route_key(request("chat", "m2", "session-7", messages=[{"role": "user", "content": "bye"}]))
    c = route_key(request("tokenize", "m1", "session-8", text="hello"))
    assert a == b and a is not None and a.blocks == ()
    assert c is not None and c.key != a.key


def test_turn_k_plus_1_text_shares_every_full_block_of_turn_k() -> None:
    texts = conversation_texts(8)
    keys = [tokenize_key(t) for t in texts]
    for prev_text, prev, nxt in zip(texts, keys, keys[1:]):
        shared = full_blocks(prev_text.encode())
        assert shared >= 1
        assert nxt.blocks[:shared] == prev.blocks[:shared]
        assert nxt.key == prev.key == prev.blocks[0]
        assert len(nxt.blocks) > len(prev.blocks)


def test_identical_texts_have_identical_keys_and_other_models_other_keys() -> None:
    text = "the same prompt, sent twice " * 300
    assert tokenize_key(text) == tokenize_key(str(text))
    assert tokenize_key(text, "qwen").key != tokenize_key(text, "bert").key
    assert tokenize_key(text).blocks[-1] != tokenize_key(text + "!").blocks[-1]


def test_short_text_is_one_block_holding_the_whole_text() -> None:
    key = tokenize_key("hi there")
    assert len(key.blocks) == 1 and key.key == key.blocks[0]
    assert tokenize_key("hi there!").key != key.key


def test_conversations_on_one_system_prompt_share_its_blocks_then_diverge() -> None:
    a = tokenize_key(conversation_texts(3, "alice")[-1])
    b = tokenize_key(conversation_texts(3, "bob")[-1])
    shared = full_blocks(f"<|system|>{SYSTEM}<|end|><|user|>".encode())
    assert a.key == b.key
    assert a.blocks[:shared] == b.blocks[:shared]
    assert a.blocks[-1] != b.blocks[-1]


def test_blocks_are_cut_on_bytes_so_non_ascii_text_works() -> None:
    text = "日本語のテキスト、絵文字 🎉 も含む。" * 200
    key = tokenize_key(text)
    assert len(key.blocks) == full_blocks(text.encode()) + (len(text.encode()) not in BOUNDARIES)
    longer = tokenize_key(text + "続き")
    shared = full_blocks(text.encode())
    assert longer.blocks[:shared] == key.blocks[:shared]


def test_batch_of_one_is_keyed_like_its_text_and_join_points_matter() -> None:
    text = conversation_texts(2)[-1]
    assert tokenize_key([text]) == tokenize_key(text)
    assert tokenize_key(["ab", "c"]) != tokenize_key(["a", "bc"])
    batch = tokenize_key([text, "another text", "a third"])
    shared = full_blocks(text.encode())
    assert batch.blocks[:shared] == tokenize_key(text).blocks[:shared]


def test_empty_inputs_still_have_a_key() -> None:
    for key in (tokenize_key(""), tokenize_key([]), route_key(request("chat", messages=[]))):
        assert key is not None and len(key.key) == _routekey.DIGEST_BYTES and key.blocks == ()


def chat_turns(user: str, turns: int) -> list[list[dict]]:
    messages: list[dict] = [{"role": "system", "content": SYSTEM}]
    out = []
    for k in range(turns):
        messages = [*messages, {"role": "user", "content": f"{user}: question {k}"}]
        out.append(messages)
        messages = [*messages, {"role": "assistant", "content": f"answer {k} to {user}"}]
    return out


def chat_key(messages: list[dict], **fields: Any) -> RouteKey:
    key = route_key(request("chat", messages=messages, **fields))
    assert key is not None
    return key


def test_chat_turn_k_plus_1_shares_its_first_messages_blocks_with_turn_k() -> None:
    turns = chat_turns("alice", 6)
    keys = [chat_key(m) for m in turns]
    for msgs, prev, nxt in zip(turns, keys, keys[1:]):
        assert len(prev.blocks) == len(msgs)
        assert nxt.blocks[:len(msgs)] == prev.blocks
        assert nxt.key == prev.key


def test_chat_users_of_one_system_prompt_share_only_the_first_block() -> None:
    a = chat_key(chat_turns("alice", 1)[0])
    b = chat_key(chat_turns("bob", 1)[0])
    assert a.blocks[0] == b.blocks[0] and a.key == b.key
    assert a.blocks[1] != b.blocks[1]


def test_chat_key_ignores_map_key_order_but_not_tools() -> None:
    one = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    reordered = [{"content": "s", "role": "system"}, {"content": "u", "role": "user"}]
    assert chat_key(one) == chat_key(reordered)
    assert chat_key(one).key != chat_key(one, tools=[{"type": "function", "function": {"name": "f"}}]).key
    assert chat_key(one) == chat_key(one, add_generation_prompt=False)


def test_count_bodies_follow_their_conversation() -> None:
    turns = chat_turns("carol", 3)
    maps = [route_key(request("count", "gpt-4o", body={"model": "gpt-4o", "messages": m})) for m in turns]
    assert all(k is not None for k in maps)
    assert maps[1].blocks[:len(turns[0])] == maps[0].blocks  # type: ignore[union-attr]
    texts = conversation_texts(3)
    strs = [route_key(request("count", "gpt-4o", body=t, format="text")) for t in texts]
    assert strs[1].blocks[:full_blocks(texts[0].encode())] == strs[0].blocks[:full_blocks(texts[0].encode())]  # type: ignore[union-attr]
    as_bin = route_key(request("count", "gpt-4o", body=texts[0].encode()))
    assert as_bin is not None and as_bin.key == strs[0].key  # type: ignore[union-attr]


def test_blocks_are_the_hash_of_the_seed_and_each_prefix_and_nothing_past_the_cap() -> None:
    """Block i is the core's hash of seed + the input's first BOUNDARIES[i] bytes (the last: the
    whole input when it ends between two); bytes past MAX_HASHED_BYTES change nothing."""
    seed = _routekey.seed(b"text", b"m")
    for size in (10, 5000, 300_000):
        text = ("abcdefghij" * (size // 10 + 1))[:size]
        key = tokenize_key(text, "m")
        data = text.encode()
        want = [_routekey.digest(seed + data[:end]) for end in BOUNDARIES if end <= len(data)]
        if len(data) not in BOUNDARIES:
            want.append(_routekey.digest(seed + data))
        assert list(key.blocks) == want and key.key == want[0]
    huge = "x" * (MAX_HASHED_BYTES + 10)
    assert tokenize_key(huge).blocks == tokenize_key(huge[:MAX_HASHED_BYTES] + "tail not hashed").blocks
    assert len(tokenize_key(huge).blocks) == MAX_BLOCKS


def test_chat_is_one_block_per_message_up_to_the_cap() -> None:
    messages = chat_turns("dave", 20)[-1]
    key = chat_key(messages)
    assert len(key.blocks) == len(messages) and len(set(key.blocks)) == len(messages)
    many = [{"role": "user", "content": str(i)} for i in range(MAX_BLOCKS + 40)]
    assert len(chat_key(many).blocks) == MAX_BLOCKS


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False) | st.text(max_size=20) | st.binary(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=5) | st.integers(-(2**63), 2**64 - 1), children, max_size=4),
    max_leaves=12,
)


@settings(max_examples=150, deadline=None)
@given(op=st.sampled_from(["tokenize", "chat", "count"]), value=json_values)
def test_malformed_inputs_never_raise_and_still_get_a_key(op: str, value: Any) -> None:
    field = {"tokenize": "text", "chat": "messages", "count": "body"}[op]
    key = route_key(request(op, **{field: value}))
    assert key is not None and len(key.key) == _routekey.DIGEST_BYTES
    assert all(len(b) == _routekey.DIGEST_BYTES for b in key.blocks)


@settings(max_examples=60, deadline=None)
@given(prefix=st.text(min_size=0, max_size=3000), suffix=st.text(min_size=1, max_size=3000))
def test_any_extension_keeps_the_full_blocks_of_its_prefix(prefix: str, suffix: str) -> None:
    shared = full_blocks(prefix.encode())
    assert tokenize_key(prefix + suffix).blocks[:shared] == tokenize_key(prefix).blocks[:shared]


# --- large payloads, read in place over ZeroMQ's buffer (the drain lends libzmq's message) --------


@pytest.mark.parametrize("body", [
    {"id": "big", "op": "tokenize", "text": "Hello, world! " * 100_000, "model": "m", "tokens_format": "u32"},
    {"op": "tokenize", "text": "é" * 600_000, "id": 7, "deadline_ms": 5000},
    {"op": "tokenize", "text": "x" * 2_000_000, "affinity": "conv-1"},
    {"op": "detokenize", "ids": b"\x01\x00\x00\x00" * 300_000, "id": b"\x00bin"},
    {"op": "tokenize", "text": "a" * 1_100_000, "id": None, "unknown_field": 5},
    {"op": "tokenize", "text": ["a" * 600_000, "b" * 600_000]},
    {"op": "chat", "messages": [{"role": "user", "content": "x" * 1_200_000}]},
    {"op": "count", "body": "y" * 1_200_000},
])
def test_a_large_payload_read_in_place_equals_its_copy_and_routes_alike(body: dict[str, Any]) -> None:
    raw = pack(body)  # over 1 MiB: read through a buffer, as the drain lends every payload (libzmq's message)
    view = memoryview(raw)
    in_place = peek_request(view)
    copied = peek_request(raw)
    assert (in_place.op, in_place.raw_id, in_place.model, in_place.deadline_ms, in_place.affinity, in_place.spans) == \
           (copied.op, copied.raw_id, copied.model, copied.deadline_ms, copied.affinity, copied.spans)
    assert in_place.body is view  # the frame itself goes on to the worker, not a copy
    assert route_key(in_place) == route_key(copied)


@pytest.mark.parametrize("body", [
    {"op": "tokenize", "text": "z" * 1_200_000, "op2": 1, 3: "int key"},  # an error to name
    {"op": "frobnicate", "text": "z" * 1_200_000, "id": 1},  # unknown op
])
def test_a_large_payload_in_error_is_answered_alike_in_place_and_copied(body: dict[Any, Any]) -> None:
    from tokenbroker.common.errors import ProtocolError

    raw = pack(body)
    answers = []
    for frame in (raw, memoryview(raw)):
        with pytest.raises(ProtocolError) as e:
            peek_request(frame)
        answers.append((e.value.code, e.value.message, e.value.raw_id))
    assert answers[0] == answers[1]
