"""OpenAI's framing: how Chat Completions and Responses bodies become prompt tokens.

OpenAI renders function definitions into the system message as TypeScript-like declarations, a
`namespace functions { ... }` block (parameter types, descriptions as comments, enums, nested objects,
optional fields), structured outputs as a `# Response Formats` block, and frames each message with
a few tokens. Every rule comes from published or recorded usage (tests/fixtures/count/openai_*.json,
each case with its source; docs/counting.md says which rule comes from where):

- per message: 3 + role + content + name (+1 with a name; 4 and -1 for gpt-3.5-turbo-0301); every
  reply is primed with 3 (2 for the o-series and gpt-5). The OpenAI Cookbook.
- chat with definitions: + the namespace block + 9; the first system message gains a trailing
  newline and, when there is one, 4 less. hmarr/openai-chat-tokens, and the Cookbook's tool cases.
- Responses with definitions: + the block + 3 (8 for the o-series and gpt-5), no system-message
  rule. Recorded usage (pydantic-ai's cassettes).
- gpt-4o families, both APIs: 1 less per function whose properties are all required and none has
  a description. Recorded usage; the cause is not known.
- an assistant's function call: name + arguments + 3; a `function` message: 2 less;
  tool_choice "none" +1, a named function +4 + name. hmarr/openai-chat-tokens.
- a tool result: role + the called function's name + content; in chat on the gpt-4o families 2
  more. The OpenAI community's 40 (gpt-3.5-turbo) and recorded usage.
- structured outputs: `# Response Formats`, `## NAME`, `// description`, the schema's compact JSON
  without `additionalProperties` and `required`. Recorded usage, both APIs.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .formats import FunctionDef, Harvest
from .json_writer import Walk
from .openai_families import openai_encoding_for

Encoder = Callable[[str], int]

PER_MESSAGE = 3
PER_NAME = 1
REPLY_PRIMING = 3
FUNCTIONS_OVERHEAD = 9  # the definitions' own message framing and header
SYSTEM_REUSE = -4  # the definitions join an existing system message
FUNCTION_ROLE = -2  # a `function` message: its name stands for the role
PER_CALL = 3  # an assistant message's function call
CHAT_TOOL_RESULT_O200K = 2  # a chat `tool` message, for the o200k families (recorded usage; cl100k: 0, the community's 40)
RESPONSES_FUNCTIONS_OVERHEAD = 3  # Responses: the definitions' framing (recorded usage), with no system-message rule
RESPONSES_REASONING_EXTRA = 5  # ... and 5 more for the o-series and gpt-5 (recorded usage)
ALL_REQUIRED_DISCOUNT = 1  # gpt-4o families: one less per function whose properties are all required, none described (recorded usage; cause unknown)
CHOICE_NONE = 1
CHOICE_NAMED = 4  # + tokens(name)
MAX_SCHEMA_DEPTH = 32  # nesting levels (objects, unions, arrays) rendered; deeper ones render as `any`, with a warning


@dataclass(frozen=True)
class Framing:
    per_message: int
    per_name: int
    per_request: int


_0301 = re.compile(r"gpt-3\.5-turbo-0301")
_REASONING = re.compile(r"(?:o1|o3|o4|gpt-5(?:\.\d+)?)(?:-.*)?", re.DOTALL)


def framing_for(model: str) -> Framing:
    """The message framing of an OpenAI model (`model` normalised).

    >>> framing_for("gpt-4o"), framing_for("gpt-3.5-turbo-0301").per_name, framing_for("o3-mini").per_request
    (Framing(per_message=3, per_name=1, per_request=3), -1, 2)
    """
    framing = Framing(PER_MESSAGE, PER_NAME, REPLY_PRIMING)
    if _0301.fullmatch(model):
        framing = Framing(4, -1, REPLY_PRIMING)  # a name replaces the role
    if _REASONING.fullmatch(model):
        framing = Framing(framing.per_message, framing.per_name, framing.per_request - 1)
    return framing


# --- the namespace block ----------------------------------------------------------------------------


class _Renderer:
    """Writes function definitions as OpenAI's TypeScript-like declarations, under the count's node budget."""

    def __init__(self, walk: Walk) -> None:
        self.walk = walk
        self.cut = False

    def namespace(self, functions: list[FunctionDef]) -> str:
        lines = ["namespace functions {", ""]
        for f in functions:
            if f.description:
                lines.append(f"// {f.description}")
            params = f.parameters if isinstance(f.parameters, dict) else {}
            if isinstance(params.get("properties"), dict) and params["properties"]:
                lines.append(f"type {f.name} = (_: {{")
                lines.append(self._properties(params, 0, 0))
                lines.append("}) => any;")
            else:
                lines.append(f"type {f.name} = () => any;")
            lines.append("")
        lines.append("} // namespace functions")
        return "\n".join(lines)

    def _properties(self, obj: dict, indent: int, depth: int) -> str:
        """One line per property (`name?: type,`), top-level ones led by their description as a comment."""
        properties = obj.get("properties")
        listed = obj.get("required")
        required = listed if isinstance(listed, list) else []
        lines: list[str] = []
        for name, spec in (properties.items() if isinstance(properties, dict) else ()):
            self.walk.budget -= 1
            if self.walk.budget < 0:
                self.cut = True
                break
            spec = spec if isinstance(spec, dict) else {}
            description = spec.get("description")
            if isinstance(description, str) and description and indent < 2:
                lines.append(f"// {description}")
            optional = "" if name in required else "?"
            lines.append(f"{name}{optional}: {self._type(spec, indent, depth + 1)},")
        return "\n".join(" " * indent + line for line in lines)

    def _type(self, spec: dict, indent: int, depth: int) -> str:
        """A property's type; `depth` counts every nesting (objects, unions, arrays) so none recurses unbounded."""
        self.walk.budget -= 1
        if depth >= MAX_SCHEMA_DEPTH or self.walk.budget < 0:
            self.cut = True
            return "any"
        variants = spec.get("anyOf", spec.get("oneOf"))
        if isinstance(variants, list) and variants:
            return " | ".join(self._type(v if isinstance(v, dict) else {}, indent, depth + 1) for v in variants)
        kind = spec.get("type")
        if isinstance(kind, list):
            return " | ".join(self._type({**spec, "type": k}, indent, depth + 1) for k in kind if not isinstance(k, list))
        enum = spec.get("enum")
        if isinstance(enum, list) and enum and kind in ("string", "number", "integer", None):
            return " | ".join(_literal(v) for v in enum)
        if kind == "string":
            return "string"
        if kind in ("number", "integer"):
            return "number"
        if kind in ("boolean", "null"):
            return kind
        if kind == "object":
            return "\n".join(["{", self._properties(spec, indent + 2, depth), "}"])
        if kind == "array":
            items = spec.get("items")
            return f"{self._type(items, indent, depth + 1)}[]" if isinstance(items, dict) else "any[]"
        return "any"


