"""The client's compiled codec (src/tokenbroker/_codec.py and the cores it names) against msgpack, the contract's
reference codec: the same request bytes for every shape the client sends, the same values for
every reply shape, results read straight from reply bytes equal to the ones built from msgpack's
map, and hostile frames refused without a crash."""

from __future__ import annotations

import asyncio
import random
import sys
from array import array
from dataclasses import fields

import msgpack
import pytest

from tokenbroker import _client_results as res
from tokenbroker import _codec

U32 = array("I", [0, 1, 0xFFD6, 2**32 - 1, 128000]).tobytes()


def ref_pack(value: object) -> bytes:
    return msgpack.Packer(use_bin_type=True).pack(value)


BODIES = [
    {"op": "tokenize", "text": "Hello, world!", "add_special_tokens": True, "tokens_format": "u32", "id": 1,
     "deadline_ms": 30000},
    {"op": "tokenize", "text": "日本語 🙂" * 500, "add_special_tokens": False, "tokens_format": "u32", "model": "m",
     "affinity": "a" * 40, "id": 2**40, "deadline_ms": 1},
    {"op": "ping", "id": 7, "deadline_ms": 2000},
    {"op": "detokenize_stream", "columns": {"tokens": U32, "lengths": b"\x01\x00\x00\x00" * 5, "states": b"",
                                            "state_lengths": b"\x00" * 20, "final": b"\x01" * 5},
     "model": "m", "id": 3, "deadline_ms": 99},
    {"op": "detokenize_stream", "seqs": [{"tokens": [1, 2], "state": None, "final": False, "stop": ["\n"],
                                          "prompt_tokens": U32, "stop_token_ids": [7], "skip_special_tokens": False,
                                          "include_stop_str_in_output": True}], "id": 3, "deadline_ms": 99},
    {"op": "tokenize", "text": "x" * 70000, "id": 4, "deadline_ms": 5},
    {"op": "tokenize", "text": ["a", "b" * 300, ""], "return_offsets": True, "return_token_strs": True,
     "truncate_prompt_tokens": 0, "truncation_side": "right",
     "block_hashes": {"block_size": 16, "seed": "0", "lora_name": "l", "cache_salt": "s"}, "id": 5, "deadline_ms": 60000},
    {"op": "detokenize", "tokens": [[1, 2, 3], U32, []], "skip_special_tokens": True, "id": 6, "deadline_ms": 1},
    {"op": "chat", "messages": [{"role": "system", "content": "x" * 40}, {"role": "user", "content": "hi",
                                                                          "name": None}],
     "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "n": 1.5}}}],
     "add_generation_prompt": True, "continue_final_message": False, "chat_template_kwargs": {"thinking": True},
     "return_prompt": False, "tokens_format": "u32", "id": 7, "deadline_ms": 3},
    {"op": "count", "body": {"model": "gpt-4o", "messages": [{"role": "user", "content": "hey"}], "n": -1,
                             "t": 0.25, "big": 2**63, "neg": -(2**63)}, "strict": False, "id": 8, "deadline_ms": 9},
    {"op": "add_model", "name": "n", "source": "s", "aliases": ["a", "b"], "chat_template": "{{ x }}", "id": 9,
     "deadline_ms": 10},
    {"k" * 40: list(range(-40, 300, 7)), "ints": [0, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**64 - 1,
                                                   -1, -32, -33, -128, -129, -32768, -32769, -(2**31), -(2**31) - 1],
     "many": list(range(70000)), "map": {str(i): i for i in range(20)}, "bigmap": {str(i): None for i in range(70000)},
     "bin": b"\x00" * 300, "bin16": b"\x01" * 70000, "str": "é" * 40, "tuple": (1, "a"), "ba": bytearray(b"xy")},
]


@pytest.mark.parametrize("body", BODIES, ids=range(len(BODIES)))
def test_requests_pack_to_msgpacks_bytes(body: dict) -> None:
    assert _codec.pack(body) == ref_pack(body)
    fields_only = {k: v for k, v in body.items() if k not in ("id", "deadline_ms")}
    head = _codec.pack_entries(fields_only)
    # a request as it goes: its fields, then id, then deadline_ms
    assert _codec.request(head, len(fields_only), 77, 30000) == ref_pack({**fields_only, "id": 77, "deadline_ms": 30000})


