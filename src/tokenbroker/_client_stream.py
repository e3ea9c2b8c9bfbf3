"""The `detokenize_stream` helper: carries each sequence's opaque `state` between steps for the caller.

The service keeps no memory of a sequence (docs/protocol.md, "Streaming detokenization"): each
reply hands back a `state` to send with that sequence's next step. A scheduler generating for many
sequences pushes one step of ids for all of them and gets a text delta per sequence; this object
remembers every open sequence's state (or, before its first answered step, its options), and
drops a sequence once it is finished. A step that fails leaves every state as it was, so sending
the same step again is safe (the service answers a repeated step byte for byte).

It speaks the columnar form (contract 1.2, "Columnar detokenize_stream") for every sequence that
has a state, and for a first step that needs no option: the states live in one buffer, in the
order of the last reply, so a step over the same sequences in the same order sends that buffer
as it came and keeps the reply's as it comes, without touching a sequence. A first step with
options goes in the row form (`seqs`), in a second request sent alongside. `columnar=False`
speaks the row form only (a 1.1 broker).
"""

from __future__ import annotations

import asyncio
import re
import sys
from array import array
from dataclasses import dataclass
from itertools import accumulate, chain, compress
from operator import itemgetter
from typing import Any, Awaitable, Callable, Generic, Hashable, Iterable, Iterator, Mapping, Sequence, TypeVar

from ._client_errors import Internal, error_from_reply
from ._client_results import ids_to_wire

K = TypeVar("K", bound=Hashable)
IdsIn = Sequence[int]
_LITTLE = sys.byteorder == "little"
_FINISHED = (None, "stop", "final")
_SEQUENCE = re.compile(r"sequence (\d+)|seqs\[(\d+)\]")


@dataclass(frozen=True, slots=True)
class StreamDelta:
    """One sequence's step: new `text` to show (maybe ""), and once it ends why (`finished`).

    `finished` is None while the sequence goes on, "stop" when a stop string or stop id matched
    (`stop` holds which), "final" after a final step.
    """

    text: str
    finished: str | None
    stop: str | int | None


def _u32(values: Iterable[int]) -> bytes:
    a = array("I", values)
    if not _LITTLE:  # pragma: no cover
        a.byteswap()
    return a.tobytes()


def _u32s(data: bytes) -> array:
    a = array("I")
    a.frombytes(data)
    if not _LITTLE:  # pragma: no cover
        a.byteswap()
    return a


def _pieces(buf: Any, lengths: array) -> list:
    """`buf` (bytes or str) cut into consecutive pieces of the given lengths, in C-speed calls."""
    if len(lengths) < 2:
        return [buf] if lengths else []
    at = list(accumulate(lengths, initial=0))
    return list(itemgetter(*map(slice, at, at[1:]))(buf))


