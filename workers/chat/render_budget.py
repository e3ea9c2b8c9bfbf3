"""What a chat template render may spend: its budget, and the size every value will have before it is built.

A render has a deadline and a size budget (the output limit). chat/sandbox.py's hooks call these
checks: `check_predicted` before a value exists, from its operands (a repeat count times a length,
the widths in a format string, the number of replacements), `check_size` after it exists when its
size cannot be known in advance. Filters slow on big input get fixed input caps instead. Each error
says which budget was exceeded. (chat/process.py adds the hard bounds: memory and a kill timer.)

>>> b = Budget(deadline=float("inf"), max_seconds=1.0, max_bytes=10)
>>> b.check_predicted(_replace_size("aaaa", "a", "bcd", -1), "a replaced string")
Traceback (most recent call last):
...
tokenbroker.workers.chat.render_budget.BudgetExceeded: chat template built a replaced string of 12 characters or more, over its size budget of 10 (the output limit)
"""

from __future__ import annotations

import re
import string
import time
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Callable, NoReturn

_PADDING_METHODS = frozenset({"center", "ljust", "rjust", "zfill"})
# Filters whose cost grows faster than their input, or that are slow per character: fixed input caps.
_MAX_ITEMS = 100_000  # items a sorting filter orders, slices `slice` makes: Jinja's own cap on range()
_MAX_SLOW_TEXT_CHARS = 256 * 1024  # urlize and wordwrap run ~1 s per MiB in Python
# A %-format conversion: width and precision are its numbers (`*` takes them from the arguments).
_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\d*|\*)(?:\.(\d*|\*))?[hlL]?[a-zA-Z%]")
_NUMBER = re.compile(r"\d+")
_LINE_BREAKS = ("\n", "\r", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029")


class BudgetExceeded(Exception):
    """A render ran past one of its budgets; the message names it."""


@dataclass(frozen=True)
class Budget:
    """One render's limits: a deadline (monotonic) and a size budget (the output limit, in characters or bytes)."""

    deadline: float
    max_seconds: float
    max_bytes: int

    def check_time(self) -> None:
        if time.monotonic() > self.deadline:
            raise BudgetExceeded(f"chat template rendering took longer than {self.max_seconds:g} s (its time budget)")

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
                f"chat template asked for a width of {width}, "
                f"over its size budget of {self.max_bytes} (the output limit)"
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


def nesting_depth(value: Any, limit: int) -> int:
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


def percent_spec_size(fmt: str) -> int:
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


# The active render's budget: context-local, set and reset around each render (None outside one).
ACTIVE: ContextVar[Budget | None] = ContextVar("tokenbroker_chat_budget", default=None)


def bounded_parts(budget: Budget, items: Any, separator: str, what: str) -> list:
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


def arg(args: tuple, kwargs: dict, index: int, name: str, default: Any = None) -> Any:
    """A filter's argument, given by position or by name."""
    return args[index] if len(args) > index else kwargs.get(name, default)


def _sorting(name: str) -> Callable[[Budget, tuple, dict], tuple]:
    def check(budget: Budget, args: tuple, kwargs: dict) -> tuple:
        value = args[0]
        if not hasattr(value, "__len__"):  # an iterator: take one item past the cap, at most
            items = []
            for item in value:
                items.append(item)
                if len(items) > _MAX_ITEMS:
                    break
            value, args = items, (items, *args[1:])
        if len(value) > _MAX_ITEMS:
            raise BudgetExceeded(
                f"chat template asked `{name}` to order more than {_MAX_ITEMS} items (its item budget)")
        return args
    return check


def _slow_text(name: str) -> Callable[[Budget, tuple, dict], tuple]:
    def check(budget: Budget, args: tuple, kwargs: dict) -> tuple:
        value = args[0]
        n = len(value) if isinstance(value, str) else text_size(value, _MAX_SLOW_TEXT_CHARS)
        if n > _MAX_SLOW_TEXT_CHARS:
            raise BudgetExceeded(
                f"chat template gave `{name}` {n} characters or more, over its input budget of {_MAX_SLOW_TEXT_CHARS}")
        return args
    return check


def _replace(budget: Budget, args: tuple, kwargs: dict) -> tuple:
    old, new = arg(args, kwargs, 1, "old"), arg(args, kwargs, 2, "new")
    if old is not None and new is not None:
        size = _replace_size(str(args[0]), str(old), str(new), arg(args, kwargs, 3, "count"))
        budget.check_predicted(size, "a replaced string (replace)")
    return args


def _center(budget: Budget, args: tuple, kwargs: dict) -> tuple:
    budget.check_width(arg(args, kwargs, 1, "width", 80))
    return args


def _indent(budget: Budget, args: tuple, kwargs: dict) -> tuple:
    width = arg(args, kwargs, 1, "width", 4)
    w = len(width) if isinstance(width, str) else width if type(width) is int else 0
    budget.check_width(w)
    if isinstance(args[0], str):
        budget.check_predicted(len(args[0]) + max(w, 0) * _line_count(args[0]), "an indented string (indent)")
    return args


def _format(budget: Budget, args: tuple, kwargs: dict) -> tuple:
    if isinstance(args[0], str):
        budget.check_predicted(percent_spec_size(args[0]), "a formatted string (format)")
    return args


def _batch(budget: Budget, args: tuple, kwargs: dict) -> tuple:
    count = arg(args, kwargs, 1, "linecount")
    if arg(args, kwargs, 2, "fill_with") is not None and type(count) is int:
        budget.check_predicted(count, "a batch")
    return args


def _slice(budget: Budget, args: tuple, kwargs: dict) -> tuple:
    count = arg(args, kwargs, 1, "slices")
    if type(count) is int and count > _MAX_ITEMS:
        raise BudgetExceeded(f"chat template asked `slice` for more than {_MAX_ITEMS} slices (its item budget)")
    return args


def _to_string(name: str) -> Callable[[Budget, tuple, dict], tuple]:
    def check(budget: Budget, args: tuple, kwargs: dict) -> tuple:
        budget.check_predicted(text_size(args[0], budget.max_bytes), f"a string ({name})")
        return args
    return check


# The checks a filter's arguments get before it runs (by filter name); each returns the arguments,
# an iterator made a list where it had to be counted. Every other filter is checked after it runs.
FILTER_CHECKS: dict[str, Callable[[Budget, tuple, dict], tuple]] = {
    **{name: _sorting(name) for name in ("sort", "unique", "dictsort", "groupby")},
    **{name: _slow_text(name) for name in ("urlize", "wordwrap")},
    "replace": _replace, "center": _center, "indent": _indent, "format": _format, "batch": _batch,
    "slice": _slice, "string": _to_string("string"), "pprint": _to_string("pprint"),
}


def check_str_method(budget: Budget, owner: str, name: str, args: tuple, kwargs: dict) -> tuple:
    """The checks a str method call gets before it runs; returns its arguments (join's iterable made a list)."""
    if name in _PADDING_METHODS and args:
        budget.check_width(args[0])
    elif name in ("format", "format_map"):
        budget.check_predicted(_format_spec_size(owner), f"a formatted string (str.{name})")
    elif name == "join" and args:
        args = (bounded_parts(budget, args[0], owner, "a joined string (str.join)"), *args[1:])
    elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        count = args[2] if len(args) > 2 else kwargs.get("count", -1)
        budget.check_predicted(_replace_size(owner, args[0], args[1], count), "a replaced string (str.replace)")
    elif name == "expandtabs":
        tabsize = args[0] if args else kwargs.get("tabsize", 8)
        if type(tabsize) is int:
            budget.check_predicted(len(owner) + owner.count("\t") * max(tabsize, 0), "an expanded string (expandtabs)")
    return args
