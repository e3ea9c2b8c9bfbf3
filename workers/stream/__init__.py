"""`detokenize_stream`: many sequences' new ids -> text deltas, exact, stateless, stop strings across steps.

The contract is docs/protocol.md "Streaming detokenization". The service keeps no memory of a
sequence: each step reads the sequence's state (workers/stream/state.py), decodes its new ids and
returns the new text with the next state.

Two decoders, chosen per tokenizer once:

- Byte table (tiktoken, and Hugging Face tokenizers whose decoder is plain ByteLevel): decoding is
  "concatenate each id's bytes, then UTF-8 with replacement", so a step joins the new ids' bytes
  onto the few bytes of an unfinished character and decodes up to that character. Exact by
  construction; the table is checked id by id against the library's own decode when built.
- Prefix window (everything else: WordPiece, Metaspace, byte fallback, ...): decode a few released
  ids of context with and without the pending ids and release the difference (vLLM's incremental
  detokenizer idea). The context makes position-dependent decoders (Metaspace drops the first
  token's space, WordPiece joins `##` pieces) render the new ids as they do mid-text. Pending ids
  are held while their text ends in U+FFFD (an unfinished character) or in a byte-fallback group
  (`<0xE6>`...: the whole group renders as U+FFFD if any byte of it is invalid, so a group is only
  released once a non-byte token closes it). For decoders that look at a token's position only, a
  fixed anchor token stands in for the context once a non-byte token is released, so a plain step
  leaves the state unchanged. All windows of a request go to one `decode_batch`.

Stop strings are then matched over the released text, holding back the longest tail that could
still begin one (workers/stream/text.py). States this worker made are kept parsed (bounded), so
the next step skips the MAC and, when nothing changed, returns the same state bytes.
"""

from __future__ import annotations

import struct
from bisect import bisect_right
from dataclasses import dataclass
from typing import Any

from tokenbroker.common.errors import ProtocolError
from tokenbroker.common.protocol import type_name

from ..budget import ReplyBudget, decoded_lengths
from .columns import FINISHED_CODE, Columns, columns_reply, read_columns
from .state import (
    HEADER_BYTES, MAX_CONTEXT_IDS, MAX_PENDING_IDS, MAX_STOP_CHARS, MAX_STOP_STRINGS, STATE_HEADER_BYTES, Options, SeqState,
    options_bytes, pack_state, state_key, unpack_state)
from .text import stop_scan, unfinished_start, valid_utf8
from .vocab import anchor_token, byte_fallback_ids, byte_level_table, tiktoken_table
from ..tokenizers import InvalidTokenId, Tokenizer, check_ids

# Released ids kept as decode context. One is enough for every decoder we know (they look at a
# token's neighbour or its index only); the context then grows by the released ids up to
# GROW_IDS, so the next step knows its context's text length from this step's decode.
CONTEXT_IDS = 1
GROW_IDS = 3
_RECENT_MAX = 1 << 14  # window states made here and kept parsed (a few hundred bytes each)
REPLACEMENT = "\ufffd"
_KNOWN_MAX = 1 << 14  # byte-table states kept, each a few dozen bytes plus its options
_DEFAULT_OPTIONS = Options()  # a sequence that starts with no option (a columnar state of length 0)
_KEPT_STATE_BYTES = 640  # states are kept (known, recent) only up to this size: both caches stay within ~40 MiB
_SEQ_REPLY_BYTES = 64  # a sequence's reply beyond its text and state: a row's keys and headers, or its lengths and flag
_WHAT = "the texts and states of its sequences"


@dataclass(slots=True)
class _Step:
    """One sequence of a request while it is being served."""

    index: int
    state: SeqState
    ids: list[int]
    flush: bool  # final, or a stop id: release everything held
    final: bool
    stop_id: int | None = None
    text: str = ""
    made: tuple | None = None  # what its state held when this worker made it (window states)
    raw_state: bytes | None = None


