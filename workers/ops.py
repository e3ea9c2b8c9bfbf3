"""The ops a worker serves: validate the op's own fields, run it through the caches, build the reply.

The broker has already checked the envelope and the common fields; a worker checks them again
where it reads them (it may be reached by a future broker version), and every check names its field.
"""

from __future__ import annotations

import logging
import sys
from array import array
from typing import Any

from tokenbroker.common.errors import ProtocolError
from tokenbroker.common.protocol import error_reply, ok_reply, opt, parse_request, raw_id, req, type_name

from .count import count_request
from .registry import CacheTally, ModelRegistry, WorkerCountEnv
from .stream import decoder_for
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


class Ops:
    """Dispatch by op name; one method per op, each returning the reply's op fields."""

    def __init__(self, registry: ModelRegistry, worker_name: str) -> None:
        self.registry = registry
        self.worker_name = worker_name

    def handle(self, data: bytes) -> tuple[bytes, str]:
        """Serve one client payload: (the reply bytes, "ok" or the error code)."""
        request_id = raw_id(data)
        try:
            request = parse_request(data)
            method = getattr(self, f"op_{request.op}", None)
            if method is None:
                raise ProtocolError("unknown_op", f"field 'op': {request.op!r} is not served by workers")
            fields = method(request.payload, request.model, request.tokens_format)
            return ok_reply(request_id, {**fields, "worker": self.worker_name}), "ok"
        except ProtocolError as e:
            return error_reply(request_id, e.code, e.message), e.code
        except RecursionError:
            return error_reply(request_id, "invalid_input", "input is nested too deeply to process"), "invalid_input"
        except Exception as e:  # a bug: say so, keep serving
            log.exception("internal error serving request id=%r", request_id)
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
        for i, t in enumerate(text):
            if not isinstance(t, str):
                raise ProtocolError("bad_request", f"field 'text[{i}]' must be str, got {type_name(t)}")
        out, total = [], 0
        for t in text:
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
        return {"text": [self._decode(model, _ids(item, f"tokens[{i}]"), skip, f"tokens[{i}]")
                         for i, item in enumerate(batch)]}

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
        seqs = req(p, "seqs", list)
        model = self.registry.resolve(model_name)
        return {"seqs": decoder_for(model.tokenizer, model.fingerprint).run(seqs)}

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
