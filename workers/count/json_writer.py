"""What one count carries through a body: its warnings (Notes) and a bounded JSON writer (Walk).

Objects in a body (`arguments` given as objects, `input`, `args`, `response`, schemas) are read by the
model as compact JSON. Walk writes them iteratively (a body nested 100,000 deep is no RecursionError)
under a node budget (bounded work even for a Python object that shares sub-objects) and says in its
Notes what it could not write.

>>> walk = Walk(Notes())
>>> walk.to_json({"a": [1, "x", None]}), walk.to_json({"b": b"bin"}), walk.notes.sentences()
('{"a":[1,"x",null]}', '{"b":null}', ['Binary values inside objects are not counted as text.'])
"""

from __future__ import annotations

import json
import json.encoder
from collections.abc import Iterable
from typing import Any

MAX_JSON_NODES = 250_000  # values written without the C encoder per request (deep or shared objects); beyond it they are cut, with a warning


class Notes:
    """Warnings as sentences, each said once, in the order first said."""

    def __init__(self) -> None:
        self._seen: dict[str, None] = {}

    def add(self, sentence: str) -> None:
        self._seen.setdefault(sentence, None)

    def sentences(self) -> list[str]:
        return list(self._seen)


class Walk:
    """What one count shares while harvesting: its notes and the node budget of JSON serialisation."""

    def __init__(self, notes: Notes, budget: int = MAX_JSON_NODES) -> None:
        self.notes = notes
        self.budget = budget

    def to_json(self, value: Any) -> str:
        """Compact JSON of `value` as a model would read it; bin values become null.

        A plain tree of modest depth (every body that came off the wire) goes through the C encoder;
        a deep one or one that shares sub-objects (only a Python caller can build those) is written
        without recursion under the node budget, so neither can raise RecursionError or run unbounded.
        """
        if _plain_tree(value):
            return json.dumps(value, ensure_ascii=False, separators=(",", ":"), skipkeys=True, default=self._binary)
        return self._to_json_iterative(value)

    def _binary(self, value: Any) -> None:
        self.notes.add("Binary values inside objects are not counted as text.")
        return None

    def _to_json_iterative(self, value: Any) -> str:
        out: list[str] = []
        stack: list[Any] = [_Value(value)]  # a str on the stack is output; a _Value is still to write
        while stack:
            item = stack.pop()
            if type(item) is str:
                out.append(item)
                continue
            if self.budget <= 0:
                self.notes.add("The body is too large to serialise fully: parts of its objects were not counted.")
                break
            self.budget -= 1
            v = item.value
            if isinstance(v, dict):
                entries = [(k, x) for k, x in v.items() if isinstance(k, (str, int, float))]
                stack.append("}")
                for i in range(len(entries) - 1, -1, -1):
                    k, x = entries[i]
                    stack.append(_Value(x))
                    stack.append(("," if i else "") + _json_key(k) + ":")
                out.append("{")
            elif isinstance(v, (list, tuple)):
                stack.append("]")
                for i in range(len(v) - 1, -1, -1):
                    stack.append(_Value(v[i]))
                    if i:
                        stack.append(",")
                out.append("[")
            elif isinstance(v, str):
                out.append(_encode_str(v))
            elif isinstance(v, (bytes, bytearray)):
                out.append("null")
                self._binary(v)
            elif v is None or isinstance(v, (int, float)):
                out.append(json.dumps(v))
            else:
                out.append(_encode_str(str(v)))
        return "".join(out)


_encode_str = json.encoder.encode_basestring  # the C encoder json.dumps(ensure_ascii=False) uses


def _json_key(key: str | int | float) -> str:
    """A key as json.dumps writes it: non-str keys become strings of their JSON text."""
    return _encode_str(key if isinstance(key, str) else json.dumps(key))


class _Value:
    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


PLAIN_DEPTH = 200  # deeper objects are written without the C encoder's recursion


def _plain_tree(value: Any) -> bool:
    """True when `value` nests less than PLAIN_DEPTH deep, has only str keys and no container appears twice."""
    if not isinstance(value, (dict, list, tuple)):
        return True
    seen: set[int] = set()
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        v, depth = stack.pop()
        if depth >= PLAIN_DEPTH or id(v) in seen:
            return False
        seen.add(id(v))
        if isinstance(v, dict):
            if any(type(k) is not str for k in v):
                return False
            children: Iterable[Any] = v.values()
        else:
            children = v
        for child in children:
            if isinstance(child, (dict, list, tuple)):
                stack.append((child, depth + 1))
    return True
