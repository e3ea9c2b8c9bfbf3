"""What calls return: small frozen dataclasses built from reply maps, ids as `array('I')` or lists.

The client asks for `tokens_format: "u32"` so a reply's ids arrive as one little-endian bin per
sequence, which becomes an `array('I')` in one copy (no Python int per id on either end);
`ids="list"` turns that into a list of int instead.
"""

from __future__ import annotations

import sys
from array import array
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Literal, Sequence, TypeVar, Union

IdsFormat = Literal["array", "list"]
Ids = Union["array[int]", list[int]]

if array("I").itemsize != 4:  # pragma: no cover - every platform CPython supports today
    raise ImportError("tokenbroker's client needs array('I') to hold 32-bit items on this platform")
_BIG_ENDIAN_HOST = sys.byteorder == "big"


def ids_from_wire(value: Any, ids: IdsFormat) -> Ids:
    """A `tokens` value of a reply (u32 bin or list of int) as the caller asked for it."""
    if isinstance(value, bytes):
        out = array("I")
        out.frombytes(value)
        if _BIG_ENDIAN_HOST:
            out.byteswap()
        return out.tolist() if ids == "list" else out
    return list(value) if ids == "list" else array("I", value)


def ids_to_wire(value: Sequence[int] | bytes) -> Any:
    """Ids for a request: an array('I') travels as a u32 bin (the broker takes one anywhere), the rest as a list."""
    if isinstance(value, array):
        if value.typecode != "I":
            value = array("I", value)
        if _BIG_ENDIAN_HOST:
            value = array("I", value)
            value.byteswap()
        return value.tobytes()
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    return value if isinstance(value, list) else list(value)


class Offsets:
    """`[start, end)` in code points of the input text (the rendered prompt for chat), one pair per id.

    Held as one flat array('I') (start, end, start, end, ...), as the u32 bin came; `offsets[i]` is a
    (start, end) tuple, `pairs()` all of them as a list.
    """

    __slots__ = ("flat",)

    def __init__(self, flat: "array[int]") -> None:
        self.flat = flat

    def __len__(self) -> int:
        return len(self.flat) // 2

    def __getitem__(self, i: int) -> tuple[int, int]:
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError("offset index out of range")
        return self.flat[2 * i], self.flat[2 * i + 1]

    def __iter__(self):
        it = iter(self.flat)
        return zip(it, it)

    def pairs(self) -> list[tuple[int, int]]:
        return list(self)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Offsets) and self.flat == other.flat

    def __repr__(self) -> str:
        return f"Offsets({self.pairs()!r})"


def block_hash_int64(digest: bytes) -> int:
    """The 64-bit form vLLM's KV events carry: the big-endian value of a digest's last 8 bytes.

    >>> block_hash_int64(bytes(24) + (3236607068019569386).to_bytes(8, "big"))
    3236607068019569386
    """
    return int.from_bytes(digest[-8:], "big")


class BlockHashes:
    """vLLM's prefix-cache block hashes (sha256_cbor) of the ids, one 32-byte digest per full block.

    `raw` is the concatenation as it came; `hashes[i]` is block i's digest, `ints()` every block's
    64-bit form (what vLLM's KV events report with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES).
    """

    __slots__ = ("raw",)
    DIGEST = 32

    def __init__(self, raw: bytes) -> None:
        self.raw = raw

    def __len__(self) -> int:
        return len(self.raw) // self.DIGEST

    def __getitem__(self, i: int) -> bytes:
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError("block index out of range")
        return self.raw[self.DIGEST * i:self.DIGEST * (i + 1)]

    def __iter__(self):
        return (self.raw[i:i + self.DIGEST] for i in range(0, len(self.raw), self.DIGEST))

    def ints(self) -> list[int]:
        return [block_hash_int64(d) for d in self]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BlockHashes) and self.raw == other.raw

    def __repr__(self) -> str:
        return f"BlockHashes({len(self)} blocks)"


def _offsets(value: Any) -> Offsets | None:
    if value is None:
        return None
    if isinstance(value, bytes):
        flat = array("I")
        flat.frombytes(value)
        if _BIG_ENDIAN_HOST:
            flat.byteswap()
        return Offsets(flat)
    return Offsets(array("I", [x for pair in value for x in pair]))


def _hashes(value: Any) -> BlockHashes | None:
    return BlockHashes(value) if value is not None else None


def _each(value: Any, convert: Any) -> list | None:
    return [convert(v) for v in value] if value is not None else None


C = TypeVar("C")


