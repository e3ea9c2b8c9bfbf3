"""The sandbox chat templates render in: transformers' Jinja environment, every value bounded in size and time.

Templates are hostile code (from the Hub, or from clients through `add_model`). Besides Jinja's
immutable sandbox, a render has a time budget and a size budget (the output limit), and every value
the template builds is charged against the size budget: before it is built where its size follows
from the operands (`s * n`, `a ~ b`, `a + b`, `join`, `replace`, `indent`, format widths and
precisions, `tojson`'s indent, padding widths), after it is built otherwise (every other filter
result, every method call result). The deadline is checked on every call, filter and loop iteration;
filters that are slow on big input (`sort`, `unique`, `dictsort`, `groupby`, `urlize`, `wordwrap`)
refuse inputs over a fixed cap. chat/process.py runs all of this in a child process with an
address-space limit and a kill timer, so what these checks miss is still bounded.

>>> env = ChatEnvironment()
>>> "".join(generate_bounded(env.compile_template("{{ 'ab' * 2 }}"), {}, max_seconds=1.0, max_bytes=16))
'abab'
"""

from __future__ import annotations

import json
import time
from datetime import datetime
from typing import Any, Iterator, NoReturn

import jinja2
import jinja2.compiler
import jinja2.ext
import jinja2.filters
import jinja2.nodes
import jinja2.utils
import jinja2.visitor
from jinja2.filters import make_attrgetter
from jinja2.runtime import markup_join, str_join
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import _PassArg, generate_lorem_ipsum

from .render_budget import (
    ACTIVE,
    FILTER_CHECKS,
    Budget,
    BudgetExceeded,
    arg,
    bounded_parts,
    check_str_method,
    nesting_depth,
    percent_spec_size,
    text_size,
)

__all__ = ["BudgetExceeded", "ChatEnvironment", "generate_bounded"]

_JINJA_JOIN = jinja2.filters.sync_do_join


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
        budget = ACTIVE.get()
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

    def __init__(self, it: Iterator, budget: Budget) -> None:
        self._it = it
        self._budget = budget

    def __iter__(self) -> _GuardedIterator:
        return self

    def __next__(self) -> Any:
        self._budget.check_time()
        return next(self._it)


