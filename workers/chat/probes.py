"""Which engine renders a chat template: MiniJinja where it is proven to give jinja2's prompts, else jinja2.

At load, a template chat/gate.py admits is rendered with both engines on a battery of conversations
that walk the paths real templates branch on: roles and system prompts, tools, tool calls (map and
string arguments) and their results, reasoning, documents, `add_generation_prompt` both ways,
chat_template_kwargs, unicode and whitespace, empty content, multimodal content parts, a continued
final message, alternation errors. MiniJinja serves the template only if it renders the one-message
conversation exactly as jinja2 does and no probe differs: a prompt must be the same text, a
`raise_exception` the same message. (A probe MiniJinja fails in another way does not count against
it: at run time any such failure is rendered again by jinja2, so it costs time, never exactness.)

jinja2 renders the probes in this process, in chat/sandbox.py's bounded environment: only templates
the gate admitted and MiniJinja rendered within its fuel get this far, so no probe can run away.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import jinja2

from tokenbroker.common.errors import ProtocolError

from .gate import gate_reason
from .mini import MiniEngine, TemplateRaised, minijinja_parse_error

if TYPE_CHECKING:
    from . import ChatRenderer

log = logging.getLogger(__name__)

MINIJINJA = "minijinja"
JINJA2 = "jinja2"

# Fuel: at most 0.21 units per character of input on the shipped templates (docs/chat.md); a render
# gets a fixed allowance plus one unit per character, 5x the most measured. Fuel past that is not an
# error: jinja2 renders the chat again.
FUEL_BASE = 100_000
FUEL_PER_CHAR = 1
# MiniJinja holds the GIL while it renders, so the worker's other jobs wait behind it: a chat with
# more input than this renders with jinja2 in the render child (as every chat did before), and no
# MiniJinja render gets more than FUEL_BASE + MAX_INPUT_CHARS of fuel (milliseconds; docs/chat.md).
MAX_INPUT_CHARS = 256 * 1024
PROBE_SECONDS = 0.5  # jinja2's time budget for each probe render
PROBES_CPU_SECONDS = 2.0  # all the probes of one template: past this, jinja2 renders it (the shipped take 5-30 ms)


# Characters Python's str.isspace() counts and Rust's char::is_whitespace() does not (the only
# difference): `trim`, `.strip()` and `.split()` treat them differently, so input holding one
# renders with jinja2 (ChatRenderer.variables looks for them while it copies the input).
PY_ONLY_SPACE = "\x1c\x1d\x1e\x1f"


def has_py_only_space(text: str) -> bool:
    """Whether `text` holds one of PY_ONLY_SPACE (four substring scans: 15x faster than a regex)."""
    return "\x1c" in text or "\x1d" in text or "\x1e" in text or "\x1f" in text


def fuel_for(chars: int) -> int | None:
    """The fuel a render gets for an input of `chars` characters (as ChatRenderer.variables counts
    them): the allowance plus one unit per character; None past MAX_INPUT_CHARS (jinja2 renders it)."""
    return None if chars > MAX_INPUT_CHARS else FUEL_BASE + FUEL_PER_CHAR * chars


@dataclass(frozen=True)
class Choice:
    """The engine that renders one template: `number` in the MiniJinja engine when it is MiniJinja."""

    engine: str
    reason: str  # why jinja2 (empty for MiniJinja)
    number: int = -1


_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "e.g. Zürich"},
                                                    "days": {"type": "integer"}}, "required": ["city"]}}}
_TOOL_2 = {"type": "function", "function": {"name": "search", "description": "Search the web",
                                            "parameters": {"type": "object", "properties": {}}}}


def _tool_chat(arguments: Any, content: Any) -> list[dict]:
    return [
        {"role": "system", "content": "You can call tools."},
        {"role": "user", "content": "Weather in Zürich, then search?"},
        {"role": "assistant", "content": content, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}},
            {"id": "call_2", "type": "function", "function": {"name": "search", "arguments": {}}}]},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": '{"temp": 21}'},
        {"role": "tool", "tool_call_id": "call_2", "name": "search", "content": "no results"},
        {"role": "assistant", "content": "21 °C."},
        {"role": "user", "content": "Thanks"},
    ]


# name: (messages, render options); the first is the basic conversation MiniJinja must render.
PROBES: list[tuple[str, list[dict], dict]] = [
    ("one user message", [{"role": "user", "content": "Hello"}], {}),
    ("system and turns", [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "  spaced \n lines  "}], {}),
    ("no generation prompt", [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"}], {"add_generation_prompt": False}),
    ("unicode", [
        {"role": "user", "content": "Grüße — 東京 🌤️ مرحبا\t\"quoted\" {{ not a tag }} <b>&amp;"},
        {"role": "assistant", "content": "✅ ça va"}, {"role": "user", "content": "ñ\r\nß"}], {}),
    ("empty content", [
        {"role": "system", "content": ""}, {"role": "user", "content": ""},
        {"role": "assistant", "content": ""}, {"role": "user", "content": " "}], {}),
    ("tools, first question", [{"role": "user", "content": "Weather?"}], {"tools": [_TOOL, _TOOL_2]}),
    ("tool calls, map arguments", _tool_chat({"city": "Zürich", "days": 2}, ""), {"tools": [_TOOL, _TOOL_2]}),
    ("tool calls, string arguments, no content",
     _tool_chat('{"city": "Zürich"}', None), {"tools": [_TOOL, _TOOL_2], "add_generation_prompt": False}),
    ("tool calls without tools", _tool_chat({"city": "Oslo"}, "Let me check."), {}),
    ("empty tools", [{"role": "user", "content": "Hi"}], {"tools": []}),
    ("reasoning", [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>\nsum\n</think>\n\n4", "reasoning_content": "Two and two."},
        {"role": "user", "content": "3+3?"},
        {"role": "assistant", "content": "6", "reasoning": "Three and three."}], {"add_generation_prompt": False}),
    ("chat_template_kwargs", [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}],
     {"extra": {"enable_thinking": False, "thinking": True, "date_string": "01 Jan 2025", "custom": [1, "a"],
                "documents": [{"title": "Zürich", "text": "Stadt"}, {"title": "Oslo", "text": "by", "id": 2}]}}),
    ("multimodal parts", [
        {"role": "user", "content": [{"type": "text", "text": "What is this?"}, {"type": "image"},
                                     {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A cat."}]},
        {"role": "user", "content": [{"type": "text", "text": "Sure?"}]}], {}),
    ("continued final message", [
        {"role": "user", "content": "Finish: "}, {"role": "assistant", "content": "The answer is "}],
     {"add_generation_prompt": False, "continue_final_message": True}),
    ("assistant first", [{"role": "assistant", "content": "Hi"}, {"role": "user", "content": "Hi"}], {}),
    ("two users in a row", [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], {}),
    ("system only", [{"role": "system", "content": "Only a system prompt."}], {}),
    ("developer and long chat", [{"role": "developer", "content": "Dev."}] + [
        {"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}: " + "word " * i}
        for i in range(21)], {}),
]


Outcome = tuple[str, Any]  # ("ok", prompt) | ("raise", message) | ("error", None)


def _jinja2_outcome(template: jinja2.Template, variables: dict, max_bytes: int) -> Outcome:
    from .sandbox import generate_bounded

    try:
        return "ok", "".join(generate_bounded(template, variables, max_seconds=PROBE_SECONDS, max_bytes=max_bytes))
    except jinja2.TemplateError as e:
        if type(e) is jinja2.TemplateError:  # raise_exception's (UndefinedError and the like are subclasses)
            return "raise", str(e) or type(e).__name__
        return "error", None
    except Exception:  # noqa: BLE001 - the budget, the template's own bug: a failure either way
        return "error", None


def _mini_outcome(engine: MiniEngine, number: int, variables: dict, fuel: int | None, max_bytes: int) -> Outcome:
    if fuel is None:
        return "error", None
    try:
        prompt = engine.render(number, variables, fuel=fuel, max_bytes=max_bytes)
    except TemplateRaised as e:
        return "raise", e.message
    return ("error", None) if prompt is None else ("ok", prompt)


def choose(source: str, renderer: ChatRenderer, engine: MiniEngine, max_bytes: int, *,
           tools_only: bool = False) -> Choice:
    """Gate, parse, then probe `source` with both engines (renderer.variables prepares each probe).
    `tools_only`: the template renders only requests with tools (a `tool_use` named template)."""
    started = time.process_time()
    reason = gate_reason(source)
    if reason is not None:
        return Choice(JINJA2, f"outside the subset MiniJinja renders in process: {reason}")
    reason = minijinja_parse_error(source)
    if reason is not None:
        return Choice(JINJA2, f"MiniJinja cannot parse it: {reason}")
    number = engine.add(source)
    from .sandbox import ChatEnvironment

    template = ChatEnvironment().compile_template(source)
    first = True
    for name, messages, options in PROBES:
        if tools_only and options.get("tools") is None:
            continue
        make: Callable[[], tuple[dict, int | None]] = lambda: _probe_variables(  # noqa: E731
            renderer, source, messages, options)
        try:
            mini = _mini_outcome(engine, number, *make(), max_bytes)
        except ProtocolError:  # not a request this template takes (say, continuing with no 'content')
            continue
        if first and mini[0] != "ok":
            return Choice(JINJA2, f"MiniJinja does not render the probe '{name}'")
        if mini[0] == "error" and not first:
            continue
        first = False
        reference = _jinja2_outcome(template, make()[0], max_bytes)
        if mini != reference:
            what = "renders it" if reference[0] == "ok" else f"answers {reference[0]}"
            return Choice(JINJA2, f"the probe '{name}' differs: jinja2 {what}, MiniJinja gives {mini[0]}")
        if time.process_time() - started > PROBES_CPU_SECONDS:
            return Choice(JINJA2, f"its probes took over {PROBES_CPU_SECONDS:g} s of CPU")
    log.debug("chat template probed in %.1f ms of CPU", (time.process_time() - started) * 1000)
    return Choice(MINIJINJA, "", number)


def _probe_variables(renderer: ChatRenderer, source: str, messages: list, options: dict) -> tuple[dict, int | None]:
    tools = options.get("tools")
    _, variables, _, fuel = renderer.variables(
        messages, tools=tools, add_generation_prompt=options.get("add_generation_prompt", True),
        continue_final_message=options.get("continue_final_message", False), extra=options.get("extra"),
        source=source)
    return variables, fuel