@pytest.mark.parametrize("model", [None, "m", "deepseek-ai/DeepSeek-V3.1"])
@pytest.mark.parametrize("affinity", [None, "conversation-7"])
@pytest.mark.parametrize("text", ["", "hi", "日本語 🙂" * 40, "x" * 70000])
def test_the_tokenize_head_is_the_generic_packers(model: str | None, affinity: str | None, text: str) -> None:
    body = {"op": "tokenize", "text": text, "add_special_tokens": False, "tokens_format": "u32"}
    if model is not None:
        body["model"] = model
    if affinity is not None:
        body["affinity"] = affinity
    assert _codec.tokenize_head(text, False, model, affinity) == (_codec.pack_entries(body), len(body))


def test_a_batchs_heads_are_each_requests_fields() -> None:
    texts = ["a", "é" * 100, "x" * 70000, ""]
    prefix = _codec.pack_entries({"op": "tokenize"}) + _codec.pack("text")
    suffix = _codec.pack_entries({"add_special_tokens": True, "model": "m"})
    for head, text in zip(_codec.heads(prefix, texts, suffix), texts):
        want = {"op": "tokenize", "text": text, "add_special_tokens": True, "model": "m"}
        assert _codec.request(head, 4, 5, 6) == ref_pack({**want, "id": 5, "deadline_ms": 6})


def test_a_turns_frames_are_msgpacks_arrays_of_the_requests() -> None:
    """`frames` writes each call's request into its frame (id, and what is left of its deadline
    at the flush): msgpack's bytes, cut at the call and byte limits, calls no longer wanted and
    cancelled ones left out, a probe's bytes as they are, a lone request as its map."""
    configure_max = 300_000
    _codec.configure(configure_max)
    loop = asyncio.new_event_loop()
    try:
        bodies = [{"op": "tokenize", "text": "t" * size, "model": "m"} for size in (0, 5, 200, 70000, 3, 1000, 9)]
        bodies.append({f"k{i}": i for i in range(20)})  # a map of 16 or more pairs
        ids = [1, 127, 128, 255, 256, 65535, 65536, 2**32 + 5]
        deadlines = [0.0005, 1.0, 0.2, 300.0, 5000.0, 0.0, 66.0, 2.5]
        calls = [_codec.Call(rid, _codec.pack_entries(b), len(b), _codec.KIND_RAW, "op", loop.create_future(), 10.0 + d, 1.0)
                 for rid, b, d in zip(ids, bodies, deadlines)]
        pending = {c.id: c for c in calls}
        del pending[ids[2]]  # answered (or expired) since it was queued
        calls[4].future.cancel()  # its awaiter stopped waiting
        probe = _codec.request(_codec.pack_entries({"op": "ping"}), 1, 99, 1000)
        out_calls: list = [*calls[:3], None, *calls[3:]]
        payloads: list = [None, None, None, probe, *[None] * 5]

        def want(call: _codec.Call) -> dict:
            left = max(1, min(configure_max, int((call.deadline - 10.0) * 1000)))
            return {**msgpack.unpackb(ref_pack(dict(bodies[ids.index(call.id)])), raw=False), "id": call.id,
                    "deadline_ms": left}

        expect = [want(calls[0]), want(calls[1]), {"op": "ping", "id": 99, "deadline_ms": 1000}, want(calls[3]),
                  want(calls[5]), want(calls[6]), want(calls[7])]
        for max_calls, max_bytes in ((256, 1 << 20), (2, 1 << 20), (256, 2000), (1, 1 << 20)):
            frames = _codec.frames(out_calls, payloads, pending, max_calls, max_bytes, 10.0)
            got: list = []
            for frame in frames:
                value = msgpack.unpackb(frame, raw=False, strict_map_key=False)
                if type(value) is list:
                    assert 1 < len(value) <= max_calls and len(frame) <= max_bytes + 5
                    assert frame == ref_pack(value)
                    got.extend(value)
                else:
                    assert frame == ref_pack(value)
                    got.append(value)
            assert got == expect
            assert [list(r) for r in got] == [list(r) for r in expect]  # keys in the order msgpack writes them
        assert _codec.frames([None], [probe], {}, 256, 1 << 20, 0.0) == [probe]
        assert _codec.frames([calls[0]], [None], pending, 256, 1 << 20, 10.0) == [_codec.request(
            calls[0].head, calls[0].nkeys, calls[0].id, 1)]
    finally:
        loop.close()
        from tokenbroker.common.protocol import MAX_DEADLINE_MS
        _codec.configure(MAX_DEADLINE_MS)