class StreamStep(Mapping[K, StreamDelta]):
    """One step's deltas by key, read from the reply's buffers when asked.

    `texts()` gives every sequence's new text in `keys` order at once (the cheapest way to read
    them all); `step[key]` builds one `StreamDelta`; `finished` holds only the sequences that ended.
    """

    __slots__ = ("keys_", "_text", "_lengths", "_finished", "_stops", "_rows", "_cols", "_index", "_texts")

    def __init__(self, col_keys: list[K], text: bytes, text_lengths: bytes, finished: bytes, stops: dict,
                 row_keys: list[K], rows: list[StreamDelta]) -> None:
        self.keys_ = col_keys + row_keys if row_keys else col_keys
        self._cols = len(col_keys)
        self._text, self._lengths, self._finished, self._stops = text, text_lengths, finished, stops
        self._rows = rows
        self._index: dict[K, int] | None = None
        self._texts: list[str] | None = None

    def texts(self) -> list[str]:
        """Every sequence's new text, in the order of `keys()` (the caller's order, first steps with options last)."""
        if self._texts is None:
            text = self._text
            if not self._cols:
                pieces: list[str] = []
            elif text.isascii():  # one decode, then str slices (bytes and characters agree)
                pieces = _pieces(text.decode("ascii"), _u32s(self._lengths))
            else:
                pieces = list(map(bytes.decode, _pieces(text, _u32s(self._lengths))))
            self._texts = pieces + [d.text for d in self._rows] if self._rows else pieces
        return self._texts

    def keys(self) -> list[K]:  # type: ignore[override]
        return self.keys_

    @property
    def finished(self) -> dict[K, StreamDelta]:
        """The sequences that ended at this step (they are no longer open)."""
        f = self._finished
        if f.count(0) == len(f):
            ended: list[int] = []
        else:
            ended = [i for i, b in enumerate(f) if b]
        out = {self.keys_[i]: self._delta(i) for i in ended}
        out.update({k: d for k, d in zip(self.keys_[self._cols:], self._rows) if d.finished is not None})
        return out

    def _delta(self, i: int) -> StreamDelta:
        if i >= self._cols:
            return self._rows[i - self._cols]
        how = _FINISHED[self._finished[i]]
        return StreamDelta(self.texts()[i], how, self._stops.get(i) if how == "stop" else None)

    def __getitem__(self, key: K) -> StreamDelta:
        if self._index is None:
            self._index = dict(zip(self.keys_, range(len(self.keys_))))
        return self._delta(self._index[key])

    def __iter__(self) -> Iterator[K]:
        return iter(self.keys_)

    def __len__(self) -> int:
        return len(self.keys_)

    def __contains__(self, key: object) -> bool:
        if self._index is None:
            self._index = dict(zip(self.keys_, range(len(self.keys_))))
        return key in self._index

    def __repr__(self) -> str:
        return f"StreamStep({dict(self.items())!r})"


@dataclass(slots=True)
class _Plan:
    """One step as it goes out: the columnar request's sequences and the row form's."""

    col_keys: list[K]  # type: ignore[valid-type]
    columns: dict[str, Any] | None
    row_keys: list  # first steps with options, in the row form
    seqs: list[dict[str, Any]]
    same_order: bool  # the columnar keys are the book's, in its order: its state buffer went as it is


