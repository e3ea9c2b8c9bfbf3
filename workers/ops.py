"""The ops a worker serves: validate the op's own fields, run it through the caches, build the reply.

The broker has already checked the envelope and the common fields; a worker checks them again
where it reads them (it may be reached by a future broker version), and every check names its field.
"""

from __future__ import annotations

import logging
import sys
import time
from array import array
from dataclasses import dataclass
from typing import Any, Callable

from tokenbroker.common.errors import ProtocolError
from tokenbroker.common.protocol import (
    SKIPPED,
    Request,
    error_reply,
    logged_id,
    ok_reply,
    opt,
    parse_request,
    raw_id,
    req,
    type_name,
)

from .cache import CacheOutcome
from .count import count_request
from .registry import Model, ModelRegistry
from .tokenizers import InvalidTokenId

log = logging.getLogger(__name__)

_LITTLE = sys.byteorder == "little"


def ids_to_u32(ids: list[int]) -> bytes:
    """Little-endian uint32, whatever the host."""
    a = array("I", ids)
    if a.itemsize != 4:  # pragma: no cover - every platform we run on has a 4-byte unsigned int
        a = array("L", ids)
    if not _LITTLE:  # pragma: no cover
        a.byteswap()
    return a.tobytes()


def u32_to_ids(data: bytes, field: str) -> list[int]:
    if len(data) % 4:
        raise ProtocolError("invalid_input", f"field '{field}': a u32 bin must be a multiple of 4 bytes long, got {len(data)}")
    a = array("I")
    a.frombytes(data)
    if not _LITTLE:  # pragma: no cover
        a.byteswap()
    return a.tolist()


def _tokens_out(ids: list[int], fmt: str) -> Any:
    return ids_to_u32(ids) if fmt == "u32" else ids


@dataclass(slots=True)
class PendingJob:
    """A job as the worker received it: the broker's id, the time left, the client's payload."""

    job_id: int
    budget_ms: int
    received: float  # time.monotonic() when it arrived
    payload: bytes


