"""The sandbox chat templates render in: transformers' Jinja environment, bounded in time and output size.

Templates come from the Hub, so they are untrusted code. Besides Jinja's immutable sandbox, a render
is bounded in time and in output size, checked as chunks are generated, on every call and loop
iteration the template makes, and where a value can be blown up without output (`*`, `**`, `+`, `%`,
padding methods and filters, namespace attributes, macro arguments).

>>> env = ChatEnvironment()
>>> "".join(generate_bounded(env.compile_template("{{ 'ab' * 2 }}"), {}, max_seconds=1.0, max_bytes=16))
'abab'
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

_WIDE_FORMAT = re.compile(r"\d{8,}")  # a width or precision of 8+ digits in a format string
_PADDING_METHODS = frozenset({"center", "ljust", "rjust", "zfill", "expandtabs"})


class BudgetExceeded(Exception):
    """A render ran past its time or size bound."""


@dataclass(frozen=True)
class _Budget:
    deadline: float
    max_seconds: float
    max_bytes: int

    def check_time(self) -> None:
        if time.monotonic() > self.deadline:
            raise BudgetExceeded(f"chat template rendering took longer than {self.max_seconds:g} s")

    def check_size(self, value: Any) -> None:
        if isinstance(value, (str, list, tuple, dict)) and len(value) > self.max_bytes:
            raise BudgetExceeded(f"chat template built a value longer than {self.max_bytes} (the output limit)")

    def check_width(self, width: Any) -> None:
        if type(width) is int and width > self.max_bytes:
            raise BudgetExceeded(f"chat template asked for a width of {width} (over the output limit)")


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


class ChatEnvironment(ImmutableSandboxedEnvironment):
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
                raise BudgetExceeded("chat template used a format width of 8 or more digits")
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
                    raise BudgetExceeded("chat template used a format width of 8 or more digits")
        return super().call(__context, __obj, *args, **kwargs)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        budget = _BUDGET.get()
        if budget is not None:
            budget.check_time()
            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if isinstance(seq, (str, list, tuple)) and type(n) is int and len(seq) * n > budget.max_bytes:
                        raise BudgetExceeded("chat template repeated a value past the output limit")
            elif operator == "**" and type(left) is int and type(right) is int and right > 0 and abs(left) > 1:
                if right * abs(left).bit_length() > 8 * budget.max_bytes:
                    raise BudgetExceeded("chat template raised a number to a power past the output limit")
            elif operator == "%" and isinstance(left, str) and _WIDE_FORMAT.search(left):
                raise BudgetExceeded("chat template used a format width of 8 or more digits")
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


def generate_bounded(template: jinja2.Template, variables: dict, *, max_seconds: float, max_bytes: int) -> list[str]:
    """The chunks `template` renders from `variables`; BudgetExceeded past `max_seconds` or `max_bytes` (UTF-8)."""
    budget = _Budget(time.monotonic() + max_seconds, max_seconds, max_bytes)
    token = _BUDGET.set(budget)
    chunks: list[str] = []
    size = 0
    try:
        for chunk in template.generate(**variables):
            size += len(chunk) if chunk.isascii() else len(chunk.encode("utf-8", "surrogatepass"))
            if size > max_bytes:
                raise BudgetExceeded(f"chat template output is longer than {max_bytes} bytes")
            budget.check_time()
            chunks.append(chunk)
    finally:
        _BUDGET.reset(token)
    return chunks
