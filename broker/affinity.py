"""Routing keys: which cached prefix a request is likely to extend, derived without tokenizing.

A worker's L1 cache holds prefixes of texts it has tokenized, so a request is cheapest on the
worker that last tokenized its longest prefix. The broker never tokenizes or renders; it hashes.

`route_key()` returns a `RouteKey`:

- `blocks`: prefix hashes, shallow to deep. Block i is the SHA-256 (truncated to 16 bytes) of a
  seed (op kind and model) followed by the input's first `BOUNDARIES[i]` bytes. One running
  hash is fed each byte once, in C, through memoryview slices, and copied at every boundary, so
  a request costs one pass over at most `MAX_HASHED_BYTES` bytes plus one copy per block; no
  Python loop touches characters. Because boundaries sit at fixed offsets, a text that extends
  another (turn k+1 of a conversation extends turn k) shares every full block of the shorter one.
  The last block is the whole input when it ends between boundaries (so identical repeats share
  their deepest block: the L0 case); input beyond `MAX_HASHED_BYTES` is not hashed, and texts
  that agree that far share a worker, which is what their long common prefix wants anyway.
- `key`: the rendezvous key used when the router's prefix index knows none of the blocks. It is
  the first block (model + first `BOUNDARIES[0]` bytes, or the first message), which every turn of a
  conversation shares, or a hash of the `affinity` field when the client gave one (then
  `blocks` is empty: the client said what belongs together).

Block sizes grow with depth: 256 bytes up to 2 KiB, then an eighth of the offset, capped at
4 KiB. Fine blocks near the start find where a conversation leaves a shared system prompt; coarse
blocks deep in a long text keep the block count (and the router's index entries per request) at
`MAX_BLOCKS`. An input shorter than 256 bytes is one block; its next, longer turn shares no block
with it and may land elsewhere, which costs re-tokenizing under 256 bytes.

Per op:

- `tokenize`: the UTF-8 bytes of `text`. A batch is hashed as one stream, its texts joined by
  0xFF (a byte UTF-8 never holds, so ["ab", "c"] and ["a", "bc"] differ); a batch of one is the
  same stream as its text, and a batch that starts with a conversation's text shares its blocks.
- `chat`: the broker does not render the template, so each message is one block: the running hash
  takes each message's canonical bytes (JSON with sorted keys, length-prefixed). Turn k+1 shares
  its first k messages' blocks with turn k; users of one system prompt share the first block.
  `tools` and `chat_template_kwargs` go into the seed, since templates render them up front.
- `count`: a map body is treated like chat, taking its message list (`messages`, `contents` or
  `input`) with the body's system/instructions/tools fields in the seed; a str/bin body is hashed
  as text.
- `detokenize`, `models`, `ping`: no key (None); any worker serves them equally well.

A malformed op field never raises here: the key falls back to the model alone and the worker
answers the request with its `bad_request`.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from typing import Any, Callable

from tokenbroker.common.protocol import Request, pack

DIGEST_BYTES = 16
MIN_BLOCK = 256
MAX_BLOCK = 4096
GROWTH_DIVISOR = 8  # past 2 KiB a block is 1/8 of its start offset: relative precision ~12%
MAX_BLOCKS = 256
BATCH_SEPARATOR = b"\xff"

KEYLESS_OPS = frozenset({"detokenize", "detokenize_stream", "models", "ping", "add_model", "remove_model"})

# The hash constructor, a module name so a test can count what is hashed through it.
_new_hash: Callable[..., Any] = hashlib.sha256

_LENGTH = struct.Struct("<Q")


def _boundaries() -> tuple[int, ...]:
    ends: list[int] = []
    pos = 0
    while len(ends) < MAX_BLOCKS:
        pos += min(MAX_BLOCK, max(MIN_BLOCK, pos // GROWTH_DIVISOR))
        ends.append(pos)
    return tuple(ends)


BOUNDARIES: tuple[int, ...] = _boundaries()
MAX_HASHED_BYTES = BOUNDARIES[-1]


@dataclass(frozen=True)
class RouteKey:
    """Where a request would like to run: see the module docstring."""

    key: bytes  # rendezvous key (affinity field, or model + first block)
    blocks: tuple[bytes, ...]  # prefix-block hashes, shallow to deep; () when affinity given or nothing to hash


def route_key(request: Request) -> RouteKey | None:
    """The routing key of a request, or None when its op needs no affinity.

    >>> k = route_key(Request(1, "tokenize", None, None, None, "list", {"text": "hello"}))
    >>> len(k.blocks), k.key == k.blocks[0]
    (1, True)
    """
    if request.op in KEYLESS_OPS:
        return None
    if request.affinity is not None:
        return RouteKey(key=_digest(b"affinity\x00" + request.affinity.encode("utf-8", "surrogatepass")), blocks=())
    model = (request.model or "").encode("utf-8", "surrogatepass")
    payload = request.payload
    if request.op == "tokenize":
        return _text_key(b"text", model, payload.get("text"))
    if request.op == "chat":
        extra = [payload.get("tools"), payload.get("chat_template_kwargs")]
        return _messages_key(b"chat", model, extra, payload.get("messages"))
    if request.op == "count":
        return _count_key(model, payload.get("body"))
    return _fallback(b"op:" + request.op.encode("utf-8", "surrogatepass"), model)


def text_blocks(seed: bytes, data: bytes) -> tuple[bytes, ...]:
    """Prefix hashes of `data` at `BOUNDARIES`, plus the whole of it when it ends between two."""
    h = _new_hash(seed)
    view = memoryview(data)[:MAX_HASHED_BYTES]
    size = len(view)
    blocks: list[bytes] = []
    start = 0
    for end in BOUNDARIES:
        if end > size:
            break
        h.update(view[start:end])
        blocks.append(h.copy().digest()[:DIGEST_BYTES])
        start = end
    if start < size:
        h.update(view[start:])
        blocks.append(h.digest()[:DIGEST_BYTES])
    return tuple(blocks)


# --- per op ------------------------------------------------------------------------------


def _text_key(kind: bytes, model: bytes, text: Any) -> RouteKey:
    seed = _seed(kind, model)
    if isinstance(text, str):
        data = _utf8_head(text, MAX_HASHED_BYTES)
    elif isinstance(text, list) and all(isinstance(t, str) for t in text):
        data = _batch_stream(text)
    elif isinstance(text, (bytes, bytearray)):
        data = bytes(text[:MAX_HASHED_BYTES])
    else:
        return _fallback(kind, model)
    blocks = text_blocks(seed, data)
    return RouteKey(key=blocks[0] if blocks else _digest(seed), blocks=blocks)


def _messages_key(kind: bytes, model: bytes, extra: list[Any], messages: Any) -> RouteKey:
    if not isinstance(messages, list):
        return _fallback(kind, model)
    h = _new_hash(_seed(kind, model))
    for part in extra:
        _feed(h, _canonical(part))
    blocks: list[bytes] = []
    for message in messages[:MAX_BLOCKS]:
        _feed(h, _canonical(message))
        blocks.append(h.copy().digest()[:DIGEST_BYTES])
    if not blocks:
        return RouteKey(key=h.digest()[:DIGEST_BYTES], blocks=())
    return RouteKey(key=blocks[0], blocks=tuple(blocks))


_SYSTEM_FIELDS = ("system", "system_instruction", "systemInstruction", "instructions", "tools")
_MESSAGE_FIELDS = ("messages", "contents", "input")


def _count_key(model: bytes, body: Any) -> RouteKey:
    if isinstance(body, dict):
        if not model and isinstance(body.get("model"), str):
            model = body["model"].encode("utf-8", "surrogatepass")
        messages = next((body[f] for f in _MESSAGE_FIELDS if isinstance(body.get(f), list)), None)
        if messages is None:  # openai.responses may give `input` as a str; other shapes: the whole body
            return _text_key(b"count", model, body.get("input") if isinstance(body.get("input"), str) else _canonical(body))
        return _messages_key(b"count-messages", model, [body.get(f) for f in _SYSTEM_FIELDS], messages)
    return _text_key(b"count", model, body)


# --- helpers -----------------------------------------------------------------------------


def _seed(kind: bytes, model: bytes) -> bytes:
    return b"tb1\x00" + kind + b"\x00" + _LENGTH.pack(len(model)) + model


def _fallback(kind: bytes, model: bytes) -> RouteKey:
    """A malformed or empty input: the model alone keys it; the worker will say what is wrong."""
    return RouteKey(key=_digest(_seed(kind, model)), blocks=())


def _digest(data: bytes) -> bytes:
    return _new_hash(data).digest()[:DIGEST_BYTES]


def _feed(h: Any, data: bytes) -> None:
    h.update(_LENGTH.pack(len(data)))
    h.update(data)


def _utf8_head(text: str, limit: int) -> bytes:
    """At least the first `limit` bytes of `text` in UTF-8 (or all of it), without encoding the rest.

    A character is 1 to 4 bytes, so the first `limit` characters hold at least `limit` bytes.
    """
    return text[:limit].encode("utf-8", "surrogatepass")


def _batch_stream(texts: list[str]) -> bytes:
    """The texts joined by 0xFF, encoding only as much as the hash will read."""
    parts: list[bytes] = []
    size = 0
    for text in texts:
        if size >= MAX_HASHED_BYTES:
            break
        part = _utf8_head(text, MAX_HASHED_BYTES - size)
        parts.append(part)
        size += len(part) + 1
    return BATCH_SEPARATOR.join(parts)


def _json_default(value: Any) -> Any:
    if isinstance(value, (bytes, bytearray)):
        return {"$bin": bytes(value).hex()}
    raise TypeError(f"not JSON: {type(value).__name__}")


# Built once: json.dumps() with options builds an encoder per call. Its configuration never changes.
_JSON = json.JSONEncoder(sort_keys=True, ensure_ascii=False, separators=(",", ":"), default=_json_default)


def _canonical(value: Any) -> bytes:
    """Bytes that equal for equal values whatever the key order a client's encoder used.

    JSON with sorted keys is built in C; a map with keys that cannot be sorted falls back to
    MessagePack, which keeps the client's order (fine within one client's conversation).
    """
    try:
        return _JSON.encode(value).encode("utf-8", "surrogatepass")
    except (TypeError, ValueError, RecursionError):
        try:
            return pack(value)
        except Exception:  # nested too deep for both: the worker will reject it anyway
            return b"\x00unencodable"
