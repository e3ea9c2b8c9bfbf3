"""What calls return: small frozen dataclasses built from reply maps, ids as `array('I')` or lists.

The client asks for `tokens_format: "u32"` so a reply's ids arrive as one little-endian bin per
sequence, which becomes an `array('I')` in one copy (no Python int per id on either end);
`ids="list"` turns that into a list of int instead.
"""

from __future__ import annotations

import sys
from array import array
from dataclasses import dataclass, field
from typing import Any, Literal, Sequence, Union

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


@dataclass(frozen=True, slots=True)
class CacheInfo:
    """Which cache layers served it: `l0` "hit" | "miss" | "off"; ids taken from L1."""

    l0: str
    l1_reused_tokens: int


def _cache(reply: dict) -> CacheInfo | None:
    c = reply.get("cache")
    return CacheInfo(c["l0"], c["l1_reused_tokens"]) if isinstance(c, dict) else None


@dataclass(frozen=True, slots=True)
class Tokens:
    """One text's ids (`tokenize`)."""

    tokens: Ids
    count: int
    worker: str
    cache: CacheInfo | None


@dataclass(frozen=True, slots=True)
class TokensBatch:
    """A batch's ids, one sequence per text, in request order (`tokenize_batch`); `count` is the total."""

    tokens: list[Ids]
    count: int
    worker: str
    cache: CacheInfo | None


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


def tokens(reply: dict, ids: IdsFormat) -> Tokens:
    return Tokens(ids_from_wire(reply["tokens"], ids), reply["count"], reply.get("worker", ""), _cache(reply))


def tokens_batch(reply: dict, ids: IdsFormat) -> TokensBatch:
    return TokensBatch([ids_from_wire(t, ids) for t in reply["tokens"]], reply["count"],
                       reply.get("worker", ""), _cache(reply))


def text(reply: dict) -> Text:
    return Text(reply["text"], reply.get("worker", ""))


def text_batch(reply: dict) -> TextBatch:
    return TextBatch(list(reply["text"]), reply.get("worker", ""))


def chat_tokens(reply: dict, ids: IdsFormat) -> ChatTokens:
    return ChatTokens(ids_from_wire(reply["tokens"], ids), reply["count"], reply.get("prompt"),
                      reply.get("worker", ""), _cache(reply))


def count(reply: dict) -> Count:
    return Count(reply["count"], reply["method"], reply.get("vocabulary"), tuple(reply.get("warnings") or ()),
                 reply.get("worker", ""), _cache(reply))


def models(reply: dict) -> list[ModelInfo]:
    return [ModelInfo(
        name=m["name"], aliases=tuple(m.get("aliases") or ()), kind=m.get("kind", ""),
        vocab_size=m.get("vocab_size", 0), special_tokens=tuple(m.get("special_tokens") or ()),
        chat_template=bool(m.get("chat_template")), cached=bool(m.get("cached")),
        fingerprint=m.get("fingerprint"), state=m.get("state"), error=m.get("error"), workers=m.get("workers"),
    ) for m in reply["models"]]


def pong(reply: dict) -> Pong:
    return Pong(reply["workers"], reply["version"], dict(reply.get("limits") or {}))
