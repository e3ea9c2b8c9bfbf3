"""Per-tokenizer tables for detokenize_stream, built once: each id's bytes, or its byte-fallback byte.

A byte table exists where decoding is "join each id's bytes, decode UTF-8 with replacement":
always for tiktoken, and for a Hugging Face tokenizer whose decoder is plain ByteLevel, checked id by
id against the library's own decode (any disagreement: no table, the window decoder serves).
"""

from __future__ import annotations

import json
import random
import re
from typing import Any

_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def tiktoken_table(enc: Any, vocab_size: int, unassigned: frozenset[int]) -> list[bytes | None]:
    return [None if i in unassigned else enc.decode_single_token_bytes(i) for i in range(vocab_size)]


def _gpt2_char_bytes() -> dict[str, int]:
    """The byte-level alphabet: printable bytes map to themselves, the rest to U+0100 onwards."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, extra = {chr(b): b for b in printable}, 0
    for b in range(256):
        if b not in printable:
            out[chr(256 + extra)] = b
            extra += 1
    return out


def decoder_spec(raw: Any) -> dict | None:
    """The tokenizer's decoder as its JSON (the decoder alone: cheap, unlike the whole tokenizer's)."""
    decoder = raw.decoder
    return None if decoder is None else json.loads(decoder.__getstate__())


def byte_level_table(raw: Any, vocab_size: int) -> list[bytes | None] | None:
    """Each id's bytes when the decoder is plain ByteLevel and the library agrees id by id; else None."""
    decoder = decoder_spec(raw) or {}
    if decoder.get("type") == "Sequence" and len(decoder.get("decoders") or []) == 1:
        decoder = decoder["decoders"][0]
    if decoder.get("type") != "ByteLevel":
        return None
    char_bytes = _gpt2_char_bytes()
    table: list[bytes | None] = []
    for i in range(vocab_size):
        token = raw.id_to_token(i)
        if token is None:
            table.append(None)
            continue
        try:
            table.append(bytes([char_bytes[c] for c in token]))
        except KeyError:  # a token outside the byte alphabet (an added token): the decoder keeps its UTF-8
            table.append(token.encode())
    known = [i for i, b in enumerate(table) if b is not None]
    library = raw.decode_batch([[i] for i in known], skip_special_tokens=False)
    if any(table[i].decode("utf-8", "replace") != text for i, text in zip(known, library)):  # type: ignore[union-attr]
        return None
    return table


def byte_fallback_ids(raw: Any) -> dict[int, int]:
    """id -> byte for `<0xNN>` tokens when the decoder has ByteFallback, else {}."""
    if '"ByteFallback"' not in json.dumps(decoder_spec(raw)):
        return {}
    out = {}
    for token, i in raw.get_vocab(with_added_tokens=False).items():
        m = _BYTE_TOKEN.match(token)
        if m:
            out[i] = int(m.group(1), 16)
    return out


# Decoders whose rendering of a token depends only on whether it is the first one (and, for byte
# fallback, on the run of byte tokens it belongs to): after any released non-byte token, one fixed
# anchor token stands in for the whole context.
_POSITION_ONLY_DECODERS = frozenset({"Sequence", "WordPiece", "Metaspace", "Replace", "ByteFallback", "Fuse", "Strip", "ByteLevel"})
_ANCHOR_TEXTS = ("the", "▁the", "Ġthe", "a", "▁a", "is", "▁is")
_WORD = re.compile(r"^[▁Ġ]?[A-Za-z]{2,}$")


def anchor_token(raw: Any, vocab_size: int, avoid: frozenset[int]) -> tuple[int, int] | None:
    """(anchor id, length of its decoded text) when the decoder renders a token the same after any
    non-first token, checked against the library on a sample of the vocabulary; else None."""
    decoder = decoder_spec(raw)
    if decoder is None or not _position_only(decoder):
        return None
    anchor = next((i for t in _ANCHOR_TEXTS if (i := raw.token_to_id(t)) is not None and i not in avoid), None)
    if anchor is None:  # any plain word piece will do
        vocab = raw.get_vocab(with_added_tokens=False)
        anchor = min((i for t, i in vocab.items() if i not in avoid and _WORD.match(t)), default=None)
        if anchor is None:
            return None
    base = raw.decode([anchor], skip_special_tokens=False)
    if not base or base.endswith("\ufffd"):
        return None
    rng = random.Random(0)
    ids = [i for i in rng.sample(range(vocab_size), min(vocab_size, 600)) if raw.id_to_token(i) is not None]
    others = [i for i in ids if i not in avoid][:3]
    jobs = [[a, t] for t in ids for a in (anchor, *others)] + [[a] for a in others]
    texts = raw.decode_batch(jobs, skip_special_tokens=False)
    lens = {a: len(t) for a, t in zip(others, texts[len(ids) * (1 + len(others)):])}
    lens[anchor] = len(base)
    k = 0
    for _ in ids:
        tails = set()
        for a in (anchor, *others):
            tails.add(texts[k][lens[a]:])
            k += 1
        if len(tails) != 1:
            return None
    return anchor, len(base)


def _position_only(decoder: dict) -> bool:
    kind = decoder.get("type")
    if kind not in _POSITION_ONLY_DECODERS:
        return False
    if kind == "Strip" and decoder.get("stop", 0):  # stripping the end depends on being the last token
        return False
    return all(_position_only(d) for d in decoder.get("decoders") or [])
