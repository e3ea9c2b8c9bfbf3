"""The sandbox chat templates render in: transformers' Jinja environment, every value bounded in size and time.

Templates are hostile code (from the Hub, or from clients through `add_model`). Besides Jinja's
immutable sandbox, a render has a time budget and a size budget (the output limit), and every value
the template builds is charged against the size budget: before it is built where its size follows
from the operands (`s * n`, `a ~ b`, `a + b`, `join`, `replace`, `indent`, format widths and
precisions, `tojson`'s indent, padding widths), after it is built otherwise (every other filter
result, every method call result). The deadline is checked on every call, filter and loop iteration;
filters that are slow on big input (`sort`, `unique`, `dictsort`, `groupby`, `urlize`, `wordwrap`)
refuse inputs over a fixed cap. chat_process.py runs all of this in a child process with an
address-space limit and a kill timer, so what these checks miss is still bounded.

>>> env = ChatEnvironment()
>>> "".join(generate_bounded(env.compile_template("{{ 'ab' * 2 }}"), {}, max_seconds=1.0, max_bytes=16))
'abab'
"""

from __future__ import annotations

import json
import re
import string
import time
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Iterator, NoReturn

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
import jinja2.visitor
import jinja2.filters
from jinja2.filters import make_attrgetter
from jinja2.runtime import markup_join, str_join
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import _PassArg, generate_lorem_ipsum

_JINJA_JOIN = jinja2.filters.sync_do_join

_PADDING_METHODS = frozenset({"center", "ljust", "rjust", "zfill"})
# Filters whose cost grows faster than their input, or that are slow per character: fixed input caps.
_MAX_ITEMS = 100_000  # items a sorting filter orders, slices `slice` makes: Jinja's own cap on range()
_MAX_SLOW_TEXT_CHARS = 256 * 1024  # urlize and wordwrap run ~1 s per MiB in Python
_SORTING_FILTERS = frozenset({"sort", "unique", "dictsort", "groupby"})
_SLOW_TEXT_FILTERS = frozenset({"urlize", "wordwrap"})
# A %-format conversion: width and precision are its numbers (`*` takes them from the arguments).
_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\d*|\*)(?:\.(\d*|\*))?[hlL]?[a-zA-Z%]")
_NUMBER = re.compile(r"\d+")
_LINE_BREAKS = ("\n", "\r", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029")


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
        """After a value is built: its length (characters, items or keys) within the size budget."""
        if isinstance(value, (str, list, tuple, dict)) and len(value) > self.max_bytes:
            self.over(len(value), "a value")

    def check_predicted(self, size: int, what: str) -> None:
        """Before a value is built: its predicted size within the size budget."""
        if size > self.max_bytes:
            self.over(size, what)

    def check_width(self, width: Any) -> None:
        if type(width) is int and width > self.max_bytes:
            raise BudgetExceeded(
                f"chat template asked for a width of {width}, over its size budget of {self.max_bytes} (the output limit)"
            )

    def over(self, size: int, what: str) -> NoReturn:
        raise BudgetExceeded(
            f"chat template built {what} of {size} characters or more, "
            f"over its size budget of {self.max_bytes} (the output limit)"
        )


def text_size(value: Any, limit: int) -> int:
    """About how many characters `value` prints as: strings their length, containers the sum of their items.

    Shared references count each time (printing repeats them). Stops early once past `limit`.

    >>> text_size(["ab", {"c": 1}], 100)
    17
    """
    total = 0
    stack = [value]
    while stack and total <= limit:
        v = stack.pop()
        if isinstance(v, str):
            total += len(v)
        elif isinstance(v, (list, tuple)):
            total += 2 + 2 * len(v)
            stack.extend(v)
        elif isinstance(v, dict):
            total += 2 + 4 * len(v)
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, int) and not isinstance(v, bool):
            total += v.bit_length() * 30103 // 100000 + 2  # its decimal digits and sign
        elif isinstance(v, float):
            total += 24  # the longest repr of a float
        else:
            total += 8
    return total


def _depth(value: Any, limit: int) -> int:
    """How deeply containers nest in `value` (0 for a scalar); stops counting at `limit`."""
    depth, level = 0, [value]
    while depth < limit:
        containers = [v for v in level if isinstance(v, (list, tuple, dict))]
        if not containers:
            break
        depth += 1
        level = [x for v in containers for x in (v.values() if isinstance(v, dict) else v)]
    return depth


