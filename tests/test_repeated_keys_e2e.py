"""Contract 1.4: a request map that holds the same key twice is a bad_request naming the key, through
a real broker and its workers, whichever key it is and whichever path would have served the request
(the compiled plain tokenize, the general path, the count lane; alone or in an array of requests).

MessagePack libraries will not write a map with a key twice, so these payloads are put together by hand."""

from __future__ import annotations

import msgpack
import pytest

from helpers import error_code

REPEATS = {  # what is repeated -> (the fields before the repeat, the repeated key, its second value)
    "text": ({"op": "tokenize", "text": "first"}, "text", "second"),
    "op": ({"op": "tokenize", "text": "hello"}, "op", "detokenize"),
    "model": ({"op": "tokenize", "model": "bert", "text": "hello"}, "model", "deepseek"),
    "unknown": ({"op": "tokenize", "text": "hello", "x_note": 1}, "x_note", 2),
    "messages": ({"op": "chat", "model": "deepseek", "messages": [{"role": "user", "content": "hi"}]}, "messages", []),
    "body": ({"op": "count", "body": "some text", "format": "text", "model": "gpt-4o"}, "body", "other text"),
    "strict": ({"op": "count", "body": {"messages": []}, "strict": True}, "strict", False),
    # over the worker's OFFLOAD_BYTES: read on the encode lane, not the round loop (workers/ops.py)
    "long text": ({"op": "tokenize", "model": "bert", "text": "word " * 30000}, "model", "deepseek"),
    "long count": ({"op": "count", "body": "word " * 30000, "format": "text"}, "format", "text"),
}


def with_repeat(fields: dict, key: str, value: object, rid: str) -> bytes:
    """A request map holding `fields` plus `id` and then `key` a second time."""
    entries = [("id", rid), *fields.items(), (key, value)]
    return bytes([0x80 | len(entries)]) + b"".join(msgpack.packb(k) + msgpack.packb(v, use_bin_type=True) for k, v in entries)


@pytest.mark.parametrize("what", sorted(REPEATS))
def test_a_repeated_key_is_a_bad_request_naming_it(conn, what):
    fields, key, value = REPEATS[what]
    conn.send_raw(b"", with_repeat(fields, key, value, "dup"))
    reply = conn.recv()
    assert error_code(reply) == "bad_request", reply
    assert f"'{key}'" in reply["error"]["message"], reply
    assert reply["id"] == "dup"


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