def _literal(value: Any) -> str:
    """An enum value as TypeScript writes it: strings quoted, whole floats without `.0`."""
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value) if isinstance(value, (int, float)) else json.dumps(value, default=str)


def render_functions(functions: list[FunctionDef], walk: Walk) -> str:
    """The `namespace functions { ... }` block OpenAI puts in the system message.

    >>> from .json_writer import Notes
    >>> f = FunctionDef("get_weather", "Weather now.", {"type": "object", "required": ["city"],
    ...     "properties": {"city": {"type": "string", "description": "City name"}, "unit": {"type": "string", "enum": ["c", "f"]}}})
    >>> print(render_functions([f], Walk(Notes())))
    namespace functions {
    <BLANKLINE>
    // Weather now.
    type get_weather = (_: {
    // City name
    city: string,
    unit?: "c" | "f",
    }) => any;
    <BLANKLINE>
    } // namespace functions
    """
    renderer = _Renderer(walk)
    text = renderer.namespace(functions)
    if renderer.cut:
        walk.notes.add("The tool definitions are too large or too deep to render fully: some of them were not counted.")
    return text


# --- the count --------------------------------------------------------------------------------------


SCHEMA_KEYWORDS_DROPPED = frozenset({"additionalProperties", "required"})  # not rendered in a response format