class StreamBook(Generic[K]):
    """Open sequences by the caller's key; their states in one buffer, in the order of `_order`."""

    def __init__(self, *, columnar: bool = True) -> None:
        self.columnar = columnar
        self._first: dict[K, dict[str, Any]] = {}  # opened, no state yet: the first step's options ({} = none)
        self._order: list[K] = []  # sequences with a state, in the buffer's order
        self._states = b""
        self._state_lengths = b""
        self._index: dict[K, int] | None = None  # key -> place in _order, built when needed

    # --- the open sequences ------------------------------------------------------------------

    def open(self, key: K, *, prompt_tokens: IdsIn = (), stop: Sequence[str] = (),
             stop_token_ids: Sequence[int] = (), skip_special_tokens: bool = True,
             include_stop_str_in_output: bool = False) -> None:
        """Start a sequence; its options travel with its first step (then inside its state)."""
        if key in self:
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
        self._first[key] = options

    def close(self, key: K) -> None:
        """Forget a sequence without a final step (the service holds nothing to release)."""
        if self._first.pop(key, None) is None and key in self._where():
            self._keep(lambda k: k != key)

    def __contains__(self, key: object) -> bool:
        return key in self._first or key in self._where()

    def __len__(self) -> int:
        return len(self._first) + len(self._order)

    def keys(self) -> list[K]:
        return list(self._order) + list(self._first)

    @property
    def order(self) -> list[K]:
        """The sequences that have a state, in the order their states are held (the last reply's):
        the list to pass to `step_columns` as it is, so the step sends the buffer untouched.
        Read it again after a step that finished or added sequences."""
        return self._order

    def _where(self) -> dict[K, int]:
        if self._index is None:
            self._index = dict(zip(self._order, range(len(self._order))))
        return self._index

    def _state_pieces(self) -> list[bytes]:
        return _pieces(self._states, _u32s(self._state_lengths))

    def _keep(self, keep: Callable[[K], bool]) -> None:
        """Drop the sequences `keep` refuses from the buffer."""
        flags = list(map(keep, self._order))
        self._set(list(compress(self._order, flags)), list(compress(self._state_pieces(), flags)))

    def _set(self, order: list[K], states: list[bytes]) -> None:
        self._order, self._index = order, None
        self._states = b"".join(states)
        self._state_lengths = _u32(map(len, states))

    def _states_of(self, keys: Iterable[K]) -> dict[K, bytes]:
        where, pieces = self._where(), self._state_pieces()
        return {k: pieces[where[k]] for k in keys if k in where}

    # --- the row form (1.1) --------------------------------------------------------------------

    def build(self, steps: Mapping[K, IdsIn], final: Iterable[K] = ()) -> tuple[list[K], list[dict[str, Any]]]:
        """The row form: the keys in request order and the request's `seqs`: the stepped ones in the
        order given, then the final ones without ids. An `invalid_input` names a sequence by its index in this order."""
        keys, finals = self._keys(steps, final)
        states = self._states_of(keys)
        seqs = []
        for k in keys:
            m: dict[str, Any] = {"tokens": ids_to_wire(steps.get(k, ()))}
            if k in states:
                m["state"] = states[k]
            else:
                m.update(self._first[k])
            if k in finals:
                m["final"] = True
            seqs.append(m)
        return keys, seqs

    def absorb(self, keys: list[K], reply_seqs: Any) -> dict[K, StreamDelta]:
        """Each key's delta from the row form's reply; states are kept for the next step, finished sequences dropped."""
        deltas, states = self._read_rows(keys, reply_seqs)
        self._after(keys, states)
        return deltas

    def _read_rows(self, keys: list[K], reply_seqs: Any) -> tuple[dict[K, StreamDelta], dict[K, bytes | None]]:
        if not isinstance(reply_seqs, list) or len(reply_seqs) != len(keys):
            got = len(reply_seqs) if isinstance(reply_seqs, list) else type(reply_seqs).__name__
            raise Internal("internal", f"detokenize_stream reply has {got} seqs for {len(keys)} sent")
        deltas: dict[K, StreamDelta] = {}
        states: dict[K, bytes | None] = {}
        for k, r in zip(keys, reply_seqs):
            finished = r.get("finished")
            deltas[k] = StreamDelta(r.get("text", ""), finished, r.get("stop"))
            state = None if finished is not None else r.get("state")
            if finished is None and not isinstance(state, bytes):
                raise Internal("internal", f"detokenize_stream reply for sequence {k!r} goes on without a state")
            states[k] = state
        return deltas, states

    def _after(self, keys: Iterable[K], states: Mapping[K, bytes | None]) -> None:
        """Take in new states (None: finished) for some sequences; the others keep theirs."""
        for k in keys:
            self._first.pop(k, None)
        old = [(k, s) for k, s in zip(self._order, self._state_pieces()) if k not in states]
        new = [(k, s) for k, s in states.items() if s is not None]
        self._set([k for k, _ in old] + [k for k, _ in new], [s for _, s in old] + [s for _, s in new])

    def _keys(self, steps: Mapping[K, IdsIn], final: Iterable[K]) -> tuple[list[K], set[K]]:
        finals = set(final) if final else set()
        keys = list(steps)
        if finals:
            keys += [k for k in dict.fromkeys(final) if k not in steps]
        for k in keys:
            if k not in self:
                raise KeyError(f"sequence {k!r} is not open (finished sequences are dropped; open it first)")
        return keys, finals

    # --- the columnar form (1.2) ---------------------------------------------------------------

    def plan(self, steps: Mapping[K, IdsIn], final: Iterable[K] = ()) -> _Plan:
        """One step's requests: the columnar one for the sequences it can carry, the row form's for the rest."""
        finals = list(dict.fromkeys(final)) if final else []
        keys = list(steps) if not finals else list(steps) + [k for k in finals if k not in steps]
        if not self.columnar:
            row_keys, row_seqs = self.build(steps, finals)
            return _Plan([], None, row_keys, row_seqs, False)
        if keys == self._order:  # the common step: every open sequence, in the buffer's order
            col_keys, row_keys, states, state_lengths, same = keys, [], self._states, self._state_lengths, True
        else:
            where, first = self._where(), self._first
            col_keys, row_keys = [], []
            for k in keys:
                if k in where or first.get(k, True) == {}:
                    col_keys.append(k)
                elif k in first:
                    row_keys.append(k)
                else:
                    raise KeyError(f"sequence {k!r} is not open (finished sequences are dropped; open it first)")
            pieces = self._state_pieces()
            chosen = [pieces[where[k]] if k in where else b"" for k in col_keys]
            states, state_lengths, same = b"".join(chosen), _u32(map(len, chosen)), False
        seqs = []
        if row_keys:
            final_set = set(finals)
            for k in row_keys:
                m = {"tokens": ids_to_wire(steps.get(k, ())), **self._first[k]}
                if k in final_set:
                    m["final"] = True
                seqs.append(m)
        columns = None
        if col_keys:
            values = list(steps.values()) if (same and not finals) else [steps.get(k, ()) for k in col_keys]
            tokens, lengths = _ids_columns(values)
            columns = {"tokens": tokens, "lengths": lengths, "states": states, "state_lengths": state_lengths}
            if finals:
                where_col = dict(zip(col_keys, range(len(col_keys))))
                flags = bytearray(len(col_keys))
                for k in finals:
                    if k in where_col:
                        flags[where_col[k]] = 1
                columns["final"] = bytes(flags)
        return _Plan(col_keys, columns, row_keys, seqs, same)

    def plan_columns(self, keys: Sequence[K], tokens: Any, lengths: Any = None, final: Any = None) -> _Plan:
        """One step given as columns (see `step_columns`): no map per sequence on the way out."""
        n = len(keys)
        ids = _u32_wire(tokens)
        counts = _ONES.get(n) or _ones(n) if lengths is None else _u32_wire(lengths)
        if len(counts) != 4 * n:
            raise ValueError(f"lengths: give one per key ({n}), got {len(counts) // 4}")
        if lengths is None and len(ids) != 4 * n:
            raise ValueError(f"tokens: give one id per key ({n}) or their lengths, got {len(ids) // 4} ids")
        flags = None
        if final is not None:
            flags = bytes(final) if not isinstance(final, bytes) else final
            if len(flags) != n:
                raise ValueError(f"final: give one flag per key ({n}), got {len(flags)}")
            if flags.count(0) == n:
                flags = None
        if not self.columnar or (self._first and any(self._first.get(k) for k in keys)):
            # a first step with options goes in the row form: the dict helper's way, for this step only
            cut = _pieces(_u32s(ids), _u32s(counts))
            return self.plan(dict(zip(keys, cut)), [k for k, f in zip(keys, flags or b"") if f])
        if keys is self._order or keys == self._order:  # the common step: every open sequence, the buffer's order
            col_keys = self._order if keys is self._order else list(keys)
            states, state_lengths, same = self._states, self._state_lengths, True
        else:
            where, first = self._where(), self._first
            col_keys = list(keys)
            pieces = self._state_pieces()
            chosen = []
            for k in col_keys:
                at = where.get(k)
                if at is not None:
                    chosen.append(pieces[at])
                elif k in first:
                    chosen.append(b"")
                else:
                    raise KeyError(f"sequence {k!r} is not open (finished sequences are dropped; open it first)")
            if len(set(col_keys)) != n:
                raise ValueError("keys: each sequence at most once a step")
            states, state_lengths, same = b"".join(chosen), _u32(map(len, chosen)), False
        columns = {"tokens": ids, "lengths": counts, "states": states, "state_lengths": state_lengths}
        if flags is not None:
            columns["final"] = flags
        return _Plan(col_keys, columns, [], [], same)

    def take(self, plan: _Plan, col_reply: dict | None, row_reply: dict | None) -> StreamStep[K]:
        """The step's deltas from its replies (both ok); the book moves on only now."""
        rows: list[StreamDelta] = []
        row_states: dict[K, bytes | None] = {}
        if plan.row_keys:
            deltas, row_states = self._read_rows(plan.row_keys, (row_reply or {}).get("seqs"))
            rows = list(deltas.values())
        if plan.columns is None:
            self._after(plan.row_keys, row_states)
            return StreamStep([], b"", b"", b"", {}, plan.row_keys, rows)
        c = (col_reply or {}).get("columns")
        n = len(plan.col_keys)
        try:
            text, text_lengths, states, state_lengths, finished = (
                c["text"], c["text_lengths"], c["states"], c["state_lengths"], c["finished"])  # type: ignore[index]
            stops = c.get("stops") or {}  # type: ignore[union-attr]
            assert len(finished) == n and len(text_lengths) == len(state_lengths) == 4 * n
        except Exception:
            raise Internal("internal", f"detokenize_stream columnar reply does not hold {n} sequences: {c!r:.200}") from None
        if plan.same_order and not plan.row_keys and finished.count(0) == n:
            self._states, self._state_lengths = states, state_lengths  # the reply's buffer, as it came
        else:
            pieces = _pieces(states, _u32s(state_lengths))
            new: dict[K, bytes | None] = {k: (s if f == 0 else None) for k, s, f in zip(plan.col_keys, pieces, finished)}
            new.update(row_states)
            self._after(list(new), new)
        return StreamStep(plan.col_keys, text, text_lengths, finished, stops, plan.row_keys, rows)