@pytest.mark.parametrize("value", [2**64, -(2**63) - 1])
def test_ints_msgpack_refuses_are_refused(value: int) -> None:
    with pytest.raises(OverflowError):
        ref_pack(value)
    with pytest.raises(OverflowError):
        _codec.pack(value)


@pytest.mark.parametrize("value", [object(), {1, 2}, memoryview(b"x"), type("S", (str,), {})("sub")])
def test_other_types_are_left_to_msgpack(value: object) -> None:
    with pytest.raises(TypeError):
        _codec.pack({"v": value})


REPLIES = [
    {"id": 1, "ok": True, "tokens": U32, "count": 5, "worker": "w-1", "cache": {"hit": False, "level": None}},
    {"id": 2, "ok": False, "error": {"code": "overloaded", "message": "queue full"}},
    {"id": 3, "ok": True, "columns": {"text": "é".encode(), "text_lengths": b"\x02\x00\x00\x00", "states": b"s",
                                      "state_lengths": b"\x01\x00\x00\x00", "finished": b"\x01",
                                      "stops": {0: "stop", 3: 17}}},
    [{"id": i, "ok": True, "text": "t" * i, "worker": ""} for i in range(20)],
    {"id": -(2**63), "ok": True, "big": 2**64 - 1, "f": 1.5, "none": None, "list": [1, [2, [3]]], b"k": 1, 1.5: 2},
    {"id": 9, "ok": True, "tokens": b"\x00" * 70000, "text": "x" * 70000},
    {"id": 10, "ok": True, "ext": msgpack.ExtType(5, b"ab")},
    "not a map",
    [],
]


@pytest.mark.parametrize("reply", REPLIES, ids=range(len(REPLIES)))
def test_replies_decode_to_msgpacks_values(reply: object) -> None:
    wire = ref_pack(reply)
    assert _codec.unpack(wire) == msgpack.unpackb(wire, raw=False, strict_map_key=False)


@pytest.mark.parametrize("wire", [b"", b"\xc1", b"\x92\x01", msgpack.packb({"id": 1}) + b"\x00",
                                  b"\x81\xa1a\xd4\xfbx", b"\xa2\xff\xfe", b"\x91" * 100000],
                         ids=["empty", "reserved", "short", "extra", "ext-negative", "bad-utf8", "deep"])
def test_frames_msgpack_refuses_are_refused(wire: bytes) -> None:
    with pytest.raises(Exception):
        _codec.unpack(wire)
    with pytest.raises(ValueError):
        _codec.settle(wire, {}, [])


def test_results_are_built_as_their_classes_build_them() -> None:
    for cls in (res.Tokens, res.Text, res.ChatTokens):
        assert tuple(f.name for f in fields(cls)) == cls.__slots__
        values = tuple(range(len(cls.__slots__)))
        assert _codec.build(cls, values) == cls(*values)


def test_results_hold_no_reference_of_their_own() -> None:
    """A result built in compiled code is freed when its holders drop it (each one once leaked:
    every reply's ids stayed in memory)."""
    for cls in (res.Tokens, res.Text, res.ChatTokens):
        built = _codec.build(cls, tuple(range(len(cls.__slots__))))
        assert sys.getrefcount(built) == sys.getrefcount(cls(*range(len(cls.__slots__))))
    for kind, reply in ((_codec.KIND_TOKENS, TOKENS_REPLIES[0]), (_codec.KIND_TOKENS_LIST, TOKENS_REPLIES[0]),
                        (_codec.KIND_TEXT, {"id": 1, "ok": True, "text": "t", "worker": "w"}),
                        (_codec.KIND_CHAT, {"id": 1, "ok": True, "tokens": U32, "count": 5, "worker": "w"})):
        got = _settled(kind, reply)
        held = sys.getrefcount(got), sys.getrefcount(getattr(got, "tokens", None) or getattr(got, "text"))
        assert type(got) is not dict and held[0] == 2  # `got` and getrefcount's argument
        if kind != _codec.KIND_TEXT:
            assert held[1] == 2  # the result's and the argument's


