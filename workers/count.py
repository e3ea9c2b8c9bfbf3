"""The `count` op: the prompt tokens of a provider request body, counted locally.

A gateway must know what a request will cost before it sends it. `count_request` parses the body,
detects its format when not told, harvests what the model will read (count_formats.py), picks a
tokenizer down a ladder and adds each format's framing and image tokens. Without `strict` it
never fails on its input: it falls down the ladder and says so in `method` and `warnings`.

The ladder, first that serves wins:

1. tiktoken, for OpenAI model families (openai_encoding_for): method "tiktoken".
2. a loaded tokenizer, by exact name or alias, then `--tokenizer-map` globs (env.loaded).
3. the embedded fallback tokenizer: method "fallback".
4. characters (Unicode code points) / 2, rounded up: method "estimate".

Framing (documented choices; OpenAI's reproduces the Cookbook's published API counts):

| format | per message | per `name` | per request | tool definitions |
|---|---|---|---|---|
| openai.chat | 3 (4 for gpt-3.5-turbo-0301) | +1 (-1 for 0301) | 3 reply priming (2 for o1/o3/o4/gpt-5) | Cookbook rule, TOOL_CONSTANTS |
| openai.responses | as chat; `instructions` is a system message, a str `input` a user message, each item a message | - | as chat | as chat |
| anthropic.messages | 3 (`system` is one message) | - | 3, plus 346 tool-use system prompt when tools are given (313 for tool_choice any/tool) | 3 + name + description + JSON of input_schema |
| gemini.generate | 3 (`systemInstruction` is one content) | - | 3 | 3 + name + description + JSON of parameters |
| text | 0 | - | 0 | - |

Images are never text: count_images.py reads their sizes and applies each provider's published rule.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from tokenbroker.common.errors import ProtocolError

from .count_detect import detect_format
from .count_formats import FORMATS, HARVESTERS, FunctionDef, Harvest
from .count_images import image_tokens
from .count_walk import Notes, Walk
from .modelmap import normalise_openai_model, openai_encoding_for

__all__ = ["Encoder", "CountEnv", "CountResult", "count_request", "openai_encoding_for", "FORMATS"]

Encoder = Callable[[str], int]


class CountEnv(Protocol):
    """What the worker lends a count: its tokenizers, each behind its caches."""

    def tiktoken(self, encoding: str) -> Encoder | None:
        """An OpenAI encoding by name, None if not available here."""

    def loaded(self, model: str) -> tuple[str, str, Encoder] | None:
        """(vocabulary, method "huggingface" or "tiktoken", encoder) for this model name, None when nothing matches."""

    def fallback(self) -> tuple[str, Encoder] | None:
        """The embedded fallback tokenizer (vocabulary, encoder)."""


@dataclass(frozen=True)
class CountResult:
    count: int
    method: str
    vocabulary: str | None
    warnings: list[str]


# --- constants -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Framing:
    per_message: int
    per_name: int
    per_request: int


@dataclass(frozen=True)
class ToolConstants:
    """The OpenAI Cookbook's num_tokens_for_tools constants."""

    func_init: int
    prop_init: int
    prop_key: int
    enum_init: int
    enum_item: int
    func_end: int


FRAMING = {
    "openai.chat": Framing(per_message=3, per_name=1, per_request=3),
    "openai.responses": Framing(per_message=3, per_name=1, per_request=3),
    "anthropic.messages": Framing(per_message=3, per_name=0, per_request=3),
    "gemini.generate": Framing(per_message=3, per_name=0, per_request=3),
    "text": Framing(per_message=0, per_name=0, per_request=0),
}
FRAMING_0301 = Framing(per_message=4, per_name=-1, per_request=3)  # a name replaces the role
TOOL_CONSTANTS = {
    "o200k_base": ToolConstants(func_init=7, prop_init=3, prop_key=3, enum_init=-3, enum_item=3, func_end=12),
    "cl100k_base": ToolConstants(func_init=10, prop_init=3, prop_key=3, enum_init=-3, enum_item=3, func_end=12),
}
SCHEMA_TOOL_OVERHEAD = 3  # per function definition, Anthropic and Gemini
ANTHROPIC_TOOL_PROMPT = 346  # Anthropic's published tool-use system prompt (Claude 4 / 3.7), tool_choice auto or none
ANTHROPIC_TOOL_PROMPT_FORCED = 313  # tool_choice any or tool

MAX_COUNT = 2**53 - 1  # the largest count every client decodes exactly (a JSON number is a double); never reached by a body under --max-request-bytes
_0301 = re.compile(r"gpt-3\.5-turbo-0301")
_REASONING = re.compile(r"(?:o1|o3|o4|gpt-5(?:\.\d+)?)(?:-.*)?", re.DOTALL)

# --- tool definitions ------------------------------------------------------------------------------


def _strip_dot(text: str) -> str:
    return text[:-1] if text.endswith(".") else text


