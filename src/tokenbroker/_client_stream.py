"""The `detokenize_stream` helper: carries each sequence's opaque `state` between steps for the caller.

The service keeps no memory of a sequence (docs/protocol.md, "Streaming detokenization"): each
reply hands back a `state` to send with that sequence's next step. A scheduler generating for many
sequences pushes one step of ids for all of them in ONE request and gets a text delta per
sequence; this object remembers every open sequence's state (or, before its first answered step,
its options), and drops a sequence once it is finished. A step that fails leaves every state as it
was, so sending the same step again is safe (the service answers a repeated step byte for byte).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Generic, Hashable, Iterable, Mapping, Sequence, TypeVar

from ._client_errors import Internal, error_from_reply
from ._client_results import ids_to_wire

K = TypeVar("K", bound=Hashable)
IdsIn = Sequence[int]


@dataclass(frozen=True, slots=True)
class StreamDelta:
    """One sequence's step: new `text` to show (maybe ""), and once it ends why (`finished`).

    `finished` is None while the sequence goes on, "stop" when a stop string or stop id matched
    (`stop` holds which), "final" after a final step.
    """

    text: str
    finished: str | None
    stop: str | int | None


@dataclass(slots=True)
class _Seq:
    options: dict[str, Any]  # first-step fields, sent until a reply has given a state
    state: bytes | None = None


class StreamBook(Generic[K]):
    """Open sequences by the caller's key: builds a step's `seqs` and takes in the reply's."""

    def __init__(self) -> None:
        self._seqs: dict[K, _Seq] = {}

    def open(self, key: K, *, prompt_tokens: IdsIn = (), stop: Sequence[str] = (),
             stop_token_ids: Sequence[int] = (), skip_special_tokens: bool = True,
             include_stop_str_in_output: bool = False) -> None:
        """Start a sequence; its options travel with its first step (then inside its state)."""
        if key in self._seqs:
            raise ValueError(f"sequence {key!r} is already open")
        if isinstance(stop, str):
            raise TypeError(f"stop of sequence {key!r} must be a list of str, got one str")
        options: dict[str, Any] = {}
        if len(prompt_tokens):
            options["prompt_tokens"] = ids_to_wire(prompt_tokens)
        if stop:
            options["stop"] = list(stop)
        if stop_token_ids:
            options["stop_token_ids"] = list(stop_token_ids)
        if not skip_special_tokens:
            options["skip_special_tokens"] = False
        if include_stop_str_in_output:
            options["include_stop_str_in_output"] = True
        self._seqs[key] = _Seq(options)

    def close(self, key: K) -> None:
        """Forget a sequence without a final step (the service holds nothing to release)."""
        self._seqs.pop(key, None)

    def __contains__(self, key: object) -> bool:
        return key in self._seqs

    def __len__(self) -> int:
        return len(self._seqs)

    def keys(self) -> list[K]:
        return list(self._seqs)

    def build(self, steps: Mapping[K, IdsIn], final: Iterable[K] = ()) -> tuple[list[K], list[dict[str, Any]]]:
        """The keys in request order and the request's `seqs`: the stepped ones in the order given,
        then the final ones without ids. An `invalid_input` names a sequence by its index in this order."""
        finals = list(dict.fromkeys(final))
        keys = list(steps) + [k for k in finals if k not in steps]
        for k in keys:
            if k not in self._seqs:
                raise KeyError(f"sequence {k!r} is not open (finished sequences are dropped; open it first)")
        final_set = set(finals)
        seqs = []
        for k in keys:
            seq = self._seqs[k]
            m: dict[str, Any] = {"tokens": ids_to_wire(steps.get(k, ()))}
            if seq.state is not None:
                m["state"] = seq.state
            else:
                m.update(seq.options)
            if k in final_set:
                m["final"] = True
            seqs.append(m)
        return keys, seqs

    def absorb(self, keys: list[K], reply_seqs: Any) -> dict[K, StreamDelta]:
        """Each key's delta; states are kept for the next step, finished sequences dropped."""
        if not isinstance(reply_seqs, list) or len(reply_seqs) != len(keys):
            got = len(reply_seqs) if isinstance(reply_seqs, list) else type(reply_seqs).__name__
            raise Internal("internal", f"detokenize_stream reply has {got} seqs for {len(keys)} sent")
        out: dict[K, StreamDelta] = {}
        for k, r in zip(keys, reply_seqs):
            finished = r.get("finished")
            out[k] = StreamDelta(r.get("text", ""), finished, r.get("stop"))
            if finished is not None:
                del self._seqs[k]
                continue
            state = r.get("state")
            if not isinstance(state, bytes):
                raise Internal("internal", f"detokenize_stream reply for sequence {k!r} goes on without a state")
            seq = self._seqs[k]
            seq.state = state
            seq.options = {}
        return out


def _request(model: str | None, seqs: list[dict[str, Any]]) -> dict[str, Any]:
    body: dict[str, Any] = {"op": "detokenize_stream", "seqs": seqs}
    if model is not None:
        body["model"] = model
    return body


class AsyncDetokenizeStream(StreamBook[K]):
    """`open()` sequences, then `await step({key: ids, ...}, final=[...])` once per generation step."""

    def __init__(self, call: Callable[[dict, float | None], Awaitable[dict]], *, model: str | None,
                 timeout: float | None) -> None:
        super().__init__()
        self._call, self._model, self._timeout = call, model, timeout

    async def step(self, steps: Mapping[K, IdsIn], *, final: Iterable[K] = (),
                   timeout: float | None = None) -> dict[K, StreamDelta]:
        keys, seqs = self.build(steps, final)
        if not keys:
            return {}
        reply = await self._call(_request(self._model, seqs), timeout if timeout is not None else self._timeout)
        if reply.get("ok") is not True:
            raise error_from_reply(reply)
        return self.absorb(keys, reply.get("seqs"))


class DetokenizeStream(StreamBook[K]):
    """The synchronous twin of `AsyncDetokenizeStream`, for `Client`."""

    def __init__(self, call: Callable[[dict, float | None], dict], *, model: str | None, timeout: float | None) -> None:
        super().__init__()
        self._call, self._model, self._timeout = call, model, timeout

    def step(self, steps: Mapping[K, IdsIn], *, final: Iterable[K] = (),
             timeout: float | None = None) -> dict[K, StreamDelta]:
        keys, seqs = self.build(steps, final)
        if not keys:
            return {}
        reply = self._call(_request(self._model, seqs), timeout if timeout is not None else self._timeout)
        if reply.get("ok") is not True:
            raise error_from_reply(reply)
        return self.absorb(keys, reply.get("seqs"))