def _format_spec_size(fmt: str) -> int:
    """The least a str.format string produces: its literal text plus every field's width and precision."""
    try:
        parsed = list(string.Formatter().parse(fmt))
    except ValueError:  # str.format raises the same error itself
        return len(fmt)
    size = 0
    for literal, _field, spec, _conversion in parsed:
        size += len(literal)
        if spec:
            size += sum(int(n) for n in _NUMBER.findall(spec))
    return size


def _percent_spec_size(fmt: str) -> int:
    """The least a %-format string produces: its length plus every conversion's width and precision."""
    size = len(fmt)
    for width, precision in _PERCENT_SPEC.findall(fmt):
        size += (int(width) if width.isdigit() else 0) + (int(precision) if precision and precision.isdigit() else 0)
    return size


def _replace_size(s: str, old: str, new: str, count: Any) -> int:
    if len(new) <= len(old):
        return len(s)
    hits = s.count(old) if old else len(s) + 1
    if type(count) is int and count >= 0:
        hits = min(hits, count)
    return len(s) + hits * (len(new) - len(old))


def _line_count(s: str) -> int:
    return 1 + sum(s.count(b) for b in _LINE_BREAKS)


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
    """transformers' tojson (no HTML escaping, json.dumps' own options), built within the size budget.

    Small values take json.dumps' C path (the output is at most 8x the value's text size with the
    default separators); an indent, custom separators or a big value stream through the encoder
    and stop as soon as the output passes the budget.
    """
    budget = _BUDGET.get()
    if budget is None:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    if type(indent) is int or isinstance(indent, str):
        width = len(indent) if isinstance(indent, str) else max(indent, 0)
        budget.check_width(width)
        if width:  # the deepest line alone is indented depth x width
            budget.check_predicted(width * _depth(x, budget.max_bytes // width + 1), "a JSON indentation")
    if indent is None and separators is None and 8 * text_size(x, budget.max_bytes) + 64 <= budget.max_bytes:
        return json.dumps(x, ensure_ascii=ensure_ascii, sort_keys=sort_keys)
    encoder = json.JSONEncoder(ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    chunks: list[str] = []
    size = 0
    for chunk in encoder.iterencode(x):
        size += len(chunk)
        if size > budget.max_bytes:
            budget.over(size, "a JSON text (tojson)")
        chunks.append(chunk)
    return "".join(chunks)


def _strftime_now(format: str) -> str:  # noqa: A002 - the name templates call it with
    return datetime.now().strftime(format)


def _guard_iter(iterable: Any) -> Any:
    budget = _BUDGET.get()
    if budget is None:
        return iterable
    return _GuardedIterator(iter(iterable), budget)


def _bounded_parts(budget: _Budget, items: Any, separator: str, what: str) -> list:
    """`items` as a list, each non-str item as str (as a join makes it), charged before the join is built."""
    parts: list = []
    size = 0
    for i, item in enumerate(items):
        if i & 1023 == 1023:
            budget.check_time()
        if not isinstance(item, str) and not hasattr(item, "__html__"):
            budget.check_predicted(size + text_size(item, budget.max_bytes), what)
            item = str(item)
        size += len(item) + (len(separator) if parts else 0)
        if size > budget.max_bytes:
            budget.over(size, what)
        parts.append(item)
    return parts


@jinja2.pass_eval_context
def _join(eval_ctx: Any, value: Any, d: str = "", attribute: Any = None) -> str:
    """Jinja's join, charged against the size budget before the joined string is built."""
    budget = _BUDGET.get()
    if budget is not None:
        if attribute is not None:
            value, attribute = map(make_attrgetter(eval_ctx.environment, attribute), value), None
        value = _bounded_parts(budget, value, str(d), "a joined string (join)")
    return _JINJA_JOIN(eval_ctx, value, d, attribute)


@jinja2.pass_eval_context
def _concat(eval_ctx: Any, *parts: Any) -> str:
    """`a ~ b ~ ...`, charged against the size budget before the string is built (Jinja's own join after)."""
    budget = _BUDGET.get()
    if budget is not None:
        size = 0
        for p in parts:
            size += len(p) if isinstance(p, str) else text_size(p, budget.max_bytes)
            budget.check_predicted(size, "a concatenation (~)")
    return markup_join(parts) if eval_ctx.autoescape else str_join(parts)


def _arg(args: tuple, kwargs: dict, index: int, name: str, default: Any = None) -> Any:
    """A filter's argument, given by position or by name."""
    return args[index] if len(args) > index else kwargs.get(name, default)


def _check_filter(budget: _Budget, name: str, args: tuple, kwargs: dict) -> tuple:
    """The checks a filter's arguments get before it runs; returns the arguments (an iterator made a list)."""
    value = args[0] if args else None
    if name in _SORTING_FILTERS:
        if not hasattr(value, "__len__"):
            items = []
            for item in value:
                items.append(item)
                if len(items) > _MAX_ITEMS:
                    break
            value, args = items, (items, *args[1:])
        if len(value) > _MAX_ITEMS:
            raise BudgetExceeded(
                f"chat template asked `{name}` to order more than {_MAX_ITEMS} items (its item budget)")
    elif name in _SLOW_TEXT_FILTERS:
        n = len(value) if isinstance(value, str) else text_size(value, _MAX_SLOW_TEXT_CHARS)
        if n > _MAX_SLOW_TEXT_CHARS:
            raise BudgetExceeded(
                f"chat template gave `{name}` {n} characters or more, over its input budget of {_MAX_SLOW_TEXT_CHARS}")
    elif name == "replace":
        old, new = _arg(args, kwargs, 1, "old"), _arg(args, kwargs, 2, "new")
        if old is not None and new is not None:
            budget.check_predicted(_replace_size(str(value), str(old), str(new), _arg(args, kwargs, 3, "count")),
                                   "a replaced string (replace)")
    elif name == "center":
        budget.check_width(_arg(args, kwargs, 1, "width", 80))
    elif name == "indent":
        width = _arg(args, kwargs, 1, "width", 4)
        w = len(width) if isinstance(width, str) else width if type(width) is int else 0
        budget.check_width(w)
        if isinstance(value, str):
            budget.check_predicted(len(value) + max(w, 0) * _line_count(value), "an indented string (indent)")
    elif name == "format":
        if isinstance(value, str):
            budget.check_predicted(_percent_spec_size(value), "a formatted string (format)")
    elif name == "batch":
        count = _arg(args, kwargs, 1, "linecount")
        if _arg(args, kwargs, 2, "fill_with") is not None and type(count) is int:
            budget.check_predicted(count, "a batch")
    elif name == "slice":
        count = _arg(args, kwargs, 1, "slices")
        if type(count) is int and count > _MAX_ITEMS:
            raise BudgetExceeded(f"chat template asked `slice` for more than {_MAX_ITEMS} slices (its item budget)")
    elif name in ("string", "pprint"):
        budget.check_predicted(text_size(value, budget.max_bytes), f"a string ({name})")
    return args


def _guard_filter(name: str, f: Any) -> Any:
    """`f` with the deadline checked and its arguments and result charged against the size budget.

    The guard takes the context so that Jinja never folds a filter into a constant at compile time,
    where no budget applies ('x' | center(10**9) would be built while compiling).
    """
    pass_arg = _PassArg.from_obj(f)

    @jinja2.pass_context
    def guarded(context: Any, *args: Any, **kwargs: Any) -> Any:
        budget = _BUDGET.get()
        if budget is not None:
            budget.check_time()
            args = _check_filter(budget, name, args, kwargs)
        if pass_arg is _PassArg.context:
            result = f(context, *args, **kwargs)
        elif pass_arg is _PassArg.eval_context:
            result = f(context.eval_ctx, *args, **kwargs)
        elif pass_arg is _PassArg.environment:
            result = f(context.environment, *args, **kwargs)
        else:
            result = f(*args, **kwargs)
        if budget is not None:
            budget.check_size(result)
        return result

    guarded.__name__ = guarded.__qualname__ = f"guarded_{name}"
    return guarded


def _check_str_method(budget: _Budget, owner: str, name: str, args: tuple, kwargs: dict) -> tuple:
    """The checks a str method call gets before it runs; returns its arguments (join's iterable made a list)."""
    if name in _PADDING_METHODS and args:
        budget.check_width(args[0])
    elif name in ("format", "format_map"):
        budget.check_predicted(_format_spec_size(owner), f"a formatted string (str.{name})")
    elif name == "join" and args:
        args = (_bounded_parts(budget, args[0], owner, "a joined string (str.join)"), *args[1:])
    elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        count = args[2] if len(args) > 2 else kwargs.get("count", -1)
        budget.check_predicted(_replace_size(owner, args[0], args[1], count), "a replaced string (str.replace)")
    elif name == "expandtabs":
        tabsize = args[0] if args else kwargs.get("tabsize", 8)
        if type(tabsize) is int:
            budget.check_predicted(len(owner) + owner.count("\t") * max(tabsize, 0), "an expanded string (expandtabs)")
    return args


class ChatEnvironment(ImmutableSandboxedEnvironment):
    """transformers' chat template environment, with hooks that keep each render within its budget."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
        self.filters["tojson"] = _tojson
        self.filters["join"] = _join
        self.filters = {name: _guard_filter(name, f) for name, f in self.filters.items()}
        self.globals["raise_exception"] = _raise_exception
        self.globals["strftime_now"] = _strftime_now
        self.globals["dict"] = _TemplateDict()
        self.globals["namespace"] = _Namespace
        self.tb_guard_iter = _guard_iter
        self.tb_concat = _concat

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        budget = _BUDGET.get()
        if budget is not None:
            budget.check_time()
            for a in (*args, *kwargs.values()):
                budget.check_size(a)
            target = getattr(__obj, "__wrapped__", __obj)  # the sandbox wraps str.format
            owner = getattr(target, "__self__", None)
            if isinstance(owner, str):
                args = _check_str_method(budget, owner, getattr(target, "__name__", ""), args, kwargs)
            elif target is generate_lorem_ipsum:
                n, most = _arg(args, kwargs, 0, "n", 5), _arg(args, kwargs, 3, "max", 100)
                if type(n) is int and type(most) is int:
                    budget.check_predicted(n * max(most, 0) * 12, "lorem ipsum (lipsum)")
        result = super().call(__context, __obj, *args, **kwargs)
        if budget is not None:
            budget.check_size(result)
        return result

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        budget = _BUDGET.get()
        if budget is not None:
            budget.check_time()
            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if isinstance(seq, (str, list, tuple)) and type(n) is int and n > 1:
                        size = len(seq) if isinstance(seq, str) else text_size(seq, budget.max_bytes // n + 1)
                        budget.check_predicted(size * n, "a repeated value (*)")
            elif operator == "+":
                if isinstance(left, str) and isinstance(right, str):
                    budget.check_predicted(len(left) + len(right), "a concatenation (+)")
                elif isinstance(left, (list, tuple)) and isinstance(right, (list, tuple)):
                    size = text_size(left, budget.max_bytes)
                    budget.check_predicted(size + text_size(right, budget.max_bytes - size), "a concatenation (+)")
            elif operator == "**" and type(left) is int and type(right) is int and right > 0 and abs(left) > 1:
                if right * abs(left).bit_length() > 8 * budget.max_bytes:
                    budget.over(right * abs(left).bit_length() // 8, "a number (**)")
            elif operator == "%" and isinstance(left, str):
                budget.check_predicted(_percent_spec_size(left), "a formatted string (%)")
        result = super().call_binop(context, operator, left, right)
        if budget is not None:
            budget.check_size(result)
        return result

    def compile_template(self, source: str) -> jinja2.Template:
        """Parse, route loops through the deadline guard and `~` through the size check, and compile."""
        ast = _Rewrite().visit(self.parse(source))
        code = self.compile(ast)
        return self.template_class.from_code(self, code, self.make_globals(None), None)


class _Rewrite(jinja2.visitor.NodeTransformer):
    """Every for-loop's iterable through `tb_guard_iter`; every `a ~ b` through `tb_concat`."""

    def visit_For(self, node: jinja2.nodes.For) -> jinja2.nodes.Node:
        node = self.generic_visit(node)
        node.iter = _env_call("tb_guard_iter", [node.iter], node.lineno)
        return node

    def visit_Concat(self, node: jinja2.nodes.Concat) -> jinja2.nodes.Node:
        node = self.generic_visit(node)
        return _env_call("tb_concat", list(node.nodes), node.lineno)


def _env_call(name: str, args: list, lineno: int) -> jinja2.nodes.Call:
    return jinja2.nodes.Call(jinja2.nodes.EnvironmentAttribute(name), args, [], None, None).set_lineno(lineno)


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
                raise BudgetExceeded(f"chat template output is longer than {max_bytes} bytes (its output budget)")
            budget.check_time()
            chunks.append(chunk)
    finally:
        _BUDGET.reset(token)
    return chunks
