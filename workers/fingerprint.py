"""A model's fingerprint: the hex SHA-256 of everything that can change an id or a rendered prompt.

Two processes that load the same model compute the same fingerprint; any change to the tokenizer's
defining bytes (vocabulary, merges, split pattern, normalizer, decoder, post-processor), its
special tokens, its chat template or its options changes it. The broker admits workers by it, and
`detokenize_stream` keys its state MAC with it, so a state made for another model is refused.

Each part is length-prefixed under a label before hashing, so no two different part lists can
hash the same bytes.

>>> from tokenbroker.workers.tokenizers import load_tokenizer
>>> tok = load_tokenizer("cl100k_base")
>>> fp = model_fingerprint(tok, None)
>>> len(fp), fp == model_fingerprint(tok, None)
(64, True)
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Iterable

from .chat import ChatTemplates
from .tokenizers import Tokenizer

FINGERPRINT_VERSION = b"tokenbroker model fingerprint v1"


def model_fingerprint(tokenizer: Tokenizer, templates: ChatTemplates | None) -> str:
    """The hex SHA-256 of the tokenizer's defining bytes, special tokens, chat template and options."""
    return fingerprints(tokenizer, templates)[0]


def fingerprints(tokenizer: Tokenizer, templates: ChatTemplates | None) -> tuple[str, str]:
    """(the model's fingerprint, its tokenizer's): the second hashes every part but the chat
    template, so models over one tokenizer file with other templates, names or aliases have one
    tokenizer fingerprint and share one engine and its caches (workers/registry.py). One pass over
    the vocabulary: the template is the last part, hashed into a copy.

    >>> from tokenbroker.workers.chat import ChatTemplates
    >>> from tokenbroker.workers.tokenizers import load_tokenizer
    >>> tok = load_tokenizer("cl100k_base")
    >>> a, b = fingerprints(tok, None), fingerprints(tok, ChatTemplates(default="{{ messages }}", named={}, source="test"))
    >>> a[0] != b[0], a[1] == b[1], a[0] == model_fingerprint(tok, None)
    (True, True, True)
    """
    h = hashlib.sha256(FINGERPRINT_VERSION)
    for label, data in _tokenizer_parts(tokenizer):
        _put(h, label, data)
    tokenizer_digest = h.copy()
    _put(h, "chat_template", _canonical(_template_parts(templates)))
    _put(tokenizer_digest, "engine", b"")  # never equal to a model fingerprint
    return h.hexdigest(), tokenizer_digest.hexdigest()


def _put(h: "hashlib._Hash", label: str, data: bytes) -> None:
    h.update(label.encode() + b"\x00" + len(data).to_bytes(8, "little"))
    h.update(data)


def _tokenizer_parts(tokenizer: Tokenizer) -> Iterable[tuple[str, bytes]]:
    yield "kind", tokenizer.kind.encode()
    yield "tokenizer", _defining_bytes(tokenizer)
    yield "special_tokens", _canonical(sorted(tokenizer.special_tokens.items()))
    yield "named_specials", _canonical(sorted(tokenizer.named_specials.items()))
    # what the chat renderer takes from tokenizer_config.json beyond the named specials (bos/eos
    # texts, add_bos_token, ...) is also what can change a rendered prompt: keep the whole config
    # minus the template (counted below, with overrides) and keys that only describe files.
    config = {k: v for k, v in tokenizer.tokenizer_config.items() if k not in _NON_DEFINING_CONFIG}
    yield "tokenizer_config", _canonical(config)


# Keys of tokenizer_config.json that never change an id or a rendered prompt.
_NON_DEFINING_CONFIG = frozenset({"chat_template", "tokenizer_class", "auto_map", "name_or_path", "model_max_length"})


def _defining_bytes(tokenizer: Tokenizer) -> bytes:
    """A Hugging Face tokenizer's canonical JSON, or a tiktoken encoding's ranks, pattern and specials."""
    raw: Any = tokenizer.raw
    if tokenizer.kind == "huggingface":
        return raw.to_str().encode()  # vocabulary serialized in id order: the same bytes in every process
    ranks = getattr(raw, "_mergeable_ranks", None) or {}
    out = bytearray(raw._pat_str.encode() + b"\x00")
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        out += rank.to_bytes(4, "little") + len(token).to_bytes(2, "little") + token
    out += _canonical(sorted(raw._special_tokens.items()))
    return bytes(out)


def _template_parts(templates: ChatTemplates | None) -> list:
    if templates is None:
        return []
    return [templates.default, sorted(templates.named.items())]


def _canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"), default=repr).encode()
