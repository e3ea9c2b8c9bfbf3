"""Chat rendering: a model's chat template rendered exactly as transformers' apply_chat_template does.

The reference is transformers 5.24 (`utils/chat_template_utils.py` and `apply_chat_template` in
`tokenization_utils_base.py`): the same sandboxed Jinja environment and options, the same filters and
globals, the same message preparation (None-valued keys dropped, reasoning fields aliased), the same
`continue_final_message` cut and the same template choice among named templates (chat_templates.py finds
the templates). transformers itself is never imported here; tests compare our prompts with its output
byte for byte.

Templates come from the Hub, so they are untrusted code: besides the sandbox, a render is bounded in
time and in output size, checked as chunks are generated, on every call and loop iteration the template
makes, and where a value can be blown up without output (`*`, `**`, `+`, `%`, padding methods and
filters, namespace attributes, macro arguments).

>>> r = ChatRenderer(ChatTemplates("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}", {}, "doc"), {})
>>> r.render([{"role": "user", "content": "hi"}], add_generation_prompt=False)
'<user>hi'
"""

from __future__ import annotations

import json
import re
import time
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Iterator, NoReturn

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tokenbroker.common.errors import ProtocolError
from tokenbroker.common.protocol import type_name

from .chat_templates import ChatTemplates, discover_chat_templates, special_tokens_from_config

