"""Typed stub of the compiled framer (_frames.pyx): see its docstring."""

from typing import Any

from ._calls import Call

def frames(calls_out: list[Call | None], payloads: list[bytes | None], pending: dict[int, Call], max_calls: int,
           max_bytes: int, now: float) -> list[bytes]: ...
def send(sock: Any, calls_out: list[Call | None], payloads: list[bytes | None], pending: dict[int, Call],
         max_calls: int, max_bytes: int, now: float) -> int: ...
