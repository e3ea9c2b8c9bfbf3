"""Reply budgets charged before the work: an op that can amplify its input bounds its reply first.

`--max-reply-bytes` is checked on every built reply (Ops._capped), but a check after the build
comes too late for an op whose output is many times its input: 2,000,000 ids (an 8 MB u32 bin)
decode to hundreds of MB of text, built in full before the check refused it. So each such op
charges an upper bound of what it is about to build against the budget, and answers too_large
before building it:

- detokenize: the text's UTF-8 size is at most the sum, over the ids, of a per-tokenizer table of
  each id's decoded byte length (`DecodedLengths`, built once per tokenizer on first use);
- tokenize and chat replies: the ids' MessagePack size from their count (u32: 4 bytes per id,
  exactly; list: at most 5, counted exactly only when that bound does not fit);
- batches: item by item, the items built so far plus the next one, so a batch stops at the budget.

What a reply holds besides (its id, the worker's name, field names) is a fixed overhead on top.
"""

from __future__ import annotations

import weakref
from itertools import islice
from typing import Any, Callable, Iterable, Sequence

from tokenbroker.common.errors import ProtocolError

from .tokenizers import check_ids

ITEM_OVERHEAD = 5  # a str/bin/array header in MessagePack: at most 5 bytes
_SUM_CHUNK = 1 << 16  # ids summed per step, so a hopeless request stops early


def too_large(what: str, size: int, limit: int) -> ProtocolError:
    return ProtocolError("too_large", f"the reply would be at least {size} bytes ({what}); this worker sends at "
                         f"most {limit} (--max-reply-bytes): split the request")


class DecodedLengths:
    """For each id of a tokenizer, an upper bound of the UTF-8 bytes it adds to a decoded text.

    From the id decoded alone (special tokens kept): its byte length + 1 (decoders such as
    WordPiece and Metaspace put a space between tokens that a lone token does not show), and 3x
    that when the lone text holds U+FFFD (a token of partial UTF-8: in a sequence each of its
    bytes may become a U+FFFD of 3 bytes, and the lone text is at least as long as its bytes).
    Cleanups and skipped special tokens only shorten a text. tests/test_reliability_budgets.py
    checks the bound against every shipped tokenizer on random and adversarial sequences.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.vocab_size = tokenizer.vocab_size
        self.unassigned: frozenset[int] = getattr(tokenizer, "unassigned", frozenset())
        self.table = list(_lengths(tokenizer))  # a list: its items are cached small ints, read 4x faster than an array's
        self.longest = max(self.table, default=0)

    def loose(self, ids: Sequence[int]) -> int:
        """A bound from the count alone (the longest id's length each): free to compute."""
        return len(ids) * self.longest

    def exact(self, ids: Sequence[int], stop_above: int) -> int:
        """The bound summed over the ids (~40 ns per id), or a partial sum past `stop_above` as soon
        as the sum passes it. Invalid ids raise InvalidTokenId, as decode would."""
        check_ids(ids, self.vocab_size, self.unassigned)
        total, it, lookup = 0, iter(ids), self.table.__getitem__
        while total <= stop_above:
            chunk = sum(map(lookup, islice(it, _SUM_CHUNK)))
            if not chunk:
                break
            total += chunk
        return total


def _lengths(tokenizer: Any) -> Iterable[int]:
    if tokenizer.kind == "tiktoken":
        enc = tokenizer.raw
        for i in range(tokenizer.vocab_size):
            try:
                b = enc.decode_single_token_bytes(i)
            except KeyError:  # an unassigned id: refused by decode
                yield 0
                continue
            try:
                b.decode("utf-8")
                yield len(b)
            except UnicodeDecodeError:
                yield 3 * len(b)
        return
    singles = tokenizer.raw.decode_batch([[i] for i in range(tokenizer.vocab_size)], skip_special_tokens=False)
    for text in singles:
        n = len(text.encode("utf-8", "surrogatepass"))
        yield 3 * n + 1 if "\ufffd" in text else n + 1


_tables: "weakref.WeakKeyDictionary[Any, DecodedLengths]" = weakref.WeakKeyDictionary()


def decoded_lengths(tokenizer: Any) -> DecodedLengths:
    """The table of a tokenizer, built on its first detokenize (~0.1-0.3 s for 130k ids) and kept."""
    table = _tables.get(tokenizer)
    if table is None:
        table = _tables[tokenizer] = DecodedLengths(tokenizer)
    return table


def list_wire_bytes(ids: Sequence[int]) -> int:
    """The MessagePack size of ids as a list of ints (1, 2, 3 or 5 bytes each; ~80 ns per id), its
    header counted as 5 bytes (at most)."""
    n = len(ids)
    return n + sum(map((127).__lt__, ids)) + sum(map((255).__lt__, ids)) + 2 * sum(map((65535).__lt__, ids)) + ITEM_OVERHEAD


class ReplyBudget:
    """What is left of --max-reply-bytes for one reply, charged before each part is built.

    Each part is charged with a bound that is free to compute (`loose`) while those fit; once the
    next would not, every part charged so far is counted again with its exact size (`exact`, a
    callable: paid only by replies near the limit), and from then on each part is counted exactly.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.exact_used = 0
        self.loose_used = 0
        self._pending: list[Callable[[], int]] | None = []  # exact sizes of the parts charged loosely

    def charge(self, loose: int, exact: Callable[[], int], what: str) -> None:
        if self._pending is not None and self.exact_used + self.loose_used + loose <= self.limit:
            self.loose_used += loose
            self._pending.append(exact)
            return
        if self._pending:
            self.exact_used += sum(size() for size in self._pending)
            self.loose_used = 0
        self._pending = None  # exact from here on
        self.exact_used += exact()
        if self.exact_used > self.limit:
            raise too_large(what, self.exact_used, self.limit)

    def charge_ids(self, ids: Sequence[int], fmt: str, what: str = "its token ids") -> None:
        """Token ids about to go in the reply, as a u32 bin (exact: 4 bytes each) or a list."""
        if fmt == "u32":
            size = 4 * len(ids) + ITEM_OVERHEAD
            self.charge(size, lambda: size, what)
        else:
            self.charge(5 * len(ids) + ITEM_OVERHEAD, lambda: list_wire_bytes(ids), what)

    def charge_count(self, count: int, tokens: Any, fmt: str, what: str = "its token ids") -> None:
        """`count` numbers about to go in the reply: exact for u32 (4 bytes each); a list is charged at
        5 bytes each (the most a uint32 takes in MessagePack), or exactly from `tokens` when given."""
        if fmt == "u32":
            size = 4 * count + ITEM_OVERHEAD
            self.charge(size, lambda: size, what)
        elif tokens is None:
            size = 5 * count + ITEM_OVERHEAD
            self.charge(size, lambda: size, what)
        else:
            self.charge_ids(tokens, fmt, what)

    def charge_decoded(self, tokenizer: Any, ids: Sequence[int], what: str = "the decoded text") -> None:
        """The text `ids` decode to, before decoding them."""
        table = decoded_lengths(tokenizer)
        self.charge(table.loose(ids) + ITEM_OVERHEAD, lambda: table.exact(ids, self.limit) + ITEM_OVERHEAD, what)

    def charge_text(self, text: str, what: str) -> None:
        size = 4 * len(text) + ITEM_OVERHEAD  # UTF-8 takes at most 4 bytes per code point
        self.charge(size, lambda: len(text.encode("utf-8", "surrogatepass")) + ITEM_OVERHEAD, what)
