"""`AsyncClient`: one typed coroutine per op over the pipelined, failing-over engine in `_client_core`."""

from __future__ import annotations

from array import array
from typing import Any, Awaitable, Mapping, Sequence

import zmq

from . import _client_results as res
from ._client_core import DEFAULT_ENDPOINT, DEFAULT_LIVENESS_S, DEFAULT_TIMEOUT_S, Core, EndpointStatus
from ._client_errors import error_from_reply
from ._client_keys import SecretKey, ServerKey, curve_keys
from ._client_stream import AsyncDetokenizeStream

IdsIn = Sequence[int] | array | bytes


def _endpoints(endpoints: str | Sequence[str]) -> list[str]:
    return [endpoints] if isinstance(endpoints, str) else list(endpoints)


def _options(model: str | None, affinity: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {}
    if model is not None:
        body["model"] = model
    if affinity is not None:
        body["affinity"] = affinity
    return body


class AsyncClient:
    """Calls to one or more brokers from an asyncio program; any number may be in flight at once.

    >>> async with AsyncClient(["tcp://127.0.0.1:5555", "tcp://127.0.0.1:5556"]) as tb:  # doctest: +SKIP
    ...     (await tb.tokenize("Hello, world!")).tokens
    array('I', [19923, 14, 2058, 3])

    Use it from the event loop it first ran on. Each call takes keyword-only `timeout` (seconds,
    sent as `deadline_ms`; the client's `timeout` when None); calls to a broker that stops
    answering are re-sent to another, `overloaded` is retried with backoff, both within the
    deadline. Errors are `TokenbrokerError` subclasses carrying the protocol's code.
    """

    def __init__(self, endpoints: str | Sequence[str] = DEFAULT_ENDPOINT, *, timeout: float = DEFAULT_TIMEOUT_S,
                 model: str | None = None, ids: res.IdsFormat = "array", liveness_s: float = DEFAULT_LIVENESS_S,
                 curve_server_key: ServerKey | None = None, curve_secret_key: SecretKey | None = None,
                 context: zmq.Context[Any] | None = None) -> None:
        """`model`: the default for tokenize, detokenize, chat and streams (not `count`, whose model is
        the provider's); `ids`: "array" (array('I')) or "list"; `liveness_s`: how long a broker may stay
        silent while calls are outstanding before it is left; `curve_server_key`: the broker's public
        key (a `.key` file or z85 bytes) turns CURVE on; `curve_secret_key`: this client's
        `.key_secret` file or a (public, secret) z85 pair (a fresh pair when not given); `context`:
        the ZeroMQ context to open sockets in (a `zmq.asyncio.Context` does too; the shared
        `zmq.Context.instance()` when not given)."""
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        if ids not in ("array", "list"):
            raise ValueError(f"ids must be 'array' or 'list', got {ids!r}")
        self._core = Core(_endpoints(endpoints), context=context,
                          curve=curve_keys(curve_server_key, curve_secret_key), liveness_s=liveness_s)
        self._timeout = timeout
        self._model = model
        self._ids: res.IdsFormat = ids

    async def _ok(self, body: dict[str, Any], timeout: float | None, plain: bool = False) -> dict[str, Any]:
        """The reply map of an ok call; its error raised otherwise (one coroutine over the call's future).
        `plain`: the body holds exact str/bytes/int/bool values only (`Core.submit`)."""
        core = self._core
        call = core.submit(body, self._timeout if timeout is None else timeout, plain)
        try:
            reply = await call.future
        except BaseException:  # cancelled (or the client closed): the engine forgets the call now
            core.discard(call)
            raise
        if reply.get("ok") is not True:
            raise error_from_reply(reply)
        return reply

    def _model_of(self, model: str | None) -> str | None:
        return self._model if model is None else model

    async def tokenize(self, text: str, *, model: str | None = None, add_special_tokens: bool = True,
                       affinity: str | None = None, timeout: float | None = None, offsets: bool = False,
                       token_strs: bool = False, truncate: int | None = None, truncation_side: str = "left",
                       block_hashes: res.BlockHashSpec | None = None) -> res.Tokens:
        """The ids of one text.

        `offsets`, `token_strs`, `truncate` (keep at most this many ids, on `truncation_side`: "left"
        keeps the last) and `block_hashes` (vLLM's prefix-cache hashes: `BlockHashSpec`) add the
        reply's 1.2 fields (contract "tokenize and chat options").
        """
        body: dict[str, Any] = {"op": "tokenize", "text": text, "add_special_tokens": add_special_tokens,
                                "tokens_format": "u32"}
        # plain (msgspec packs it): the fields this method fills from exact str and bool values
        plain = type(text) is str and type(add_special_tokens) is bool
        model = self._model if model is None else model
        if model is not None:
            body["model"] = model
            plain = plain and type(model) is str
        if affinity is not None:
            body["affinity"] = affinity
            plain = plain and type(affinity) is str
        if offsets or token_strs or truncate is not None or block_hashes is not None:
            body.update(res.token_in(offsets, token_strs, truncate, truncation_side, block_hashes))
            plain = False
        return res.tokens(await self._ok(body, timeout, plain), self._ids)

    async def tokenize_batch(self, texts: Sequence[str], *, model: str | None = None, add_special_tokens: bool = True,
                             affinity: str | None = None, timeout: float | None = None, offsets: bool = False,
                             token_strs: bool = False, truncate: int | None = None, truncation_side: str = "left",
                             block_hashes: res.BlockHashSpec | None = None) -> res.TokensBatch:
        """The ids of several texts in one request (one job for routing and deadlines); options as `tokenize`."""
        body = {"op": "tokenize", "text": list(texts), "add_special_tokens": add_special_tokens,
                "tokens_format": "u32", **_options(self._model_of(model), affinity),
                **res.token_in(offsets, token_strs, truncate, truncation_side, block_hashes)}
        return res.tokens_batch(await self._ok(body, timeout), self._ids)

    async def detokenize(self, tokens: IdsIn, *, model: str | None = None, skip_special_tokens: bool = True,
                         timeout: float | None = None) -> res.Text:
        """The text of one sequence of ids (an array('I') travels as a u32 bin)."""
        body = {"op": "detokenize", "tokens": res.ids_to_wire(tokens), "skip_special_tokens": skip_special_tokens,
                **_options(self._model_of(model), None)}
        return res.text(await self._ok(body, timeout))

    async def detokenize_batch(self, batch: Sequence[IdsIn], *, model: str | None = None,
                               skip_special_tokens: bool = True, timeout: float | None = None) -> res.TextBatch:
        """The texts of several sequences in one request."""
        body = {"op": "detokenize", "tokens": [res.ids_to_wire(t) for t in batch],
                "skip_special_tokens": skip_special_tokens, **_options(self._model_of(model), None)}
        return res.text_batch(await self._ok(body, timeout))

    async def chat(self, messages: Sequence[Mapping[str, Any]], *, model: str | None = None,
                   tools: Sequence[Any] | None = None, add_generation_prompt: bool = True,
                   continue_final_message: bool = False, chat_template_kwargs: Mapping[str, Any] | None = None,
                   return_prompt: bool = False, affinity: str | None = None,
                   timeout: float | None = None, offsets: bool = False, token_strs: bool = False,
                   truncate: int | None = None, truncation_side: str = "left",
                   block_hashes: res.BlockHashSpec | None = None) -> res.ChatTokens:
        """A chat rendered with the model's template, then tokenized (as transformers does); options
        as `tokenize`, offsets in the rendered prompt."""
        body: dict[str, Any] = {"op": "chat", "messages": [dict(m) for m in messages],
                                "add_generation_prompt": add_generation_prompt,
                                "continue_final_message": continue_final_message,
                                "return_prompt": return_prompt, "tokens_format": "u32",
                                **_options(self._model_of(model), affinity),
                                **res.token_in(offsets, token_strs, truncate, truncation_side, block_hashes)}
        if tools is not None:
            body["tools"] = list(tools)
        if chat_template_kwargs:
            body["chat_template_kwargs"] = dict(chat_template_kwargs)
        return res.chat_tokens(await self._ok(body, timeout), self._ids)

    async def count(self, body: Mapping[str, Any] | str | bytes, *, model: str | None = None,
                    format: str | None = None, strict: bool = False, timeout: float | None = None) -> res.Count:
        """Tokens of a provider request body; `model` is the provider's name (else the body's own)."""
        request: dict[str, Any] = {"op": "count", "body": dict(body) if isinstance(body, Mapping) else body,
                                   "strict": strict}
        if model is not None:
            request["model"] = model
        if format is not None:
            request["format"] = format
        return res.count(await self._ok(request, timeout))

    async def models(self, *, timeout: float | None = None) -> list[res.ModelInfo]:
        """The broker's catalog."""
        return res.models(await self._ok({"op": "models"}, timeout))

    async def ping(self, *, timeout: float | None = None) -> res.Pong:
        """Answered by a broker itself: how many workers it has ready."""
        return res.pong(await self._ok({"op": "ping"}, timeout, True))

    async def add_model(self, name: str, source: str, *, aliases: Sequence[str] = (), chat_template: str | None = None,
                        timeout: float | None = None) -> res.ModelState:
        """Admin op (1.1): add a model to the catalog; it loads in the background (`models` shows how it went).

        `source` is any model form of `--model`; `chat_template` is the template's text, not a path.
        """
        if isinstance(aliases, (str, bytes)):  # a lone name would otherwise travel as its characters
            raise TypeError(f"aliases: give a list of names, got the {type(aliases).__name__} {aliases!r}")
        body: dict[str, Any] = {"op": "add_model", "name": name, "source": source, "aliases": list(aliases)}
        if chat_template is not None:
            body["chat_template"] = chat_template
        reply = await self._ok(body, timeout)
        return res.ModelState(name, reply["state"])

    async def remove_model(self, name: str, *, timeout: float | None = None) -> res.RemovedModel:
        """Admin op (1.1): drop a model from the catalog."""
        reply = await self._ok({"op": "remove_model", "name": name}, timeout)
        return res.RemovedModel(name, bool(reply["removed"]))

    def detokenize_stream(self, *, model: str | None = None, timeout: float | None = None) -> AsyncDetokenizeStream:
        """A helper that carries each open sequence's `state`: `open()` them, then `await step(...)`."""
        return AsyncDetokenizeStream(self._stream_body, model=self._model_of(model), timeout=timeout)

    async def request(self, op: str, fields: Mapping[str, Any] | None = None, *,
                      timeout: float | None = None) -> dict[str, Any]:
        """Any op with its raw fields; the reply map as it came, ok or not (failover and retries still apply)."""
        return await self._request_body({"op": op, **(fields or {})}, timeout)

    async def _request_body(self, body: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        """`request` for a whole body (its `id` and `deadline_ms` are the client's)."""
        return await self._core.call(dict(body), self._timeout if timeout is None else timeout)

    def _stream_body(self, body: dict[str, Any], timeout: float | None = None) -> Awaitable[dict[str, Any]]:
        """A stream step's request (a fresh body the helper built: bins, ints and str; plain when its
        model is an exact str): the core's call itself, no coroutine of its own."""
        model = body.get("model")
        return self._core.call(body, self._timeout if timeout is None else timeout,
                               "columns" in body and (model is None or type(model) is str))

    def status(self) -> list[EndpointStatus]:
        """Each broker as this client sees it: alive, calls outstanding, counters."""
        return self._core.status()

    def pending(self) -> int:
        """Calls not yet answered, expired or cancelled."""
        return self._core.pending()

    async def aclose(self) -> None:
        """Fail pending calls as `Unavailable` and close the sockets."""
        await self._core.aclose()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
