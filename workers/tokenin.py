"""What a token-in engine or a KV-aware router asks of `tokenize` and `chat` beside the ids (contract
1.2): code-point offsets, token strings, truncation, and vLLM's prefix-cache block hashes.

Offsets and token strings come from the model's reference library (`reference()`, the one place an
engine that cannot give them hands over), so they never depend on which engine served the ids.
Truncation cuts the full encoding the caches gave (never a second, truncated encode); everything
else then describes the ids kept.

Block hashes are vLLM's `sha256_cbor` chain (docs/protocol.md, "tokenize and chat options"),
computed without a CBOR library: each id's canonical CBOR is looked up in a table, a block's ids
are joined in C, and the chain loop does one concatenation and one SHA-256 per block. With the
caches on, chains are remembered by a digest of the ids before every few blocks (`ChainMemo`), so a
prompt that repeats or extends an earlier one (a conversation's next turn, an L0 or L1 hit) hashes
only its new blocks.

>>> hasher = BlockHasher()
>>> digests = hasher.chain(list(range(1, 17)), BlockSpec(16, "0"))
>>> int.from_bytes(digests[-8:], "big")  # the contract's test vector
3236607068019569386
"""

from __future__ import annotations

import hashlib
import threading
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from itertools import accumulate, repeat
from operator import itemgetter
from typing import Any, Iterator

from tokenbroker.common.errors import ProtocolError
from tokenbroker.common.protocol import opt, type_name

from .cache import CacheOutcome

EXTRA_FIELDS = ("return_offsets", "return_token_strs", "truncate_prompt_tokens", "truncation_side", "block_hashes")
_EXTRA_SET = frozenset(EXTRA_FIELDS)
MAX_BLOCK_SIZE = 4096
DIGEST = 32  # bytes of one block hash
# ChainMemo: a checkpoint every this many tokens (at least every block), and its memory per worker.
CHECKPOINT_TOKENS = 256
CHAIN_MEMO_BYTES = 8 * 1024 * 1024
TABLE_MAX = 1 << 20  # ids with a precomputed CBOR form: past every vocabulary we serve (Gemma's is 262k)
_MEMO_ENTRY_OVERHEAD = 120  # an OrderedDict slot, its 16-byte key and the segment's bytes header

# --- the request's options ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BlockSpec:
    """`block_hashes`: what makes vLLM's chain; `lora_name` and `cache_salt` become its extra keys."""

    block_size: int
    seed: str
    lora_name: str | None = None
    cache_salt: str | None = None


@dataclass(frozen=True, slots=True)
class Extras:
    """The options of one tokenize or chat request; `parse_extras` gives None when none is asked."""

    offsets: bool = False
    token_strs: bool = False
    truncate: int | None = None
    left: bool = True  # truncation_side "left": keep the last ids
    blocks: BlockSpec | None = None


def asks_extras(p: dict) -> bool:
    """Whether a request names any option of this module (the batch encode path serves none of them)."""
    named = p.keys() & _EXTRA_SET  # most requests name none: one set operation in C
    return bool(named) and any(p[k] is not None for k in named)


def parse_extras(p: dict) -> Extras | None:
    """The options, checked (bad_request naming the field); None when none changes the reply."""
    if not asks_extras(p):
        return None
    offsets = opt(p, "return_offsets", bool, False)
    token_strs = opt(p, "return_token_strs", bool, False)
    truncate = opt(p, "truncate_prompt_tokens", int, None)
    if truncate is not None and truncate < 0:
        raise ProtocolError("bad_request", f"field 'truncate_prompt_tokens' must be an int >= 0 or nil, got {truncate}")
    side = opt(p, "truncation_side", str, "left")
    if side not in ("left", "right"):
        raise ProtocolError("bad_request", f"field 'truncation_side' must be \"left\" or \"right\", got {side!r:.40}")
    spec = opt(p, "block_hashes", dict, None)
    blocks = _block_spec(spec) if spec is not None else None
    if not (offsets or token_strs or truncate is not None or blocks is not None):
        return None
    return Extras(offsets, token_strs, truncate, side == "left", blocks)