def render_response_format(name: str, description: str, schema: Any, walk: Walk, *, joined: bool) -> str:
    r"""A JSON-schema structured output as OpenAI puts it in the system message (recorded usage, both APIs).

    `# Response Formats`, `## NAME`, the description as a `//` line, then the schema's compact JSON
    without `additionalProperties` and `required`; after a blank line when it joins tool definitions
    or a system message.

    >>> from .json_writer import Notes
    >>> schema = {"type": "object", "properties": {"required": {"type": "string"}}, "required": ["required"], "additionalProperties": False}
    >>> render_response_format("reply", "", schema, Walk(Notes()), joined=False)
    '# Response Formats\n\n## reply\n\n{"type":"object","properties":{"required":{"type":"string"}}}'
    """
    comment = f"// {description}\n" if description else ""
    prefix = "\n\n" if joined else ""
    return f"{prefix}# Response Formats\n\n## {name}\n\n{comment}{walk.to_json(_without_keywords(schema, walk))}"


def _without_keywords(schema: Any, walk: Walk, depth: int = 0) -> Any:
    """A copy of `schema` without the dropped keywords (property names are kept); deeper than
    MAX_SCHEMA_DEPTH levels, or past the node budget, the rest is kept as it is."""
    if depth >= MAX_SCHEMA_DEPTH or walk.budget <= 0:
        return schema
    walk.budget -= 1
    if isinstance(schema, list):
        return [_without_keywords(v, walk, depth + 1) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in SCHEMA_KEYWORDS_DROPPED:
            continue
        if key == "properties" and isinstance(value, dict):  # property names are names, not keywords
            out[key] = {k: _without_keywords(v, walk, depth + 1) for k, v in value.items()}
        else:
            out[key] = _without_keywords(value, walk, depth + 1)
    return out


def _plain_required(f: FunctionDef) -> bool:
    """A function whose properties are all required and none has a description (see ALL_REQUIRED_DISCOUNT)."""
    params = f.parameters if isinstance(f.parameters, dict) else {}
    properties, required = params.get("properties"), params.get("required")
    if not isinstance(properties, dict) or not properties or not isinstance(required, list):
        return False
    if any(isinstance(spec, dict) and spec.get("description") for spec in properties.values()):
        return False
    try:
        return set(properties) <= set(required)
    except TypeError:  # unhashable entries in `required`: not a list of names
        return False


def definitions_tokens(h: Harvest, model: str, encode: Encoder, walk: Walk, *, chat: bool) -> int:
    """The function definitions' block and its framing (`model` normalised)."""
    if not h.functions:
        return 0
    n = encode(render_functions(h.functions, walk))
    if chat:
        n += FUNCTIONS_OVERHEAD
        if any(m.role in ("system", "developer") for m in h.messages):
            n += SYSTEM_REUSE
    else:
        n += RESPONSES_FUNCTIONS_OVERHEAD + (RESPONSES_REASONING_EXTRA if _REASONING.fullmatch(model) else 0)
    if openai_encoding_for(model) != "cl100k_base":  # the gpt-4o families
        n -= ALL_REQUIRED_DISCOUNT * sum(1 for f in h.functions if _plain_required(f))
    return n


def openai_tokens(h: Harvest, model: str, encode: Encoder, walk: Walk, *, api: str) -> int:
    """The prompt tokens of an OpenAI body's messages, definitions and choices; images apart.

    `model` is normalised; `api` is "chat" or "responses", which frame tool definitions and tool
    results differently.
    """
    framing = framing_for(model)
    chat = api == "chat"
    # chat adds a newline to the first system message when there are definitions; Responses does not
    pad = chat and bool(h.functions)
    tool_result = CHAT_TOOL_RESULT_O200K if chat and openai_encoding_for(model) != "cl100k_base" else 0
    n = framing.per_request
    for m in h.messages:
        texts = m.texts
        if pad and m.role in ("system", "developer") and m.content_at is not None:
            texts = list(texts)
            texts[m.content_at] += "\n"
            pad = False
        n += framing.per_message + sum(encode(t) for t in texts if t)
        if m.named:
            n += framing.per_name
        if m.role == "function":
            n += FUNCTION_ROLE
        if m.role == "tool":
            n += tool_result
        n += PER_CALL * m.calls
    n += definitions_tokens(h, model, encode, walk, chat=chat)
    if h.choice == "none":
        n += CHOICE_NONE
    elif h.choice_name is not None:
        n += CHOICE_NAMED + encode(h.choice_name)
    if h.response_format is not None:
        joined = bool(h.functions) or any(m.role in ("system", "developer") for m in h.messages)
        n += encode(render_response_format(*h.response_format, walk, joined=joined))
    return n
