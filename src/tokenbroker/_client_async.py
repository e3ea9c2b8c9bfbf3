"""`AsyncClient`: one typed coroutine per op over the pipelined, failing-over engine in `_client_core`."""

from __future__ import annotations

from array import array
from typing import Any, Awaitable, Callable, Mapping, Sequence

import zmq

from . import _client_results as res
from . import _codec
from ._client_core import DEFAULT_ENDPOINT, DEFAULT_LIVENESS_S, DEFAULT_TIMEOUT_S, Core, EndpointStatus, head_of
from ._client_errors import error_from_reply
from ._client_keys import SecretKey, ServerKey, curve_keys
from ._client_stream import AsyncDetokenizeStream

IdsIn = Sequence[int] | array | bytes


def _endpoints(endpoints: str | Sequence[str]) -> list[str]:
    return [endpoints] if isinstance(endpoints, str) else list(endpoints)


def _heads(fields: dict[str, Any], varying: str, values: list[Any]) -> tuple[list[bytes], int]:
    """The packed fields of a batch's requests: `fields` with `varying` set to each value in turn
    (its place in the map is where `fields` holds it), compiled in one call."""
    keys = list(fields)
    at = keys.index(varying)
    before = {k: fields[k] for k in keys[:at]}
    after = {k: fields[k] for k in keys[at + 1:]}
    try:
        prefix = _codec.pack_entries(before) + _codec.pack(varying)
        return _codec.heads(prefix, values, _codec.pack_entries(after)), len(fields)
    except TypeError:  # a value the compiled packer does not take: each request packed on its own
        return [head_of({**before, varying: v, **after})[0] for v in values], len(fields)


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

    _engine: type[Core] = Core  # `Client`'s own is the same engine on the caller's thread (_client_blocking)

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
        self._core = self._engine(_endpoints(endpoints), context=context,
                          curve=curve_keys(curve_server_key, curve_secret_key), liveness_s=liveness_s)
        self._timeout = timeout
        self._model = model
        self._ids: res.IdsFormat = ids
        self._tokens_kind = _codec.KIND_TOKENS_LIST if ids == "list" else _codec.KIND_TOKENS  # replies read into Tokens

    async def _ok(self, body: dict[str, Any], timeout: float | None, kind: int = _codec.KIND_RAW) -> Any:
        """The result of an ok call (the reply map, or for `kind` its result read in compiled code);
        its error raised otherwise (one coroutine over the call's future)."""
        core = self._core
        call = core.submit(*head_of(body), kind, body["op"], self._timeout if timeout is None else timeout)
        try:
            reply = await call.future
        except BaseException:  # cancelled (or the client closed): the engine forgets the call now
            core.discard(call)
            raise
        if type(reply) is dict and reply.get("ok") is not True:
            raise error_from_reply(reply)
        return reply

    async def _many(self, heads: list[bytes], nkeys: int, kind: int, op: str, timeout: float | None,
                    convert: Callable[[dict], Any], result: type, return_exceptions: bool) -> list[Any]:
        """A batch of independent calls: their results in order; an error raised (the first in
        order, once every call has settled) or, with `return_exceptions`, left in its place."""
        if not heads:
            return []
        core = self._core
        batch = core.submit_batch(heads, nkeys, kind, op, self._timeout if timeout is None else timeout)
        try:
            await batch.future
        except BaseException:
            core.discard_batch(batch)
            raise
        core.settled_batch(batch)
        results = batch.results
        if batch.odd:
            first: BaseException | None = None
            for i, r in enumerate(results):
                if type(r) is result:
                    continue
                if type(r) is dict:
                    r = results[i] = convert(r) if r.get("ok") is True else error_from_reply(r)
                if isinstance(r, BaseException) and first is None:
                    first = r
            if first is not None and not return_exceptions:
                raise first
        return results

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
        model = self._model if model is None else model
        if offsets or token_strs or truncate is not None or block_hashes is not None:
            body = {"op": "tokenize", "text": text, "add_special_tokens": add_special_tokens, "tokens_format": "u32",
                    **_options(model, affinity), **res.token_in(offsets, token_strs, truncate, truncation_side, block_hashes)}
            return res.tokens(await self._ok(body, timeout), self._ids)
        try:
            head, nkeys = _codec.tokenize_head(text, add_special_tokens, model, affinity)
        except TypeError:  # a value the compiled packer does not take (a str subclass...)
            head, nkeys = head_of({"op": "tokenize", "text": text, "add_special_tokens": add_special_tokens,
                                   "tokens_format": "u32", **_options(model, affinity)})
        # The hot path: the call's own future awaited here, no coroutine in between.
        core = self._core
        call = core.submit(head, nkeys, self._tokens_kind, "tokenize", self._timeout if timeout is None else timeout)
        try:
            reply = await call.future
        except BaseException:  # cancelled (or the client closed): the engine forgets the call now
            core.discard(call)
            raise
        if type(reply) is res.Tokens:
            return reply
        if reply.get("ok") is not True:
            raise error_from_reply(reply)
        return res.tokens(reply, self._ids)

    async def tokenize_many(self, texts: Sequence[str], *, model: str | Sequence[str | None] | None = None,
                            add_special_tokens: bool = True,
                            affinity: str | None = None, timeout: float | None = None, offsets: bool = False,
                            token_strs: bool = False, truncate: int | None = None, truncation_side: str = "left",
                            block_hashes: res.BlockHashSpec | None = None,
                            return_exceptions: bool = False) -> list[res.Tokens]:
        """`tokenize` of each text, as independent requests: each is routed on its own (spread over
        the pool, its own cache and affinity), all sent at once (contract 1.2 arrays) and awaited
        as one. Results in the order given. Options as `tokenize`, for every text; `timeout` is
        the whole batch's deadline. An error is raised once every text has settled (the first in
        order), or with `return_exceptions` put in its text's place (a `TokenbrokerError`).
        `model` may be a list, one model per text (None: the client's default)."""
        options = res.token_in(offsets, token_strs, truncate, truncation_side, block_hashes)
        if model is None or isinstance(model, str):
            fields: dict[str, Any] = {"op": "tokenize", "text": "", "add_special_tokens": add_special_tokens,
                                      "tokens_format": "u32", **_options(self._model_of(model), affinity), **options}
            heads, nkeys = _heads(fields, "text", texts if type(texts) is list else list(texts))
        else:  # one model per text: `model` in every request, nil (the broker's default, as the contract says) for None
            models = [self._model_of(m) for m in model]
            if len(models) != len(texts):
                raise ValueError(f"model: give one per text ({len(texts)}), got {len(models)}")
            fields = {"op": "tokenize", "text": "", "add_special_tokens": add_special_tokens, "tokens_format": "u32",
                      "model": None, **_options(None, affinity), **options}
            heads = [head_of({**fields, "text": t, "model": m})[0] for t, m in zip(texts, models)]
            nkeys = len(fields)
        ids = self._ids
        return await self._many(heads, nkeys, _codec.KIND_RAW if options else self._tokens_kind, "tokenize", timeout,
                                lambda r: res.tokens(r, ids), res.Tokens, return_exceptions)

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
        reply = await self._ok(body, timeout, _codec.KIND_TEXT)
        return reply if type(reply) is res.Text else res.text(reply)

    async def detokenize_many(self, seqs: Sequence[IdsIn], *, model: str | None = None,
                              skip_special_tokens: bool = True, timeout: float | None = None,
                              return_exceptions: bool = False) -> list[res.Text]:
        """`detokenize` of each sequence, as independent requests sent at once (see `tokenize_many`)."""
        fields = {"op": "detokenize", "tokens": b"", "skip_special_tokens": skip_special_tokens,
                  **_options(self._model_of(model), None)}
        heads, nkeys = _heads(fields, "tokens", [res.ids_to_wire(t) for t in seqs])
        return await self._many(heads, nkeys, _codec.KIND_TEXT, "detokenize", timeout, res.text, res.Text,
                                return_exceptions)

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
        kind = (_codec.KIND_CHAT_LIST if self._ids == "list" else _codec.KIND_CHAT) if not (
            offsets or token_strs or truncate is not None or block_hashes is not None) else _codec.KIND_RAW
        reply = await self._ok(body, timeout, kind)
        return reply if type(reply) is res.ChatTokens else res.chat_tokens(reply, self._ids)

    async def chat_many(self, conversations: Sequence[Sequence[Mapping[str, Any]]], *, model: str | None = None,
                        tools: Sequence[Any] | None = None, add_generation_prompt: bool = True,
                        continue_final_message: bool = False, chat_template_kwargs: Mapping[str, Any] | None = None,
                        return_prompt: bool = False, affinity: str | None = None, timeout: float | None = None,
                        offsets: bool = False, token_strs: bool = False, truncate: int | None = None,
                        truncation_side: str = "left", block_hashes: res.BlockHashSpec | None = None,
                        return_exceptions: bool = False) -> list[res.ChatTokens]:
        """`chat` of each conversation (a list of messages), as independent requests sent at once
        (see `tokenize_many`); the other options apply to every conversation."""
        fields: dict[str, Any] = {"op": "chat", "messages": [], "add_generation_prompt": add_generation_prompt,
                                  "continue_final_message": continue_final_message,
                                  "return_prompt": return_prompt, "tokens_format": "u32",
                                  **_options(self._model_of(model), affinity)}
        options = res.token_in(offsets, token_strs, truncate, truncation_side, block_hashes)
        fields.update(options)
        if tools is not None:
            fields["tools"] = list(tools)
        if chat_template_kwargs:
            fields["chat_template_kwargs"] = dict(chat_template_kwargs)
        values = [c if type(c) is list else list(c) for c in conversations]
        heads, nkeys = _heads(fields, "messages", values)
        ids = self._ids
        kind = (_codec.KIND_CHAT_LIST if ids == "list" else _codec.KIND_CHAT) if not options else _codec.KIND_RAW
        return await self._many(heads, nkeys, kind, "chat", timeout, lambda r: res.chat_tokens(r, ids),
                                res.ChatTokens, return_exceptions)

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
        return res.pong(await self._ok({"op": "ping"}, timeout))

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
        """A stream step's request: the core's call itself, no coroutine of its own."""
        return self._core.call(body, self._timeout if timeout is None else timeout)

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
