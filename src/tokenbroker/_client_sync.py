"""`Client`: the synchronous client, for a scheduler thread; the same engine on a private I/O thread.

Every socket lives on the client's own event-loop thread (an `AsyncClient` there), so a call from
the caller's thread is one hand-over each way, and a batch (`map`, `submit`) is pipelined exactly
as the async client pipelines it. It is meant for one thread at a time; since only the I/O thread
touches sockets, calls from several threads do not corrupt anything, but `close()` must not race them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Any, Awaitable, Callable, Coroutine, Iterable, Mapping, Sequence, TypeVar

from . import _client_results as res
from ._client_async import AsyncClient, IdsIn
from ._client_core import DEFAULT_ENDPOINT, DEFAULT_LIVENESS_S, DEFAULT_TIMEOUT_S, EndpointStatus
from ._client_keys import SecretKey, ServerKey
from ._client_stream import DetokenizeStream

T = TypeVar("T")
A = TypeVar("A")


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

    # --- one method per op ---------------------------------------------------------------

    def tokenize(self, text: str, *, model: str | None = None, add_special_tokens: bool = True,
                 affinity: str | None = None, timeout: float | None = None, offsets: bool = False,
                 token_strs: bool = False, truncate: int | None = None, truncation_side: str = "left",
                 block_hashes: res.BlockHashSpec | None = None) -> res.Tokens:
        return self._run(self.aio.tokenize(text, model=model, add_special_tokens=add_special_tokens,
                                           affinity=affinity, timeout=timeout, offsets=offsets, token_strs=token_strs,
                                           truncate=truncate, truncation_side=truncation_side, block_hashes=block_hashes))

    def tokenize_batch(self, texts: Sequence[str], *, model: str | None = None, add_special_tokens: bool = True,
                       affinity: str | None = None, timeout: float | None = None, offsets: bool = False,
                       token_strs: bool = False, truncate: int | None = None, truncation_side: str = "left",
                       block_hashes: res.BlockHashSpec | None = None) -> res.TokensBatch:
        return self._run(self.aio.tokenize_batch(texts, model=model, add_special_tokens=add_special_tokens,
                                                 affinity=affinity, timeout=timeout, offsets=offsets,
                                                 token_strs=token_strs, truncate=truncate,
                                                 truncation_side=truncation_side, block_hashes=block_hashes))

    def detokenize(self, tokens: IdsIn, *, model: str | None = None, skip_special_tokens: bool = True,
                   timeout: float | None = None) -> res.Text:
        return self._run(self.aio.detokenize(tokens, model=model, skip_special_tokens=skip_special_tokens,
                                             timeout=timeout))

    def detokenize_batch(self, batch: Sequence[IdsIn], *, model: str | None = None, skip_special_tokens: bool = True,
                         timeout: float | None = None) -> res.TextBatch:
        return self._run(self.aio.detokenize_batch(batch, model=model, skip_special_tokens=skip_special_tokens,
                                                   timeout=timeout))

    def chat(self, messages: Sequence[Mapping[str, Any]], *, model: str | None = None,
             tools: Sequence[Any] | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, chat_template_kwargs: Mapping[str, Any] | None = None,
             return_prompt: bool = False, affinity: str | None = None, timeout: float | None = None,
             offsets: bool = False, token_strs: bool = False, truncate: int | None = None,
             truncation_side: str = "left", block_hashes: res.BlockHashSpec | None = None) -> res.ChatTokens:
        return self._run(self.aio.chat(messages, model=model, tools=tools, add_generation_prompt=add_generation_prompt,
                                       continue_final_message=continue_final_message,
                                       chat_template_kwargs=chat_template_kwargs, return_prompt=return_prompt,
                                       affinity=affinity, timeout=timeout, offsets=offsets, token_strs=token_strs,
                                       truncate=truncate, truncation_side=truncation_side, block_hashes=block_hashes))

    def count(self, body: Mapping[str, Any] | str | bytes, *, model: str | None = None, format: str | None = None,
              strict: bool = False, timeout: float | None = None) -> res.Count:
        return self._run(self.aio.count(body, model=model, format=format, strict=strict, timeout=timeout))

    def models(self, *, timeout: float | None = None) -> list[res.ModelInfo]:
        return self._run(self.aio.models(timeout=timeout))

    def ping(self, *, timeout: float | None = None) -> res.Pong:
        return self._run(self.aio.ping(timeout=timeout))

    def add_model(self, name: str, source: str, *, aliases: Sequence[str] = (), chat_template: str | None = None,
                  timeout: float | None = None) -> res.ModelState:
        return self._run(self.aio.add_model(name, source, aliases=aliases, chat_template=chat_template,
                                            timeout=timeout))

    def remove_model(self, name: str, *, timeout: float | None = None) -> res.RemovedModel:
        return self._run(self.aio.remove_model(name, timeout=timeout))

    def detokenize_stream(self, *, model: str | None = None, timeout: float | None = None) -> DetokenizeStream:
        """A helper that carries each open sequence's `state`: `open()` them, then `step(...)`."""
        def call(body: dict, step_timeout: float | None) -> dict:
            return self._run(self.aio._request_body(body, step_timeout))

        return DetokenizeStream(call, model=self.aio._model_of(model), timeout=timeout)

    def request(self, op: str, fields: Mapping[str, Any] | None = None, *, timeout: float | None = None) -> dict:
        """Any op with its raw fields; the reply map as it came, ok or not."""
        return self._run(self.aio.request(op, fields, timeout=timeout))

    def status(self) -> list[EndpointStatus]:
        return self._loop_call(self.aio.status)

    def pending(self) -> int:
        return self._loop_call(self.aio.pending)

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
