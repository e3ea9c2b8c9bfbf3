"""The columnar `detokenize_stream` (contract 1.2) in the worker's decoder: the row form's results, from buffers.

For every tokenizer the tests ship (DeepSeek's byte-level BPE, Qwen's .tiktoken, an OpenAI
encoding, BERT WordPiece, and a byte-fallback Metaspace BPE for the window decoder's byte groups),
many sequences step together with random step sizes, stop strings across steps, empty steps,
`final` and sequences finishing at different steps; at every step the same states and ids go
through both forms, which must agree sequence by sequence: text, state bytes, finish and stop.
Buffers that disagree are refused naming the field (and the sequence for a state), and a refused
step leaves nothing behind: the same states then step as if it had never been sent.
"""

from __future__ import annotations

import random
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_stream import EXAMPLES, assigned_ids, decoder, reference, texts, tokenizer

from tokenbroker.common.errors import ProtocolError

NAMES = ["deepseek", "qwen", "cl100k", "bert", "sp-bytefallback"]
FINISHED = {0: None, 1: "stop", 2: "final"}


def u32(ids) -> bytes:
    return struct.pack(f"<{len(ids)}I", *ids)


def columns_of(seqs: list[dict]) -> dict:
    """The columnar request for row-form maps that each hold `tokens`, `state` (maybe None) and `final`."""
    states = [s.get("state") or b"" for s in seqs]
    return {
        "tokens": b"".join(u32(s["tokens"]) for s in seqs),
        "lengths": u32([len(s["tokens"]) for s in seqs]),
        "states": b"".join(states),
        "state_lengths": u32([len(x) for x in states]),
        "final": bytes(1 if s.get("final") else 0 for s in seqs),
    }


def rows_of(reply: dict) -> list[dict]:
    """A columnar reply as the row form's maps, to compare them."""
    c = reply["columns"]
    n = len(c["finished"])
    tl = struct.unpack(f"<{n}I", c["text_lengths"])
    sl = struct.unpack(f"<{n}I", c["state_lengths"])
    assert sum(tl) == len(c["text"]) and sum(sl) == len(c["states"])
    assert set(c["stops"]) <= {i for i in range(n) if c["finished"][i] == 1}
    out, ta, sa = [], 0, 0
    for i in range(n):
        text, state = c["text"][ta:ta + tl[i]], c["states"][sa:sa + sl[i]]
        ta, sa = ta + tl[i], sa + sl[i]
        out.append({"text": text.decode("utf-8"), "state": state or None, "finished": FINISHED[c["finished"][i]],
                    "stop": c["stops"].get(i)})
    return out


def both(name: str, seqs: list[dict], columnar: list[bool]) -> list[dict]:
    """One step both ways: the row form for every sequence, the columnar form for those marked; they must agree."""
    d = decoder(name)
    rows = d.run([dict(s) for s in seqs])
    picked = [s for s, c in zip(seqs, columnar) if c]
    if picked:
        got = rows_of(d.run_columns(columns_of(picked), 1 << 16))
        want = [r for r, c in zip(rows, columnar) if c]
        assert got == want
    return rows


