"""Chat templates rendered by MiniJinja in the worker's own process, with transformers' Jinja options.

MiniJinja (PyPI `minijinja`, the Rust engine SMG and others render Hugging Face templates with)
renders the templates it serves 2-6x faster than jinja2 (docs/chat.md has the figures), and with no
round trip to a render child. It is set up as transformers sets up Jinja: `trim_blocks` and
`lstrip_blocks` on, no autoescape, `raise_exception` and `strftime_now` as globals, a `tojson` filter
with json.dumps' keyword arguments (HF's own, not MiniJinja's HTML-safe one), and pycompat methods
(`.strip()`, `.split()`, `.items()`, `.get()`, ...) for the Python-style calls templates make.

Bounds: chat/gate.py admits only templates in which fuel bounds every value; fuel (instructions, and
most of each string's size) grows with the input; the output is held to the render's output budget;
`tojson` charges its own size budget (chat/sandbox.py). The GIL stays held during a render, so fuel
is also what bounds how long the worker's other work waits behind one.

A render either gives the prompt, raises the template's own `raise_exception` message (the same text
jinja2 gives), or gives None: MiniJinja failed in any other way (fuel spent, an error whose message
differs from Jinja's), and the caller renders with jinja2 (chat/process.py), the reference, which
answers exactly as transformers does.

>>> engine = MiniEngine()
>>> engine.render(engine.add("{% for m in messages %}{{ m.content | trim }}{% endfor %}"),
...               {"messages": [{"content": " hi "}]}, fuel=10_000, max_bytes=100)
'hi'
"""

from __future__ import annotations

import threading
import time
from datetime import datetime
from typing import Any, NoReturn

import jinja2
import minijinja

from .render_budget import ACTIVE, Budget, BudgetExceeded
from .sandbox import _tojson

__all__ = ["MiniEngine", "TemplateRaised", "minijinja_parse_error", "shared_engine"]

_MAX_MESSAGE_CHARS = 64 * 1024  # as chat/process.py cuts the messages a template builds


class TemplateRaised(Exception):
    """A template's raise_exception(message): `message` is what jinja2 (and so transformers) says."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class _AskJinja2(Exception):
    """A value MiniJinja hands to Python that may have been undefined: only jinja2 knows what follows."""


def _raise_exception(message: Any = None) -> NoReturn:
    # transformers raises jinja2's TemplateError(message); the reply carries str() of it
    if message is None:  # none, or undefined (MiniJinja passes both as None), which jinja2 prints as ""
        raise _AskJinja2
    text = str(jinja2.exceptions.TemplateError(message)) or "TemplateError"
    raise TemplateRaised(text[:_MAX_MESSAGE_CHARS])


def _strftime_now(format: str) -> str:  # noqa: A002 - the name templates call it with
    return datetime.now().strftime(format)


def _hf_tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
    """transformers' tojson (json.dumps with its keyword arguments), within the render's size budget.

    None may be an undefined value (MiniJinja passes both as None): json.dumps raises on jinja2's
    Undefined, so jinja2 renders that chat (found by the hypothesis test: llama 3.2, a tool message
    without content)."""
    if value is None:
        raise _AskJinja2
    if isinstance(separators, list):  # a Jinja tuple arrives as a list; json.dumps unpacks either
        separators = tuple(separators)
    return _tojson(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _no_autoescape(name: str) -> bool:
    return False


def minijinja_parse_error(source: str) -> str | None:
    """None when MiniJinja parses `source`; else its first line of error (for the fallback's log line)."""
    try:
        minijinja.Environment(trim_blocks=True, lstrip_blocks=True).add_template("probe", source)
    except minijinja.TemplateError as e:
        return str(e).splitlines()[0]
    return None


class MiniEngine:
    """One MiniJinja environment with the HF options; templates compiled once, by number. Thread-safe."""

    def __init__(self) -> None:
        self._env = minijinja.Environment(
            trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=False, debug=False, pycompat=True,
            undefined_behavior="lenient", auto_escape_callback=_no_autoescape,
        )
        self._env.add_global("raise_exception", _raise_exception)
        self._env.add_global("strftime_now", _strftime_now)
        self._env.add_filter("tojson", _hf_tojson)
        self._lock = threading.Lock()
        self._numbers: dict[str, int] = {}

    def add(self, source: str) -> int:
        """Compile `source` (once); its number. minijinja.TemplateError when MiniJinja cannot parse it."""
        with self._lock:
            number = self._numbers.get(source)
            if number is None:
                number = len(self._numbers)
                self._env.add_template(f"t{number}", source)
                self._numbers[source] = number
            return number

    def render(self, number: int, variables: dict, *, fuel: int, max_bytes: int) -> str | None:
        """The prompt; TemplateRaised for the template's raise_exception; None for any other failure
        (the caller renders with jinja2, which says exactly what transformers says)."""
        budget = Budget(time.monotonic() + 60.0, 60.0, max_bytes)  # tojson's size budget; fuel bounds time
        with self._lock:
            self._env.fuel = fuel
            token = ACTIVE.set(budget)
            try:
                prompt = self._env.render_template(f"t{number}", **variables)
            except TemplateRaised:
                raise
            except (minijinja.TemplateError, BudgetExceeded, Exception):  # noqa: BLE001 - jinja2 decides
                return None
            finally:
                ACTIVE.reset(token)
        if len(prompt) > max_bytes // 4 and len(prompt.encode("utf-8", "surrogatepass")) > max_bytes:
            return None  # jinja2 renders it too, and names the output budget exactly as it always has
        return prompt


_shared: MiniEngine | None = None
_shared_lock = threading.Lock()


def shared_engine() -> MiniEngine:
    """The process's MiniJinja engine: every model's renderer shares it (and its compiled templates)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = MiniEngine()
        return _shared