def _block_spec(d: dict) -> BlockSpec:
    size = d.get("block_size")
    if size is None:
        raise ProtocolError("bad_request", "field 'block_hashes.block_size' is required")
    if type(size) is not int or not 1 <= size <= MAX_BLOCK_SIZE:
        raise ProtocolError("bad_request", f"field 'block_hashes.block_size' must be an int in 1..{MAX_BLOCK_SIZE}, "
                            f"got {size!r:.40}" if type(size) is int else
                            f"field 'block_hashes.block_size' must be int, got {type_name(size)}")
    seed = d.get("seed")
    if seed is None:
        raise ProtocolError("bad_request", "field 'block_hashes.seed' is required (the engine's PYTHONHASHSEED, a str)")
    if not isinstance(seed, str):
        raise ProtocolError("bad_request", f"field 'block_hashes.seed' must be str, got {type_name(seed)}")
    extra = []
    for key in ("lora_name", "cache_salt"):
        value = d.get(key)
        if value is not None and not isinstance(value, str):
            raise ProtocolError("bad_request", f"field 'block_hashes.{key}' must be str or nil, got {type_name(value)}")
        extra.append(value)
    return BlockSpec(size, seed, *extra)


# --- the reference library -----------------------------------------------------------------------


def reference(tokenizer: Any) -> Any:
    """The model's reference library object (a `tokenizers.Tokenizer` or a `tiktoken.Encoding`), the one
    that defines offsets and token strings. An engine that cannot give them is bypassed here."""
    return tokenizer.raw


def _is_tiktoken(tokenizer: Any) -> bool:
    return tokenizer.kind == "tiktoken"


_CONTINUATION = bytes(range(0x80, 0xC0))


def tiktoken_offsets(pieces: list[bytes], text_len: int) -> list[int]:
    """Flat [start, end, ...] per id: start as tiktoken's `decode_with_offsets` gives it (a token that
    begins inside a character starts at that character), end the next start, the last ends at `text_len`."""
    if b"".join(pieces).isascii():
        starts = list(accumulate(map(len, pieces), initial=0))
        starts[-1] = text_len
    else:
        starts, seen = [], 0
        for piece in pieces:
            starts.append(max(0, seen - (0x80 <= piece[0] < 0xC0)) if piece else seen)
            seen += len(piece.translate(None, _CONTINUATION))
        starts.append(text_len)
    flat = [0] * (2 * len(pieces))
    flat[0::2] = starts[:-1]
    flat[1::2] = starts[1:]
    return flat


# --- one text's result ---------------------------------------------------------------------------


@dataclass(slots=True)
class Served:
    """One text's ids as kept, what was asked beside them, and how the caches served it."""

    ids: list[int]
    outcome: CacheOutcome | None  # None: no cache was looked up (the reference library encoded it)
    truncated: int = 0
    offsets: list[int] | None = None  # flat [start, end, ...]
    token_strs: list | None = None  # str (tokenizer.json) or bytes (tiktoken) per id
    block_hashes: bytes | None = None


class Tokenin:
    """Serves the options of one text (`serve`, then `hash_blocks` when asked); owned by the worker's
    Ops, with the worker's chain memo."""

    def __init__(self, memo_bytes: int = 0) -> None:
        self.hasher = BlockHasher(ChainMemo(memo_bytes) if memo_bytes > 0 else None)

    def serve(self, model: Any, text: str, add_special: bool, ex: Extras) -> Served:
        tok = model.tokenizer
        offsets = pieces = None
        if ex.offsets and not _is_tiktoken(tok):
            # tokenizers' offsets come with an encode of their own: its ids are the reply's (equal,
            # id for id, to any engine's), and no cache is consulted.
            enc = reference(tok).encode_batch([text], add_special_tokens=add_special)[0]  # releases the GIL
            ids, outcome = enc.ids, None
            offsets = [x for pair in enc.offsets for x in pair]
        else:
            ids, outcome = model.cache.encode(text, add_special)
            if ex.offsets:  # tiktoken: offsets follow from the ids' bytes alone
                pieces = list(map(reference(tok).decode_single_token_bytes, ids))
                offsets = tiktoken_offsets(pieces, len(text)) if ids else []
        served = Served(ids, outcome)
        if ex.truncate is not None and len(ids) > ex.truncate:
            n = ex.truncate
            served.truncated = len(ids) - n
            if ex.left:
                served.ids = ids[len(ids) - n:]
                cut = slice(2 * (len(ids) - n), None)
                pieces = pieces[len(ids) - n:] if pieces is not None else None
            else:
                served.ids = ids[:n]
                cut = slice(0, 2 * n)
                pieces = pieces[:n] if pieces is not None else None
            offsets = offsets[cut] if offsets is not None else None
        served.offsets = offsets
        if ex.token_strs:
            served.token_strs = pieces if pieces is not None else token_strs(tok, served.ids)
        return served

    def hash_blocks(self, served: Served, spec: BlockSpec, u32: bytes | None = None) -> None:
        """`served.block_hashes` of the ids kept; `u32`: those ids as uint32 in host order, if at hand."""
        served.block_hashes = self.hasher.chain(served.ids, spec, u32)


