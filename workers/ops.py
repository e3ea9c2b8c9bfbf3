"""The ops a worker serves: validate the op's own fields, run it through the caches, build the reply.

The broker has already checked the envelope and the common fields; a worker checks them again
where it reads them (it may be reached by a future broker version), and every check names its field.
"""

from __future__ import annotations

import codecs
import logging
import sys
import time
from array import array
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, cast

import msgpack

from tokenbroker.common.errors import ProtocolError
from tokenbroker.common.protocol import (
    NIL,
    SKIPPED,
    Request,
    error_reply,
    logged_id,
    ok_reply,
    opt,
    parse_request,
    raw_id,
    req,
    seek_key,
    type_name,
)

from ._core import pack_tokens, read_plain
from .budget import ITEM_OVERHEAD, ReplyBudget
from .cache import OFF, CacheOutcome, u32_list
from .background import Done, Lane
from .count import count_request
from .count_lane import Stop, count_at_head, engine_encoder, uncollected, wants_lane
from .registry import Model, ModelRegistry
from .tokenin import CHAIN_MEMO_BYTES, Extras, Served, Tokenin, asks_extras, parse_extras
from .tokenizers import InvalidTokenId, ids_to_u32, le_array

log = logging.getLogger(__name__)

_LITTLE = sys.byteorder == "little"


def u32_array(data: bytes, field: str) -> array:
    """The ids of a u32 bin, 4 bytes each (a list of ints would take 36): what budgets are charged from."""
    if len(data) % 4:
        raise ProtocolError("invalid_input", f"field '{field}': a u32 bin must be a multiple of 4 bytes long, got {len(data)}")
    return le_array("I", data)


def _u64s(data: bytes) -> array:
    """The little-endian u64s of an engine's `ends` buffer (workers/tokenizers.py `encode_flat`)."""
    return le_array("Q", data)


def _tokens_out(ids: list[int], fmt: str) -> Any:
    return ids_to_u32(ids) if fmt == "u32" else ids


@dataclass(slots=True)
class PendingJob:
    """A job as the worker received it: the broker's id, the time left, the client's payload."""

    job_id: int
    budget_ms: int
    received: float  # time.monotonic() when it arrived
    payload: bytes | memoryview  # a view of ZeroMQ's frame when large (main.LARGE_FRAME): never copied on the round loop

    def deadline(self) -> float | None:
        """When nobody waits for its reply any more (time.monotonic()); None without a budget."""
        return self.received + self.budget_ms / 1000 if self.budget_ms else None


BATCH_STEP = 256  # a long batch is encoded this many texts at a time (and stops past its deadline)


@dataclass(slots=True)
class _Plain:
    """A plain tokenize as `read_plain` read it (or `_as_plain` from a parsed large payload), with the
    model it names: what the plain path serves (`Ops._encode`, `Ops._packed`)."""

    job: PendingJob
    model: Model
    name: str | None
    text: str | list[str]
    u32: bool
    add_special: bool
    rid: bytes  # the id's MessagePack bytes, as they came

    def texts(self) -> list[str]:
        return [self.text] if type(self.text) is str else cast("list[str]", self.text)


OFFLOAD_BYTES = 64 * 1024  # a tokenize payload longer than this is read, encoded and answered on the encode lane (~10 ms of work)
PLAIN_READ_BYTES = 1 << 20  # the compiled reader decodes a lane's payload up to this size in one call (at most ~1 ms with the GIL)


@dataclass(slots=True)
class ChatJob:
    """A chat between its fields and its reply: the model, its render (a call that blocks), what to return."""

    model: Model
    render: Callable[[], str]  # jinja2, in the render child: may wait up to the render's time budget
    return_prompt: bool
    extras: Extras | None = None  # (1.2) offsets, token strings, truncation, block hashes of the prompt
    here: Callable[[], str | None] = lambda: None  # MiniJinja, bounded by fuel; None: `render` renders it


def _plain_request(name: str | None, text: str | list[str], u32: bool, add_special: bool, rid: bytes) -> Request:
    """The Request a plain tokenize read by `read_plain` stands for, built only when the general path
    must serve it (the compiled path never needs one)."""
    return Request("tokenize", name, None, None, "u32" if u32 else "list",
                   {"text": text, "add_special_tokens": add_special}, rid)


