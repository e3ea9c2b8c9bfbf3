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
  takes each message's MessagePack bytes as the client sent them, a map's entries sorted by key
  (so a client's key order does not matter), length-prefixed. Nothing is decoded: the bytes are
  found by skipping values in C, and at most `MAX_HASHED_BYTES` of them are hashed. Turn k+1 shares
  its first k messages' blocks with turn k; users of one system prompt share the first block.
  `tools` and `chat_template_kwargs` go into the seed, since templates render them up front.
- `count`: a map body is treated like chat, taking its message list (`messages`, `contents` or
  `input`) with the body's system/instructions/tools fields in the seed; a str/bin body is hashed
  as text.
- `detokenize`, `models`, `ping`: no key (None); any worker serves them equally well.

Routing reads the request's raw MessagePack (`Peek`, from the frontend), never a decoded payload,
and hashes at most `MAX_HASHED_BYTES` of it, so its cost is bounded whatever the request's size.
A malformed op field never raises here: the key falls back to the model alone and the worker
answers the request with its `bad_request`.
"""

from __future__ import annotations

import hashlib
import io
import struct
from typing import Any, Callable, Iterator, NamedTuple

import msgpack

from .frontend import Peek

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
_READ_SIZE = 64 * 1024  # a value is walked through a file view of the payload, this much at a time


def _boundaries() -> tuple[int, ...]:
    ends: list[int] = []
    pos = 0
    while len(ends) < MAX_BLOCKS:
        pos += min(MAX_BLOCK, max(MIN_BLOCK, pos // GROWTH_DIVISOR))
        ends.append(pos)
    return tuple(ends)


BOUNDARIES: tuple[int, ...] = _boundaries()
MAX_HASHED_BYTES = BOUNDARIES[-1]


class RouteKey(NamedTuple):
    """Where a request would like to run: see the module docstring. A NamedTuple: one is built per
    request, and a frozen dataclass costs several times more to build."""

    key: bytes  # rendezvous key (affinity field, or model + first block)
    blocks: tuple[bytes, ...]  # prefix-block hashes, shallow to deep; () when affinity given or nothing to hash


def route_key(peek: Peek) -> RouteKey | None:
    """The routing key of a request, or None when its op needs no affinity.

    >>> from tokenbroker.broker.frontend import peek_request
    >>> k = route_key(peek_request(msgpack.packb({"op": "tokenize", "text": "hello"})))
    >>> len(k.blocks), k.key == k.blocks[0]
    (1, True)
    """
    if peek.op in KEYLESS_OPS:
        return None
    if peek.affinity is not None:
        return RouteKey(key=_digest(b"affinity\x00" + peek.affinity.encode("utf-8", "surrogatepass")), blocks=())
    model = (peek.model or "").encode("utf-8", "surrogatepass")
    raw, span = peek.raw, peek.spans.get("text")
    if isinstance(raw, memoryview):  # a large payload peeked in place (only tokenize and keyless ops are):
        if span is None:         # what the key reads, the head of its text, is copied, not the frame
            return _fallback(b"text", model)
        raw = raw[span[0]:min(span[1], span[0] + _STR_HEADER_BYTES + MAX_HASHED_BYTES)].tobytes()
        span = (0, len(raw))
    if peek.op == "tokenize":
        return _text_key(b"text", model, raw, span)
    if peek.op == "chat":
        extra = [_capped(raw, peek.spans.get("tools")), _capped(raw, peek.spans.get("chat_template_kwargs"))]
        return _messages_key(b"chat", model, extra, raw, peek.spans.get("messages"))
    if peek.op == "count":
        return _count_key(model, raw, peek.spans.get("body"))
    return _fallback(b"op:" + peek.op.encode("utf-8", "surrogatepass"), model)


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


# --- raw MessagePack, read without decoding ------------------------------------------------


def _str_head(raw: bytes, start: int, limit: int) -> bytes | None:
    """The first `limit` bytes of the str or bin value at `start` (no decode); None for other types."""
    b = raw[start]
    if 0xA0 <= b <= 0xBF:
        at, size = start + 1, b & 0x1F
    elif b in (0xD9, 0xC4):
        at, size = start + 2, raw[start + 1]
    elif b in (0xDA, 0xC5):
        at, size = start + 3, int.from_bytes(raw[start + 1:start + 3], "big")
    elif b in (0xDB, 0xC6):
        at, size = start + 5, int.from_bytes(raw[start + 1:start + 5], "big")
    else:
        return None
    return raw[at:at + min(size, limit)]


def _walker(raw: bytes, start: int) -> msgpack.Unpacker:
    """An unpacker positioned at `start`, reading the payload through a view (no whole copy)."""
    f = io.BytesIO(raw)
    f.seek(start)
    size = max(len(raw), 1)
    return msgpack.Unpacker(f, raw=False, strict_map_key=False, read_size=min(_READ_SIZE, size), max_buffer_size=size)


def _items(raw: bytes, span: tuple[int, int], limit: int) -> Iterator[tuple[int, int]] | None:
    """Spans of the first `limit` items of the list at `span`; None when the value is not a list."""
    if raw[span[0]] not in _ARRAYS:
        return None
    return _walk_items(raw, span[0], limit)


_ARRAYS = frozenset(range(0x90, 0xA0)) | {0xDC, 0xDD}
_STR_HEADER_BYTES = 5  # the longest str or bin header (str32, bin32)
_MAPS = frozenset(range(0x80, 0x90)) | {0xDE, 0xDF}


def _walk_items(raw: bytes, start: int, limit: int) -> Iterator[tuple[int, int]]:
    u = _walker(raw, start)
    n = u.read_array_header()
    for _ in range(min(n, limit)):
        at = start + u.tell()
        u.skip()
        yield at, start + u.tell()


def _map_entries(raw: bytes, span: tuple[int, int]) -> list[tuple[Any, tuple[int, int]]] | None:
    """(key, value span) of the map at `span`, keys decoded (they are small); None if not a map."""
    start = span[0]
    if raw[start] not in _MAPS:
        return None
    u = _walker(raw, start)
    out = []
    for _ in range(u.read_map_header()):
        key = u.unpack()
        at = start + u.tell()
        u.skip()
        out.append((key, (at, start + u.tell())))
    return out


def _capped(raw: bytes, span: "tuple[int, int] | None") -> bytes:
    """A value's raw bytes for a seed: its length and at most MAX_HASHED_BYTES of it."""
    if span is None:
        return b""
    return _LENGTH.pack(span[1] - span[0]) + raw[span[0]:min(span[1], span[0] + MAX_HASHED_BYTES)]


def _canonical(raw: bytes, span: tuple[int, int], budget: int) -> bytes:
    """A message's bytes whatever the client's key order: a map's entries sorted by key."""
    entries = _map_entries(raw, span)
    if entries is None or any(not isinstance(k, str) for k, _ in entries):
        return raw[span[0]:min(span[1], span[0] + budget)]
    parts = []
    for key, (a, b) in sorted(entries, key=lambda e: e[0]):
        parts.append(_LENGTH.pack(len(key)) + key.encode("utf-8", "surrogatepass"))
        parts.append(_LENGTH.pack(b - a) + raw[a:min(b, a + budget)])
    return b"".join(parts)[:budget]


# --- per op ------------------------------------------------------------------------------


def _text_key(kind: bytes, model: bytes, raw: bytes, span: "tuple[int, int] | None") -> RouteKey:
    if span is None:
        return _fallback(kind, model)
    try:
        data = _str_head(raw, span[0], MAX_HASHED_BYTES)
        if data is None:
            data = _batch_stream(raw, span)
    except Exception:  # truncated or nested too deep: the worker will say what is wrong
        data = None
    if data is None:
        return _fallback(kind, model)
    seed = _seed(kind, model)
    blocks = text_blocks(seed, data)
    return RouteKey(key=blocks[0] if blocks else _digest(seed), blocks=blocks)


def _batch_stream(raw: bytes, span: tuple[int, int]) -> bytes | None:
    """A batch's texts joined by 0xFF, at most MAX_HASHED_BYTES of them; None if not a list of str."""
    items = _items(raw, span, MAX_HASHED_BYTES)
    if items is None:
        return None
    parts: list[bytes] = []
    size = 0
    for a, _ in items:
        if size >= MAX_HASHED_BYTES:
            break
        part = _str_head(raw, a, MAX_HASHED_BYTES - size)
        if part is None or raw[a] in (0xC4, 0xC5, 0xC6):
            return None
        parts.append(part)
        size += len(part) + 1
    return BATCH_SEPARATOR.join(parts)


def _messages_key(kind: bytes, model: bytes, extra: list[bytes], raw: bytes, span: "tuple[int, int] | None") -> RouteKey:
    if span is None:
        return _fallback(kind, model)
    h = _new_hash(_seed(kind, model))
    for part in extra:
        _feed(h, part)
    blocks: list[bytes] = []
    try:
        items = _items(raw, span, MAX_BLOCKS)
        if items is None:
            return _fallback(kind, model)
        budget = MAX_HASHED_BYTES
        for item in items:
            if budget <= 0:
                break
            data = _canonical(raw, item, budget)
            budget -= len(data)
            _feed(h, data)
            blocks.append(h.copy().digest()[:DIGEST_BYTES])
    except Exception:  # malformed: keep the blocks read so far
        pass
    if not blocks:
        return RouteKey(key=h.digest()[:DIGEST_BYTES], blocks=())
    return RouteKey(key=blocks[0], blocks=tuple(blocks))


_SYSTEM_FIELDS = ("system", "system_instruction", "systemInstruction", "instructions", "tools")
_MESSAGE_FIELDS = ("messages", "contents", "input")


def _count_key(model: bytes, raw: bytes, span: "tuple[int, int] | None") -> RouteKey:
    if span is None:
        return _fallback(b"count", model)
    try:
        entries = _map_entries(raw, span)
    except Exception:
        entries = None
    if entries is None:
        return _text_key(b"count", model, raw, span)
    body = {k: v for k, v in entries if isinstance(k, str)}
    if not model and "model" in body:
        name = _str_head(raw, body["model"][0], 1024)
        if name is not None and raw[body["model"][0]] not in (0xC4, 0xC5, 0xC6):
            model = name
    messages = next((body[f] for f in _MESSAGE_FIELDS if f in body and raw[body[f][0]] in _ARRAYS), None)
    if messages is None:  # openai.responses may give `input` as a str; other shapes: the whole body
        if "input" in body and _str_head(raw, body["input"][0], 0) is not None:
            return _text_key(b"count", model, raw, body["input"])
        whole = _capped(raw, span)
        blocks = text_blocks(_seed(b"count", model), whole)
        return RouteKey(key=blocks[0], blocks=blocks)
    extra = [_capped(raw, body.get(f)) for f in _SYSTEM_FIELDS]
    return _messages_key(b"count-messages", model, extra, raw, messages)


# --- helpers -----------------------------------------------------------------------------


_SEEDS: dict[tuple[bytes, bytes], bytes] = {}


def _seed(kind: bytes, model: bytes) -> bytes:
    """The hash seed of a key kind and model, built once per pair (models are few; past 4096 not kept)."""
    seed = _SEEDS.get((kind, model))
    if seed is None:
        seed = b"tb1\x00" + kind + b"\x00" + _LENGTH.pack(len(model)) + model
        if len(_SEEDS) < 4096:
            _SEEDS[(kind, model)] = seed
    return seed


def _fallback(kind: bytes, model: bytes) -> RouteKey:
    """A malformed or empty input: the model alone keys it; the worker will say what is wrong."""
    return RouteKey(key=_digest(_seed(kind, model)), blocks=())


def _digest(data: bytes) -> bytes:
    return _new_hash(data).digest()[:DIGEST_BYTES]


def _feed(h: Any, data: bytes) -> None:
    h.update(_LENGTH.pack(len(data)))
    h.update(data)