def _builder(cls: type[C]) -> Callable[..., C]:
    """A constructor for a frozen slots dataclass, every field positional, that builds the very
    instance `cls(...)` does (none of these has a __post_init__) at a third of the cost: a frozen
    `__init__` sets each field through `object.__setattr__`, which costs more than the rest of
    reading a reply. A twin class with the same slots sets them with plain stores, then turns the
    instance into a `cls` (the same layout, so Python allows the `__class__` change)."""
    names = [f.name for f in fields(cls)]  # type: ignore[arg-type]
    assert tuple(names) == cls.__slots__, cls  # type: ignore[attr-defined]
    stores = "".join(f"        self.{n} = {n}\n" for n in names)
    env: dict[str, Any] = {"_cls": cls}
    exec(f"class Twin:\n    __slots__ = {tuple(names)!r}\n    def __init__(self, {', '.join(names)}):\n"
         f"{stores}        self.__class__ = _cls\n", env)
    twin = env["Twin"]
    twin.__qualname__ = twin.__name__ = f"_{cls.__name__}Twin"
    return twin


@dataclass(frozen=True, slots=True)
class CacheInfo:
    """Which cache layers served it: `l0` "hit" | "miss" | "off"; ids taken from L1."""

    l0: str
    l1_reused_tokens: int


_CACHE_INFOS: dict[tuple[Any, Any], CacheInfo] = {}  # a few distinct values recur on every reply: built once each
_CACHE_INFOS_MAX = 4096


def _cache(reply: dict) -> CacheInfo | None:
    c = reply.get("cache")
    return None if c is None else _cache_info(c)


def _cache_info(c: Any) -> CacheInfo | None:
    if not isinstance(c, dict):
        return None
    key = (c["l0"], c["l1_reused_tokens"])
    try:
        return _CACHE_INFOS[key]
    except (KeyError, TypeError):  # TypeError: an unhashable value, from a broker not ours to judge
        info = CacheInfo(*key)
        if type(key[0]) is str and type(key[1]) is int and len(_CACHE_INFOS) < _CACHE_INFOS_MAX:
            _CACHE_INFOS[key] = info
        return info


@dataclass(frozen=True, slots=True)
class Tokens:
    """One text's ids (`tokenize`); the 1.2 fields are None unless asked for."""

    tokens: Ids
    count: int
    worker: str
    cache: CacheInfo | None
    offsets: Offsets | None = None
    token_strs: list | None = None  # str per id (tokenizer.json models) or bytes (tiktoken)
    truncated: int | None = None  # ids dropped by truncate_prompt_tokens
    block_hashes: BlockHashes | None = None


@dataclass(frozen=True, slots=True)
class TokensBatch:
    """A batch's ids, one sequence per text, in request order (`tokenize_batch`); `count` is the
    total, the 1.2 fields one per text (`truncated` too, contract 1.3: the ids each text dropped)."""

    tokens: list[Ids]
    count: int
    worker: str
    cache: CacheInfo | None
    offsets: list[Offsets] | None = None
    token_strs: list[list] | None = None
    truncated: list[int] | None = None
    block_hashes: list[BlockHashes] | None = None


@dataclass(frozen=True, slots=True)
class Text:
    """The text of one sequence of ids (`detokenize`)."""

    text: str
    worker: str


@dataclass(frozen=True, slots=True)
class TextBatch:
    """The texts of a batch of sequences, in request order (`detokenize_batch`)."""

    texts: list[str]
    worker: str


@dataclass(frozen=True, slots=True)
class ChatTokens:
    """A chat rendered with the model's template and tokenized; `prompt` when asked for."""

    tokens: Ids
    count: int
    prompt: str | None
    worker: str
    cache: CacheInfo | None
    offsets: Offsets | None = None  # in the rendered prompt
    token_strs: list | None = None
    truncated: int | None = None
    block_hashes: BlockHashes | None = None


@dataclass(frozen=True, slots=True)
class Count:
    """A provider request body's token count, and how it was reached (`method`, `warnings`)."""

    count: int
    method: str
    vocabulary: str | None
    warnings: tuple[str, ...]
    worker: str
    cache: CacheInfo | None


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """One model of the broker's catalog; the 1.1 fields are None from a version 1 broker."""

    name: str
    aliases: tuple[str, ...]
    kind: str
    vocab_size: int
    special_tokens: tuple[str, ...]
    chat_template: bool
    cached: bool
    fingerprint: str | None = None
    state: str | None = None
    error: str | None = None
    workers: int | None = None
    bos_token: str | None = None  # (1.2) from the model's own files
    eos_token: str | None = None
    model_max_length: int | None = None
    added_tokens: int | None = None
    backend: str | None = None  # (1.2) the library that encodes it: "fastokens", "tokenizers", "tiktoken"
    # The engine that renders its chat template (docs/chat.md): "minijinja", "jinja2", per template
    # ("default:minijinja,tool_use:jinja2"), or "" without a template or from a broker that does not say.
    chat_renderer: str = ""