class Ops:
    """Dispatch by op name; one method per op, each returning the reply's op fields."""

    def __init__(self, registry: ModelRegistry, worker_name: str) -> None:
        self.registry = registry
        self.worker_name = worker_name
        self.limits = registry.limits
        self.deadline = float("inf")  # of the job being served (time.monotonic()); batches stop past it

    def run(self, jobs: list[PendingJob]) -> list[tuple[int, str, bytes]]:
        """Serve a batch: (job id, outcome, reply) per job, in order. One job's failure is its own.

        Plain tokenize jobs of one model with its caches off go through one batch encode (which
        releases the GIL); the rest are served one by one. Replies equal what `handle` gives.
        """
        out: list[tuple[int, str, bytes] | None] = [None] * len(jobs)
        groups: dict[tuple[int, bool], tuple[Any, list[tuple[int, Request]]]] = {}
        for i, job in enumerate(jobs):
            if job.budget_ms and (time.monotonic() - job.received) * 1000 > job.budget_ms:
                out[i] = (job.job_id, SKIPPED, b"")  # the broker answers `timeout` (now or already)
                continue
            try:
                request = parse_request(job.payload)
            except ProtocolError as e:
                out[i] = (job.job_id, e.code, error_reply(raw_id(job.payload), e.code, e.message))
                continue
            model = self._plain_tokenize_model(request)
            if model is None:
                reply, outcome = self.serve(request, deadline=job.received + job.budget_ms / 1000 if job.budget_ms else None)
                out[i] = (job.job_id, outcome, reply)
            else:
                add_special = request.payload.get("add_special_tokens") is not False
                groups.setdefault((id(model), add_special), (model, []))[1].append((i, request))
        for (_, add_special), (model, members) in groups.items():
            self._encode_group(model, jobs, members, add_special, out)
        return out  # type: ignore[return-value]

    def _plain_tokenize_model(self, request: Request) -> Any:
        """The model of a tokenize request that a batch encode serves exactly, else None."""
        p = request.payload
        if request.op != "tokenize" or type(p.get("text")) is not str or type(p.get("add_special_tokens", True)) not in (bool, type(None)):
            return None
        try:
            model = self.registry.resolve(request.model)
        except ProtocolError:
            return None
        return None if model.cache.enabled else model

    def _encode_group(self, model: Any, jobs: list[PendingJob], members: list[tuple[int, Request]],
                      add_special: bool, out: list) -> None:
        try:
            all_ids = model.tokenizer.encode_many([r.payload["text"] for _, r in members], add_special_tokens=add_special)
        except Exception:  # one text the batch call refuses: serve each alone, so only it fails
            for i, request in members:
                reply, outcome = self.serve(request)
                out[i] = (jobs[i].job_id, outcome, reply)
            return
        off = CacheTally(self.registry.l0_enabled).to_wire()  # a cache-less model: nothing looked up
        for (i, request), ids in zip(members, all_ids):
            fields = {"tokens": _tokens_out(ids, request.tokens_format), "count": len(ids), "cache": off,
                      "worker": self.worker_name}
            out[i] = (jobs[i].job_id, *self._capped(request.raw_id, ok_reply(request.raw_id, fields), "ok"))

    def _capped(self, request_id: bytes, reply: bytes, outcome: str) -> tuple[str, bytes]:
        """(outcome, reply), or too_large when the reply is over --max-reply-bytes."""
        if len(reply) <= self.limits.max_reply_bytes:
            return outcome, reply
        return "too_large", error_reply(request_id, "too_large", f"the reply would be {len(reply)} bytes; this worker sends "
                                        f"at most {self.limits.max_reply_bytes} (--max-reply-bytes): split the request")

    def _batch_items(self, items: list, field: str) -> None:
        if len(items) > self.limits.max_batch_items:
            raise ProtocolError("too_large", f"field '{field}' holds {len(items)} items; this worker takes at most "
                                f"{self.limits.max_batch_items} (--max-batch-items): split the batch")

    def _check_deadline(self, done: int) -> None:
        """Every 256 items of a batch: stop when the request's deadline has passed (nobody waits for it)."""
        if done & 255 == 255 and time.monotonic() > self.deadline:
            raise ProtocolError("timeout", f"the deadline passed after {done + 1} items of the batch")

    def handle(self, data: bytes) -> tuple[bytes, str]:
        """Serve one client payload: (the reply bytes, "ok" or the error code)."""
        try:
            request = parse_request(data)
        except ProtocolError as e:
            return error_reply(raw_id(data), e.code, e.message), e.code
        return self.serve(request)

    def serve(self, request: Request, *, deadline: float | None = None) -> tuple[bytes, str]:
        """Serve one parsed request: (the reply bytes, outcome). A batch inside it stops once
        `deadline` (time.monotonic()) has passed."""
        self.deadline = float("inf") if deadline is None else deadline
        request_id = request.raw_id
        try:
            method = getattr(self, f"op_{request.op}", None)
            if method is None:
                raise ProtocolError("unknown_op", f"field 'op': {request.op!r} is not served by workers")
            fields = method(request.payload, request.model, request.tokens_format)
            reply = ok_reply(request_id, {**fields, "worker": self.worker_name})
            outcome, reply = self._capped(request_id, reply, "ok")
            return reply, outcome
        except ProtocolError as e:
            return error_reply(request_id, e.code, e.message), e.code
        except RecursionError:
            return error_reply(request_id, "invalid_input", "input is nested too deeply to process"), "invalid_input"
        except Exception as e:  # a bug: say so, keep serving
            log.exception("internal error serving request id=%s", logged_id(request_id))
            return error_reply(request_id, "internal", f"internal error: {type(e).__name__}: {e}"), "internal"

    # --- ops ---------------------------------------------------------------------------

    def op_tokenize(self, p: dict, model_name: str | None, fmt: str) -> dict:
        text = req(p, "text", (str, list))
        add_special = opt(p, "add_special_tokens", bool, True)
        model = self.registry.resolve(model_name)
        tally = CacheTally(self.registry.l0_enabled)
        if isinstance(text, str):
            ids, outcome = model.cache.encode(text, add_special)
            tally.add(outcome)
            return {"tokens": _tokens_out(ids, fmt), "count": len(ids), "cache": tally.to_wire()}
        self._batch_items(text, "text")
        for i, t in enumerate(text):
            if not isinstance(t, str):
                raise ProtocolError("bad_request", f"field 'text[{i}]' must be str, got {type_name(t)}")
        out, total = [], 0
        for i, t in enumerate(text):
            self._check_deadline(i)
            ids, outcome = model.cache.encode(t, add_special)
            tally.add(outcome)
            total += len(ids)
            out.append(_tokens_out(ids, fmt))
        return {"tokens": out, "count": total, "cache": tally.to_wire()}

    def op_detokenize(self, p: dict, model_name: str | None, fmt: str) -> dict:
        tokens = req(p, "tokens", (list, bytes))
        skip = opt(p, "skip_special_tokens", bool, True)
        model = self.registry.resolve(model_name)
        batch = _split_batch(tokens)
        if batch is None:
            return {"text": self._decode(model, _ids(tokens, "tokens"), skip, "tokens")}
        self._batch_items(batch, "tokens")
        texts = []
        for i, item in enumerate(batch):
            self._check_deadline(i)
            texts.append(self._decode(model, _ids(item, f"tokens[{i}]"), skip, f"tokens[{i}]"))
        return {"text": texts}

    def _decode(self, model, ids: list[int], skip: bool, field: str) -> str:
        try:
            return model.tokenizer.decode(ids, skip_special_tokens=skip)
        except InvalidTokenId as e:
            raise ProtocolError("invalid_input", f"field '{field}[{e.index}]': {e}") from e

    def op_chat(self, p: dict, model_name: str | None, fmt: str) -> dict:
        messages = req(p, "messages", list)
        tools = opt(p, "tools", list, None)
        add_generation_prompt = opt(p, "add_generation_prompt", bool, True)
        continue_final = opt(p, "continue_final_message", bool, False)
        kwargs = opt(p, "chat_template_kwargs", dict, {})
        return_prompt = opt(p, "return_prompt", bool, False)
        for i, m in enumerate(messages):
            if not isinstance(m, dict):
                raise ProtocolError("bad_request", f"field 'messages[{i}]' must be a map, got {type_name(m)}")
        model = self.registry.resolve(model_name)
        prompt = model.renderer().render(
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final,
            extra=kwargs,
        )
        ids, outcome = model.cache.encode(prompt, False)
        tally = CacheTally(self.registry.l0_enabled)
        tally.add(outcome)
        reply = {"tokens": _tokens_out(ids, fmt), "count": len(ids), "cache": tally.to_wire()}
        if return_prompt:
            reply["prompt"] = prompt
        return reply

    def op_count(self, p: dict, model_name: str | None, fmt: str) -> dict:
        body = req(p, "body", (dict, str, bytes))
        fmt_name = opt(p, "format", str, None)
        strict = opt(p, "strict", bool, False)
        tally = CacheTally(self.registry.l0_enabled)
        result = count_request(
            body, format=fmt_name, model=model_name, strict=strict, env=WorkerCountEnv(self.registry, tally)
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
        """Many sequences' next ids -> text deltas and states (workers/stream.py); touches no cache."""
        columns = p.get("columns")
        if columns is not None:  # the columnar form (1.2): a few byte strings instead of a map per sequence
            if p.get("seqs") is not None:
                raise ProtocolError("bad_request", "give 'seqs' or 'columns', not both")
            model = self.registry.resolve(model_name)
            return model.stream_decoder().run_columns(columns, self.limits.max_batch_items)
        seqs = req(p, "seqs", list)
        self._batch_items(seqs, "seqs")
        model = self.registry.resolve(model_name)
        return {"seqs": model.stream_decoder().run(seqs)}

    def op_models(self, p: dict, model_name: str | None, fmt: str) -> dict:
        return {"models": self.registry.describe()}


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


def _ids(value: list | bytes, field: str) -> list[int]:
    if isinstance(value, bytes):
        return u32_to_ids(value, field)
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
    """The counting ladder's view of this worker: every rung encodes through a model's cache."""

    def __init__(self, registry: ModelRegistry, tally: CacheTally) -> None:
        self._registry = registry
        self._tally = tally

    def _encoder(self, model: Model) -> Callable[[str], int]:
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