_ONES: dict[int, bytes] = {}


def _ones(n: int) -> bytes:
    """n little-endian uint32 ones (one id per sequence), kept for the next step of as many."""
    if len(_ONES) > 64:
        _ONES.clear()
    ones = _ONES[n] = _u32([1]) * n
    return ones


def _u32_wire(values: Any) -> bytes:
    """Ids or counts as a little-endian u32 bin: an array('I') or bytes as they are, else packed."""
    if type(values) is bytes:
        return values
    if isinstance(values, array) and values.typecode == "I" and _LITTLE:
        return values.tobytes()
    if isinstance(values, (bytearray, memoryview)):
        return bytes(values)
    return _u32(values)


def _ids_columns(values: list) -> tuple[bytes, bytes]:
    """Every sequence's ids as one u32 buffer, and their counts."""
    kinds = set(map(type, values))
    if kinds <= {list, tuple}:
        return _u32(list(chain.from_iterable(values))), _u32(map(len, values))
    wire = [ids_to_wire(v) for v in values]
    parts = [w if type(w) is bytes else _u32(w) for w in wire]
    return b"".join(parts), _u32(len(p) // 4 for p in parts)


def _request(model: str | None, fields: dict[str, Any]) -> dict[str, Any]:
    body: dict[str, Any] = {"op": "detokenize_stream", **fields}
    if model is not None:
        body["model"] = model
    return body


def _checked(reply: dict, keys: list) -> dict:
    """The reply when ok, else its error; an error naming a sequence by index also names its key."""
    if reply.get("ok") is True:
        return reply
    error = reply.get("error")
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        m = _SEQUENCE.search(error["message"])
        if m is not None:
            i = int(m.group(1) or m.group(2))
            if i < len(keys):
                reply = {**reply, "error": {**error, "message": f"{error['message']} (sequence {i} is key {keys[i]!r})"}}
    raise error_from_reply(reply)


class AsyncDetokenizeStream(StreamBook[K]):
    """`open()` sequences, then `await step({key: ids, ...}, final=[...])` once per generation step."""

    def __init__(self, call: Callable[[dict, float | None], Awaitable[dict]], *, model: str | None,
                 timeout: float | None, columnar: bool = True) -> None:
        super().__init__(columnar=columnar)
        self._call, self._model, self._timeout = call, model, timeout

    async def step(self, steps: Mapping[K, IdsIn], *, final: Iterable[K] = (),
                   timeout: float | None = None) -> StreamStep[K]:
        return await self._send_plan(self.plan(steps, final), timeout)


    async def step_columns(self, keys: Sequence[K], tokens: Any, lengths: Any = None, *, final: Any = None,
                           timeout: float | None = None) -> StreamStep[K]:
        """One step for many sequences given as columns: `keys` in order, `tokens` every one's new
        ids concatenated (an array('I'), u32 bytes or a list of int), `lengths` how many each has
        (None: one id each), `final` one flag per key (bytes or a list of bool; None: none ends).
        Passing the same `keys` list every step (`stream.keys()` or `stream.order`) sends the
        states buffer as the last reply gave it: no map, no state and no key is touched per
        sequence. The step's texts are `result.texts()`, in `keys` order."""
        plan = self.plan_columns(keys, tokens, lengths, final)
        if plan.seqs:  # a first step with options: the dict helper's two requests
            return await self._send_plan(plan, timeout)
        t = timeout if timeout is not None else self._timeout
        reply = _checked(await self._call(_request(self._model, {"columns": plan.columns}), t), plan.col_keys)
        return self.take(plan, reply, None)

    async def _send_plan(self, plan: _Plan, timeout: float | None) -> StreamStep[K]:
        t = timeout if timeout is not None else self._timeout
        calls = []
        if plan.columns is not None:
            calls.append(self._call(_request(self._model, {"columns": plan.columns}), t))
        if plan.seqs:
            calls.append(self._call(_request(self._model, {"seqs": plan.seqs}), t))
        if not calls:
            return StreamStep([], b"", b"", b"", {}, [], [])
        replies = await asyncio.gather(*calls) if len(calls) > 1 else [await calls[0]]
        col = _checked(replies[0], plan.col_keys) if plan.columns is not None else None
        row = _checked(replies[-1], plan.row_keys) if plan.seqs else None
        return self.take(plan, col, row)


class DetokenizeStream(StreamBook[K]):
    """The synchronous twin of `AsyncDetokenizeStream`, for `Client`."""

    def __init__(self, call: Callable[[dict, float | None], dict], *, model: str | None, timeout: float | None,
                 columnar: bool = True) -> None:
        super().__init__(columnar=columnar)
        self._call, self._model, self._timeout = call, model, timeout

    def step(self, steps: Mapping[K, IdsIn], *, final: Iterable[K] = (),
             timeout: float | None = None) -> StreamStep[K]:
        return self._send_plan(self.plan(steps, final), timeout)

    def step_columns(self, keys: Sequence[K], tokens: Any, lengths: Any = None, *, final: Any = None,
                     timeout: float | None = None) -> StreamStep[K]:
        """`AsyncDetokenizeStream.step_columns`, for `Client`."""
        return self._send_plan(self.plan_columns(keys, tokens, lengths, final), timeout)

    def _send_plan(self, plan: _Plan, timeout: float | None) -> StreamStep[K]:
        t = timeout if timeout is not None else self._timeout
        # a step with first steps that carry options needs two requests: sent one after the other here
        row = _checked(self._call(_request(self._model, {"seqs": plan.seqs}), t), plan.row_keys) if plan.seqs else None
        col = (_checked(self._call(_request(self._model, {"columns": plan.columns}), t), plan.col_keys)
               if plan.columns is not None else None)
        return self.take(plan, col, row)


__all__ = ["AsyncDetokenizeStream", "DetokenizeStream", "StreamBook", "StreamDelta", "StreamStep"]