def _raise_exception(message: Any) -> NoReturn:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    """transformers' tojson (no HTML escaping, json.dumps' own options), built within the size budget.

    Small values take json.dumps' C path (the output is at most 12x the value's text size with the
    default separators); an indent, custom separators or a big value stream through the encoder
    and stop as soon as the output passes the budget.
    """
    budget = ACTIVE.get()
    if budget is None:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    if type(indent) is int or isinstance(indent, str):
        width = len(indent) if isinstance(indent, str) else max(indent, 0)
        budget.check_width(width)
        if width:  # the deepest line alone is indented depth x width
            budget.check_predicted(width * nesting_depth(x, budget.max_bytes // width + 1), "a JSON indentation")
    if indent is None and separators is None and 12 * text_size(x, budget.max_bytes) + 64 <= budget.max_bytes:
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
    budget = ACTIVE.get()
    if budget is None:
        return iterable
    return _GuardedIterator(iter(iterable), budget)


@jinja2.pass_eval_context
def _join(eval_ctx: Any, value: Any, d: str = "", attribute: Any = None) -> str:
    """Jinja's join, charged against the size budget before the joined string is built."""
    budget = ACTIVE.get()
    if budget is not None:
        if attribute is not None:
            value, attribute = map(make_attrgetter(eval_ctx.environment, attribute), value), None
        value = bounded_parts(budget, value, str(d), "a joined string (join)")
    return _JINJA_JOIN(eval_ctx, value, d, attribute)


def _concat(eval_ctx: Any, parts: tuple) -> str:
    """`a ~ b ~ ...`, charged against the size budget before the string is built (Jinja's own join after)."""
    budget = ACTIVE.get()
    if budget is not None:
        size = 0
        for p in parts:
            size += len(p) if isinstance(p, str) else text_size(p, budget.max_bytes)
            budget.check_predicted(size, "a concatenation (~)")
    return markup_join(parts) if eval_ctx.autoescape else str_join(parts)


class _CodeGenerator(jinja2.compiler.CodeGenerator):
    """Jinja's code generator, except that `a ~ b` calls the environment's size-checked concat.

    Generated directly (not as a template-level call) so that the sandbox's call hook, which every
    `~` would otherwise pass through, costs nothing on the request path.
    """

    @jinja2.compiler.optimizeconst
    def visit_Concat(self, node: jinja2.nodes.Concat, frame: jinja2.compiler.Frame) -> None:
        self.write("environment.tb_concat(context.eval_ctx, (")
        for part in node.nodes:
            self.visit(part, frame)
            self.write(", ")
        self.write("))")


def _guard_filter(name: str, f: Any) -> Any:
    """`f` with the deadline checked and its arguments and result charged against the size budget.

    The guard takes the context so that Jinja never folds a filter into a constant at compile time,
    where no budget applies ('x' | center(10**9) would be built while compiling).
    """
    pass_arg = _PassArg.from_obj(f)
    check = FILTER_CHECKS.get(name)
    if pass_arg is _PassArg.context:
        call = f
    elif pass_arg is _PassArg.eval_context:
        def call(context: Any, *args: Any, **kwargs: Any) -> Any:
            return f(context.eval_ctx, *args, **kwargs)
    elif pass_arg is _PassArg.environment:
        def call(context: Any, *args: Any, **kwargs: Any) -> Any:
            return f(context.environment, *args, **kwargs)
    else:
        def call(context: Any, *args: Any, **kwargs: Any) -> Any:
            return f(*args, **kwargs)

    @jinja2.pass_context
    def guarded(context: Any, *args: Any, **kwargs: Any) -> Any:
        budget = ACTIVE.get()
        if budget is None:
            return call(context, *args, **kwargs)
        if time.monotonic() > budget.deadline:
            budget.check_time()
        if check is not None and args:
            args = check(budget, args, kwargs)
        result = call(context, *args, **kwargs)
        budget.check_size(result)
        return result

    guarded.__name__ = guarded.__qualname__ = f"guarded_{name}"
    return guarded


class ChatEnvironment(ImmutableSandboxedEnvironment):
    """transformers' chat template environment, with hooks that keep each render within its budget."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})
    code_generator_class = _CodeGenerator

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
        budget = ACTIVE.get()
        if budget is None:
            return super().call(__context, __obj, *args, **kwargs)
        if time.monotonic() > budget.deadline:
            budget.check_time()
        target = getattr(__obj, "__wrapped__", __obj)  # the sandbox wraps str.format
        owner = getattr(target, "__self__", None)
        if isinstance(owner, str):
            args = check_str_method(budget, owner, getattr(target, "__name__", ""), args, kwargs)
        elif target is generate_lorem_ipsum:
            n, most = arg(args, kwargs, 0, "n", 5), arg(args, kwargs, 3, "max", 100)
            if type(n) is int and type(most) is int:
                budget.check_predicted(n * max(most, 0) * 12, "lorem ipsum (lipsum)")
        result = super().call(__context, __obj, *args, **kwargs)
        budget.check_size(result)
        return result

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        budget = ACTIVE.get()
        if budget is None:
            return super().call_binop(context, operator, left, right)
        if time.monotonic() > budget.deadline:
            budget.check_time()
        if operator == "+":
            if type(left) is str and type(right) is str:  # the common case, kept short: it is on the request path
                if len(left) + len(right) > budget.max_bytes:
                    budget.over(len(left) + len(right), "a concatenation (+)")
                return left + right
            if type(left) is int and type(right) is int:
                return left + right
            if isinstance(left, (list, tuple)) and isinstance(right, (list, tuple)):
                size = text_size(left, budget.max_bytes)
                budget.check_predicted(size + text_size(right, budget.max_bytes - size), "a concatenation (+)")
        elif operator == "*":
            if type(left) is int and type(right) is int:
                bits = left.bit_length() + right.bit_length()
                if bits > 8 * budget.max_bytes:
                    budget.over(bits // 8, "a number (*)")
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and type(n) is int and n > 1:
                    size = len(seq) if isinstance(seq, str) else text_size(seq, budget.max_bytes // n + 1)
                    budget.check_predicted(size * n, "a repeated value (*)")
        elif operator == "**" and type(left) is int and type(right) is int and right > 0 and abs(left) > 1:
            if right * abs(left).bit_length() > 8 * budget.max_bytes:
                budget.over(right * abs(left).bit_length() // 8, "a number (**)")
        elif operator == "%" and isinstance(left, str):
            budget.check_predicted(percent_spec_size(left), "a formatted string (%)")
        result = super().call_binop(context, operator, left, right)
        budget.check_size(result)
        return result

    def compile_template(self, source: str) -> jinja2.Template:
        """Parse, route every for-loop's iterable through the deadline guard, and compile."""
        ast = _Rewrite().visit(self.parse(source))
        code = self.compile(ast)
        return self.template_class.from_code(self, code, self.make_globals(None), None)


class _Rewrite(jinja2.visitor.NodeTransformer):
    """Every for-loop's iterable through `tb_guard_iter` (a loop may produce no output at all)."""

    def visit_For(self, node: jinja2.nodes.For) -> jinja2.nodes.Node:
        self.generic_visit(node)  # rewrites the children in place and returns `node`
        node.iter = _env_call("tb_guard_iter", [node.iter], node.lineno)
        return node


def _env_call(name: str, args: list, lineno: int) -> jinja2.nodes.Call:
    call = jinja2.nodes.Call(jinja2.nodes.EnvironmentAttribute(name), args, [], None, None)
    call.set_lineno(lineno)
    return call


def generate_bounded(template: jinja2.Template, variables: dict, *, max_seconds: float, max_bytes: int) -> list[str]:
    """The chunks `template` renders from `variables`; BudgetExceeded past `max_seconds` or `max_bytes` (UTF-8)."""
    budget = Budget(time.monotonic() + max_seconds, max_seconds, max_bytes)
    token = ACTIVE.set(budget)
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
        ACTIVE.reset(token)
    return chunks
