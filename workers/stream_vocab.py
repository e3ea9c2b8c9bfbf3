"""Per-tokenizer tables for detokenize_stream, built once: each id's bytes, or its byte-fallback byte.

A byte table exists where decoding is "join each id's bytes, decode UTF-8 with replacement":
always for tiktoken, and for a Hugging Face tokenizer whose decoder is plain ByteLevel, checked id by
id against the library's own decode (any disagreement: no table, the window decoder serves).
"""

from __future__ import annotations

import json
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


def byte_level_table(raw: Any, vocab_size: int) -> list[bytes | None] | None:
    """Each id's bytes when the decoder is plain ByteLevel and the library agrees id by id; else None."""
    decoder = json.loads(raw.to_str()).get("decoder") or {}
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
    if '"ByteFallback"' not in json.dumps(json.loads(raw.to_str()).get("decoder")):
        return {}
    out = {}
    for token, i in raw.get_vocab(with_added_tokens=False).items():
        m = _BYTE_TOKEN.match(token)
        if m:
            out[i] = int(m.group(1), 16)
    return out