class StreamDecoder:
    """Serves `detokenize_stream` for one model; built once per model and kept by it (`Model.stream_decoder`)."""

    def __init__(self, tokenizer: Tokenizer, fingerprint: str) -> None:
        self.tokenizer = tokenizer
        self.key = state_key(fingerprint)
        self.vocab_size = tokenizer.vocab_size
        self.unassigned: frozenset[int] = getattr(tokenizer, "unassigned", frozenset())
        raw: Any = tokenizer.raw
        if tokenizer.kind == "tiktoken":
            self.skip_ids = frozenset(tokenizer.special_tokens.values())
            self.table: list[bytes | None] | None = tiktoken_table(raw, self.vocab_size, self.unassigned)
            self.byte_ids: dict[int, int] = {}
        else:
            self.skip_ids = frozenset(i for i, a in raw.get_added_tokens_decoder().items() if a.special)
            self.table = byte_level_table(raw, self.vocab_size)
            self.byte_ids = byte_fallback_ids(raw) if self.table is None else {}
        # byte-table states made or verified here: state -> (options, pending bytes, held text), and back
        self._known: dict[bytes, tuple[Options, bytes, str]] = {}
        self._by_content: dict[tuple[Options, bytes, str], bytes] = {}
        # The state of a sequence with default options and nothing held, the same for all of them, and
        # each id's text from that state when it leaves the state unchanged (its bytes are whole
        # characters; b"" for a skipped special id; None otherwise): a columnar step's common case.
        self.plain_state = pack_state(SeqState(_DEFAULT_OPTIONS), self.key)
        self.plain_text: list[bytes | None] | None = None
        if self.table is not None:
            self.plain_text = [b"" if i in self.skip_ids else (b if b is not None and valid_utf8(b) else None)
                               for i, b in enumerate(self.table)]
        # window states made here: state -> what it holds, so the next step need not verify it
        self._recent: dict[bytes, tuple] = {}
        # one token that stands in for any context ending in a released non-byte token (see stream/vocab.py)
        found = None if self.table is not None else anchor_token(raw, self.vocab_size, self.skip_ids | frozenset(self.byte_ids))
        self.anchor: int | None
        self.anchor, self.anchor_len = found if found is not None else (None, -1)
        # a byte token no byte completes, standing in for a byte group that is already invalid
        self.invalid_byte_id = min((i for i, b in self.byte_ids.items() if b >= 0xF8 or 0x80 <= b < 0xC0), default=None)

    @property
    def method(self) -> str:
        return "byte-table" if self.table is not None else "prefix-window"

    # --- the reply's budget, charged before any text is built --------------------------------

    def _per_seq(self) -> int:
        """What a sequence's reply may hold beyond its text and what its request's state (or options)
        held: map keys and headers, and a new state's fixed part (a window state's ids too)."""
        ids = 0 if self.table is not None else 4 * (MAX_CONTEXT_IDS + MAX_PENDING_IDS)
        return _SEQ_REPLY_BYTES + HEADER_BYTES + STATE_HEADER_BYTES + 3 + ids

    def charge_rows(self, budget: ReplyBudget, seqs: list, payload_bytes: int) -> None:
        """Charge a row request's reply before it is served (too_large before any text is built).

        Free bound first: every id takes at least a byte of the payload and decodes to at most the
        longest id's text; a state's held text and options come back at most twice over (state and
        text), so texts and states are within payload x (longest + 2) plus a fixed part per sequence.
        When that does not fit, each sequence is read (and checked, naming its fields) and counted:
        its new and pending ids by their decoded lengths, its state's options and held text twice.
        """
        lengths = decoded_lengths(self.tokenizer)
        per_seq = self._per_seq()
        loose = payload_bytes * (max(lengths.longest, 4) + 2) + len(seqs) * per_seq  # a stop id: 1 byte in, 4 in a state

        def exact() -> int:
            total = 0
            for i, m in enumerate(seqs):
                s = self._read(i, m)
                st = s.state
                total += lengths.exact(st.pending + s.ids if st.pending else s.ids, budget.limit) + per_seq
                total += 2 * (options_bytes(st.options) + 4 * len(st.held)) + len(st.pending_bytes)
                if total > budget.limit:
                    break
            return total

        budget.charge(loose, exact, _WHAT)

    def charge_columns(self, budget: ReplyBudget, c: Columns) -> None:
        """Charge a columnar request's reply (as `charge_rows`): the ids by their decoded lengths, each
        state's ids (its header says how many; a state that lies fails its MAC before anything is
        built from it) at the longest id's text, and its bytes three times (state, held text, options)."""
        lengths = decoded_lengths(self.tokenizer)
        per_seq = self._per_seq()
        state_bytes = sum(map(len, c.states))
        base = c.n * per_seq + 3 * state_bytes
        loose = base + len(c.ids) * lengths.longest + (state_bytes // 4) * lengths.longest

        def exact() -> int:
            held_ids = 0
            if self.table is None:
                for raw in c.states:
                    if len(raw) >= HEADER_BYTES + STATE_HEADER_BYTES:
                        held_ids += int.from_bytes(raw[HEADER_BYTES + 3:HEADER_BYTES + 5], "little")  # pending ids
            return base + lengths.exact(c.ids, budget.limit) + held_ids * lengths.longest

        budget.charge(loose, exact, _WHAT)

    # --- one request ---------------------------------------------------------------------

    def run(self, seqs: list, budget: ReplyBudget | None = None, payload_bytes: int = 0) -> list[dict]:
        """Serve a row request; with `budget`, its reply is charged first (`charge_rows`)."""
        if budget is not None:
            self.charge_rows(budget, seqs, payload_bytes)
        if self.table is not None:
            return [self._table_fast(m) or self._table_slow(i, m) for i, m in enumerate(seqs)]
        steps = [self._read(i, m) for i, m in enumerate(seqs)]
        windows = [s for s in steps if self._window_prepare(s)]
        if windows:
            self._window_finish(windows)
        return [self._reply(s) for s in steps]

    # --- one columnar request (contract 1.2) ----------------------------------------------

    def run_columns(self, cols: Any, max_items: int, budget: ReplyBudget | None = None) -> dict:
        """A columnar step: the same results as `run` on the equivalent `seqs`, as the reply's `columns`.

        One pass over the buffers; a byte-table model serves the common sequence (a state seen
        before, no final, no stop id) inline, as `_table_fast` does for a map, and sends any
        other through the row form's own steps, so both forms agree by construction.
        """
        c = read_columns(cols, max_items)
        self._check_column_ids(c)
        if budget is not None:
            self.charge_columns(budget, c)
        if self.table is not None:
            return self._table_columns(c)
        steps = [self._column_step(c, i) for i in range(c.n)]
        windows = [s for s in steps if self._window_prepare(s)]
        if windows:
            self._window_finish(windows)
        texts, states, finished, stops = [], [], bytearray(c.n), {}
        for s in steps:
            text, state, how, stop = self._result(s)
            texts.append(text.encode())
            states.append(state or b"")
            if how is not None:
                finished[s.index] = FINISHED_CODE[how]
                if stop is not None:
                    stops[s.index] = stop
        return columns_reply(texts, states, finished, stops)

    def _check_column_ids(self, c: Columns) -> None:
        ids = c.ids
        if ids and (max(ids) >= self.vocab_size or (self.unassigned and not self.unassigned.isdisjoint(ids))):
            try:
                check_ids(ids, self.vocab_size, self.unassigned)
            except InvalidTokenId as e:
                i = bisect_right(c.id_starts, e.index) - 1 if c.id_starts else e.index
                raise ProtocolError("invalid_input", f"field 'columns.tokens[{e.index}]': sequence {i}: {e}") from e

    def _column_step(self, c: Columns, i: int) -> _Step:
        """Sequence i of a columnar request as the row form's step (its state verified as there)."""
        ids = c.ids[i:i + 1] if c.id_starts is None else c.ids[c.id_starts[i]:c.id_starts[i + 1]]
        final = c.final is not None and c.final[i] == 1
        raw_state = c.states[i]
        if not raw_state:
            return self._begin(i, ids, final, SeqState(_DEFAULT_OPTIONS), None, None)
        return self._continue(i, ids, final, raw_state, "columns.states")

    def _table_columns(self, c: Columns) -> dict:
        """The byte-table decoder over a columnar step; mirrors `_table_fast` and `_table_slow`."""
        table, known, skip_ids = self.table, self._known, self.skip_ids
        ids, id_starts, final = c.ids, c.id_starts, c.final
        default = (_DEFAULT_OPTIONS, b"", "")
        texts: list[bytes] = []
        states: list[bytes] = []
        finished, stops = bytearray(c.n), dict[int, str | int]()
        fast_texts = False  # some text is raw table bytes, not yet checked to be valid UTF-8
        plain_state, plain_text = self.plain_state, self.plain_text
        add_text, add_state = texts.append, states.append
        one_each = id_starts is None
        for i, raw_state in enumerate(c.states):
            if one_each and final is None and (raw_state == plain_state or not raw_state):
                piece = plain_text[ids[i]]  # type: ignore[index]
                if piece is not None:  # the common step: whole characters, nothing held, the state unchanged
                    add_text(piece)
                    add_state(plain_state)
                    continue
            k = known.get(raw_state) if raw_state else default
            if k is not None and (final is None or not final[i]):
                options, pending, held = k
                seq = ids[i:i + 1] if id_starts is None else ids[id_starts[i]:id_starts[i + 1]]
                if not (options.stop_token_ids and not options.stop_token_ids.isdisjoint(seq)):
                    if options.skip_special_tokens and skip_ids and not skip_ids.isdisjoint(seq):
                        seq = [t for t in seq if t not in skip_ids]
                    data = pending + b"".join([table[t] for t in seq])  # type: ignore[index, misc]
                    cut = len(data) if not data or data[-1] < 0x80 else unfinished_start(data)
                    rest = data[cut:]
                    if options.stop:
                        text, matched, now_held = stop_scan(held, data[:cut].decode("utf-8", "replace"), options, False)
                        texts.append(text.encode())
                        if matched is not None:
                            states.append(b"")
                            finished[i] = 1
                            stops[i] = matched
                            continue
                    else:
                        texts.append(data[:cut] if cut < len(data) else data)
                        fast_texts = True
                        now_held = held
                    if rest == pending and now_held == held and raw_state:
                        states.append(raw_state)
                    else:
                        states.append(self._table_state(options, rest, now_held))
                    continue
            s = self._column_step(c, i)
            s.text = self._table_step(s)
            text, state, how, stop = self._result(s)
            texts.append(text.encode())
            states.append(state or b"")
            if how is not None:
                finished[i] = FINISHED_CODE[how]
                if stop is not None:
                    stops[i] = stop
        if fast_texts:
            _valid_texts(texts)
        return columns_reply(texts, states, finished, stops)

    def _read(self, i: int, m: Any) -> _Step:
        if type(m) is not dict:
            raise ProtocolError("bad_request", f"field 'seqs[{i}]' must be a map, got {type_name(m)}")
        tokens = m.get("tokens")
        if tokens is None:
            raise ProtocolError("bad_request", f"field 'seqs[{i}].tokens' is required")
        if type(tokens) is list and len(tokens) == 1 and type(tokens[0]) is int and 0 <= tokens[0] < self.vocab_size \
                and tokens[0] not in self.unassigned:
            ids = tokens  # one plain id, the common step: checked here without the general path
        else:
            ids = self._ids(tokens, i, "tokens")
        final = m.get("final")
        if final is None:
            final = False
        elif type(final) is not bool:
            raise ProtocolError("bad_request", f"field 'seqs[{i}].final' must be bool, got {type_name(final)}")
        raw_state = m.get("state")
        if raw_state is None:
            return self._begin(i, ids, final, self._first_state(m, i), None, None)
        if type(raw_state) is not bytes:
            raise ProtocolError("bad_request", f"field 'seqs[{i}].state' must be bin or nil, got {type_name(raw_state)}")
        return self._continue(i, ids, final, raw_state, f"seqs[{i}].state")

    def _continue(self, i: int, ids: list[int], final: bool, raw_state: bytes, where: str) -> _Step:
        """A step from a state: kept parsed when this worker made it, else verified and read."""
        made = self._recent.get(raw_state)
        if made is not None:  # made here, so verified: skip the MAC and the parse
            state = SeqState(*made)
        else:
            state = unpack_state(raw_state, self.key, i, where)
            if state.context or state.pending:
                self._check_state_ids(state, i, where)
        return self._begin(i, ids, final, state, made, raw_state)

    def _begin(self, i: int, ids: list[int], final: bool, state: SeqState, made: tuple | None,
               raw_state: bytes | None) -> _Step:
        options = state.options
        stop_id = None
        if options.stop_token_ids and not options.stop_token_ids.isdisjoint(ids):
            k = next(k for k, t in enumerate(ids) if t in options.stop_token_ids)
            stop_id, ids = ids[k], ids[:k]
        if options.skip_special_tokens and self.skip_ids and not self.skip_ids.isdisjoint(ids):
            ids = [t for t in ids if t not in self.skip_ids]
        return _Step(i, state, ids, final or stop_id is not None, final, stop_id, made=made, raw_state=raw_state)

    def _ids(self, value: Any, i: int, name: str) -> list[int]:
        """Ids given as a list of int or a u32 bin, checked against the vocabulary."""
        if type(value) is list:
            ids = value
            if ids and not (len(ids) == 1 and type(ids[0]) is int) and set(map(type, ids)) != {int}:
                j = next(j for j, t in enumerate(ids) if type(t) is not int)
                raise ProtocolError("bad_request", f"field 'seqs[{i}].{name}[{j}]' must be int, got {type_name(ids[j])}")
        elif type(value) is bytes:
            if len(value) % 4:
                raise ProtocolError(
                    "invalid_input", f"field 'seqs[{i}].{name}': a u32 bin must be a multiple of 4 bytes long, got {len(value)}")
            ids = list(struct.unpack(f"<{len(value) // 4}I", value))
        else:
            raise ProtocolError("bad_request", f"field 'seqs[{i}].{name}' must be list or bin, got {type_name(value)}")
        if ids and (min(ids) < 0 or max(ids) >= self.vocab_size or (self.unassigned and not self.unassigned.isdisjoint(ids))):
            try:
                check_ids(ids, self.vocab_size, self.unassigned)
            except InvalidTokenId as e:
                raise ProtocolError("invalid_input", f"field 'seqs[{i}].{name}[{e.index}]': {e}") from e
        return ids

    def _first_state(self, m: dict, i: int) -> SeqState:
        stop = _field(m, "stop", list, [], i)
        for j, s in enumerate(stop):
            if not isinstance(s, str):
                raise ProtocolError("bad_request", f"field 'seqs[{i}].stop[{j}]' must be str, got {type_name(s)}")
            if not 0 < len(s) <= MAX_STOP_CHARS:
                raise ProtocolError(
                    "invalid_input", f"field 'seqs[{i}].stop[{j}]': a stop string has 1 to {MAX_STOP_CHARS} characters, got {len(s)}")
        if len(set(stop)) > MAX_STOP_STRINGS:
            raise ProtocolError("invalid_input", f"field 'seqs[{i}].stop': at most {MAX_STOP_STRINGS} stop strings, got {len(set(stop))}")
        stop_ids = _field(m, "stop_token_ids", list, [], i)
        for j, t in enumerate(stop_ids):
            if type(t) is not int:
                raise ProtocolError("bad_request", f"field 'seqs[{i}].stop_token_ids[{j}]' must be int, got {type_name(t)}")
        options = Options(
            skip_special_tokens=_field(m, "skip_special_tokens", bool, True, i),
            stop=tuple(dict.fromkeys(stop)),
            stop_token_ids=frozenset(t for t in stop_ids if 0 <= t < 2**32),  # others can never match
            include_stop_str_in_output=_field(m, "include_stop_str_in_output", bool, False, i),
        )
        state = SeqState(options=options)
        prompt = m.get("prompt_tokens")
        if prompt is not None:
            ids = self._ids(prompt, i, "prompt_tokens")
            if options.skip_special_tokens and self.skip_ids:
                ids = [t for t in ids[-(MAX_PENDING_IDS + CONTEXT_IDS) * 4:] if t not in self.skip_ids]
            self._prompt_context(state, ids)
        return state

    def _check_state_ids(self, state: SeqState, i: int, where: str) -> None:
        """A forged state is well-formed but may name ids outside the vocabulary: refuse, never crash."""
        try:
            check_ids(state.context + state.pending, self.vocab_size, self.unassigned)
        except InvalidTokenId as e:
            raise ProtocolError("invalid_input", f"field '{where}': sequence {i}: holds {e}") from e

    # --- byte table ----------------------------------------------------------------------

    def _table_fast(self, m: Any) -> dict | None:
        """The common step of a byte-table model in few operations: a state seen before (so already
        verified), plain ids, no `final`, no stop id among them. None sends the step the general
        way, which checks everything and names what is wrong.
        """
        if type(m) is not dict:
            return None
        raw_state = m.get("state")
        known = self._known.get(raw_state) if type(raw_state) is bytes else None
        final = m.get("final")
        if known is None or (final is not None and final is not False):  # a `final` of 0 is no bool: the general way says so
            return None
        ids = m.get("tokens")
        if type(ids) is not list or (ids and (set(map(type, ids)) != {int} or min(ids) < 0 or max(ids) >= self.vocab_size)):
            return None
        options, pending, held = known
        if options.stop_token_ids and not options.stop_token_ids.isdisjoint(ids):
            return None
        if options.skip_special_tokens and self.skip_ids and not self.skip_ids.isdisjoint(ids):
            ids = [t for t in ids if t not in self.skip_ids]
        table = self.table
        try:
            data = pending + b"".join([table[t] for t in ids])  # type: ignore[index, misc]
        except TypeError:  # an unassigned id (None in the table): the general way names it
            return None
        cut = len(data) if not data or data[-1] < 0x80 else unfinished_start(data)
        text = data[:cut].decode("utf-8", "replace")
        rest = data[cut:]
        if options.stop:
            text, matched, now_held = stop_scan(held, text, options, False)
            if matched is not None:
                return {"text": text, "state": None, "finished": "stop", "stop": matched}
        else:
            now_held = held
        state = raw_state if rest == pending and now_held == held else self._table_state(options, rest, now_held)
        return {"text": text, "state": state, "finished": None, "stop": None}

    def _table_slow(self, i: int, m: Any) -> dict:
        s = self._read(i, m)
        s.text = self._table_step(s)
        return self._reply(s)

    def _table_state(self, options: Options, pending: bytes, held: str) -> bytes:
        """A byte-table sequence's state, packed once and kept with what it holds (so it is not verified again)."""
        key = (options, pending, held)
        state = self._by_content.get(key)
        if state is None:
            if len(self._known) >= _KNOWN_MAX:
                self._known.clear()
                self._by_content.clear()
            state = pack_state(SeqState(options, pending_bytes=pending, held=held), self.key)
            if len(state) <= _KEPT_STATE_BYTES:  # larger ones (many or long stop strings) go the general way
                self._known[state] = key
                self._by_content[key] = state
        return state

    def _table_step(self, s: _Step) -> str:
        st = s.state
        table = self.table
        data = st.pending_bytes + b"".join([table[t] for t in s.ids])  # type: ignore[index, misc]
        if s.flush:
            st.pending_bytes = b""
            return data.decode("utf-8", "replace")
        cut = unfinished_start(data)
        st.pending_bytes = data[cut:]
        return data[:cut].decode("utf-8", "replace")

    # --- prefix window -------------------------------------------------------------------

    def _window_prepare(self, s: _Step) -> bool:
        """Queue the step's ids; True when there is something to decode."""
        st = s.state
        if s.ids:
            st.pending = st.pending + s.ids  # a new list: the lists of a kept state are shared, never changed
        return bool(st.pending)

    def _window_finish(self, steps: list[_Step]) -> None:
        jobs, released = [], []
        for s in steps:
            st = s.state
            ids = st.context + st.pending
            released.append(ids)
            jobs.append(ids)
            if st.base_len < 0:  # the context's text length is not known from the previous step
                jobs.append(st.context)
        texts = self.tokenizer.raw.decode_batch(jobs, skip_special_tokens=False)
        byte_ids, anchor, anchor_len, at = self.byte_ids, self.anchor, self.anchor_len, 0
        for s, ids in zip(steps, released):
            st = s.state
            full = texts[at]
            if st.base_len < 0:
                base_len = len(texts[at + 1])
                at += 2
            else:
                base_len = st.base_len
                at += 1
            new = full[base_len:]
            if s.flush or not (new.endswith(REPLACEMENT) or st.pending[-1] in byte_ids):
                s.text = new
                st.pending = []
                if anchor is not None and ids[-1] not in byte_ids:  # the state stays the same: no new MAC
                    st.context, st.base_len = [anchor], anchor_len
                elif not byte_ids and len(ids) <= GROW_IDS:  # the common case of _next_context, inline
                    st.context, st.base_len = ids, len(full)
                else:
                    st.context = self._next_context(ids)
                    # a context that grew by the released ids decodes to `full`: the next step needs no base decode
                    st.base_len = len(full) if st.context == ids else -1
            elif len(st.pending) >= MAX_PENDING_IDS:
                s.text = self._force_release(st, full[:base_len], new)
                st.base_len = -1
            else:
                st.base_len = base_len

    def _byte_run(self, ids: list[int]) -> int:
        """How many ids at the end of `ids` are byte-fallback tokens (an open byte group)."""
        r = 0
        while r < len(ids) and ids[-1 - r] in self.byte_ids:
            r += 1
        return r

    def _next_context(self, ids: list[int]) -> list[int]:
        """Context for what follows `ids`: a few ids, never starting inside a byte group left open.

        A closed group renders the same with and without the pending ids, wherever the window
        starts. An open one must start at a character boundary (its valid text goes on the same
        way) or, when it is already invalid, be replaced by one invalid byte (it renders U+FFFD per
        byte whatever follows).
        """
        r = self._byte_run(ids) if self.byte_ids else 0
        if r == 0:
            if self.anchor is not None and ids:
                return [self.anchor]
            return ids if len(ids) <= GROW_IDS else ids[-CONTEXT_IDS:]
        group = bytes([self.byte_ids[t] for t in ids[len(ids) - r:]])
        try:
            group.decode("utf-8")
        except UnicodeDecodeError:
            return [self.invalid_byte_id] if self.invalid_byte_id is not None else ids[-CONTEXT_IDS:]
        last_char = max(i for i, b in enumerate(group) if b & 0xC0 != 0x80)
        return ids[len(ids) - (len(group) - last_char):]

    def _force_release(self, st: SeqState, base: str, new: str) -> str:
        """Too many ids held (a very long byte group or U+FFFD run): release up to a character boundary."""
        r = self._byte_run(st.pending)
        if r:
            group = bytes([self.byte_ids[t] for t in st.pending[len(st.pending) - r:]])
            cut = unfinished_start(group)
            keep = len(group) - cut
            if keep:
                done = st.pending[:len(st.pending) - keep]
                try:
                    group[:cut].decode("utf-8")
                except UnicodeDecodeError:
                    pass
                else:
                    text = self.tokenizer.raw.decode(st.context + done, skip_special_tokens=False)[len(base):]
                    st.context, st.pending = self._next_context(st.context + done), st.pending[len(done):]
                    return text
        st.context, st.pending = self._next_context(st.context + st.pending), []
        return new

    def _prompt_context(self, state: SeqState, ids: list[int]) -> None:
        """Context from the prompt's last ids; an unfinished character at its end belongs to the stream."""
        if self.table is not None:
            tail = b"".join([self.table[t] for t in ids[-3:]])  # type: ignore[misc]
            state.pending_bytes = tail[unfinished_start(tail):]
            return
        ctx = ids[-(MAX_PENDING_IDS + CONTEXT_IDS):]
        if self.byte_ids:
            r = self._byte_run(ctx)
            group = bytes([self.byte_ids[t] for t in ctx[len(ctx) - r:]])
            cut = unfinished_start(group)
            if r and cut < len(group) and valid_utf8(group[:cut]) and r < MAX_PENDING_IDS:
                state.pending = ctx[len(ctx) - r:]  # the open group renders as U+FFFD until completed
                ctx = ctx[:len(ctx) - r]
            state.context = self._next_context(ctx)
            return
        if ctx and self.tokenizer.raw.decode(ctx, skip_special_tokens=False).endswith(REPLACEMENT):
            moved = 0
            while moved < min(3, len(ctx)) and self.tokenizer.raw.decode(ctx[:len(ctx) - moved], skip_special_tokens=False).endswith(REPLACEMENT):
                moved += 1
            state.pending = ctx[len(ctx) - moved:]
            ctx = ctx[:len(ctx) - moved]
        state.context = ctx[-CONTEXT_IDS:]

    # --- stop strings and the reply ------------------------------------------------------

    def _reply(self, s: _Step) -> dict:
        text, state, finished, stop = self._result(s)
        return {"text": text, "state": state, "finished": finished, "stop": stop}

    def _result(self, s: _Step) -> tuple[str, bytes | None, str | None, str | int | None]:
        """A served step as (text, state, finished, stop), which both wire forms carry."""
        st, opts = s.state, s.state.options
        text, matched = s.text, None
        if opts.stop:
            text, matched = _apply_stops(st, text, opts, s.flush)
        if matched is not None:
            return text, None, "stop", matched
        if s.stop_id is not None:
            return text, None, "stop", s.stop_id
        if s.final:
            return text, None, "final", None
        if self.table is not None:
            return text, self._table_state(opts, st.pending_bytes, st.held), None, None
        holds = (opts, st.context, st.pending, st.pending_bytes, st.held, st.base_len)
        if holds == s.made:  # nothing changed (an anchored context, nothing held): the same state again
            return text, s.raw_state, None, None
        state = pack_state(st, self.key)
        if len(state) <= _KEPT_STATE_BYTES:
            if len(self._recent) >= _RECENT_MAX:
                self._recent.clear()
            self._recent[state] = holds
        return text, state, None, None


def _valid_texts(texts: list[bytes]) -> None:
    """Raw table bytes as the row form shows them: each piece decoded with replacement, in place.

    A piece never ends inside a character a later byte could complete (its tail is held back),
    so the concatenation is valid UTF-8 exactly when every piece is: one check for the whole step.
    """
    joined = b"".join(texts)
    if joined.isascii():
        return
    try:
        joined.decode("utf-8")
    except UnicodeDecodeError:
        for j, t in enumerate(texts):
            texts[j] = t.decode("utf-8", "replace").encode()


def _apply_stops(st: SeqState, new: str, opts: Options, flush: bool) -> tuple[str, str | None]:
    text, matched, st.held = stop_scan(st.held, new, opts, flush)
    return text, matched


def _field(m: dict, name: str, kind: type, default: Any, i: int) -> Any:
    value = m.get(name)
    if value is None:
        return default
    if type(value) is not kind:
        want = {bool: "bool", list: "list"}[kind]
        raise ProtocolError("bad_request", f"field 'seqs[{i}].{name}' must be {want}, got {type_name(value)}")
    return value