def token_strs(tokenizer: Any, ids: list[int]) -> list:
    """Each id's vocabulary entry: `Tokenizer.id_to_token` (str), or a tiktoken token's bytes."""
    ref = reference(tokenizer)
    if _is_tiktoken(tokenizer):
        return list(map(ref.decode_single_token_bytes, ids))
    return list(map(ref.id_to_token, ids))


# --- vLLM's block hashes -------------------------------------------------------------------------


def _cbor_head(major: int, n: int) -> bytes:
    """A canonical CBOR head: the major type and the shortest form of `n`."""
    m = major << 5
    if n < 24:
        return bytes([m | n])
    if n < 0x100:
        return bytes([m | 24, n])
    if n < 0x10000:
        return bytes([m | 25]) + n.to_bytes(2, "big")
    if n < 0x100000000:
        return bytes([m | 26]) + n.to_bytes(4, "big")
    return bytes([m | 27]) + n.to_bytes(8, "big")


def _cbor_text(s: str) -> bytes:
    data = s.encode("utf-8")
    return _cbor_head(3, len(data)) + data


_BLOCK_HEAD = b"\x83" + _cbor_head(2, DIGEST)  # [parent, ids, extra]: an array of 3, then a 32-byte string
_NULL = b"\xf6"


class BlockHasher:
    """vLLM's sha256_cbor chain of a sequence's full blocks, with a per-id table of canonical CBOR uints
    (grown to the largest id seen, at most TABLE_MAX: about 45 bytes per id, 9 MB for a 200k vocabulary)."""

    def __init__(self, memo: "ChainMemo | None" = None) -> None:
        self.memo = memo
        self._table: list[bytes] = [_cbor_head(0, i) for i in range(256)]
        self._lock = threading.Lock()

    def _grow(self, top: int) -> None:
        with self._lock:
            table = self._table
            size = min(TABLE_MAX, (top | 4095) + 1)
            if size > len(table):
                table.extend(_cbor_head(0, i) for i in range(len(table), size))

    def _cbor_ids(self, ids: list[int]) -> tuple[bytes, ...]:
        """Each id's canonical CBOR: from the table (in C), or built one by one for ids past TABLE_MAX."""
        top = max(ids)
        table = self._table
        if top >= TABLE_MAX:  # an id past any vocabulary we know: the slow way
            return tuple(table[i] if i < len(table) else _cbor_head(0, i) for i in ids)
        if top >= len(table):
            self._grow(top)
        return itemgetter(*ids)(table) if len(ids) > 1 else (table[ids[0]],)

    def chain(self, ids: list[int], spec: BlockSpec, u32: bytes | None = None) -> bytes:
        """The concatenated digests of every full block of `ids` (`u32`: the ids as uint32 in host
        order, at least the full blocks', if the caller has them: the memo keys on them)."""
        bs = spec.block_size
        full = len(ids) // bs
        if not full:
            return b""
        n = full * bs
        body = ids if n == len(ids) else ids[:n]
        if self.memo is None:
            return self._hash(body, spec, 0, _none_hash(spec.seed))
        if u32 is None:
            u32 = array("I", body).tobytes()
        keys = self.memo.keys(spec, u32, full)
        done, prefix = self.memo.lookup(keys)
        parent = prefix[-DIGEST:] if prefix else _none_hash(spec.seed)
        rest = self._hash(body[done * bs:], spec, done, parent)
        digests = prefix + rest
        self.memo.store(keys, digests, done, self.memo.stride(bs))
        return digests

    def _hash(self, ids: list[int], spec: BlockSpec, first: int, parent: bytes) -> bytes:
        """Digests of the full blocks of `ids`, which begin at block `first`, chained from `parent`."""
        if not ids:
            return b""
        bs = spec.block_size
        arr = _cbor_head(4, bs)
        parts = iter(self._cbor_ids(ids))
        lora = _cbor_text(spec.lora_name) if spec.lora_name is not None else None
        if lora is None and spec.cache_salt is None:
            tails: Iterator[bytes] = repeat(_NULL)
        else:
            later = b"\x81" + lora if lora is not None else _NULL
            tails = repeat(later)
            if first == 0 and spec.cache_salt is not None:
                salt = _cbor_text(spec.cache_salt)
                head = b"\x82" + lora + salt if lora is not None else b"\x81" + salt
                tails = iter([head, *repeat(later, len(ids) // bs - 1)])
        blocks = map(b"".join, zip(repeat(arr), *[parts] * bs, tails))
        sha, out = hashlib.sha256, list[bytes]()
        append = out.append
        for block in blocks:
            parent = sha(_BLOCK_HEAD + parent + block).digest()
            append(parent)
        return b"".join(out)


def _none_hash(seed: str) -> bytes:
    """vLLM's NONE_HASH: sha256_cbor(PYTHONHASHSEED), the first block's parent."""
    return hashlib.sha256(_cbor_text(seed)).digest()


class ChainMemo:
    """Block-hash chains remembered in segments, so a prompt that begins like an earlier one hashes
    only what is new.

    A checkpoint falls every `stride` blocks (CHECKPOINT_TOKENS tokens) and after a prompt's last full
    block; its key is a digest of the options and every id before it, its value the digests of the
    blocks since the previous checkpoint. A lookup walks the checkpoints from the start while they are known, so shared
    prefixes are stored once and memory grows with distinct blocks, not prompts. Least recently used
    segments go first, within a byte budget. Keys depend only on ids, never on the model.
    """

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.bytes = 0
        self.hits = 0  # blocks served from the memo
        self._map: OrderedDict[bytes, bytes] = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def stride(block_size: int) -> int:
        return max(1, CHECKPOINT_TOKENS // block_size)

    def keys(self, spec: BlockSpec, u32: bytes, full: int) -> list[bytes]:
        """One key per checkpoint up to `full` blocks, and one for the blocks after the last: a SHA-256
        over the options and the ids, copied at each."""
        bs = spec.block_size
        stride = self.stride(bs)
        h = hashlib.sha256(b"".join((_cbor_head(0, bs), _cbor_text(spec.seed),
                                     _cbor_text(spec.lora_name) if spec.lora_name is not None else _NULL,
                                     _cbor_text(spec.cache_salt) if spec.cache_salt is not None else _NULL)))
        view, step, keys, pos = memoryview(u32), 4 * bs * stride, [], 0
        for _ in range(full // stride):
            h.update(view[pos:pos + step])
            pos += step
            keys.append(h.copy().digest()[:16])
        if full % stride:  # the blocks past the last checkpoint: a prompt seen again is all memo
            h.update(view[pos:4 * bs * full])
            keys.append(h.digest()[:16])
        return keys

    def lookup(self, keys: list[bytes]) -> tuple[int, bytes]:
        """(blocks known from the start, their digests)."""
        segments = []
        with self._lock:
            get = self._map.get
            for key in keys:
                segment = get(key)
                if segment is None:
                    break
                self._map.move_to_end(key)
                segments.append(segment)
        prefix = b"".join(segments)
        self.hits += len(prefix) // DIGEST
        return len(prefix) // DIGEST, prefix

    def store(self, keys: list[bytes], digests: bytes, known: int, stride: int) -> None:
        """Keep the segments of `digests` past the `known` blocks that came from here."""
        seg = DIGEST * stride
        items = [(keys[i], digests[i * seg:(i + 1) * seg]) for i in range(known // stride, len(keys))]
        if not items:
            return
        with self._lock:
            for key, segment in items:
                if key in self._map:
                    continue
                self._map[key] = segment
                self.bytes += len(segment) + _MEMO_ENTRY_OVERHEAD
            while self.bytes > self.budget and self._map:
                _, gone = self._map.popitem(last=False)
                self.bytes -= len(gone) + _MEMO_ENTRY_OVERHEAD

    def __len__(self) -> int:
        return len(self._map)