class _Link:
    def __init__(self) -> None:
        self.outstanding: dict = {}


def _settled(kind: int, reply: dict) -> object:
    """`reply` as `settle` gives it to a pending call of `kind`."""
    loop = asyncio.new_event_loop()
    try:
        future = loop.create_future()
        call = _codec.Call(reply.get("id", 1), b"", 0, kind, "op", future, 0.0, 1.0)
        link = _Link()
        call.link = link
        link.outstanding[call.id] = call
        calls = {call.id: call}
        odd: list = []
        assert _codec.settle(ref_pack(reply), calls, odd) == 1 and not odd and not calls and not link.outstanding
        return future.result()
    finally:
        loop.close()


TOKENS_REPLIES = [
    {"id": 1, "ok": True, "tokens": U32, "count": 5, "cache": {"l0": "miss", "l1_reused_tokens": 0}, "worker": "w-1"},
    {"id": 2, "ok": True, "tokens": b"", "count": 0, "cache": {"l0": "hit", "l1_reused_tokens": 12}, "worker": "w"},
    {"id": 3, "ok": True, "tokens": U32, "count": 5, "worker": "ü-2"},
    {"id": 4, "ok": True, "tokens": U32, "count": 5, "cache": {"l0": "off", "l1_reused_tokens": 0}, "worker": "w",
     "truncated": 2, "offsets": array("I", range(10)).tobytes(), "token_strs": ["a"] * 5},
    {"id": 5, "ok": True, "tokens": list(range(5)), "count": 5, "worker": "w"},
    {"id": 6, "ok": False, "error": {"code": "invalid_input", "message": "no"}},
    {"ok": True, "id": 7, "count": 5, "tokens": U32},
]


@pytest.mark.parametrize("ids", ["array", "list"])
@pytest.mark.parametrize("reply", TOKENS_REPLIES, ids=range(len(TOKENS_REPLIES)))
def test_tokenize_replies_read_into_tokens_equal_the_maps_results(reply: dict, ids: str) -> None:
    got = _settled(_codec.KIND_TOKENS_LIST if ids == "list" else _codec.KIND_TOKENS, reply)
    if type(got) is dict:  # a shape read as a map: the Python reader's, as before
        assert got == msgpack.unpackb(ref_pack(reply), raw=False)
        assert reply.get("ok") is not True or set(reply) - {"id", "ok", "tokens", "count", "cache", "worker"} \
            or type(reply["tokens"]) is not bytes
    else:
        assert got == res.tokens(msgpack.unpackb(ref_pack(reply), raw=False), ids)  # type: ignore[arg-type]
        assert type(got.tokens) is (list if ids == "list" else array)  # type: ignore[attr-defined]


@pytest.mark.parametrize("reply", [
    {"id": 1, "ok": True, "text": "héllo", "worker": "w-1"},
    {"id": 1, "ok": True, "text": "", "worker": "w-1"},
    {"id": 1, "ok": True, "text": ["a", "b"], "worker": "w-1"},
])
def test_detokenize_replies_read_into_text(reply: dict) -> None:
    got = _settled(_codec.KIND_TEXT, reply)
    if type(reply["text"]) is str:
        assert got == res.text(reply)
    else:
        assert got == reply


@pytest.mark.parametrize("reply", [
    {"id": 1, "ok": True, "tokens": U32, "count": 5, "prompt": "p", "cache": {"l0": "miss", "l1_reused_tokens": 3},
     "worker": "w"},
    {"id": 1, "ok": True, "tokens": U32, "count": 5, "prompt": None, "worker": "w"},
    {"id": 1, "ok": True, "tokens": U32, "count": 5, "worker": "w"},
])
def test_chat_replies_read_into_chat_tokens(reply: dict) -> None:
    assert _settled(_codec.KIND_CHAT, reply) == res.chat_tokens(reply, "array")


def _strict_pairs(pairs: list) -> dict:
    """msgpack's map, refused where the codec refuses one: a repeated key (msgpack keeps the last)."""
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ValueError("repeated key")
    return out