def _type_name(spec: dict) -> str:
    kind = spec.get("type")
    if isinstance(kind, list):
        return " | ".join(str(k) for k in kind)
    return kind if isinstance(kind, str) else ""


def cookbook_tool_tokens(functions: list[FunctionDef], encode: Encoder, c: ToolConstants, walk: Walk) -> int:
    """The Cookbook's num_tokens_for_tools; nested object properties count by the same rule (our extension)."""
    if not functions:
        return 0
    n = c.func_end
    for f in functions:
        n += c.func_init + encode(f.name + ":" + _strip_dot(f.description))
        params = f.parameters if isinstance(f.parameters, dict) else {}
        stack = [params.get("properties")]
        while stack:
            props = stack.pop()
            if not isinstance(props, dict) or not props:
                continue
            n += c.prop_init
            for key, spec in props.items():
                walk.budget -= 1
                if walk.budget < 0:
                    walk.notes.add("The tool definitions are too large to count fully: some properties were not counted.")
                    return n
                spec = spec if isinstance(spec, dict) else {}
                n += c.prop_key
                if isinstance(spec.get("enum"), list):
                    n += c.enum_init
                    for item in spec["enum"]:
                        n += c.enum_item + encode(item if isinstance(item, str) else walk.to_json(item))
                description = spec.get("description") if isinstance(spec.get("description"), str) else ""
                n += encode(f"{key}:{_type_name(spec)}:{_strip_dot(description)}")
                items = spec.get("items")
                stack.append(spec.get("properties"))
                if isinstance(items, dict):
                    stack.append(items.get("properties"))
    return n


def schema_tool_tokens(functions: list[FunctionDef], encode: Encoder, walk: Walk) -> int:
    n = 0
    for f in functions:
        n += SCHEMA_TOOL_OVERHEAD + encode(f.name) + encode(f.description)
        if f.parameters is not None:
            n += encode(walk.to_json(f.parameters))
    return n


# --- the ladder ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Tokenizer:
    method: str
    vocabulary: str | None
    encode: Encoder


def estimate_tokens(text: str) -> int:
    """The last rung: one token per two characters (code points), rounded up."""
    return (len(text) + 1) // 2


def _vendor_note(model: str | None, fmt: str) -> str | None:
    name = normalise_openai_model(model) if model else ""
    if name.startswith("claude") or (not model and fmt == "anthropic.messages"):
        return "Anthropic does not publish Claude's tokenizer: this count is an estimate."
    if name.startswith("gemini") or (not model and fmt == "gemini.generate"):
        return "Google does not publish Gemini's tokenizer: this count is an estimate."
    return None


def resolve_tokenizer(model: str | None, *, strict: bool, env: CountEnv, notes: Notes) -> _Tokenizer:
    """The first rung of the ladder that serves `model`; strict refuses to fall below a named model's tokenizer."""
    if model is not None:
        encoding = openai_encoding_for(model)
        missing = ""
        if encoding is not None:
            encoder = env.tiktoken(encoding)
            if encoder is not None:
                return _Tokenizer("tiktoken", encoding, encoder)
            missing = (f"the tiktoken encoding {encoding} is not available here: workers load encodings only from "
                       "local files (tiktoken's cache), never over the network on a request")
            notes.add(f"For model {model!r}, {missing}.")
        loaded = env.loaded(model)
        if loaded is not None:
            vocabulary, method, encoder = loaded
            return _Tokenizer(method, vocabulary, encoder)
        if strict:
            why = f": {missing}" if missing else ""
            raise ProtocolError("unknown_model", f"field 'model': no tokenizer is available for {model!r} (strict count){why}")
        notes.add(f"No tokenizer is loaded for model {model!r}.")
    else:
        notes.add("No model was given in the request or in the body.")
    fallback = env.fallback()
    if fallback is not None:
        vocabulary, encoder = fallback
        notes.add(f"Counted with the embedded fallback tokenizer {vocabulary!r}, an approximation.")
        return _Tokenizer("fallback", vocabulary, encoder)
    notes.add("No tokenizer is available: the count is an estimate of one token per two characters.")
    return _Tokenizer("estimate", None, estimate_tokens)


# --- parsing ---------------------------------------------------------------------------------------


def _decode(body: bytes, *, strict: bool, notes: Notes) -> str:
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError as e:
        if strict:
            raise ProtocolError("invalid_input", f"field 'body' is not valid UTF-8: {e.reason} at byte {e.start}") from e
        notes.add("The body is not valid UTF-8: invalid bytes were replaced.")
        return body.decode("utf-8", errors="replace")


def _parse(text: str, *, strict: bool, notes: Notes) -> object:
    """The JSON value of `text`; malformed JSON is the text itself, said in a note (with strict: invalid_input)."""
    try:
        return json.loads(text)
    except ValueError as e:
        problem = f"is not JSON ({e})"
    except RecursionError:
        problem = "nests too deeply to parse"
    if strict:
        raise ProtocolError("invalid_input", f"field 'body' {problem}")
    notes.add(f"The body {problem}: it was counted as raw text.")
    return _RawText(text)