@dataclass(frozen=True, slots=True)
class Pong:
    """The broker is up: how many workers are ready, its version, and the limits it applies
    (`max_request_bytes`, `max_batch_items`, ...; empty from a broker that does not say)."""

    workers: int
    version: str
    limits: dict = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ModelState:
    """`add_model`'s answer: "loading" (in the background; `models` shows how it went) or "ready"."""

    name: str
    state: str


@dataclass(frozen=True, slots=True)
class RemovedModel:
    """`remove_model`'s answer: the model left the catalog."""

    name: str
    removed: bool


_build_tokens = _builder(Tokens)
_build_chat_tokens = _builder(ChatTokens)
_build_text = _builder(Text)


_EMPTY_U32 = array("I")


def tokens(reply: dict, ids: IdsFormat) -> Tokens:
    # The hot path of every tokenize call, written out: a u32 bin becomes an array('I') in one copy.
    value = reply["tokens"]
    got: Ids
    if type(value) is bytes and ids == "array" and not _BIG_ENDIAN_HOST:
        u32 = _EMPTY_U32[:]
        u32.frombytes(value)
        got = u32
    else:
        got = ids_from_wire(value, ids)
    cache, offsets, hashes = reply.get("cache"), reply.get("offsets"), reply.get("block_hashes")
    return _build_tokens(got, reply["count"], reply.get("worker", ""), None if cache is None else _cache_info(cache),
                         None if offsets is None else _offsets(offsets), reply.get("token_strs"),
                         reply.get("truncated"), None if hashes is None else _hashes(hashes))


def tokens_batch(reply: dict, ids: IdsFormat) -> TokensBatch:
    return TokensBatch([ids_from_wire(t, ids) for t in reply["tokens"]], reply["count"],
                       reply.get("worker", ""), _cache(reply), _each(reply.get("offsets"), _offsets),
                       reply.get("token_strs"), reply.get("truncated"), _each(reply.get("block_hashes"), _hashes))


def text(reply: dict) -> Text:
    return _build_text(reply["text"], reply.get("worker", ""))


def text_batch(reply: dict) -> TextBatch:
    return TextBatch(list(reply["text"]), reply.get("worker", ""))


def chat_tokens(reply: dict, ids: IdsFormat) -> ChatTokens:
    offsets, hashes = reply.get("offsets"), reply.get("block_hashes")
    return _build_chat_tokens(ids_from_wire(reply["tokens"], ids), reply["count"], reply.get("prompt"),
                              reply.get("worker", ""), _cache(reply), None if offsets is None else _offsets(offsets),
                              reply.get("token_strs"), reply.get("truncated"),
                              None if hashes is None else _hashes(hashes))


def count(reply: dict) -> Count:
    return Count(reply["count"], reply["method"], reply.get("vocabulary"), tuple(reply.get("warnings") or ()),
                 reply.get("worker", ""), _cache(reply))


def models(reply: dict) -> list[ModelInfo]:
    return [ModelInfo(
        name=m["name"], aliases=tuple(m.get("aliases") or ()), kind=m.get("kind", ""),
        vocab_size=m.get("vocab_size", 0), special_tokens=tuple(m.get("special_tokens") or ()),
        chat_template=bool(m.get("chat_template")), cached=bool(m.get("cached")),
        fingerprint=m.get("fingerprint"), state=m.get("state"), error=m.get("error"), workers=m.get("workers"),
        bos_token=m.get("bos_token"), eos_token=m.get("eos_token"), model_max_length=m.get("model_max_length"),
        added_tokens=m.get("added_tokens"), backend=m.get("backend"),
        chat_renderer=m.get("chat_renderer") or "",
    ) for m in reply["models"]]


@dataclass(frozen=True, slots=True)
class BlockHashSpec:
    """What vLLM's prefix cache hashes with: its block size, the engine's PYTHONHASHSEED (a str),
    and the request's LoRA adapter name and cache salt, if any."""

    block_size: int
    seed: str
    lora_name: str | None = None
    cache_salt: str | None = None


def token_in(offsets: bool, token_strs: bool, truncate: int | None, truncation_side: str,
             block_hashes: BlockHashSpec | None) -> dict[str, Any]:
    """The 1.2 tokenize/chat options as request fields, only those that change the reply."""
    body: dict[str, Any] = {}
    if offsets:
        body["return_offsets"] = True
    if token_strs:
        body["return_token_strs"] = True
    if truncate is not None:
        body["truncate_prompt_tokens"] = truncate
        body["truncation_side"] = truncation_side
    if block_hashes is not None:
        spec = {"block_size": block_hashes.block_size, "seed": block_hashes.seed}
        for key in ("lora_name", "cache_salt"):
            if getattr(block_hashes, key) is not None:
                spec[key] = getattr(block_hashes, key)
        body["block_hashes"] = spec
    return body


def pong(reply: dict) -> Pong:
    return Pong(reply["workers"], reply["version"], dict(reply.get("limits") or {}))
