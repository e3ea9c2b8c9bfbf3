"""Chat templates: where a model keeps them, and the special tokens transformers passes to them.

Discovery follows transformers 5.24's loading order (chat_template.json, chat_template.jinja with
additional_chat_templates/, tokenizer_config.json) and its choice among named templates; rendering
them is chat.py's job.

>>> discover_chat_templates(None, {"chat_template": "{{ messages }}"}, None).select(None)
'{{ messages }}'
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenbroker.common.errors import ProtocolError

from ..tokenizer_config import token_text

# Standard named special tokens, in transformers' SPECIAL_TOKENS_ATTRIBUTES order.
SPECIAL_TOKEN_ATTRIBUTES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


@dataclass(frozen=True)
class ChatTemplates:
    """A model's chat templates, as transformers holds them: one template, or several by name."""

    default: str | None  # the template used without tools
    named: dict[str, str]  # all named templates (incl. "default"/"tool_use" when given as a list)
    source: str  # where it came from, for logs and errors

    def by_name(self) -> dict[str, str]:
        """Every template by name ("default" for a lone one)."""
        if self.named:
            return dict(self.named)
        return {} if self.default is None else {"default": self.default}

    def select(self, tools: list | None) -> str:
        """The template for a request, by transformers' get_chat_template rules (tools given: `tool_use`)."""
        if self.named:
            if tools is not None and "tool_use" in self.named:
                return self.named["tool_use"]
            if "default" in self.named:
                return self.named["default"]
            raise ProtocolError(
                "template_error",
                f"the model has several chat templates ({', '.join(sorted(self.named))}) and none is named "
                "'default'; give one with --chat-template",
            )
        if self.default is None:
            raise ProtocolError("template_error", "the model has no chat template; give one with --chat-template")
        return self.default


def discover_chat_templates(
    model_dir: Path | None, tokenizer_config: dict, override: str | None, *, text: str | None = None
) -> ChatTemplates | None:
    """Find a model's chat templates; the first found wins.

    Order: `text` (a template's text, as `add_model` sends it), `override` (the --chat-template file; .json files are read like chat_template.json),
    chat_template.json in the model folder (a bare string or {"chat_template": ...}), chat_template.jinja
    (with additional_chat_templates/*.jinja as named ones, as transformers loads them), any other .jinja
    file (the first by name), then tokenizer_config["chat_template"] (a string, or a list of
    {"name", "template"}). Raises OSError or ValueError naming the file for a template that cannot be read.
    """
    if text is not None:
        return ChatTemplates(text, {}, "add_model chat_template (text)")
    if override is not None:
        return _from_override(override)
    if model_dir is not None:
        found = _from_model_dir(Path(model_dir))
        if found is not None:
            return found
    value = (tokenizer_config or {}).get("chat_template")
    if value is None:
        return None
    return _from_value(value, "tokenizer_config.json chat_template")


def _from_override(override: str) -> ChatTemplates:
    path = Path(override)
    if path.is_file():
        if path.suffix == ".json":
            return _from_json_file(path)
        return ChatTemplates(_read_text(path), {}, str(path))
    if "{{" in override or "{%" in override:
        return ChatTemplates(override, {}, "--chat-template (inline)")
    raise FileNotFoundError(f"--chat-template {override!r}: no such file")


def _from_model_dir(model_dir: Path) -> ChatTemplates | None:
    json_file = model_dir / "chat_template.json"
    if json_file.is_file():
        return _from_json_file(json_file)
    extra_dir = model_dir / "additional_chat_templates"
    extras = {p.name.removesuffix(".jinja"): _read_text(p) for p in sorted(extra_dir.glob("*.jinja"))}
    main = model_dir / "chat_template.jinja"
    if main.is_file():
        text = _read_text(main)
        named = {"default": text, **extras} if extras else {}
        return ChatTemplates(text, named, str(main))
    if extras:
        return ChatTemplates(extras.get("default"), extras, str(extra_dir))
    others = sorted(model_dir.glob("*.jinja"))
    if others:
        return ChatTemplates(_read_text(others[0]), {}, str(others[0]))
    return None


def _from_json_file(path: Path) -> ChatTemplates:
    try:
        data = json.loads(_read_text(path))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON: {e}") from e
    if isinstance(data, dict):
        if "chat_template" not in data:
            raise ValueError(f"{path}: no 'chat_template' key")
        data = data["chat_template"]
    return _from_value(data, str(path))


def _from_value(value: Any, source: str) -> ChatTemplates:
    if isinstance(value, str):
        return ChatTemplates(value, {}, source)
    if isinstance(value, list):
        named: dict[str, str] = {}
        for i, entry in enumerate(value):
            if not (isinstance(entry, dict) and isinstance(entry.get("name"), str)
                    and isinstance(entry.get("template"), str)):
                raise ValueError(f"{source}[{i}] must be a map with str 'name' and 'template'")
            named[entry["name"]] = entry["template"]
        return ChatTemplates(named.get("default"), named, source)
    raise ValueError(f"{source} must be a str or a list of named templates, got {type(value).__name__}")


def _read_text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def special_tokens_from_config(tokenizer_config: dict) -> dict[str, str]:
    """The named special tokens transformers passes to templates (its `special_tokens_map`).

    The seven standard ones, then model-specific ones: other `*_token` str keys, `extra_special_tokens`
    and `model_specific_special_tokens` given as maps. Values may be str or AddedToken maps ({"content"}).
    """
    config = tokenizer_config or {}
    out = {k: v for k in SPECIAL_TOKEN_ATTRIBUTES if (v := token_text(config.get(k))) is not None}
    auto = {k: v for k, v in config.items()
            if k.endswith("_token") and k not in SPECIAL_TOKEN_ATTRIBUTES and isinstance(v, str)}
    explicit = config.get("model_specific_special_tokens")
    extra = config.get("extra_special_tokens")
    for group in (auto, explicit if isinstance(explicit, dict) else {}, extra if isinstance(extra, dict) else {}):
        out.update({k: v for k, val in group.items() if (v := token_text(val)) is not None})
    return out
