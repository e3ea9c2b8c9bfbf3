"""`Client`: the synchronous client, for a scheduler thread; the same engine on a private I/O thread.

Every socket lives on the client's own event-loop thread (an `AsyncClient` there), so a call from
the caller's thread is one hand-over each way, and a batch (`map`, `submit`) is pipelined exactly
as the async client pipelines it. It is meant for one thread at a time; since only the I/O thread
touches sockets, calls from several threads do not corrupt anything, but `close()` must not race them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import threading
from typing import Any, Awaitable, Callable, Concatenate, Coroutine, Iterable, ParamSpec, Sequence, TypeVar

from . import _client_results as res
from ._client_async import AsyncClient
from ._client_core import DEFAULT_ENDPOINT, DEFAULT_LIVENESS_S, DEFAULT_TIMEOUT_S
from ._client_keys import SecretKey, ServerKey
from ._client_stream import DetokenizeStream

T = TypeVar("T")
A = TypeVar("A")
P = ParamSpec("P")


def _sync(method: Callable[Concatenate[AsyncClient, P], Awaitable[T]]) -> Callable[Concatenate["Client", P], T]:
    """`Client`'s twin of an `AsyncClient` coroutine method: the same parameters (type checkers see
    them through the ParamSpec, `inspect.signature` and `help` through `__wrapped__`), run on the
    I/O thread. The coroutine is built in the caller's thread, so a wrong argument raises there."""
    @functools.wraps(method)
    def call(self: "Client", /, *args: P.args, **kwargs: P.kwargs) -> T:
        return self._run(method(self.aio, *args, **kwargs))  # type: ignore[arg-type]

    return call


def _on_loop(method: Callable[[AsyncClient], T]) -> Callable[["Client"], T]:
    """A plain `AsyncClient` method read on the I/O thread (the engine's state is that thread's)."""
    @functools.wraps(method)
    def call(self: "Client") -> T:
        return self._loop_call(functools.partial(method, self.aio))

    return call


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
        # Built here, so option errors raise in the caller's thread; its sockets open on first use, on the I/O thread.
        self.aio = AsyncClient(endpoints, timeout=timeout, model=model, ids=ids, liveness_s=liveness_s,
                               curve_server_key=curve_server_key, curve_secret_key=curve_secret_key)
        self._timeout = timeout
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tokenbroker-client", daemon=True)
        self._thread.start()
        self._closed = False

    # --- running coroutines on the I/O thread --------------------------------------------

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Start a call built from `aio` without waiting: `fut = tb.submit(tb.aio.tokenize(text))`."""
        if self._closed:
            coro.close()
            raise RuntimeError("the client is closed")
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        future = self.submit(coro)
        try:
            return future.result()
        except BaseException:  # KeyboardInterrupt in the caller: cancel the call rather than leave it pending
            future.cancel()
            raise

    def map(self, fn: Callable[[A], Awaitable[T]], items: Iterable[A], *, return_exceptions: bool = False) -> list[T]:
        """`fn(item)` for every item, all in flight at once, results in order: `tb.map(tb.aio.ping, ...)`.

        The first error is raised (the other calls still finish) unless `return_exceptions`, which
        puts each error in its place instead.
        """
        async def gather() -> list[Any]:
            return list(await asyncio.gather(*(fn(item) for item in items), return_exceptions=return_exceptions))

        return self._run(gather())

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
    status = _on_loop(AsyncClient.status)
    pending = _on_loop(AsyncClient.pending)

    def detokenize_stream(self, *, model: str | None = None, timeout: float | None = None) -> DetokenizeStream:
        """A helper that carries each open sequence's `state`: `open()` them, then `step(...)`."""
        def call(body: dict, step_timeout: float | None) -> dict:
            return self._run(self.aio._request_body(body, step_timeout))

        return DetokenizeStream(call, model=self.aio._model_of(model), timeout=timeout)

    def _loop_call(self, fn: Callable[[], T]) -> T:
        async def run() -> T:
            return fn()

        return self._run(run())

    def close(self) -> None:
        """Fail pending calls as `Unavailable`, close the sockets, stop the I/O thread."""
        if self._closed:
            return
        self._run(self.aio.aclose())
        self._closed = True
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
