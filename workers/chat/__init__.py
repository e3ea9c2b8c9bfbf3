"""Chat rendering: a model's chat template rendered exactly as transformers' apply_chat_template does.

The reference is transformers 5.24 (`utils/chat_template_utils.py` and `apply_chat_template` in
`tokenization_utils_base.py`): the same sandboxed Jinja environment and options, the same filters and
globals, the same message preparation (None-valued keys dropped, reasoning fields aliased), the same
`continue_final_message` cut and the same template choice among named templates (chat/templates.py finds
the templates). transformers itself is never imported here; tests compare our prompts with its output
byte for byte.

Two engines render, one answer: MiniJinja (chat/mini.py) in the worker's own process for templates
chat/gate.py admits (fuel bounds every value they build) and chat/probes.py proves exact at load, and
jinja2 for the rest and for every MiniJinja render that fails. Templates come from the Hub, so they are
untrusted code: jinja2 renders them in chat/sandbox.py's sandboxed environment, bounded in time,
output size and every value's size (max_seconds, max_output_bytes), inside a child process with an
address-space limit and a kill timer (chat/process.py; max_memory_bytes), started only when jinja2
first renders. docs/chat.md says which shipped templates each engine serves and why.

>>> r = ChatRenderer(ChatTemplates("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}", {}, "doc"), {})
>>> r.render([{"role": "user", "content": "hi"}], add_generation_prompt=False)
'<user>hi'
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from tokenbroker.common.errors import ProtocolError
from tokenbroker.common.protocol import type_name

from .mini import TemplateRaised, shared_engine
from .probes import JINJA2, MINIJINJA, Choice, choose, fuel_for, has_py_only_space
from .process import DEFAULT_MAX_MEMORY_BYTES, shared_render_process
from .templates import ChatTemplates, discover_chat_templates, special_tokens_from_config

log = logging.getLogger(__name__)

# Engines proven per process: (template text, special tokens, output budget, tools only) -> Choice.
_CHOSEN: dict[tuple[str, tuple, int, bool], Choice] = {}

__all__ = [
    "ChatRenderer", "PreparedChat", "ChatTemplates", "discover_chat_templates", "special_tokens_from_config",
    "DEFAULT_MAX_OUTPUT_BYTES", "DEFAULT_MAX_SECONDS", "DEFAULT_MAX_MEMORY_BYTES",
]

DEFAULT_MAX_OUTPUT_BYTES = 16 * 2**20
DEFAULT_MAX_SECONDS = 10.0

# Names a message's reasoning comes under; the first is the one templates read (transformers' _REASONING_FIELDS).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# What transformers appends to the final message to find where it ends in the prompt.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
# apply_chat_template's own parameters: as template kwargs they clash with it (a TypeError there).
_RESERVED_KWARGS = frozenset({
    "conversation", "messages", "tools", "chat_template", "add_generation_prompt", "continue_final_message",
    "tokenize", "sanitize_control_tokens", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})


# --- message preparation ----------------------------------------------------------------------------


class _Measure:
    """What a render's input holds, counted while it is copied: characters (for fuel), and whether any
    string holds a character MiniJinja would treat differently (chat/probes.py PY_ONLY_SPACE)."""

    __slots__ = ("chars", "odd")

    def __init__(self) -> None:
        self.chars = 0
        self.odd = False


class _NotPlain(Exception):
    """_copy met a value it does not copy: _plain says which, by its path."""


def _copy(value: Any, m: _Measure) -> Any:
    """A fresh copy of MessagePack data for the template, counted into `m` (the fast path, no paths
    built); _NotPlain for anything but str, int, float, bool, None, str-keyed maps and lists."""
    t = type(value)
    if t is str:
        m.chars += len(value)
        if not m.odd and has_py_only_space(value):
            m.odd = True
        return value
    if t is dict:
        return _copy_map(value, m, False)
    if t is list or t is tuple:
        m.chars += 2 + 2 * len(value)
        return [_copy(v, m) for v in value]
    if value is None or t is int or t is float or t is bool:
        m.chars += 8
        return value
    raise _NotPlain


def _copy_map(value: dict, m: _Measure, drop_none: bool) -> dict:
    """_copy of a map (str values inline: most are); `drop_none` drops None-valued keys (a message's)."""
    out = {}
    chars = 2
    for k, v in value.items():
        if type(k) is not str:
            raise _NotPlain
        if type(v) is str:
            chars += len(k) + len(v) + 4
            if not m.odd and has_py_only_space(v):
                m.odd = True
            out[k] = v
        elif v is None and drop_none:
            continue
        else:
            chars += len(k) + 4
            out[k] = _copy(v, m)
    m.chars += chars
    return out


def _checked_copy(value: Any, path: str, m: _Measure) -> Any:
    """_copy, or the bad_request naming the field that is not plain data."""
    try:
        return _copy(value, m)
    except _NotPlain:
        return _copy(_plain(value, path), m)  # raises naming the field, or copies subclasses as plain


def _plain(value: Any, path: str) -> Any:
    """A fresh copy of MessagePack data for the template; a bin anywhere is a bad_request naming it."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, (bytes, bytearray, memoryview)):
        raise ProtocolError("bad_request", f"field '{path}' is a bin; text must be a str")
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise ProtocolError("bad_request", f"field '{path}' has a {type_name(k)} key; keys must be str")
            out[k] = _plain(v, f"{path}.{k}")
        return out
    if isinstance(value, (list, tuple)):
        return [_plain(v, f"{path}[{i}]") for i, v in enumerate(value)]
    raise ProtocolError("bad_request", f"field '{path}' has unsupported type {type_name(value)}")


def _prepare_messages(messages: Any, m: _Measure) -> list[dict]:
    """What transformers does to a conversation: maps only, None-valued keys dropped, reasoning aliased.

    We also require a str `role` in every message, which every template reads.
    """
    if not isinstance(messages, list):
        raise ProtocolError("bad_request", f"field 'messages' must be a list, got {type_name(messages)}")
    if not messages:
        raise ProtocolError("bad_request", "field 'messages' is empty; give at least one message")
    chat = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ProtocolError("bad_request", f"field 'messages[{i}]' must be a map, got {type_name(message)}")
        try:
            message = _copy_map(message, m, True)
        except _NotPlain:
            message = _checked_copy({k: v for k, v in message.items() if v is not None}, f"messages[{i}]", m)
        role = message.get("role")
        if role is None:
            raise ProtocolError("bad_request", f"field 'messages[{i}].role' is missing")
        if not isinstance(role, str):
            raise ProtocolError("bad_request", f"field 'messages[{i}].role' must be a str, got {type_name(role)}")
        for field in _REASONING_FIELDS:
            reasoning = message.get(field)
            if reasoning is not None:
                break
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        chat.append(message)
    return chat


def _prepare_kwargs(extra: dict | None, named_specials: dict[str, str], m: _Measure) -> tuple[dict, list | None]:
    """Template variables: the special tokens, overridden by chat_template_kwargs; and the documents."""
    if extra is None:
        extra = {}
    if not isinstance(extra, dict):
        raise ProtocolError("bad_request", f"field 'chat_template_kwargs' must be a map, got {type_name(extra)}")
    kwargs = _checked_copy(extra, "chat_template_kwargs", m)
    for name in kwargs:
        if name in _RESERVED_KWARGS:
            raise ProtocolError(
                "bad_request",
                f"field 'chat_template_kwargs.{name}' is not allowed: it is a parameter of the chat op itself",
            )
    documents = kwargs.pop("documents", None)
    if documents is not None:
        if not isinstance(documents, list):
            raise ProtocolError("bad_request", "field 'chat_template_kwargs.documents' must be a list of maps")
        for i, d in enumerate(documents):
            if not isinstance(d, dict):
                raise ProtocolError("bad_request", f"field 'chat_template_kwargs.documents[{i}]' must be a map")
    return {**named_specials, **kwargs}, documents


def _prepare_tools(tools: Any, m: _Measure) -> list | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ProtocolError("bad_request", f"field 'tools' must be a list, got {type_name(tools)}")
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise ProtocolError("bad_request", f"field 'tools[{i}]' must be a map (a JSON schema), got {type_name(tool)}")
    return _checked_copy(tools, "tools", m)


def _tag_final_message(chat: list[dict], source: str) -> str:
    """Mark the end of the final message's content as transformers does; returns the text to continue."""
    last = len(chat) - 1
    content = chat[-1].get("content")
    if content is None:
        raise ProtocolError(
            "bad_request", f"continue_final_message is set but messages[{last}] has no content to continue"
        )
    if "content" not in source:
        raise ProtocolError(
            "bad_request", "continue_final_message is set but this model's chat template never reads 'content'"
        )
    if isinstance(content, list):
        for j in range(len(content) - 1, -1, -1):
            block = content[j]
            if isinstance(block, str) and "text" in block or isinstance(block, dict) and "text" in block:
                if not isinstance(block, dict) or not isinstance(block["text"], str):
                    raise ProtocolError(
                        "bad_request", f"field 'messages[{last}].content[{j}].text' must be a str to continue it"
                    )
                final = block["text"]
                block["text"] = final + _CONTINUE_TAG
                return final
        raise ProtocolError(
            "bad_request", f"continue_final_message is set but messages[{last}].content has no text part to continue"
        )
    if not isinstance(content, str):
        raise ProtocolError(
            "bad_request",
            f"field 'messages[{last}].content' must be a str or a list of parts to continue it, got {type_name(content)}",
        )
    chat[-1]["content"] = content + _CONTINUE_TAG
    return content


def _cut_after_final_message(prompt: str, final: str) -> str:
    """transformers' cut: end the prompt where the tagged final message ends."""
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in prompt or tag not in prompt:
        raise ProtocolError(
            "template_error",
            "continue_final_message is set but the final message does not appear in the rendered chat: "
            "the chat template drops or changes part of it",
        )
    at = prompt.rindex(tag)
    if prompt[at: at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return prompt[:at]
    return prompt[:at].rstrip()


# --- rendering --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PreparedChat:
    """A chat checked and copied for its template (ChatRenderer.prepare)."""

    request: dict[str, Any]  # what prepare was given: the reference renders from a fresh copy of it
    source: str  # the template's text
    variables: dict
    final: str | None  # the final message's text, when it is continued
    fuel: int | None  # MiniJinja's fuel; None: jinja2 renders this input


_JINJA2_CHOICE = Choice(JINJA2, "")


class ChatRenderer:
    """Renders one model's chat templates: with MiniJinja in this process where chat/probes.py proves it
    exact (chat/mini.py), else with jinja2 in the worker's render child (chat/process.py), which
    compiles each template once and keeps it. A MiniJinja render that fails for any reason but the
    template's own raise_exception is rendered again by jinja2, so every answer is the reference's."""

    def __init__(
        self,
        templates: ChatTemplates,
        named_specials: dict[str, str],
        *,
        max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES,
        max_seconds: float = DEFAULT_MAX_SECONDS,
        max_memory_bytes: int = DEFAULT_MAX_MEMORY_BYTES,
        prefer: str = "auto",
    ) -> None:
        """`prefer`: "auto" (MiniJinja where the probes prove it, chat/probes.py), or "jinja2" for every
        template (benchmarks and the render child's own tests)."""
        if prefer not in ("auto", JINJA2):
            raise ValueError(f"prefer must be 'auto' or 'jinja2', got {prefer!r}")
        self.templates = templates
        self._specials = dict(named_specials)
        self._specials_chars = sum(len(k) + len(v) for k, v in self._specials.items())
        self._odd_specials = any(has_py_only_space(v) for v in self._specials.values())
        self._max_bytes = max_output_bytes
        self._max_seconds = max_seconds
        self.sandbox = shared_render_process(max_memory_bytes)  # started only when jinja2 first renders
        self._mini = shared_engine()
        self._choices: dict[str, Choice] = {}  # template text -> its engine
        self.fallbacks = 0  # MiniJinja renders that jinja2 rendered again (fuel spent or an error)
        self._choose(prefer)

    def variables(
        self,
        messages: list,
        *,
        tools: list | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        extra: dict | None = None,
        source: str | None = None,
    ) -> tuple[str, dict, str | None, int | None]:
        """What a render needs: the template's text, its variables, the final message's text when it is
        continued (the prompt is cut after it), and MiniJinja's fuel (chat/probes.py fuel_for; None:
        jinja2 must render this input). `source` overrides the template's choice (probes render each of
        a model's templates). Raises ProtocolError as `render` says."""
        for name, flag in (("add_generation_prompt", add_generation_prompt),
                           ("continue_final_message", continue_final_message)):
            if type(flag) is not bool:
                raise ProtocolError("bad_request", f"field '{name}' must be a bool, got {type_name(flag)}")
        if source is None:
            source = self.templates.select(tools)
        m = _Measure()
        chat = _prepare_messages(messages, m)
        if continue_final_message and add_generation_prompt:
            raise ProtocolError(
                "bad_request",
                "continue_final_message and add_generation_prompt cannot both be true: continue the final "
                "message, or start a new assistant message",
            )
        tool_schemas = _prepare_tools(tools, m)
        kwargs, documents = _prepare_kwargs(extra, self._specials, m)
        final = _tag_final_message(chat, source) if continue_final_message else None
        return source, {
            **kwargs, "messages": chat, "tools": tool_schemas, "documents": documents,
            "add_generation_prompt": add_generation_prompt,
        }, final, None if m.odd or self._odd_specials else fuel_for(m.chars + self._specials_chars)

    def render(
        self,
        messages: list,
        *,
        tools: list | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        extra: dict | None = None,
    ) -> str:
        """The prompt transformers' apply_chat_template(tokenize=False) gives for the same input.

        `extra` is chat_template_kwargs: extra template variables (overriding the special tokens), and
        `documents`. Raises ProtocolError: bad_request for malformed input (naming the field),
        template_error when there is no template, it fails to compile, raises, or exceeds its bounds.
        """
        chat = self.prepare(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                            continue_final_message=continue_final_message, extra=extra)
        prompt = self.render_here(chat)
        return self.render_reference(chat) if prompt is None else prompt

    def prepare(
        self,
        messages: list,
        *,
        tools: list | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        extra: dict | None = None,
    ) -> PreparedChat:
        """A chat checked and ready to render (render_here, then render_reference if that gives None).
        Raises ProtocolError (bad_request) as `render` says."""
        request: dict[str, Any] = {"messages": messages, "tools": tools, "add_generation_prompt": add_generation_prompt,
                   "continue_final_message": continue_final_message, "extra": extra}
        source, variables, final, fuel = self.variables(**request)
        return PreparedChat(request, source, variables, final, fuel)

    def render_here(self, chat: PreparedChat) -> str | None:
        """The prompt, rendered by MiniJinja in this process, or None: jinja2 must render it
        (render_reference; a template MiniJinja does not serve, fuel spent, an error). Never waits on
        the render child; its time is bounded by fuel. ProtocolError for the template's raise_exception."""
        choice = self._choices.get(chat.source)
        if choice is None or choice.engine != MINIJINJA or chat.fuel is None:
            return None
        try:
            prompt = self._mini.render(choice.number, chat.variables, fuel=chat.fuel, max_bytes=self._max_bytes)
        except TemplateRaised as e:
            raise ProtocolError("template_error", e.message) from None
        if prompt is None:
            self.fallbacks += 1
            return None
        return prompt if chat.final is None else _cut_after_final_message(prompt, chat.final)

    def render_reference(self, chat: PreparedChat) -> str:
        """The prompt, rendered by jinja2 in the render child (which it may wait on for max_seconds)."""
        variables = chat.variables
        if self._choices.get(chat.source, _JINJA2_CHOICE).engine == MINIJINJA:
            _, variables, _, _ = self.variables(**chat.request)  # a fresh copy: MiniJinja has read this one
        prompt = self.sandbox.render(chat.source, self.templates.source, variables,
                                     max_seconds=self._max_seconds, max_bytes=self._max_bytes)
        return prompt if chat.final is None else _cut_after_final_message(prompt, chat.final)

    @property
    def engine(self) -> str:
        """Which engine renders this model's templates: "minijinja" or "jinja2"; with several templates
        that differ, each by name ("default:minijinja,tool_use:jinja2")."""
        engines = {name: self._choices[src].engine for name, src in self.templates.by_name().items()
                   if src in self._choices}
        if len(set(engines.values())) <= 1:
            return next(iter(engines.values()), JINJA2)
        return ",".join(f"{name}:{engine}" for name, engine in sorted(engines.items()))

    def _choose(self, prefer: str) -> None:
        """Each template's engine, proven once per process for the same template and special tokens."""
        key_specials = tuple(sorted(self._specials.items()))
        for name, source in self.templates.by_name().items():
            if source in self._choices:
                continue
            key = (source, key_specials, self._max_bytes, name == "tool_use")
            choice = _CHOSEN.get(key) if prefer == "auto" else None
            if choice is None:
                if prefer == JINJA2:
                    choice = Choice(JINJA2, "jinja2 was asked for")
                else:
                    try:
                        choice = choose(source, self, self._mini, self._max_bytes, tools_only=name == "tool_use")
                    except Exception as e:  # noqa: BLE001 - whatever went wrong, jinja2 is the reference
                        choice = Choice(JINJA2, f"probing failed: {type(e).__name__}: {e}")
                    if choice.engine == JINJA2:
                        log.info("chat template %s%s renders with jinja2 (in the render child): %s",
                                 self.templates.source, "" if name == "default" else f" ({name})", choice.reason)
                if prefer == "auto":
                    _CHOSEN[key] = choice
            self._choices[source] = choice
