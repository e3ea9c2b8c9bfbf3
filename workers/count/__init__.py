"""The `count` op: the prompt tokens of a provider request body, counted locally.

A gateway must know what a request will cost before it sends it. `count_request` parses the body,
detects its format when not told, harvests what the model will read (formats.py), picks a
tokenizer down a ladder and adds each format's framing and image tokens. Without `strict` it
never fails on its input: it falls down the ladder and says so in `method` and `warnings`.

The ladder, first that serves wins:

1. tiktoken, for OpenAI model families (openai_encoding_for): method "tiktoken". The worker builds
   the encoding from a local file only (encodings.py): no rung touches the network.
2. a loaded tokenizer, by exact name or alias, then `--tokenizer-map` globs (env.loaded).
3. the embedded fallback tokenizer: method "fallback".
4. characters (Unicode code points) / 2, rounded up: method "estimate".

Framing: OpenAI's in openai.py (messages, the `namespace functions` block of tool definitions,
calls, tool results and structured outputs; it reproduces every published and recorded count in
tests/fixtures/count/). Anthropic: 3
per message (`system` is one), 3 per request, and per tool 3 + name + description + JSON of
input_schema plus Anthropic's published tool-use system prompt (346; 313 for tool_choice any/tool).
Gemini (gemini.py): the text, and one per content from Gemini 2.5 on; declarations by their
text, an estimate. Text: nothing. docs/counting.md gives each rule's source.

Images are never text: images.py reads their sizes and applies each provider's published rule.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, cast

from tokenbroker.common.errors import ProtocolError

from .bounds import body_chars, body_items, check_body_items
from .detect import detect_format
from .formats import FORMATS, HARVESTERS, FunctionDef, Harvest
from .gemini import gemini_tokens
from .images import image_tokens
from .json_writer import Notes, Walk
from .openai import openai_tokens
from .openai_families import normalise_openai_model, openai_encoding_for

OPENAI_ENCODINGS = frozenset({"o200k_base", "o200k_harmony", "cl100k_base"})  # the ladder's first rung serves only these

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
    per_request: int


# OpenAI's framing lives in openai.py, Gemini's in gemini.py; Anthropic's is our
# documented estimate (Anthropic publishes none).
ANTHROPIC_FRAMING = Framing(per_message=3, per_request=3)
SCHEMA_TOOL_OVERHEAD = 3  # per function definition, Anthropic
ANTHROPIC_TOOL_PROMPT = 346  # Anthropic's published tool-use system prompt (Claude 4 / 3.7), tool_choice auto or none
ANTHROPIC_TOOL_PROMPT_FORCED = 313  # tool_choice any or tool
MAX_COUNT = 2**53 - 1  # the largest count every client decodes exactly (a JSON number is a double); never reached by a body under --max-request-bytes

# --- tool definitions ------------------------------------------------------------------------------


def schema_tool_tokens(functions: list[FunctionDef], encode: Encoder, walk: Walk, *, overhead: int) -> int:
    """Name, description and the JSON of the schema per definition, plus `overhead` each (Anthropic)."""
    n = 0
    for f in functions:
        n += overhead + encode(f.name) + encode(f.description)
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
    return estimate_tokens_of(len(text))


def estimate_tokens_of(chars: int) -> int:
    """The last rung's rule on a number of characters."""
    return (chars + 1) // 2


GEMINI_ESTIMATE = ("Google does not publish Gemini's tokenizer: this count is an estimate "
                   "(map gemini-* to a Gemma tokenizer with --tokenizer-map: Gemini shares Gemma's vocabulary).")


def _vendor_note(model: str | None, fmt: str, tokenizer: _Tokenizer) -> str | None:
    """Why a Claude or Gemini count is an estimate; None when it is not one.

    Gemini shares Gemma's vocabulary (Google's Gemma 3 report), so a Gemini model counted with a
    loaded tokenizer whose name says Gemma counts its text exactly.
    """
    name = normalise_openai_model(model) if model else ""
    if name.startswith("claude") or (not model and fmt == "anthropic.messages"):
        return "Anthropic does not publish Claude's tokenizer: this count is an estimate."
    if name.startswith("gemini") or (not model and fmt == "gemini.generate"):
        loaded = tokenizer.method in ("huggingface", "tiktoken") and "gemma" in (tokenizer.vocabulary or "").lower()
        return None if loaded else GEMINI_ESTIMATE
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


def _over_items(value: object, max_items: int, notes: Notes) -> CountResult:
    """A body over the worker's item bound, without `strict`: the last rung over its strings, not a
    failure (bounds.py)."""
    notes.add(f"The body holds more than {max_items} messages, parts, images and other list items, more "
              f"than this worker counts (--max-batch-items): the count is an estimate of one token per two "
              f"characters of its text.")
    count = estimate_tokens_of(body_chars(value))
    return CountResult(count=min(count, MAX_COUNT), method="estimate", vocabulary=None, warnings=notes.sentences())


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
        return cast(str, value)  # a str body is counted as it is
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


def _count_harvest(h: Harvest, fmt: str, model: str | None, encode: Encoder, walk: Walk) -> int:
    name = normalise_openai_model(model) if model else ""
    if fmt.startswith("openai."):
        n = openai_tokens(h, name, encode, walk, api=fmt.removeprefix("openai."))
    elif fmt == "gemini.generate":
        n = gemini_tokens(h, name, encode, walk)
    else:
        framing = ANTHROPIC_FRAMING
        n = framing.per_request + sum(framing.per_message + sum(encode(t) for t in m.texts if t) for m in h.messages)
        n += schema_tool_tokens(h.functions, encode, walk, overhead=SCHEMA_TOOL_OVERHEAD)
        if h.tools_given:
            n += ANTHROPIC_TOOL_PROMPT_FORCED if h.tool_choice_forced else ANTHROPIC_TOOL_PROMPT
    return n + image_tokens(h.images, fmt, name, walk.notes)


def count_request(body: object, *, format: str | None, model: str | None, strict: bool, env: CountEnv,
                  max_items: int | None = None) -> CountResult:
    """Count the prompt tokens of a provider request body (docs/protocol.md, op `count`).

    Raises ProtocolError: bad_request for a `format` or `body` of the wrong kind; with `strict`,
    invalid_input for a body that is not JSON (or not UTF-8) and unknown_model when no tokenizer
    serves the named model; too_large for a body of more than `max_items` list items (bounds.py),
    measured before anything is counted. Without `strict` such a body is estimated instead.
    """
    if format is not None and format not in FORMATS:
        raise ProtocolError("bad_request", f"field 'format' must be one of {', '.join(FORMATS)} or nil, got {format!r}")
    if not isinstance(body, (dict, str, bytes)):
        raise ProtocolError("bad_request", f"field 'body' must be a map, str or bin, got {type(body).__name__}")
    notes = Notes()
    walk = Walk(notes)
    value = _value(body, format, strict=strict, walk=walk)
    if max_items is not None and body_items(value, max_items) > max_items:
        if strict:
            check_body_items(value, max_items)
        return _over_items(value, max_items, notes)
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
    vendor = _vendor_note(model, fmt, tokenizer)
    if vendor and tokenizer.vocabulary not in OPENAI_ENCODINGS:
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