@dataclass(frozen=True)
class _RawText:
    text: str


def _value(body: dict | str | bytes, fmt: str | None, *, strict: bool, walk: Walk) -> dict | str:
    """The body as a map for the provider formats, or the str that is counted as it is."""
    notes = walk.notes
    value: object = _decode(body, strict=strict, notes=notes) if isinstance(body, bytes) else body
    if fmt == "text":
        if isinstance(value, dict):
            notes.add("A map body was counted as its JSON text.")
            return walk.to_json(value)
        return value  # a str body is counted as it is
    if isinstance(value, str):
        value = _parse(value, strict=strict, notes=notes)
    if isinstance(value, _RawText):
        return value.text
    if isinstance(value, dict):
        return value
    if isinstance(value, str):
        notes.add("The body is a JSON string, not an object: its content was counted as text.")
        return value
    notes.add("The body is JSON but not an object: its JSON text was counted.")
    return walk.to_json(value)


def _format(value: dict, fmt: str | None, model: str | None, walk: Walk) -> str | None:
    """The given format, else the body's shape's (said in a note); None when it is unrecognisable."""
    if fmt is not None:
        return fmt
    fmt = detect_format(value, model)
    if fmt is None:
        walk.notes.add("The body's format is not recognised: its JSON text was counted.")
    else:
        walk.notes.add(f"The format was not given: the body's shape says {fmt}.")
    return fmt


# --- counting --------------------------------------------------------------------------------------


def _chat_framing(fmt: str, model: str) -> Framing:
    framing = FRAMING[fmt]
    if not fmt.startswith("openai."):
        return framing
    if _0301.fullmatch(model):
        framing = FRAMING_0301
    if _REASONING.fullmatch(model):
        framing = Framing(framing.per_message, framing.per_name, framing.per_request - 1)
    return framing


def _count_harvest(h: Harvest, fmt: str, model: str | None, encode: Encoder, walk: Walk) -> int:
    name = normalise_openai_model(model) if model else ""
    framing = _chat_framing(fmt, name)
    n = framing.per_request
    for m in h.messages:
        n += framing.per_message + sum(encode(t) for t in m.texts if t)
        if m.named:
            n += framing.per_name
    if fmt.startswith("openai."):
        constants = TOOL_CONSTANTS.get(openai_encoding_for(name) or "", TOOL_CONSTANTS["o200k_base"])
        n += cookbook_tool_tokens(h.functions, encode, constants, walk)
    else:
        n += schema_tool_tokens(h.functions, encode, walk)
    if fmt == "anthropic.messages" and h.tools_given:
        n += ANTHROPIC_TOOL_PROMPT_FORCED if h.tool_choice_forced else ANTHROPIC_TOOL_PROMPT
    return n + image_tokens(h.images, fmt, name, walk.notes)


def count_request(body: object, *, format: str | None, model: str | None, strict: bool, env: CountEnv) -> CountResult:
    """Count the prompt tokens of a provider request body (docs/protocol.md, op `count`).

    Raises ProtocolError: bad_request for a `format` or `body` of the wrong kind; with `strict`,
    invalid_input for a body that is not JSON (or not UTF-8) and unknown_model when no tokenizer
    serves the named model.
    """
    if format is not None and format not in FORMATS:
        raise ProtocolError("bad_request", f"field 'format' must be one of {', '.join(FORMATS)} or nil, got {format!r}")
    if not isinstance(body, (dict, str, bytes)):
        raise ProtocolError("bad_request", f"field 'body' must be a map, str or bin, got {type(body).__name__}")
    notes = Notes()
    walk = Walk(notes)
    value = _value(body, format, strict=strict, walk=walk)
    if model is None and isinstance(value, dict) and isinstance(value.get("model"), str):
        model = value["model"]
    fmt = "text"
    if isinstance(value, dict):
        detected = _format(value, format, model, walk)
        if detected is None:
            value = walk.to_json(value)
        else:
            fmt = detected
    tokenizer = resolve_tokenizer(model, strict=strict, env=env, notes=notes)
    vendor = _vendor_note(model, fmt)
    if vendor and tokenizer.method != "tiktoken":
        notes.add(vendor)
    if isinstance(value, str):
        count = tokenizer.encode(value) if value else 0
    else:
        harvest = HARVESTERS[fmt](walk, value)
        count = _count_harvest(harvest, fmt, model, tokenizer.encode, walk)
    if count > MAX_COUNT:
        notes.add(f"The count exceeds {MAX_COUNT} and was capped there.")
    return CountResult(count=min(max(0, count), MAX_COUNT), method=tokenizer.method, vocabulary=tokenizer.vocabulary,
                       warnings=notes.sentences())