class Ops:
    """Dispatch by op name; one method per op, each returning the reply's op fields."""

    def __init__(self, registry: ModelRegistry, worker_name: str) -> None:
        self.registry = registry
        self.worker_name = worker_name
        self.limits = registry.limits
        self.deadline = float("inf")  # of the job being served (time.monotonic()); batches stop past it
        self.payload_bytes = 0  # of the job being served: what detokenize_stream's free reply bound reads
        self._cache_tails: dict[str, tuple[bytes, bytes, bytes]] = {}  # `_cache_tail`'s parts, by l0
        caches = registry.cache_config
        self.tokenin = Tokenin(CHAIN_MEMO_BYTES if caches.l0_enabled or caches.l1_enabled else 0)
        # Set by the worker: jinja2 chat renders, and long texts encode, off its round loop (workers/background.py);
        # MiniJinja renders in the round, bounded by fuel (workers/chat/mini.py).
        self.renders: Lane | None = None
        self.encodes: Lane | None = None

    def run(self, jobs: list[PendingJob]) -> list[tuple[int, str, bytes]]:
        """Serve a batch: (job id, outcome, reply) per job, in order. One job's failure is its own.
        With lanes set, a chat job only starts its render here, and a plain tokenize of a long text
        its encode: `finish_deferred` answers them.

        A plain tokenize (one text or a batch of them) has one path: read by the compiled reader
        (workers/_core.pyx `read_plain`: no dict, no parse of the common fields in Python), encoded
        by `_encode` (through the model's caches, or its engine's batch call, which releases the GIL),
        its reply written by `_packed` straight from the engine's u32 buffer. In a worker, the
        compiled round (workers/_round.pyx) has served the plain tokenizes of cache-less models
        before this is called, a round's worth in one engine call each; what it hands back comes
        here. The rest are parsed and served one by one, by `_serve`, which gives the same replies
        byte for byte (tests check). `run` is Python's one entry point: the worker calls it, and so
        do the tests.
        """
        out: list[tuple[int, str, bytes] | None] = [None] * len(jobs)
        models: dict[str | None, Model | None] = {}  # this round's plain-path model per name
        now = time.monotonic()
        for i, job in enumerate(jobs):
            if job.budget_ms and (now - job.received) * 1000 > job.budget_ms:
                out[i] = (job.job_id, SKIPPED, b"")  # the broker answers `timeout` (now or already)
                continue
            if self.encodes is not None and len(job.payload) > OFFLOAD_BYTES:
                span = text_span(job.payload)  # a long `text` (a tokenize): not even parsed here
                if span is not None:
                    self.encodes.submit((job, self._finish_large), partial(self._large, job, span), job.deadline())
                    continue
                if count_at_head(job.payload):  # a long count: read and counted on the lane (workers/count_lane.py)
                    self._defer_count(job, None)
                    continue
            if type(job.payload) is not bytes:  # a large frame the worker took without copying
                job.payload = bytes(job.payload)
            plain = self._read_plain(job, job.payload, models)
            out[i] = self._general(job) if plain is None else self._tokenize(plain)
        return [r for r in out if r is not None]  # deferred jobs are answered by finish_deferred

    def _general(self, job: PendingJob) -> tuple[int, str, bytes] | None:
        """A job the compiled path does not serve: parsed in Python and served by its op (a chat
        may only start its render, and a large count goes to the encode lane: None)."""
        try:
            request = parse_request(cast(bytes, job.payload))
        except ProtocolError as e:
            reply, code = self._error(raw_id(cast(bytes, job.payload)), e)
            return job.job_id, code, reply
        if request.op == "chat" and self.renders is not None:
            return self._defer_chat(job, request)
        if request.op == "count" and self.encodes is not None and wants_lane(request.payload, len(job.payload), self.registry):
            self._defer_count(job, request)
            return None
        reply, outcome = self._serve(request, len(job.payload), deadline=job.deadline())
        return job.job_id, outcome, reply

    def _known_model(self, name: str | None) -> Model | None:
        """The model requests naming `name` are served by, or None (the general way says why not)."""
        try:
            return self.registry.resolve(name)
        except ProtocolError:
            return None

    # --- the plain tokenize: one path ---------------------------------------------------

    @property
    def alone(self) -> int:
        """A batch of more texts than this is never in the compiled round's shared engine call
        (workers/_round.pyx): `_tokenize` encodes it on its own, in steps, with its deadline."""
        return min(BATCH_STEP, self.limits.max_batch_items)

    def plain_engine(self, name: str | None) -> tuple[Callable[..., tuple[bytes, bytes]], bytes] | None:
        """How the worker's compiled round (workers/_round.pyx) serves plain tokenizes naming `name`,
        one engine call for a round's worth: (the engine's batch call, the reply's `cache` and
        `worker` tail, as `_packed` writes them), for a model held here with its caches off; else
        None (`run` serves them)."""
        model = self._known_model(name)
        if model is None or model.cache.enabled:
            return None
        return model.tokenizer.encode_flat, self._cache_tail("off" if not self.registry.l0_enabled else "miss", 0)

    def _read_plain(self, job: PendingJob, payload: bytes, models: dict[str | None, Model | None] | None = None) -> _Plain | None:
        """The job (its `payload`) as a plain tokenize of a model this worker holds, or None (the
        general way serves it, and names any fault). `models`: a round's memo of names resolved."""
        fields = read_plain(payload)
        if fields is None:
            return None
        text, name, u32, add_special, rid = fields
        if models is None:
            model = self._known_model(name)
        else:
            model = models[name] if name in models else models.setdefault(name, self._known_model(name))
        return None if model is None else _Plain(job, model, name, text, u32, add_special, rid)

    def _as_plain(self, job: PendingJob, request: Request) -> _Plain | None:
        """A parsed request (a large payload read on a lane, `read_large`) as a plain tokenize of one
        text, or None when it is anything else."""
        p = request.payload
        if request.op != "tokenize" or type(p.get("text")) is not str or type(p.get("add_special_tokens", True)) not in (bool, type(None)):
            return None
        model = None if asks_extras(p) else self._known_model(request.model)
        if model is None:
            return None
        return _Plain(job, model, request.model, p["text"], request.tokens_format == "u32",
                      p.get("add_special_tokens") is not False, request.raw_id)

    def _tokenize(self, plain: _Plain) -> tuple[int, str, bytes]:
        """A plain tokenize encoded on its own: with its deadline checked between steps of a long
        batch, and the encode stopped once the reply's free bound passes --max-reply-bytes."""
        try:
            texts = plain.texts()
            if type(plain.text) is not str:
                self._batch_items(texts, "text")
            flat, ends, outcomes = self._encode(plain.model, texts, plain.add_special, plain.job.deadline(),
                                                self.limits.max_reply_bytes, 4 if plain.u32 else 5)
        except Exception as e:  # noqa: BLE001 - what op_tokenize's encode raises, answered as _serve does
            reply, code = self._error(plain.rid, e)
            return plain.job.job_id, code, reply
        return self._reply(plain, flat, ends, 0, outcomes)

    def _encode(self, model: Model, texts: list[str], add_special: bool, deadline: float | None, limit: int | None,
                per_id: int) -> tuple[bytes, bytes, list[CacheOutcome] | None]:
        """The texts' ids: (one little-endian u32 buffer of them all, where each text's end in it as
        little-endian u64s, each text's cache outcome or None when the model has no caches).

        Through the model's caches text by text, or its engine's batch call BATCH_STEP texts at a
        time (one call, the engine's own buffers, for up to BATCH_STEP texts). ProtocolError timeout once
        `deadline` has passed between two steps. With `limit`, it stops early, returning the texts
        encoded so far, once the reply's free bound (`per_id` bytes an id and ITEM_OVERHEAD a text,
        what workers/budget.py charges first) passes it: that reply is built the general way."""
        cached = model.cache.enabled
        if not cached and len(texts) <= BATCH_STEP:
            flat, offsets = model.tokenizer.encode_flat(texts, add_special_tokens=add_special)
            return flat, offsets, None
        parts: list[bytes] = []
        ends = array("Q", [0])
        outcomes: list[CacheOutcome] = []
        loose = 0
        for at in range(0, len(texts), BATCH_STEP):
            if at and deadline is not None and time.monotonic() > deadline:
                raise ProtocolError("timeout", f"the deadline passed after {at} items of the batch")
            if cached:
                for t in texts[at:at + BATCH_STEP]:
                    packed, got = model.cache.encode_u32(t, add_special)
                    parts.append(packed)
                    outcomes.append(got)
                    ends.append(ends[-1] + (len(packed) >> 2))
                    loose += per_id * (len(packed) >> 2) + ITEM_OVERHEAD
                    if limit is not None and loose > limit:
                        break
            else:
                flat, offsets = model.tokenizer.encode_flat(texts[at:at + BATCH_STEP], add_special_tokens=add_special)
                step = _u64s(offsets)
                base = ends[-1]
                ends.extend([base + e for e in step[1:]])
                parts.append(flat)
                loose += per_id * (len(flat) >> 2) + ITEM_OVERHEAD * (len(step) - 1)
            if limit is not None and loose > limit:
                break
        if not _LITTLE:  # pragma: no cover
            ends.byteswap()
        return parts[0] if len(parts) == 1 else b"".join(parts), ends.tobytes(), outcomes if cached else None

    def _packed(self, plain: _Plain, flat: bytes, ends: bytes, first: int, outcomes: list[CacheOutcome] | None) -> bytes | None:
        """The reply of a plain tokenize whose texts are `first`.. of `_encode`'s buffers, written by
        `pack_tokens` (workers/_core.pyx) with the request's `cache` map; None when the reply budget
        might refuse it (or `_encode` stopped short of its texts): then it is built the general way."""
        batch = type(plain.text) is not str
        n = len(plain.text) if batch else 1
        if len(ends) // 8 - 1 < first + n:
            return None
        hits = reused = 0
        if outcomes is not None:
            for got in outcomes[first:first + n]:
                hits += got.l0 == "hit"
                reused += got.l1_reused_tokens
        l0 = "off" if not self.registry.l0_enabled else "hit" if n and hits == n else "miss"
        return pack_tokens(flat, ends, first, n, batch, plain.u32, plain.rid, self._cache_tail(l0, reused),
                           self.limits.max_reply_bytes)

    def _reply(self, plain: _Plain, flat: bytes, ends: bytes, first: int,
               outcomes: list[CacheOutcome] | None) -> tuple[int, str, bytes]:
        """(job id, outcome, reply) of a plain tokenize from `_encode`'s buffers: `_packed`, or, when
        the reply budget might refuse it, `op_tokenize`'s reply from the texts encoded so far (none
        twice), byte for byte what `_serve` gives."""
        job = plain.job
        built = self._packed(plain, flat, ends, first, outcomes)
        if built is not None:
            return job.job_id, "ok", built
        bounds = _u64s(ends)
        n = len(plain.text) if type(plain.text) is not str else 1
        done = [(flat[4 * bounds[k]:4 * bounds[k + 1]], OFF if outcomes is None else outcomes[k])
                for k in range(first, min(first + n, len(bounds) - 1))]
        fmt = "u32" if plain.u32 else "list"
        reply, outcome = self._serve(_plain_request(plain.name, plain.text, plain.u32, plain.add_special, plain.rid),
                                     len(job.payload), deadline=job.deadline(),
                                     fields=partial(self._tokenize_plain, plain.model, plain.text, plain.add_special, fmt, done))
        return job.job_id, outcome, reply

    def _cache_tail(self, l0: str, reused: int) -> bytes:
        """The last two fields of a tokenize reply, `cache` ({"l0", "l1_reused_tokens"}) and `worker`,
        as `_serve` packs them: the bytes around the reused count packed once per l0 value."""
        parts = self._cache_tails.get(l0)
        if parts is None:
            whole = msgpack.packb({"cache": {"l0": l0, "l1_reused_tokens": 0}, "worker": self.worker_name}, use_bin_type=True)[1:]
            at = whole.index(b"\xb0l1_reused_tokens") + 17
            parts = self._cache_tails[l0] = (whole, whole[:at], whole[at + 1:])
        return parts[0] if not reused else parts[1] + msgpack.packb(reused) + parts[2]

    def _capped(self, reply: bytes) -> bytes:
        """The reply, or ProtocolError too_large when it is over --max-reply-bytes."""
        if len(reply) <= self.limits.max_reply_bytes:
            return reply
        raise ProtocolError("too_large", f"the reply would be {len(reply)} bytes; this worker sends "
                            f"at most {self.limits.max_reply_bytes} (--max-reply-bytes): split the request")

    def _error(self, raw_id: bytes, exc: BaseException) -> tuple[bytes, str]:
        """(reply, outcome) for a request that failed: the worker's one builder of error replies.
        A ProtocolError answers its own code; a RecursionError (input nested too deeply for the
        decoder or a renderer) is invalid_input; anything else is a bug: logged, answered internal,
        and the worker keeps serving."""
        if isinstance(exc, ProtocolError):
            code, message = exc.code, exc.message
        elif isinstance(exc, RecursionError):
            code, message = "invalid_input", "input is nested too deeply to process"
        else:
            log.error("internal error serving request id=%s", logged_id(raw_id), exc_info=exc)
            code, message = "internal", f"internal error: {type(exc).__name__}: {exc}"
        return error_reply(raw_id, code, message), code

    def _batch_items(self, items: list, field: str) -> None:
        if len(items) > self.limits.max_batch_items:
            raise ProtocolError("too_large", f"field '{field}' holds {len(items)} items; this worker takes at most "
                                f"{self.limits.max_batch_items} (--max-batch-items): split the batch")

    def _check_deadline(self, done: int) -> None:
        """Every 256 items of a batch: stop when the request's deadline has passed (nobody waits for it)."""
        if done & 255 == 255 and time.monotonic() > self.deadline:
            raise ProtocolError("timeout", f"the deadline passed after {done + 1} items of the batch")

    def _serve(self, request: Request, payload_bytes: int, *, deadline: float | None = None,
               fields: Callable[[], dict] | None = None) -> tuple[bytes, str]:
        """Serve one parsed request of `payload_bytes`: (the reply bytes, outcome). A batch inside it
        stops once `deadline` (time.monotonic()) has passed. `fields` gives the op's reply fields
        instead of its op_ method (a chat whose render finished in the background)."""
        self.deadline = float("inf") if deadline is None else deadline
        self.payload_bytes = payload_bytes
        request_id = request.raw_id
        try:
            method = getattr(self, f"op_{request.op}", None)
            if method is None:
                raise ProtocolError("unknown_op", f"field 'op': {request.op!r} is not served by workers")
            op_fields = method(request.payload, request.model, request.tokens_format) if fields is None else fields()
            return self._capped(ok_reply(request_id, {**op_fields, "worker": self.worker_name})), "ok"
        except Exception as e:  # noqa: BLE001 - a bug too is one request's error (_error logs it)
            return self._error(request_id, e)

    # --- ops ---------------------------------------------------------------------------

    def op_tokenize(self, p: dict, model_name: str | None, fmt: str) -> dict:
        text = req(p, "text", (str, list))
        add_special = opt(p, "add_special_tokens", bool, True)
        extras = parse_extras(p)
        model = self.registry.resolve(model_name)
        if isinstance(text, list):
            self._batch_items(text, "text")
            for i, t in enumerate(text):
                if not isinstance(t, str):
                    raise ProtocolError("bad_request", f"field 'text[{i}]' must be str, got {type_name(t)}")
        if extras is not None:
            tally = CacheTally(self.registry.l0_enabled)
            budget = ReplyBudget(self.limits.max_reply_bytes)
            batch = isinstance(text, list)
            return self._with_extras(model, text if batch else [text], add_special, extras, fmt, tally, budget, batch=batch)
        return self._tokenize_plain(model, text, add_special, fmt)

    def _tokenize_plain(self, model: Model, text: str | list[str], add_special: bool, fmt: str,
                        done: list[tuple[bytes, CacheOutcome]] | None = None) -> dict:
        """A checked plain tokenize's reply fields, the reply budget charged text by text. `done`: the
        (packed ids, outcome) of its first texts, already through the caches (`_cached`), not again."""
        tally = CacheTally(self.registry.l0_enabled)
        budget = ReplyBudget(self.limits.max_reply_bytes)
        done = done or []
        if isinstance(text, str):
            tokens, count = self._encode_one(model, text, add_special, fmt, tally, budget, "its token ids",
                                             done[0] if done else None)
            return {"tokens": tokens, "count": count, "cache": tally.to_wire()}
        out, total = [], 0
        for i, t in enumerate(text):
            self._check_deadline(i)
            tokens, count = self._encode_one(model, t, add_special, fmt, tally, budget, f"the token ids of text[0..{i}]",
                                             done[i] if i < len(done) else None)
            total += count
            out.append(tokens)
        return {"tokens": out, "count": total, "cache": tally.to_wire()}

    def _with_extras(self, model: Model, texts: list[str], add_special: bool, ex: Extras, fmt: str,
                     tally: "CacheTally", budget: ReplyBudget, *, batch: bool) -> dict:
        """tokenize or chat with the 1.2 options (workers/tokenin.py): each text served, then the reply's
        fields per text (a list of them for a batch). The budget is charged for each text's ids (and
        offsets, two numbers per id) before its fields are built."""
        cols: dict[str, list] = {"tokens": []}
        if ex.offsets:
            cols["offsets"] = []
        if ex.token_strs:
            cols["token_strs"] = []
        if ex.blocks is not None:
            cols["block_hashes"] = []
        total = 0
        truncated: list[int] = []  # (1.3) one per text, in the texts' order
        for i, t in enumerate(texts):
            self._check_deadline(i)
            served = self.tokenin.serve(model, t, add_special, ex)
            if served.outcome is not None:
                tally.add(served.outcome)
            budget.charge_ids(served.ids, fmt, f"the token ids of text[0..{i}]")
            if ex.offsets:
                budget.charge_count(2 * len(served.ids), None, fmt, f"the offsets of text[0..{i}]")
            tokens = _tokens_out(served.ids, fmt)
            if ex.blocks is not None:
                self.tokenin.hash_blocks(served, ex.blocks, tokens if fmt == "u32" and _LITTLE else None)
            total += len(served.ids)
            truncated.append(served.truncated)
            _add_served(cols, served, tokens, fmt)
        reply = {k: v if batch else v[0] for k, v in cols.items()}
        reply["count"] = total
        if ex.truncate is not None:
            reply["truncated"] = truncated if batch else truncated[0]
        reply["cache"] = tally.to_wire()
        return reply

    @staticmethod
    def _encode_one(model: Model, text: str, add_special: bool, fmt: str, tally: "CacheTally",
                    budget: ReplyBudget, what: str, done: tuple[bytes, CacheOutcome] | None = None) -> tuple[Any, int]:
        """(tokens in `fmt`, count) through the model's caches, charged to the reply's budget; `u32`
        never makes an int per id where the engine and L0 hold packed ids. `done`: this text's
        `encode_u32` result, already taken (a model with caches)."""
        if fmt == "u32":
            packed, outcome = done if done is not None else model.cache.encode_u32(text, add_special)
            tally.add(outcome)
            budget.charge_count(len(packed) // 4, packed, fmt, what)
            return packed, len(packed) // 4
        if done is not None:
            ids, outcome = u32_list(done[0]), done[1]
        else:
            ids, outcome = model.cache.encode(text, add_special)
        tally.add(outcome)
        budget.charge_ids(ids, fmt, what)
        return ids, len(ids)

    def op_detokenize(self, p: dict, model_name: str | None, fmt: str) -> dict:
        tokens = req(p, "tokens", (list, bytes))
        skip = opt(p, "skip_special_tokens", bool, True)
        model = self.registry.resolve(model_name)
        batch = _split_batch(tokens)
        budget = ReplyBudget(self.limits.max_reply_bytes)
        if batch is None:
            return {"text": self._decode(model, _ids(tokens, "tokens"), skip, "tokens", budget)}
        self._batch_items(batch, "tokens")
        texts = []
        for i, item in enumerate(batch):
            self._check_deadline(i)
            texts.append(self._decode(model, _ids(item, f"tokens[{i}]"), skip, f"tokens[{i}]", budget))
        return {"text": texts}

    def _decode(self, model, ids: list[int] | array, skip: bool, field: str, budget: ReplyBudget) -> str:
        """The text of `ids`, once its size bound is charged to `budget` (too_large before decoding)."""
        try:
            budget.charge_decoded(model.tokenizer, ids, f"the text of {field}")
            return model.tokenizer.decode(ids if isinstance(ids, list) else ids.tolist(), skip_special_tokens=skip)
        except InvalidTokenId as e:
            raise ProtocolError("invalid_input", f"field '{field}[{e.index}]': {e}") from e

    def op_chat(self, p: dict, model_name: str | None, fmt: str) -> dict:
        chat = self._chat_start(p, model_name)
        prompt = chat.here()
        return self._chat_finish(chat, chat.render() if prompt is None else prompt, fmt)

    def _chat_start(self, p: dict, model_name: str | None) -> ChatJob:
        """A chat's fields read and its model resolved: what its render (inline or in the background) needs."""
        messages = req(p, "messages", list)
        tools = opt(p, "tools", list, None)
        add_generation_prompt = opt(p, "add_generation_prompt", bool, True)
        continue_final = opt(p, "continue_final_message", bool, False)
        kwargs = opt(p, "chat_template_kwargs", dict, {})
        return_prompt = opt(p, "return_prompt", bool, False)
        extras = parse_extras(p)
        for i, m in enumerate(messages):
            if not isinstance(m, dict):
                raise ProtocolError("bad_request", f"field 'messages[{i}]' must be a map, got {type_name(m)}")
        model = self.registry.resolve(model_name)
        renderer = model.renderer()
        prepared = renderer.prepare(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                    continue_final_message=continue_final, extra=kwargs)
        return ChatJob(model, partial(renderer.render_reference, prepared), return_prompt, extras,
                       partial(renderer.render_here, prepared))

    def _chat_finish(self, chat: ChatJob, prompt: str, fmt: str) -> dict:
        """A rendered chat's reply fields: its prompt encoded, charged to the reply budget."""
        model, return_prompt = chat.model, chat.return_prompt
        tally = CacheTally(self.registry.l0_enabled)
        budget = ReplyBudget(self.limits.max_reply_bytes)
        if return_prompt:
            budget.charge_text(prompt, "the rendered prompt")
        if chat.extras is not None:
            reply = self._with_extras(model, [prompt], False, chat.extras, fmt, tally, budget, batch=False)
        else:
            tokens, count = self._encode_one(model, prompt, False, fmt, tally, budget, "its token ids")
            reply = {"tokens": tokens, "count": count, "cache": tally.to_wire()}
        if return_prompt:
            reply["prompt"] = prompt
        return reply

    def _defer_chat(self, job: PendingJob, request: Request) -> tuple[int, str, bytes] | None:
        """Start a chat job's render on the render lane: None once it is on its way (`finish_deferred`
        answers it), else the job's result (its fields refused it before any render)."""
        try:
            chat = self._chat_start(request.payload, request.model)
            prompt = chat.here()  # MiniJinja renders here, within its fuel (workers/chat/mini.py)
        except ProtocolError as e:
            reply, code = self._error(request.raw_id, e)
            return job.job_id, code, reply
        except Exception:  # noqa: BLE001 - a bug: served inline instead (a retry), where _serve() says so
            reply, outcome = self._serve(request, len(job.payload))
            return job.job_id, outcome, reply
        if prompt is not None:  # answered in this round; only jinja2 renders go to the lane
            reply, outcome = self._serve(request, len(job.payload),
                                         fields=partial(self._chat_finish, chat, prompt, request.tokens_format))
            return job.job_id, outcome, reply

        def finish(_: PendingJob, done: Done) -> tuple[bytes, str]:
            def fields() -> dict:
                if done.error is not None:
                    raise done.error
                return self._chat_finish(chat, done.result, request.tokens_format)

            return self._serve(request, len(job.payload), fields=fields)

        cast(Lane, self.renders).submit((job, finish), chat.render, job.deadline(), chat.model.renderer().sandbox.cancel)
        return None

    def _large(self, job: PendingJob, span: tuple[int, int, int]) -> tuple[bytes, str] | Request:
        """On the encode lane: read a payload over OFFLOAD_BYTES with a long `text` and, when it is a
        plain tokenize of one text for a cache-less model, encode it and write its reply (`_encode`,
        `_packed`: the plain path); else the parsed request, which the round loop serves
        (`_finish_large`; caches are the round thread's). The round loop never holds the GIL long for
        such a payload: up to PLAIN_READ_BYTES it is read by the compiled reader, beyond that its text
        is decoded in 1 MiB steps (`read_large`); the ids stay the engine's packed buffer, and
        `pack_tokens` writes the reply without the GIL."""
        if len(job.payload) <= PLAIN_READ_BYTES:
            plain = self._read_plain(job, bytes(job.payload))
        else:
            try:
                request = read_large(job.payload, span)
            except ProtocolError as e:
                return self._error(raw_id(without_text(job.payload, span)), e)
            plain = self._as_plain(job, request)
            if plain is None:
                return request
        if plain is None or plain.model.cache.enabled or type(plain.text) is not str:
            return read_large(job.payload, span)  # served on the round loop, which names any error
        try:
            flat, ends, _ = self._encode(plain.model, [plain.text], plain.add_special, None, None, 0)
        except Exception:  # noqa: BLE001 - a text the batch call refuses: served inline, which names the error
            return read_large(job.payload, span)
        reply = self._packed(plain, flat, ends, 0, None)
        return (reply, "ok") if reply is not None else read_large(job.payload, span)  # over budget: said on the round loop

    def _finish_large(self, job: PendingJob, done: Done) -> tuple[bytes, str] | None:
        """On the round thread: a large payload's reply from the lane, or its request served here
        (a chat starts its render; None then)."""
        if done.error is not None:  # a bug reading it (its id unread): _error logs it
            return self._error(NIL, done.error)
        if not isinstance(done.result, Request):
            return done.result
        request = done.result
        if request.op == "chat" and self.renders is not None:
            result = self._defer_chat(job, request)
            return None if result is None else (result[2], result[1])
        return self._serve(request, len(job.payload), deadline=job.deadline())

    def finish_deferred(self, lane: Lane) -> list[tuple[int, str, bytes]]:
        """The results of the jobs whose call on `lane` finished: (job id, outcome, reply) each."""
        out = []
        for done in lane.finished():
            job, finish = done.key
            if job.budget_ms and (time.monotonic() - job.received) * 1000 > job.budget_ms:
                out.append((job.job_id, SKIPPED, b""))  # the broker has answered `timeout`
                continue
            answer = finish(job, done)
            if answer is not None:  # None: it went on to another lane (a large chat's render)
                out.append((job.job_id, answer[1], answer[0]))
        return out

    def _defer_count(self, job: PendingJob, request: Request | None) -> None:
        """Count on the encode lane (workers/count_lane.py): the payload parsed there when `request`
        is None, the reply built there; `_finish_large` sends it (or serves here what is no count)."""
        stop = Stop(job.deadline())

        def call() -> tuple[bytes, str] | Request:
            parsed = request
            if parsed is None:
                data = bytes(job.payload)
                try:
                    parsed = parse_request(data)
                except ProtocolError as e:
                    return self._error(raw_id(data), e)
                if parsed.op != "count":  # a later `op` key won: the round loop serves it
                    return parsed
            try:  # built here, not by _serve: that sets the round thread's per-job state
                fields = self.op_count(parsed.payload, parsed.model, parsed.tokens_format, engine_encoder(stop))
                return self._capped(ok_reply(parsed.raw_id, {**fields, "worker": self.worker_name})), "ok"
            except Exception as e:  # noqa: BLE001 - one request's error, as _serve answers it
                return self._error(parsed.raw_id, e)

        cast(Lane, self.encodes).submit((job, self._finish_large), uncollected(call), job.deadline(), stop.cancel)

    def op_count(self, p: dict, model_name: str | None, fmt: str,
                 encoder: Callable[[Model], Callable[[str], int]] | None = None) -> dict:
        body = req(p, "body", (dict, str, bytes))
        fmt_name = opt(p, "format", str, None)
        strict = opt(p, "strict", bool, False)
        tally = CacheTally(self.registry.l0_enabled)
        result = count_request(
            body, format=fmt_name, model=model_name, strict=strict, env=WorkerCountEnv(self.registry, tally, encoder),
            max_items=self.limits.max_batch_items,
        )
        reply = {
            "count": result.count,
            "method": result.method,
            "vocabulary": result.vocabulary,
            "warnings": list(result.warnings),
        }
        reply["cache"] = tally.to_wire()
        return reply

    def op_detokenize_stream(self, p: dict, model_name: str | None, fmt: str) -> dict:
        """Many sequences' next ids -> text deltas and states (workers/stream/); touches no cache.
        The reply is charged to --max-reply-bytes before any text is built, in both forms."""
        columns = p.get("columns")
        if columns is not None:  # the columnar form (1.2): a few byte strings instead of a map per sequence
            if p.get("seqs") is not None:
                raise ProtocolError("bad_request", "give 'seqs' or 'columns', not both")
            model = self.registry.resolve(model_name)
            return model.stream_decoder().run_columns(columns, self.limits.max_batch_items, ReplyBudget(self.limits.max_reply_bytes))
        seqs = req(p, "seqs", list)
        self._batch_items(seqs, "seqs")
        model = self.registry.resolve(model_name)
        return {"seqs": model.stream_decoder().run(seqs, ReplyBudget(self.limits.max_reply_bytes), self.payload_bytes)}

    def op_models(self, p: dict, model_name: str | None, fmt: str) -> dict:
        return {"models": self.registry.describe()}


_STEP = 1 << 20  # bytes or ids handled per GIL-holding call on a lane (about a millisecond each)


def read_large(payload: bytes | memoryview, span: tuple[int, int, int]) -> Request:
    """A payload with a long top-level `text` (its `text_span`) as parse_request reads it, without one
    long call: the rest of the map is parsed alone (small) and the text decoded in 1 MiB steps."""
    _, start, end = span
    request = parse_request(without_text(payload, span))
    if request.payload.get("text") != "":
        return request  # a later `text` key wins, as in parse_request
    decoder = codecs.getincrementaldecoder("utf-8")()
    try:
        parts = [decoder.decode(payload[at:min(at + _STEP, end)]) for at in range(start, end, _STEP)]
        parts.append(decoder.decode(b"", final=True))
    except UnicodeDecodeError as e:
        raise ProtocolError("bad_request", f"payload holds a str that is not valid UTF-8: {e.reason}") from e
    request.payload["text"] = "".join(parts)
    return request


def without_text(payload: bytes | memoryview, span: tuple[int, int, int]) -> bytes:
    """The payload with its long `text` replaced by "" (the rest of the map, as bytes)."""
    return bytes(payload[:span[0]]) + b"\xa0" + bytes(payload[span[2]:])


def text_span(payload: bytes | memoryview) -> tuple[int, int, int] | None:
    """(where the `text` value starts, where its UTF-8 starts, where it ends) when the payload is a map
    whose entries before `text` lie in its first 64 KiB and `text` is a str of 64 KiB or more; else
    None. Reads those entries only (a few microseconds), so the round loop can afford it."""
    head = bytes(payload[:1 << 16])
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=len(head) or 1)
    unpacker.feed(head)
    try:
        at = seek_key(unpacker, "text")
        if at is None:
            return None
        kind = head[at]
        if kind == 0xDA:
            size, start = int.from_bytes(head[at + 1:at + 3], "big"), at + 3
        elif kind == 0xDB:
            size, start = int.from_bytes(head[at + 1:at + 5], "big"), at + 5
        else:
            return None
    except Exception:  # noqa: BLE001 - unreadable within its head: parse_request says why
        return None
    if size < 1 << 16 or start + size > len(payload):
        return None
    return at, start, start + size