def _verdict(wire: bytes) -> object:
    """msgpack's reading of a reply frame, or the exception it (or a repeated key) raises."""
    try:
        return msgpack.unpackb(wire, raw=False, strict_map_key=False, object_pairs_hook=_strict_pairs)
    except Exception as e:  # noqa: BLE001 - every refusal counts alike here
        return e


def _overloaded(reply: object) -> bool:
    error = reply.get("error") if type(reply) is dict else None
    return type(reply) is dict and reply.get("ok") is not True and type(error) is dict and error.get("code") == "overloaded"


def _expected(elements: list, pending: set[int]) -> tuple[set[int], int]:
    """What settling a read frame must do: the pending calls it settles (the first map naming each
    by an int id, unless `overloaded`), and how many elements are handed back in `odd`."""
    settled: set[int] = set()
    odd = 0
    for e in elements:
        rid = e.get("id") if type(e) is dict else None
        if type(rid) is int and rid in pending and rid not in settled and not _overloaded(e):
            settled.add(rid)
        else:
            odd += 1
    return settled, odd


def _check_settle(wire: bytes, loop: asyncio.AbstractEventLoop) -> bool:
    """`settle` against msgpack's verdict: a frame msgpack refuses (or one with a repeated key)
    raises ValueError with every call still pending and nothing handed back; a frame msgpack reads
    settles what `_expected` says. True if the frame was read."""
    calls = {i: _codec.Call(i, b"", 0, (_codec.KIND_TOKENS, _codec.KIND_TEXT, _codec.KIND_RAW)[i % 3], "op",
                            loop.create_future(), 0.0, 1.0) for i in range(1, 8)}
    pending = dict(calls)
    odd: list = []
    ref = _verdict(wire)
    if isinstance(ref, Exception):
        with pytest.raises(ValueError):
            _codec.settle(wire, calls, odd)
        assert calls == pending and not odd, wire
        assert not any(c.future.done() for c in pending.values()), wire
        return False
    settled = _codec.settle(wire, calls, odd)
    want, want_odd = _expected(ref if type(ref) is list else [ref], set(pending))
    assert settled == len(want) and set(pending) - set(calls) == want, (wire, settled, want)
    assert {rid for rid, c in pending.items() if c.future.done()} == want and len(odd) == want_odd, wire
    assert _codec.unpack(wire) == ref
    return True


def test_hostile_frames_never_crash_the_reader() -> None:
    """Random bytes and every truncation and one-byte change of real reply frames: each is read
    or refused with ValueError, never a crash, and settles nothing it cannot read (`_check_settle`)."""
    rng = random.Random(33)
    frames = [ref_pack([t for t in TOKENS_REPLIES]), ref_pack(TOKENS_REPLIES[0]), ref_pack(REPLIES[2]),
              ref_pack([{"id": i, "ok": True, "text": "é" * i, "worker": "w"} for i in range(1, 6)])]
    cases = [bytes(rng.getrandbits(8) for _ in range(rng.randrange(1, 64))) for _ in range(2000)]
    for frame in frames:
        cases += [frame[:i] for i in range(len(frame))]
        for _ in range(500):
            i = rng.randrange(len(frame))
            cases.append(frame[:i] + bytes([rng.getrandbits(8)]) + frame[i + 1:])
    loop = asyncio.new_event_loop()
    try:
        read = sum(_check_settle(wire, loop) for wire in cases)
    finally:
        loop.close()
    assert 100 < read < len(cases) - 1000  # both sides of the promise were exercised


_GOOD = ref_pack({"id": 1, "ok": True, "text": "a", "worker": "w"})
_ODD = ref_pack({"id": 99, "ok": True})


