"""A model folder's tokenizer_config.json and special_tokens_map.json: what they say about special tokens.

Both the tokenizer loader (named specials, added tokens) and the chat templates (the special tokens a
template sees) read these files, and both accept a token written as a str or as an AddedToken map.

>>> token_text({"content": "<s>", "special": True}), token_text("</s>"), token_text(None)
('<s>', '</s>', None)
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenbroker.common.errors import BootError

SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


def read_json(path: Path) -> dict:
    """A JSON object from `path`; BootError names the file when it is unreadable or not an object."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise BootError(f"cannot read {path}: {e}") from e
    if not isinstance(data, dict):
        raise BootError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def read_config(model_dir: Path | None) -> dict:
    """tokenizer_config.json of `model_dir`; {} when there is no folder or no such file."""
    if model_dir is None or not (model_dir / "tokenizer_config.json").is_file():
        return {}
    return read_json(model_dir / "tokenizer_config.json")


def token_text(value: object) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def named_specials(model_dir: Path | None, config: dict) -> dict[str, str]:
    """bos/eos/... from tokenizer_config.json, with special_tokens_map.json filling what it lacks."""
    fallback: dict = {}
    if model_dir is not None and (model_dir / "special_tokens_map.json").is_file():
        fallback = read_json(model_dir / "special_tokens_map.json")
    named = {}
    for key in SPECIAL_KEYS:
        text = token_text(config[key]) if key in config else token_text(fallback.get(key))
        if text is not None:
            named[key] = text
    return named