def _add_served(cols: dict[str, list], served: Served, tokens: Any, fmt: str) -> None:
    """One text's fields into the reply's columns: offsets as [start, end] pairs or a u32 bin of both."""
    cols["tokens"].append(tokens)
    if "offsets" in cols:
        flat = served.offsets or []
        cols["offsets"].append(ids_to_u32(flat) if fmt == "u32" else [flat[i:i + 2] for i in range(0, len(flat), 2)])
    if "token_strs" in cols:
        cols["token_strs"].append(served.token_strs)
    if "block_hashes" in cols:
        cols["block_hashes"].append(served.block_hashes)


def _split_batch(tokens: list | bytes) -> list | None:
    """None for one sequence (a bin, or a list of ints); the items for a batch (a list of lists or bins)."""
    if isinstance(tokens, bytes) or not tokens:
        return None
    nested = [isinstance(t, (list, bytes)) for t in tokens]
    if all(nested):
        return tokens
    if any(nested):
        raise ProtocolError("bad_request", "field 'tokens' mixes ids with lists: give a list of int or a list of lists")
    return None


def _ids(value: list | bytes, field: str) -> list[int] | array:
    if isinstance(value, bytes):
        return u32_array(value, field)
    for i, t in enumerate(value):
        if type(t) is not int:
            raise ProtocolError("bad_request", f"field '{field}[{i}]' must be int, got {type_name(t)}")
    return value