@pytest.mark.parametrize("frame", [
    # `id` twice: msgpack reads the last, the codec once settled call 1 with this overloaded error
    b"\x84\xa2id\x01\xa2ok\xc2\xa5error\x81\xa4code\xaaoverloaded\xa2id\x02",
    b"\x85\xa2id\x01\xa2ok\xc3\xa6tokens\xc4\x00\xa5count\x00\xa2id\x02",
    b"\x92" + _GOOD + b"\x85\xa2id\x01\xa2ok\xc3\xa4text\xa1b\xa6worker\xa1w\xa4text\xa1c",  # a typed field twice
    # a good reply, then a malformed element, then one for no pending call: once, the first was settled
    b"\x93" + _GOOD + b"\x84\xa2id\x02\xa2ok\xc3\xa4text\xa2\xff\xfe\xa6worker\xa1w" + _ODD,  # bad UTF-8
    b"\x93" + _GOOD + b"\x81\x91\x01\x02" + _ODD,  # a list as a map key
    b"\x93" + _GOOD + b"\x82\xa2id\x02\xa1t\xd4\xff\x00" + _ODD,  # a 1-byte timestamp
], ids=["id-twice-overloaded", "id-twice-tokens", "text-twice", "bad-utf8", "list-key", "timestamp-1-byte"])
def test_frames_with_a_misread_element_settle_nothing(frame: bytes) -> None:
    """The two misreads fuzzing found: each frame raises ValueError, no call settled, nothing in `odd`."""
    loop = asyncio.new_event_loop()
    try:
        assert isinstance(_verdict(frame), Exception)
        assert not _check_settle(frame, loop)
    finally:
        loop.close()


def test_frames_go_and_replies_come_through_libzmq() -> None:
    """`send` hands libzmq the very bytes `frames` cuts (written in place into its messages), and
    `drain` takes in every frame waiting, settles what each answers, drops a malformed one whole
    and hands back the rest: real sockets, one burst."""
    import zmq

    ctx = zmq.Context.instance()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    loop = asyncio.new_event_loop()
    try:
        router.bind("inproc://codec-io")
        dealer.connect("inproc://codec-io")
        calls = [_codec.Call(i, _codec.pack_entries({"op": "tokenize", "text": "t" * i}), 2, _codec.KIND_TOKENS, "op",
                             loop.create_future(), 10.0, 1.0) for i in range(1, 6)]
        pending = {c.id: c for c in calls}
        probe = _codec.request(_codec.pack_entries({"op": "ping"}), 1, 99, 1000)
        out_calls: list = [*calls, None]
        payloads: list = [None] * 5 + [probe]
        want = _codec.frames(out_calls, payloads, pending, 2, 1 << 20, 9.0)
        assert _codec.send(dealer, out_calls, payloads, pending, 2, 1 << 20, 9.0) == len(want) == 3
        got = [router.recv_multipart()[1] for _ in want]
        assert got == want
        # replies: a good array, a malformed frame (id 3's reply after a bad element), an overloaded one, a late one
        frames_back = [ref_pack([{"id": 1, "ok": True, "tokens": U32, "count": 5, "worker": "w"},
                                 {"id": 2, "ok": True, "tokens": b"", "count": 0, "worker": "w"}]),
                       b"\x92" + ref_pack({"id": 3, "ok": True, "tokens": b"", "count": 0}) + b"\x81\x91\x01\x02",
                       ref_pack({"id": 4, "ok": False, "error": {"code": "overloaded", "message": "m"}}),
                       ref_pack({"id": 77, "ok": True})]
        dealer_id = _router_peer(router, dealer)
        for frame in frames_back:
            router.send_multipart([dealer_id, frame])
        link = _Link()
        link.dropped = 0  # type: ignore[attr-defined]
        odd: list = []
        received = 0
        settled = 0
        for _ in range(200):  # inproc delivery is asynchronous: take in until all four came
            f, s = _codec.drain(dealer, pending, odd, link)
            received, settled = received + f, settled + s
            if received == 4:
                break
            dealer.poll(50)
        assert (received, settled, link.dropped) == (4, 2, 1)  # type: ignore[attr-defined]
        assert calls[0].future.result().tokens.tobytes() == U32 and calls[1].future.done()
        assert not calls[2].future.done() and 3 in pending  # its frame was malformed: nothing of it settled
        assert [rid for rid, _ in odd] == [4, 77] and 4 in pending
    finally:
        loop.close()
        router.close(0)
        dealer.close(0)


def _router_peer(router: object, dealer: object) -> bytes:
    """The dealer's routing id as the router sees it (from a message the dealer sends)."""
    dealer.send(b"hello")  # type: ignore[attr-defined]
    peer, _ = router.recv_multipart()  # type: ignore[attr-defined]
    return peer
