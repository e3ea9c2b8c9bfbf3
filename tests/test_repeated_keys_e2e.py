"""Contract 1.4: a request map that holds the same key twice is a bad_request naming the key, in the
same words whether the broker's core or a worker found it. Through a real broker and its workers,
whichever key it is (alone or in an array of requests), and a worker's own reading (its Ops, with a
real tokenizer, no sockets), whichever path would have served the request (the compiled plain
tokenize hands such a map to the general path; a long text or count is read apart).

MessagePack libraries will not write a map with a key twice, so these payloads are put together by hand."""

from __future__ import annotations

import msgpack
import pytest

from tokenbroker.common.config import ModelConfig, ModelSpec
from tokenbroker.workers.ops import Ops
from tokenbroker.workers.registry import ModelRegistry

from helpers import BERT_DIR, error_code, serve_payload

REPEATS = {  # what is repeated -> (the fields before the repeat, the repeated key, its second value)
    "text": ({"op": "tokenize", "text": "first"}, "text", "second"),
    "op": ({"op": "tokenize", "text": "hello"}, "op", "detokenize"),
    "model": ({"op": "tokenize", "model": "bert", "text": "hello"}, "model", "deepseek"),
    "unknown": ({"op": "tokenize", "text": "hello", "x_note": 1}, "x_note", 2),
    "messages": ({"op": "chat", "model": "deepseek", "messages": [{"role": "user", "content": "hi"}]}, "messages", []),
    "body": ({"op": "count", "body": "some text", "format": "text", "model": "gpt-4o"}, "body", "other text"),
    "strict": ({"op": "count", "body": {"messages": []}, "strict": True}, "strict", False),
    # over the worker's OFFLOAD_BYTES: read apart from the round's other requests (workers/ops.py)
    "long text": ({"op": "tokenize", "model": "bert", "text": "word " * 30000}, "model", "deepseek"),
    "long count": ({"op": "count", "body": "word " * 30000, "format": "text"}, "format", "text"),
}


def with_repeat(fields: dict, key: str, value: object, rid: str) -> bytes:
    """A request map holding `fields` plus `id` and then `key` a second time."""
    entries = [("id", rid), *fields.items(), (key, value)]
    return bytes([0x80 | len(entries)]) + b"".join(msgpack.packb(k) + msgpack.packb(v, use_bin_type=True) for k, v in entries)


@pytest.fixture(scope="module")
def worker_ops() -> Ops:
    """A worker's request handling on a real tokenizer, without a broker in front to refuse first."""
    return Ops(ModelRegistry(ModelConfig(models=(ModelSpec("bert", str(BERT_DIR)),), tokenizer_map=(("*", "bert"),))), "w")


@pytest.mark.parametrize("what", sorted(REPEATS))
def test_a_repeated_key_is_a_bad_request_naming_it_alike_at_the_broker_and_the_worker(conn, worker_ops, what):
    fields, key, value = REPEATS[what]
    payload = with_repeat(fields, key, value, "dup")
    conn.send_raw(b"", payload)
    reply = conn.recv()
    assert error_code(reply) == "bad_request" and f"'{key}'" in reply["error"]["message"], reply
    assert reply["id"] == "dup"
    at_worker = msgpack.unpackb(serve_payload(worker_ops, payload)[0], raw=False)
    assert at_worker == {"id": "dup", "ok": False, "error": reply["error"]}


def test_in_an_array_only_the_element_with_a_repeated_key_is_refused(conn):
    good = msgpack.packb({"id": "good", "op": "tokenize", "model": "bert", "text": "served"}, use_bin_type=True)
    bad = with_repeat({"op": "tokenize", "model": "bert", "text": "a"}, "text", "b", "bad")
    conn.send_raw(b"", b"\x92" + good + bad)
    replies: dict = {}
    while len(replies) < 2:
        got = msgpack.unpackb(conn.recv_frames()[-1], raw=False)
        for reply in got if isinstance(got, list) else [got]:
            replies[reply["id"]] = reply
    assert replies["good"]["ok"] and replies["good"]["tokens"], replies["good"]
    assert error_code(replies["bad"]) == "bad_request" and "'text'" in replies["bad"]["error"]["message"], replies["bad"]
