"""How much a `count` body asks for, measured before any of it is counted.

Harvesting a body costs per item: each message, part, image and tool definition is read, each
image's header decoded (up to images.IMAGE_HEADER_CHARS), each text encoded. The bytes of a request
are bounded by the broker's --max-request-bytes, but items are cheap to pack (an empty map is one
byte): a body of a million empty parts would be counted a million times over. So before a count
harvests anything, `body_items` walks the body once (iteratively, stopping as soon as it is over)
and a body holding more items than the worker's --max-batch-items is not harvested. With `strict` it
is answered `too_large`, as a tokenize batch of more texts would be. Without `strict` a count never
fails on its input (docs/protocol.md), so it gets the ladder's last rung instead: one token per two
characters of the body's strings (`body_chars`, one more walk of the same bound), method "estimate",
with a warning that names the limit.

>>> body_items({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}] * 3}]}, 100)
4
>>> body_items({"contents": [{"parts": [1, 2]}] * 10, "tools": [[0] * 50]}, 5)  # stops at the list that takes it over
51
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from tokenbroker.common.errors import ProtocolError


def _containers(value: Any) -> Iterator[dict | list]:
    """Every map and list inside `value`, each once, without recursion (a Python caller may share
    sub-objects; off the wire every node is its own)."""
    stack = [value]
    seen: set[int] = set()
    while stack:
        node = stack.pop()
        if (type(node) is not dict and type(node) is not list) or id(node) in seen:
            continue
        seen.add(id(node))
        yield node
        stack.extend(node.values() if type(node) is dict else node)


def body_items(value: Any, limit: int) -> int:
    """The elements of every list inside `value` (messages, parts, images, tools, ...), counted up
    to `limit + 1` at most: the walk stops there, so measuring costs no more than the limit."""
    items = 0
    for node in _containers(value):
        if type(node) is list:
            items += len(node)
            if items > limit:
                break
    return items


def body_chars(value: Any) -> int:
    """The code points of every str value inside `value` (map keys are the format's own names, not
    text a model reads): what the last rung estimates from."""
    if type(value) is str:
        return len(value)
    return sum(len(c) for node in _containers(value) for c in (node.values() if type(node) is dict else node)
               if type(c) is str)


def check_body_items(value: Any, limit: int) -> None:
    """ProtocolError too_large when `value` holds more than `limit` items (see the module's docstring)."""
    items = body_items(value, limit)
    if items > limit:
        raise ProtocolError("too_large", f"field 'body' holds more than {limit} messages, parts, images and other "
                            f"list items; this worker counts at most {limit} (--max-batch-items): split the body")
