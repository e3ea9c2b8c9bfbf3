"""Typed stub of the compiled call registry (_calls.pyx): see its docstring."""

import asyncio
from typing import Any

KIND_RAW: int
KIND_TOKENS: int
KIND_TEXT: int
KIND_CHAT: int
KIND_TOKENS_LIST: int
KIND_CHAT_LIST: int

class Batch:
    future: asyncio.Future[Any]
    results: list[Any]
    left: int
    odd: int
    first: int
    def __init__(self, future: asyncio.Future[Any], n: int) -> None: ...
    def put(self, index: int, value: Any, odd: bool) -> None: ...

class Call:
    id: int
    head: bytes
    nkeys: int
    kind: int
    op: str
    future: asyncio.Future[Any]  # (None for a call of a batch: the batch's future settles it)
    batch: Batch | None
    index: int
    deadline: float
    timeout: float
    link: Any
    retry: asyncio.TimerHandle | None
    attempts: int
    def __init__(self, rid: int, head: bytes, nkeys: int, kind: int, op: str, future: asyncio.Future[Any] | None,
                 deadline: float, timeout: float, batch: Batch | None = None, index: int = 0) -> None: ...
    def done(self) -> bool: ...
    def payload(self, now: float) -> bytes: ...
    def settle(self, reply: Any) -> None: ...
    def fail(self, error: BaseException) -> None: ...

def configure(max_deadline_ms: int) -> None: ...
def submit_one(head: bytes, nkeys: int, kind: int, op: str, future: asyncio.Future[Any], rid: int, deadline: float,
               timeout: float, now: float, calls: dict[int, Call], link: Any, heap: list[tuple[float, int]],
               grace: float) -> Call: ...
def submit_batch(heads: list[bytes], nkeys: int, kind: int, op: str, batch: Batch, start: int, first_id: int,
                 deadline: float, timeout: float, now: float, calls: dict[int, Call], link: Any) -> int: ...