# --- what ops lend: the reply's cache map, the counting ladder's encoders ------------------------


class CacheTally:
    """Folds the cache outcomes of a request's encodes into its reply `cache` map.

    L0 is "off" when it is configured off (every model shares one cache config), "hit" only when
    every lookup hit, and "miss" otherwise, also for a request that looked nothing up.
    """

    def __init__(self, l0_enabled: bool) -> None:
        self.l0_enabled = l0_enabled
        self.lookups = 0
        self.l0_hits = 0
        self.l1_reused = 0

    def add(self, outcome: CacheOutcome) -> None:
        self.lookups += 1
        self.l0_hits += outcome.l0 == "hit"
        self.l1_reused += outcome.l1_reused_tokens

    def to_wire(self) -> dict:
        if not self.l0_enabled:
            l0 = "off"
        else:
            l0 = "hit" if self.lookups and self.l0_hits == self.lookups else "miss"
        return {"l0": l0, "l1_reused_tokens": self.l1_reused}


class WorkerCountEnv:
    """The counting ladder's view of this worker: every rung encodes through a model's cache (on the
    round thread), or with `encoder`'s (a count on a lane: workers/count_lane.py)."""

    def __init__(self, registry: ModelRegistry, tally: CacheTally,
                 encoder: Callable[[Model], Callable[[str], int]] | None = None) -> None:
        self._registry = registry
        self._tally = tally
        self._lane_encoder = encoder

    def _encoder(self, model: Model) -> Callable[[str], int]:
        if self._lane_encoder is not None:
            return self._lane_encoder(model)

        def encode(text: str) -> int:
            ids, outcome = model.cache.encode(text, False)
            self._tally.add(outcome)
            return len(ids)

        return encode

    def tiktoken(self, encoding: str) -> Callable[[str], int] | None:
        model = self._registry.encoding(encoding)
        return self._encoder(model) if model is not None else None

    def loaded(self, model: str) -> tuple[str, str, Callable[[str], int]] | None:
        found = self._registry.find(model)
        if found is None:
            return None
        return found.name, found.tokenizer.kind, self._encoder(found)

    def fallback(self) -> tuple[str, Callable[[str], int]] | None:
        model = self._registry.fallback()
        return (model.name, self._encoder(model)) if model is not None else None