@pytest.mark.parametrize("name", NAMES)
def test_columnar_and_row_forms_agree_step_by_step(name: str) -> None:
    tok = tokenizer(name)
    stops = st.lists(st.sampled_from(["zz", "日本", "\n\n", "he", "o w", " ", "🙂", "l"]), max_size=2)

    @settings(max_examples=max(EXAMPLES // 2, 10), deadline=None, suppress_health_check=[HealthCheck.too_slow],
              database=None)
    @given(seq_texts=st.lists(texts(name), min_size=1, max_size=8), data=st.data())
    def run(seq_texts, data):
        gens = [tok.encode(t, add_special_tokens=False) for t in seq_texts]
        options = [data.draw(st.fixed_dictionaries({}, optional={
            "stop": stops, "include_stop_str_in_output": st.booleans(), "skip_special_tokens": st.booleans()}))
            for _ in gens]
        rng = random.Random(data.draw(st.integers(0, 2**32 - 1)))
        at, states, shown = [0] * len(gens), [None] * len(gens), [""] * len(gens)
        live = set(range(len(gens)))
        first = True
        while live:
            order = sorted(live)
            seqs, marks = [], []
            for k in order:
                n = rng.choice([0, 1, 1, 1, 2, 3, 5])  # empty steps among them
                chunk = gens[k][at[k]:at[k] + n]
                at[k] += len(chunk)
                final = at[k] >= len(gens[k]) and rng.random() < 0.7
                m = {"tokens": chunk, "state": states[k], "final": final}
                if states[k] is None:
                    m.update(options[k])
                seqs.append(m)
                # the columnar form carries what has a state, and first steps without options
                marks.append(states[k] is not None or not options[k])
            replies = both(name, seqs, marks)
            for k, r in zip(order, replies):
                shown[k] += r["text"]
                if r["finished"] is not None:
                    live.discard(k)
                else:
                    states[k] = r["state"]
            first = False
            for k in list(live):  # a sequence whose ids are all sent and not yet final ends with an empty final step
                if at[k] >= len(gens[k]) and rng.random() < 0.3:
                    r = both(name, [{"tokens": [], "state": states[k], "final": True}], [True])[0]
                    shown[k] += r["text"]
                    assert r["finished"] == "final"
                    live.discard(k)
        for k, g in enumerate(gens):
            if not options[k].get("stop"):
                assert shown[k] == reference(name, [], g, options[k].get("skip_special_tokens", True))
        assert not first

    run()


@pytest.mark.parametrize("name", ["deepseek", "qwen", "sp-bytefallback"])
def test_random_ids_invalid_utf8_included_agree_in_both_forms(name: str) -> None:
    """Random ids make stray and unfinished bytes (the texts' one UTF-8 check must fall back per piece)."""

    @settings(max_examples=max(EXAMPLES // 2, 10), deadline=None, suppress_health_check=[HealthCheck.too_slow],
              database=None)
    @given(gens=st.lists(st.lists(assigned_ids(name), max_size=12), min_size=1, max_size=6),
           sizes=st.lists(st.integers(0, 3), min_size=1, max_size=8))
    def run(gens, sizes):
        states, at = [None] * len(gens), [0] * len(gens)
        shown = [""] * len(gens)
        for step, size in enumerate(sizes + [max(map(len, gens))]):
            last = step == len(sizes)
            seqs = [{"tokens": g[a:a + size], "state": s, "final": last} for g, s, a in zip(gens, states, at)]
            replies = both(name, seqs, [True] * len(seqs))
            for k, r in enumerate(replies):
                at[k] += size
                shown[k] += r["text"]
                states[k] = r["state"]
        assert shown == [reference(name, [], g, True) for g in gens]

    run()


def test_a_sequence_may_start_in_the_columnar_form_with_an_empty_state() -> None:
    d = decoder("deepseek")
    ids = tokenizer("deepseek").encode("hello 日本語 🙂", add_special_tokens=False)
    row = d.run([{"tokens": ids}])[0]
    col = rows_of(d.run_columns({"tokens": u32(ids), "lengths": u32([len(ids)]), "states": b"",
                                 "state_lengths": u32([0]), "final": None}, 16))[0]
    assert col == row and row["state"] is not None


def test_a_step_sent_again_gives_the_same_reply_byte_for_byte() -> None:
    d = decoder("qwen")
    ids = tokenizer("qwen").encode("日本語 naïve 🙂🚀", add_special_tokens=False)
    seqs = [{"tokens": ids[k:k + 1], "state": None, "final": False} for k in range(len(ids))]
    first = d.run_columns(columns_of(seqs), 64)
    later = {**columns_of(seqs), "states": first["columns"]["states"], "state_lengths": first["columns"]["state_lengths"]}
    assert d.run_columns(later, 64) == d.run_columns(later, 64)
    assert decoder("qwen").run_columns(columns_of(seqs), 64) == first


# --- buffers that disagree -------------------------------------------------------------------


def good_step(name: str = "deepseek") -> tuple[dict, list[bytes]]:
    """Three sequences with states (one of them with a stop string), and their states."""
    d = decoder(name)
    ids = tokenizer(name).encode("hello world, 日本", add_special_tokens=False)
    rows = d.run([{"tokens": ids[:2]}, {"tokens": ids[:3], "stop": ["zz"]}, {"tokens": ids[:1]}])
    states = [r["state"] for r in rows]
    return {"tokens": u32([ids[2], ids[3], ids[1]]), "lengths": u32([1, 1, 1]), "states": b"".join(states),
            "state_lengths": u32([len(s) for s in states]), "final": b"\x00\x00\x00"}, states


def refused(cols: dict, code: str, *words: str, name: str = "deepseek") -> str:
    with pytest.raises(ProtocolError) as e:
        decoder(name).run_columns(cols, 1 << 16)
    assert e.value.code == code, e.value.message
    for w in words:
        assert w in e.value.message, (w, e.value.message)
    return e.value.message


def test_buffers_that_disagree_are_refused_naming_the_field() -> None:
    cols, states = good_step()
    refused({**cols, "lengths": u32([1, 1])}, "invalid_input", "columns.state_lengths")
    refused({**cols, "lengths": u32([1, 1, 2])}, "invalid_input", "columns.tokens", "adds up to 4")
    refused({**cols, "tokens": cols["tokens"][:-1]}, "invalid_input", "columns.tokens", "multiple of 4")
    refused({**cols, "lengths": cols["lengths"] + b"\x00"}, "invalid_input", "columns.lengths", "multiple of 4")
    refused({**cols, "state_lengths": cols["state_lengths"][:-2]}, "invalid_input", "columns.state_lengths")
    refused({**cols, "states": cols["states"][:-1]}, "invalid_input", "columns.states", "adds up to")
    refused({**cols, "final": b"\x00\x07\x00"}, "invalid_input", "columns.final", "sequence 1")
    refused({**cols, "final": b"\x00\x00"}, "invalid_input", "columns.final")
    refused({**cols, "tokens": u32([1, 2**31, 3])}, "invalid_input", "columns.tokens[1]", "sequence 1")
    for field in ("tokens", "lengths", "states", "state_lengths"):
        refused({k: v for k, v in cols.items() if k != field}, "bad_request", f"columns.{field}")
        refused({**cols, field: [1, 2]}, "bad_request", f"columns.{field}", "must be bin")
    refused({**cols, "final": [0, 0, 0]}, "bad_request", "columns.final", "must be bin")
    refused([cols], "bad_request", "columns", "must be map")


def test_a_short_forged_or_foreign_state_is_invalid_input_naming_its_sequence() -> None:
    cols, states = good_step()
    # a short state: the lengths still add up (the next state starts earlier), but sequence 1's is cut
    short = {**cols, "state_lengths": u32([len(states[0]), 10, len(states[1]) + len(states[2]) - 10])}
    refused(short, "invalid_input", "columns.states", "sequence 1")
    for at in (1, 5, len(states[1]) - 1):  # any changed byte of sequence 1's state
        forged = bytearray(states[1])
        forged[at] ^= 0x20
        refused({**cols, "states": states[0] + bytes(forged) + states[2]}, "invalid_input", "columns.states", "sequence 1")
    foreign = decoder("cl100k").run([{"tokens": [1, 2]}])[0]["state"]
    refused({**cols, "states": states[0] + states[1] + foreign, "state_lengths": u32([len(states[0]), len(states[1]), len(foreign)])},
            "invalid_input", "columns.states", "sequence 2")


def test_a_refused_step_disturbs_no_other_sequence() -> None:
    """The service keeps nothing of a refused step: the same good step afterwards gives what it gave before."""
    cols, states = good_step()
    d = decoder("deepseek")
    before = d.run_columns(cols, 16)
    bad = bytearray(states[2])
    bad[-1] ^= 1
    refused({**cols, "states": states[0] + states[1] + bytes(bad)}, "invalid_input", "sequence 2")
    refused({**cols, "final": b"\x00\x02\x00"}, "invalid_input", "columns.final")
    assert d.run_columns(cols, 16) == before
    # the window decoder likewise
    cols, states = good_step("bert")
    before = decoder("bert").run_columns(cols, 16)
    refused({**cols, "states": cols["states"][:-1] + bytes([cols["states"][-1] ^ 1])}, "invalid_input", "sequence 2", name="bert")
    assert decoder("bert").run_columns(cols, 16) == before


def test_stops_map_sequences_by_index_and_states_end_empty() -> None:
    d = decoder("cl100k")
    ids = tokenizer("cl100k").encode("hello world", add_special_tokens=False)
    rows = d.run([{"tokens": [], "stop": ["wor"]}, {"tokens": [], "stop_token_ids": [ids[1]]}, {"tokens": []}])
    cols = columns_of([{"tokens": ids, "state": r["state"], "final": k == 2} for k, r in enumerate(rows)])
    c = d.run_columns(cols, 16)["columns"]
    assert c["finished"] == b"\x01\x01\x02" and c["stops"] == {0: "wor", 1: ids[1]}
    assert c["state_lengths"] == u32([0, 0, 0]) and c["states"] == b""
    assert rows_of({"columns": c})[0]["text"] == "hello "