__all__ = [
    "ChatRenderer", "ChatTemplates", "discover_chat_templates", "special_tokens_from_config",
    "DEFAULT_MAX_OUTPUT_BYTES", "DEFAULT_MAX_SECONDS",
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
_WIDE_FORMAT = re.compile(r"\d{8,}")  # a width or precision of 8+ digits in a format string
_PADDING_METHODS = frozenset({"center", "ljust", "rjust", "zfill", "expandtabs"})


# --- the sandbox ------------------------------------------------------------------------------------


class _BudgetExceeded(Exception):
    """A render ran past its time or size bound."""


@dataclass(frozen=True)
class _Budget:
    deadline: float
    max_seconds: float
    max_bytes: int

    def check_time(self) -> None:
        if time.monotonic() > self.deadline:
            raise _BudgetExceeded(f"chat template rendering took longer than {self.max_seconds:g} s")

    def check_size(self, value: Any) -> None:
        if isinstance(value, (str, list, tuple, dict)) and len(value) > self.max_bytes:
            raise _BudgetExceeded(f"chat template built a value longer than {self.max_bytes} (the output limit)")

    def check_width(self, width: Any) -> None:
        if type(width) is int and width > self.max_bytes:
            raise _BudgetExceeded(f"chat template asked for a width of {width} (over the output limit)")


class _Namespace(jinja2.utils.Namespace):
    """transformers' TemplateNamespace (no underscore names), plus the render's time and size bounds."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - Jinja's signature trick: `self` may be a key
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _check_namespace_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_namespace_name(name)
        budget = _BUDGET.get()
        if budget is not None:
            budget.check_time()
            budget.check_size(value)
        jinja2.utils.Namespace.__setitem__(self, name, value)


def _check_namespace_name(name: Any) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(
            f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}. "
            "Please rename the attribute."
        )


class _TemplateDict:
    """transformers' `dict` global: builds dicts without exposing the dict type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` renders its body (transformers only tracks it for masks)."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


class _GuardedIterator:
    """Checks the render's deadline at every loop iteration (a loop may produce no output at all)."""

    __slots__ = ("_it", "_budget")

    def __init__(self, it: Iterator, budget: _Budget) -> None:
        self._it = it
        self._budget = budget

    def __iter__(self) -> _GuardedIterator:
        return self

    def __next__(self) -> Any:
        self._budget.check_time()
        return next(self._it)


# The active render's budget: context-local, set and reset around each render (None outside one).
_BUDGET: ContextVar[_Budget | None] = ContextVar("tokenbroker_chat_budget", default=None)


def _raise_exception(message: Any) -> NoReturn:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # transformers' tojson: no HTML escaping, and json.dumps' own options.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:  # noqa: A002 - the name templates call it with
    return datetime.now().strftime(format)


def _guard_iter(iterable: Any) -> Any:
    budget = _BUDGET.get()
    if budget is None:
        return iterable
    return _GuardedIterator(iter(iterable), budget)


class _ChatEnvironment(ImmutableSandboxedEnvironment):
    """transformers' chat template environment, with hooks that keep each render within its budget."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
        self.filters["tojson"] = _tojson
        self.filters["center"] = self._wrap_width_filter(self.filters["center"], "width", 1)
        self.filters["indent"] = self._wrap_width_filter(self.filters["indent"], "width", 1)
        self.filters["format"] = self._format_filter(self.filters["format"])
        self.globals["raise_exception"] = _raise_exception
        self.globals["strftime_now"] = _strftime_now
        self.globals["dict"] = _TemplateDict()
        self.globals["namespace"] = _Namespace
        self.tb_guard_iter = _guard_iter

    # The wrappers take the context so that Jinja never folds them into constants at compile time,
    # where no budget applies ('x' | center(10**9) would be built while compiling).
    @staticmethod
    def _wrap_width_filter(f: Any, name: str, position: int) -> Any:
        @jinja2.pass_context
        def wrapped(_context: Any, *args: Any, **kwargs: Any) -> Any:
            budget = _BUDGET.get()
            if budget is not None:
                budget.check_width(kwargs.get(name, args[position] if len(args) > position else None))
            return f(*args, **kwargs)
        return wrapped

    @staticmethod
    def _format_filter(f: Any) -> Any:
        @jinja2.pass_context
        def wrapped(_context: Any, value: Any, *args: Any, **kwargs: Any) -> Any:
            if _BUDGET.get() is not None and isinstance(value, str) and _WIDE_FORMAT.search(value):
                raise _BudgetExceeded("chat template used a format width of 8 or more digits")
            return f(value, *args, **kwargs)
        return wrapped

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        budget = _BUDGET.get()
        if budget is not None:
            budget.check_time()
            for a in args:
                budget.check_size(a)
            target = getattr(__obj, "__wrapped__", __obj)  # the sandbox wraps str.format
            owner = getattr(target, "__self__", None)
            if isinstance(owner, str):
                name = getattr(target, "__name__", "")
                if name in _PADDING_METHODS and args:
                    budget.check_width(args[0])
                elif name in ("format", "format_map") and _WIDE_FORMAT.search(owner):
                    raise _BudgetExceeded("chat template used a format width of 8 or more digits")
        return super().call(__context, __obj, *args, **kwargs)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        budget = _BUDGET.get()
        if budget is not None:
            budget.check_time()
            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if isinstance(seq, (str, list, tuple)) and type(n) is int and len(seq) * n > budget.max_bytes:
                        raise _BudgetExceeded("chat template repeated a value past the output limit")
            elif operator == "**" and type(left) is int and type(right) is int and right > 0 and abs(left) > 1:
                if right * abs(left).bit_length() > 8 * budget.max_bytes:
                    raise _BudgetExceeded("chat template raised a number to a power past the output limit")
            elif operator == "%" and isinstance(left, str) and _WIDE_FORMAT.search(left):
                raise _BudgetExceeded("chat template used a format width of 8 or more digits")
        result = super().call_binop(context, operator, left, right)
        if budget is not None:
            budget.check_size(result)
        return result

    def compile_template(self, source: str) -> jinja2.Template:
        """Parse, route every for-loop's iterable through the deadline guard, and compile."""
        ast = self.parse(source)
        for loop in ast.find_all(jinja2.nodes.For):
            loop.iter = jinja2.nodes.Call(
                jinja2.nodes.EnvironmentAttribute("tb_guard_iter"), [loop.iter], [], None, None
            ).set_lineno(loop.lineno)
        code = self.compile(ast)
        return self.template_class.from_code(self, code, self.make_globals(None), None)


# --- message preparation ----------------------------------------------------------------------------


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


def _prepare_messages(messages: Any) -> list[dict]:
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
        message = _plain({k: v for k, v in message.items() if v is not None}, f"messages[{i}]")
        role = message.get("role")
        if role is None:
            raise ProtocolError("bad_request", f"field 'messages[{i}].role' is missing")
        if not isinstance(role, str):
            raise ProtocolError("bad_request", f"field 'messages[{i}].role' must be a str, got {type_name(role)}")
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        chat.append(message)
    return chat


def _prepare_kwargs(extra: dict | None, named_specials: dict[str, str]) -> tuple[dict, list | None]:
    """Template variables: the special tokens, overridden by chat_template_kwargs; and the documents."""
    if extra is None:
        extra = {}
    if not isinstance(extra, dict):
        raise ProtocolError("bad_request", f"field 'chat_template_kwargs' must be a map, got {type_name(extra)}")
    kwargs = _plain(extra, "chat_template_kwargs")
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


def _prepare_tools(tools: Any) -> list | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ProtocolError("bad_request", f"field 'tools' must be a list, got {type_name(tools)}")
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise ProtocolError("bad_request", f"field 'tools[{i}]' must be a map (a JSON schema), got {type_name(tool)}")
    return _plain(tools, "tools")


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


class ChatRenderer:
    """Renders one model's chat templates; each template is compiled once, on first use, and kept."""

    def __init__(
        self,
        templates: ChatTemplates,
        named_specials: dict[str, str],
        *,
        max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES,
        max_seconds: float = DEFAULT_MAX_SECONDS,
    ) -> None:
        self.templates = templates
        self._specials = dict(named_specials)
        self._max_bytes = max_output_bytes
        self._max_seconds = max_seconds
        self._env = _ChatEnvironment()
        self._compiled: dict[str, jinja2.Template] = {}

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
        for name, flag in (("add_generation_prompt", add_generation_prompt),
                           ("continue_final_message", continue_final_message)):
            if type(flag) is not bool:
                raise ProtocolError("bad_request", f"field '{name}' must be a bool, got {type_name(flag)}")
        source = self.templates.select(tools)
        chat = _prepare_messages(messages)
        if continue_final_message and add_generation_prompt:
            raise ProtocolError(
                "bad_request",
                "continue_final_message and add_generation_prompt cannot both be true: continue the final "
                "message, or start a new assistant message",
            )
        tool_schemas = _prepare_tools(tools)
        kwargs, documents = _prepare_kwargs(extra, self._specials)
        final = _tag_final_message(chat, source) if continue_final_message else None
        template = self._compile(source)
        prompt = self._generate(template, {
            **kwargs, "messages": chat, "tools": tool_schemas, "documents": documents,
            "add_generation_prompt": add_generation_prompt,
        })
        return prompt if final is None else _cut_after_final_message(prompt, final)

    def _compile(self, source: str) -> jinja2.Template:
        compiled = self._compiled.get(source)
        if compiled is None:
            try:
                compiled = self._env.compile_template(source)
            except jinja2.TemplateSyntaxError as e:
                raise ProtocolError(
                    "template_error", f"chat template ({self.templates.source}) does not compile: line {e.lineno}: {e.message}"
                ) from e
            self._compiled[source] = compiled
        return compiled

    def _generate(self, template: jinja2.Template, variables: dict) -> str:
        budget = _Budget(time.monotonic() + self._max_seconds, self._max_seconds, self._max_bytes)
        token = _BUDGET.set(budget)
        chunks: list[str] = []
        size = 0
        try:
            for chunk in template.generate(**variables):
                size += len(chunk) if chunk.isascii() else len(chunk.encode("utf-8", "surrogatepass"))
                if size > self._max_bytes:
                    raise _BudgetExceeded(f"chat template output is longer than {self._max_bytes} bytes")
                budget.check_time()
                chunks.append(chunk)
        except _BudgetExceeded as e:
            raise ProtocolError("template_error", str(e)) from None
        except jinja2.TemplateError as e:
            raise ProtocolError("template_error", str(e) or type(e).__name__) from e
        except RecursionError as e:
            raise ProtocolError("template_error", "chat template recursed too deeply") from e
        except MemoryError as e:
            raise ProtocolError("template_error", "chat template ran out of memory") from e
        except Exception as e:  # a template's own bug (TypeError, KeyError, ...) is the template's error
            raise ProtocolError("template_error", f"chat template failed: {type(e).__name__}: {e}") from e
        finally:
            _BUDGET.reset(token)
        return "".join(chunks)
