"""Gemini's framing: what Google's `countTokens` and `usageMetadata.promptTokenCount` count.

Google counts the text of the contents and almost nothing else:

- "The quick brown fox jumps over the lazy dog." is 10 tokens, its text alone (the Gemini Cookbook,
  `quickstarts/Counting_Tokens.ipynb`, gemini-1.5-flash; also the API reference's example).
- Gemini 2.5 and later count one more per content (`systemInstruction` is one): the same prompts
  recorded on gemini-2.0-flash and gemini-2.5-flash differ by exactly that in six pairs of
  pydantic-ai's cassettes (`tests/models/cassettes/test_google/`), and sessions of one, two and
  three contents on 2.5 are 1, 2 and 3 over their text.
- `generationConfig.responseJsonSchema` is not counted (the same recordings).
- function declarations: Google publishes no rendering. Recorded gemini-2.0-flash usage counts far
  less than their JSON: about their text (names, descriptions, property names and descriptions,
  enum values) and 2 per declaration and per property, which is the estimate used here, with a
  warning. Gemini 2.5 and later add a tool preamble of varying size that is not counted.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from .formats import FunctionDef, Harvest
from .json_writer import Walk

Encoder = Callable[[str], int]

PER_CONTENT_FROM_2_5 = 1
PER_DECLARATION = 2
PER_PROPERTY = 2
_VERSION = re.compile(r"gemini-(\d+)(?:\.(\d+))?")


def counts_contents(model: str) -> bool:
    """True for Gemini 2.5 and later (and versionless `-latest` names), which count one token per content.

    >>> counts_contents("gemini-2.5-flash"), counts_contents("models/gemini-3-pro-preview"), counts_contents("gemini-2.0-flash")
    (True, True, False)
    """
    name = model.rsplit("/", 1)[-1].lower()
    m = _VERSION.match(name)
    if m is None:
        return name.startswith("gemini") and "latest" in name
    return (int(m.group(1)), int(m.group(2) or 0)) >= (2, 5)


def declaration_tokens(functions: list[FunctionDef], encode: Encoder, walk: Walk) -> int:
    """The estimate for function declarations: their text, and PER_DECLARATION and PER_PROPERTY each."""
    n = 0
    for f in functions:
        n += PER_DECLARATION + encode(f.name) + encode(f.description)
        stack: list[Any] = [f.parameters]
        while stack:
            schema = stack.pop()
            walk.budget -= 1
            if walk.budget < 0:
                walk.notes.add("The function declarations are too large to count fully: some of them were not counted.")
                return n
            if not isinstance(schema, dict):
                continue
            properties = schema.get("properties")
            for name, spec in (properties.items() if isinstance(properties, dict) else ()):
                n += PER_PROPERTY + encode(str(name))
                spec = spec if isinstance(spec, dict) else {}
                if isinstance(spec.get("description"), str):
                    n += encode(spec["description"])
                enum = spec.get("enum")
                if isinstance(enum, list):
                    n += sum(encode(str(v)) for v in enum)
                stack.append(spec)
            for key in ("items", "anyOf", "oneOf", "any_of"):
                value = schema.get(key)
                stack.extend(value if isinstance(value, list) else [value])
    return n


def gemini_tokens(h: Harvest, model: str, encode: Encoder, walk: Walk) -> int:
    """The prompt tokens of a generateContent body's contents and declarations; images apart."""
    n = sum(sum(encode(t) for t in m.texts if t) for m in h.messages)
    if counts_contents(model):
        n += PER_CONTENT_FROM_2_5 * len(h.messages)
    if h.functions:
        n += declaration_tokens(h.functions, encode, walk)
        walk.notes.add("Gemini function declarations are counted as their text and 2 per declaration and property, an estimate.")
    return n
