"""Which templates MiniJinja may render in the worker's own process: those whose every value fuel bounds.

MiniJinja charges fuel for each instruction and, before or while building it, for most of a string's
size (about one unit per 32 bytes), so fuel bounds a render's time and the strings it builds. It does
not charge for everything. Measured on minijinja 3.1.0 (the worker process, fuel 1,000,000):

- container growth: `ns.l + ns.l` or `[ns.l, ns.l]` in a loop builds a list or a shared tree that
  doubles each time at no fuel; printing, `string` or `tojson` of it then walks 2**40 items in one
  instruction (over 20 s, with the GIL held, so the worker's round loop stops too);
- lazy repetition: `[s] * 10**6` costs nothing until `join` builds it (2 GB, 2.3 s);
- Python-style formatting: `'{:.999999999f}'.format(1.0)` allocates 1 GB before any charge (7.6 s).

So MiniJinja serves a template only when its syntax tree (parsed by Jinja, which the fallback uses
anyway) stays inside a subset where none of that can happen; anything else renders with jinja2 in
the render child, bounded there by construction (chat/process.py). The subset:

- in a loop or macro body, no list, tuple or map literal, `namespace(...)` or `dict(...)` holds more
  than one value that body assigns (nothing doubles), and `a + b` on such a value has a string on
  one side (strings fuel charges; a variable counts when every value it is given is one) or a
  number constant on one side: no list grows by copying itself;
- `*` only between number constants; no `**`;
- only the filters, methods and globals real chat templates use (the lists below), no `include`,
  `import`, `extends` or blocks.

Every shipped template is inside it. It refuses no template: it only says which engine renders it.

>>> gate_reason("{% for m in messages %}{{ m.content | trim }}{% endfor %}") is None
True
>>> gate_reason("{% set ns = namespace(l=[]) %}{% for m in messages %}{% set ns.l = ns.l + ns.l %}{% endfor %}")
"line 1: '+' that may add lists, on a value the loop or macro builds (each step copies it)"
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

import jinja2
import jinja2.nodes as n

# Filters fuel bounds (or that cannot grow a value), as MiniJinja implements them (plus our tojson).
ALLOWED_FILTERS = frozenset({
    "abs", "attr", "bool", "capitalize", "count", "d", "default", "dictsort", "e", "escape", "first", "float",
    "groupby", "indent", "int", "items", "join", "last", "length", "list", "lower", "map", "max", "min", "reject",
    "rejectattr", "replace", "reverse", "round", "safe", "select", "selectattr", "sort", "split", "string",
    "title", "tojson", "trim", "unique", "upper", "lines",
})
# Methods on values (MiniJinja's pycompat): the ones that make a value no larger than what it is called on.
ALLOWED_METHODS = frozenset({
    "strip", "lstrip", "rstrip", "split", "rsplit", "splitlines", "startswith", "endswith", "lower", "upper",
    "title", "capitalize", "replace", "count", "find", "rfind", "index", "isalnum", "isalpha", "isdigit",
    "isnumeric", "islower", "isupper", "isspace", "items", "keys", "values", "get", "removeprefix",
    "removesuffix", "cycle",
})
ALLOWED_GLOBALS_CALLED = frozenset({"raise_exception", "strftime_now", "namespace", "dict", "range", "loop",
                                    "caller", "super", "varargs", "kwargs"})
_BUILDERS = frozenset({"namespace", "dict"})
_REFUSED_NODES = (n.Include, n.Import, n.FromImport, n.Extends, n.Block, n.CallBlock, n.FilterBlock,
                  n.Scope, n.OverlayScope, n.EvalContextModifier, n.ScopedEvalContextModifier, n.Pow)


class _Refused(Exception):
    pass


def gate_reason(source: str) -> str | None:
    """None when MiniJinja may render `source` in process; else why not (one line, for the log)."""
    from .sandbox import ChatEnvironment

    try:
        tree = ChatEnvironment().parse(source)
    except jinja2.TemplateSyntaxError as e:
        return f"Jinja does not parse it either (line {e.lineno}: {e.message})"
    macros = {m.name for m in tree.find_all(n.Macro)}
    try:
        _check(tree, _Facts(macros, _string_variables(tree)), ())
    except _Refused as e:
        return str(e)
    return None


def _refuse(node: n.Node, why: str) -> _Refused:
    return _Refused(f"line {node.lineno}: {why}")


def _assigned(body: list[n.Node]) -> set[str]:
    """Names a loop or macro body assigns (`set x`, `set ns.x` as 'ns.x', nested loop targets too)."""
    out: set[str] = set()
    for stmt in body:
        for node in _walk(stmt):
            if not isinstance(node, (n.Assign, n.AssignBlock, n.For)):
                continue
            target = node.target
            for t in target.find_all((n.Name, n.NSRef)) if not isinstance(target, (n.Name, n.NSRef)) else [target]:
                out.add(_name_of(t))
    return out


def _name_of(node: n.Node) -> str:
    if isinstance(node, n.NSRef):
        return f"{node.name}.{node.attr}"
    if isinstance(node, n.Getattr) and isinstance(node.node, n.Name):
        return f"{node.node.name}.{node.attr}"
    return getattr(node, "name", "")


def _mentions(expr: n.Node, names: set[str]) -> bool:
    if not names:
        return False
    for node in _walk(expr):
        if isinstance(node, (n.Name, n.NSRef, n.Getattr)) and (_name_of(node) in names or
                                                              getattr(node, "name", None) in names):
            return True
    return False


def _walk(node: n.Node) -> Iterator[n.Node]:
    yield node
    for child in node.iter_child_nodes():
        yield from _walk(child)


_STRING_FILTERS = frozenset({"trim", "string", "tojson", "upper", "lower", "title", "capitalize", "replace", "join",
                             "indent", "escape", "e", "safe"})
_STRING_METHODS = frozenset({"strip", "lstrip", "rstrip", "lower", "upper", "title", "capitalize", "replace",
                             "removeprefix", "removesuffix"})


def _stringy(node: n.Node, strings: frozenset[str] = frozenset()) -> bool:
    """Whether `node` is a str whenever it is anything (`strings`: variables that always are): then `+`
    with it concatenates strings (which fuel charges) or fails (MiniJinja adds no str to a list)."""
    if isinstance(node, n.Const):
        return isinstance(node.value, str)
    if isinstance(node, n.Concat):
        return True
    if isinstance(node, (n.Name, n.NSRef, n.Getattr)) and _name_of(node) in strings:
        return True
    if isinstance(node, n.Add):
        return _stringy(node.left, strings) or _stringy(node.right, strings)
    if isinstance(node, n.Filter):
        return node.name in _STRING_FILTERS
    if isinstance(node, n.Call) and isinstance(node.node, n.Getattr):
        return node.node.attr in _STRING_METHODS
    if isinstance(node, n.CondExpr):
        return (_stringy(node.expr1, strings) and node.expr2 is not None and _stringy(node.expr2, strings))
    return False


def _string_variables(tree: n.Template) -> frozenset[str]:
    """Variables (`x`, `ns.x`) every value of which is a str, `namespace(x=...)` included: the greatest
    such set (a `set x = x + y` keeps x a str if x is one). Loop targets and unpacked names never are."""
    unknown: n.Node = n.Const(None)
    values: dict[str, list[n.Node]] = {}
    for node in _walk(tree):
        if isinstance(node, n.Assign) and isinstance(node.target, (n.Name, n.NSRef)):
            values.setdefault(_name_of(node.target), []).append(node.node)
            call = node.node
            if (isinstance(node.target, n.Name) and isinstance(call, n.Call) and isinstance(call.node, n.Name)
                    and call.node.name == "namespace"):
                for kw in call.kwargs:  # namespace(x=...) gives `ns.x` its first value
                    values.setdefault(f"{node.target.name}.{kw.key}", []).append(kw.value)
        elif isinstance(node, (n.Assign, n.For, n.AssignBlock)):
            block = isinstance(node, n.AssignBlock)  # {% set x %}...{% endset %} is a str
            for t in _walk(node.target):
                if isinstance(t, (n.Name, n.NSRef)):
                    values.setdefault(_name_of(t), []).append(n.Concat([]) if block else unknown)
    strings = frozenset(values)
    while True:
        kept = frozenset(k for k in strings if all(_stringy(v, strings) for v in values[k]))
        if kept == strings:
            return strings
        strings = kept


def _numeric_constant(node: n.Node) -> bool:
    return isinstance(node, n.Const) and type(node.value) in (int, float)


@dataclass(frozen=True)
class _Facts:
    macros: set[str]
    strings: frozenset[str]  # variables that are always a str (_string_variables)


def _growing(parts: Sequence[n.Node], names: set[str]) -> bool:
    """More than one of `parts` reads a value its loop or macro assigns: together they can double it."""
    return sum(1 for p in parts if _mentions(p, names)) > 1


def _check(node: n.Node, facts: _Facts, scopes: tuple[set[str], ...]) -> None:
    """Walk the tree; `scopes`: for each enclosing loop or macro, the names its body assigns."""
    if isinstance(node, _REFUSED_NODES):
        raise _refuse(node, f"{type(node).__name__} is outside the subset MiniJinja renders in process")
    if isinstance(node, (n.For, n.Macro)):
        body = list(node.body) + list(getattr(node, "else_", []))
        names = _assigned(body)
        if isinstance(node, n.Macro):
            names |= {a.name for a in node.args}
        inner = (*scopes, names)
        in_body = {id(b) for b in body}
        for child in node.iter_child_nodes():
            _check(child, facts, inner if id(child) in in_body or isinstance(node, n.Macro) else scopes)
        return
    here: set[str] = set().union(*scopes) if scopes else set()
    if isinstance(node, (n.List, n.Tuple)) and getattr(node, "ctx", "load") == "load" and _growing(node.items, here):
        raise _refuse(node, "a list or tuple of several values the loop or macro builds (it can double at no fuel)")
    if isinstance(node, n.Dict) and _growing([p.value for p in node.items], here):
        raise _refuse(node, "a map of several values the loop or macro builds (it can double at no fuel)")
    if isinstance(node, n.Mul) and not (isinstance(node.left, n.Const) and isinstance(node.right, n.Const)
                                        and all(type(x.value) in (int, float) for x in (node.left, node.right))):
        raise _refuse(node, "'*' on a value that is not a number constant (lazy repetition)")
    if (isinstance(node, n.Add) and not (_stringy(node.left, facts.strings) or _stringy(node.right, facts.strings))
            and not (_numeric_constant(node.left) or _numeric_constant(node.right))
            and (_mentions(node.left, here) or _mentions(node.right, here))):
        raise _refuse(node, "'+' that may add lists, on a value the loop or macro builds (each step copies it)")
    if isinstance(node, n.Filter) and node.name not in ALLOWED_FILTERS:
        raise _refuse(node, f"filter {node.name!r} is outside the subset MiniJinja renders in process")
    if isinstance(node, n.Call):
        target = node.node
        if isinstance(target, n.Getattr):
            if target.attr not in ALLOWED_METHODS:
                raise _refuse(node, f"method {target.attr!r} is outside the subset MiniJinja renders in process")
        elif isinstance(target, n.Name):
            if target.name not in ALLOWED_GLOBALS_CALLED and target.name not in facts.macros:
                raise _refuse(node, f"function {target.name!r} is outside the subset MiniJinja renders in process")
            if target.name in _BUILDERS and _growing([*node.args, *(k.value for k in node.kwargs)], here):
                raise _refuse(node, f"{target.name}(...) of several values the loop or macro builds (it can double at no fuel)")
        else:
            raise _refuse(node, "a call of a computed value")
        if node.dyn_args is not None or node.dyn_kwargs is not None:
            raise _refuse(node, "a call with *args or **kwargs")
    for child in node.iter_child_nodes():
        _check(child, facts, scopes)
