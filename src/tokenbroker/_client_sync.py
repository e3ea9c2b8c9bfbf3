"""`Client`: the synchronous client, for a scheduler thread; the same engine, run by the caller.

A call runs in the calling thread, start to end: its `AsyncClient` coroutine (every op's code is
shared) is stepped by hand, and while it waits the engine's turns run right there
(`_client_blocking.Turns`: its sockets' descriptors polled, replies read and settled in compiled
code), with failover, deadlines and `overloaded` retries exactly as the async client has them. No
event loop, no I/O thread, no hand-off per call. A batch (`map`, the `*_many` methods) is pipelined
as the async client pipelines it. Threads sharing one `Client` take turns, a call at a time
(`Turns.lock`: ZeroMQ sockets are not thread-safe); `close()` must not race a call.
"""

from __future__ import annotations

import concurrent.futures
import functools
from typing import Any, Awaitable, Callable, Concatenate, Coroutine, Iterable, ParamSpec, Sequence, TypeVar

from . import _client_results as res
from ._client_async import AsyncClient
from ._client_blocking import BlockingCore
from ._client_core import DEFAULT_ENDPOINT, DEFAULT_LIVENESS_S, DEFAULT_TIMEOUT_S
from ._client_keys import SecretKey, ServerKey
from ._client_stream import DetokenizeStream

T = TypeVar("T")
A = TypeVar("A")
P = ParamSpec("P")


def _sync(method: Callable[Concatenate[AsyncClient, P], Awaitable[T]]) -> Callable[Concatenate["Client", P], T]:
    """`Client`'s twin of an `AsyncClient` coroutine method: the same parameters (type checkers see
    them through the ParamSpec, `inspect.signature` and `help` through `__wrapped__`), run to its
    result in the caller's thread."""
    @functools.wraps(method)
    def call(self: "Client", /, *args: P.args, **kwargs: P.kwargs) -> T:
        return self._run(method(self.aio, *args, **kwargs))  # type: ignore[arg-type]

    return call


def _plain(method: Callable[[AsyncClient], T]) -> Callable[["Client"], T]:
    """A plain `AsyncClient` method (the engine's state, read in the caller's thread)."""
    @functools.wraps(method)
    def call(self: "Client") -> T:
        return method(self.aio)

    return call


class _Aio(AsyncClient):
    """The `AsyncClient` under a `Client`: its engine runs on the caller's thread (`BlockingCore`)."""

    _engine = BlockingCore


class Client:
    """Calls to one or more brokers from ordinary (threaded) code.

    >>> with Client("tcp://127.0.0.1:5555") as tb:  # doctest: +SKIP
    ...     tb.tokenize("Hello, world!").tokens
    array('I', [19923, 14, 2058, 3])

    Options and methods are `AsyncClient`'s, without `await`; `map(fn, items)` and `submit(coro)`
    send many calls at once. `aio` is the `AsyncClient` underneath, to build those coroutines:
    `tb.map(tb.aio.tokenize, texts)`.
    """

    def __init__(self, endpoints: str | Sequence[str] = DEFAULT_ENDPOINT, *, timeout: float = DEFAULT_TIMEOUT_S,
                 model: str | None = None, ids: res.IdsFormat = "array", liveness_s: float = DEFAULT_LIVENESS_S,
                 curve_server_key: ServerKey | None = None, curve_secret_key: SecretKey | None = None) -> None:
        # Its sockets open on the first call.
        self.aio: AsyncClient = _Aio(endpoints, timeout=timeout, model=model, ids=ids, liveness_s=liveness_s,
                                     curve_server_key=curve_server_key, curve_secret_key=curve_secret_key)
        self._turns = self.aio._core.turns  # type: ignore[attr-defined]  # a BlockingCore's
        self._timeout = timeout
        self._closed = False

    # --- running coroutines in the caller's thread -----------------------------------------

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Start a call built from `aio` without waiting: `fut = tb.submit(tb.aio.tokenize(text))`.
        Its request leaves with the next wait of this client (this future's `result()`, or any call)."""
        if self._closed:
            coro.close()
            raise RuntimeError("the client is closed")
        return self._turns.start(coro)

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._closed:
            coro.close()
            raise RuntimeError("the client is closed")
        return self._turns.run(coro)

    def map(self, fn: Callable[[A], Awaitable[T]], items: Iterable[A], *, return_exceptions: bool = False) -> list[T]:
        """`fn(item)` for every item, all in flight at once, results in order: `tb.map(tb.aio.ping, ...)`.

        The first error is raised (the other calls still finish) unless `return_exceptions`, which
        puts each error in its place instead.
        """
        if self._closed:
            raise RuntimeError("the client is closed")
        outcomes = self._turns.run_all([fn(item) for item in items])
        if not return_exceptions:
            for ok, value in outcomes:
                if not ok:
                    raise value
        return [value for _, value in outcomes]

    # --- one method per op, made from AsyncClient's (signature, annotations and docs kept) ------

    tokenize = _sync(AsyncClient.tokenize)
    tokenize_batch = _sync(AsyncClient.tokenize_batch)
    tokenize_many = _sync(AsyncClient.tokenize_many)
    detokenize = _sync(AsyncClient.detokenize)
    detokenize_batch = _sync(AsyncClient.detokenize_batch)
    detokenize_many = _sync(AsyncClient.detokenize_many)
    chat = _sync(AsyncClient.chat)
    chat_many = _sync(AsyncClient.chat_many)
    count = _sync(AsyncClient.count)
    models = _sync(AsyncClient.models)
    ping = _sync(AsyncClient.ping)
    add_model = _sync(AsyncClient.add_model)
    remove_model = _sync(AsyncClient.remove_model)
    request = _sync(AsyncClient.request)
    status = _plain(AsyncClient.status)
    pending = _plain(AsyncClient.pending)

    def detokenize_stream(self, *, model: str | None = None, timeout: float | None = None) -> DetokenizeStream:
        """A helper that carries each open sequence's `state`: `open()` them, then `step(...)`."""
        def call(body: dict, step_timeout: float | None) -> dict:
            return self._run(self.aio._request_body(body, step_timeout))

        return DetokenizeStream(call, model=self.aio._model_of(model), timeout=timeout)

    def close(self) -> None:
        """Fail pending calls as `Unavailable`, close the sockets."""
        if self._closed:
            return
        self._run(self.aio.aclose())
        self._closed = True
        self._turns.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
