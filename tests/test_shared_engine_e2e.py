"""One engine per distinct tokenizer, in a real worker: models over one tokenizer.json share it.

Two models read the same tokenizer.json (one from its folder, one from a copy elsewhere), each with a
chat template of its own: the worker holds one tokenizer for both, and one pair of caches, so a text
that one model's request put in L0 is an L0 hit for the other. Each still renders its own template
and `models` lists both names.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from helpers import CHAT_TEMPLATES, LSTRIP_DIR, free_port, scrape, series, serving, wait_until

from tokenbroker.workers import engine
from tokenbroker.workers.tokenizers import load_tokenizer

TEXT = "one text, sent through both models <|user|> hello <|end|>"
TEXTS = [TEXT, "", " ", "<s>", "<|both|>x<|both|> <nl> ITEM item <w>w<w>", "words " * 300 + "<|end|>" * 3,
         "\n\n  <|user|>  \t<|end|>\u3000ünïcödé 🙂"]
MESSAGES = [{"role": "user", "content": "hi"}]
CACHE_MODES = {"off": (), "l0": ("--tokenizer-cache-enable-l0",), "l1": ("--tokenizer-cache-enable-l1",),
               "l0+l1": ("--tokenizer-cache-enable-l0", "--tokenizer-cache-enable-l1")}


@pytest.mark.parametrize("mode", list(CACHE_MODES))
def test_two_models_over_one_tokenizer_json_share_one_engine_and_its_caches(tmp_path: Path, mode: str) -> None:
    copy = tmp_path / "tokenizer.json"
    shutil.copy(LSTRIP_DIR / "tokenizer.json", copy)
    plain = tmp_path / "plain.jinja"
    plain.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}")
    reference = load_tokenizer(str(LSTRIP_DIR))
    with serving("--model", f"a={LSTRIP_DIR}", "--model-chat-template", f"a={CHAT_TEMPLATES / 'chatml.jinja'}",
                 "--model", f"b={copy}", "--model-chat-template", f"b={plain}", *CACHE_MODES[mode]) as (_, c):
        first = c.call("tokenize", model="a", text=TEXT)
        second = c.call("tokenize", model="b", text=TEXT)
        if "l0" in mode:
            assert (first["cache"]["l0"], second["cache"]["l0"]) == ("miss", "hit")  # one L0 for both models
        for flag in (True, False):
            for _ in range(2):  # a second time: what the caches kept, through the other model first
                for model in ("b", "a"):
                    got = c.call("tokenize", model=model, text=TEXTS, add_special_tokens=flag)
                    assert got["tokens"] == [reference.encode(t, add_special_tokens=flag) for t in TEXTS], (model, flag)
        prompts = {m: c.call("chat", model=m, messages=MESSAGES, add_generation_prompt=False, return_prompt=True)
                   for m in ("a", "b")}
        assert prompts["a"]["ok"] and prompts["b"]["ok"], prompts
        assert "<|im_start|>user" in prompts["a"]["prompt"] and prompts["b"]["prompt"] == "[user] hi\n"
        models = c.call("models")
        listed = {m["name"]: m for m in models["models"]}
        assert {"a", "b"} <= set(listed), models
        assert listed["a"]["fingerprint"] != listed["b"]["fingerprint"]  # the templates differ


def test_fast_engines_past_the_limit_encode_on_threads_of_their_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker whose threads hold one fast engine each (a limit kept on disk, as a measured one is)
    serves two distinct tokenizers and a third model sharing the first: one engine on its serving
    thread, one on a thread of its own, both exact; the metrics say so."""
    monkeypatch.setenv(engine.ENGINE_CACHE_ENV, str(tmp_path / "verdicts"))
    engine.write_verdict("limit", {"limit": 1})
    byte_level = tmp_path / "bytes"
    byte_level.mkdir()
    (byte_level / "tokenizer.json").write_text(engine._probe_json())
    sources = {"a": str(LSTRIP_DIR), "b": str(LSTRIP_DIR / "tokenizer.json"), "bytes": str(byte_level)}
    flags = [f for name, source in sources.items() for f in ("--model", f"{name}={source}")]
    with serving(*flags, "--tokenizer-backend", "auto", "--metrics-port", str(free_port())) as (broker, c):
        for model, source in sources.items():
            want = [load_tokenizer(source).encode(t) for t in TEXTS]
            assert c.call("tokenize", model=model, text=TEXTS)["tokens"] == want, model
            assert [c.call("tokenize", model=model, text=t)["tokens"] for t in TEXTS] == want, model
        assert {m["name"]: m["backend"] for m in c.call("models")["models"]} == dict.fromkeys(sources, "fastokens")

        def gauges() -> dict | None:
            samples = scrape(broker.metrics)
            got = {name: next(iter(series(samples, f"tokenbroker_worker_{name}").values()), None)
                   for name in ("engine_limit", "fast_engines", "engine_threads")}
            return got if got["engine_limit"] else None

        assert wait_until(gauges, what="the engine gauges") == {"engine_limit": 1, "fast_engines": 2, "engine_threads": 1}
        assert broker.logged("more encode on thread tokenbroker-engines-1")


def test_the_fast_engine_is_warmed_on_the_serving_thread_before_ready() -> None:
    """fastokens builds a thread's state for an engine at that thread's first encode with it (9-54 ms):
    the worker does it before its READY, so no request pays it."""
    with serving("--model", f"a={LSTRIP_DIR}", "--tokenizer-backend", "auto") as (broker, c):
        assert c.call("tokenize", model="a", text=TEXT)["ok"] is True
        lines = list(broker.log)
        warmed = next(i for i, line in enumerate(lines) if "fast engines: 1 placed and warmed" in line)
        joined = next(i for i, line in enumerate(lines) if "joined (pid" in line)
        assert warmed < joined, lines
        assert "1 on the serving thread" in lines[warmed]


def test_placement_gives_a_worker_no_more_tokenizers_than_its_engine_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """READY carries the worker's engine limit and placement keeps to it under the cap: with one fast
    engine a thread (a kept verdict) and --max-models-per-worker 2, two workers serve two tokenizers
    one each, none on a thread of its own, and both are exact."""
    monkeypatch.setenv(engine.ENGINE_CACHE_ENV, str(tmp_path / "verdicts"))
    engine.write_verdict("limit", {"limit": 1})
    byte_level = tmp_path / "bytes"
    byte_level.mkdir()
    (byte_level / "tokenizer.json").write_text(engine._probe_json())
    sources = {"a": str(LSTRIP_DIR), "bytes": str(byte_level)}
    flags = [f for name, source in sources.items() for f in ("--model", f"{name}={source}")]
    with serving(*flags, "--tokenizer-backend", "auto", "--max-models-per-worker", "2",
                 "--metrics-port", str(free_port()), workers=2) as (broker, c):
        for _ in range(3):
            for model, source in sources.items():
                assert c.call("tokenize", model=model, text=TEXT)["tokens"] == load_tokenizer(source).encode(TEXT)

        def placed() -> dict | None:
            samples = scrape(broker.metrics)
            fast = series(samples, "tokenbroker_worker_fast_engines")
            threads = series(samples, "tokenbroker_worker_engine_threads")
            return {"fast": sorted(fast.values()), "threads": sorted(threads.values())} if len(fast) == 2 else None

        assert wait_until(placed, what="two workers' engine gauges") == {"fast": [1, 1], "threads": [0, 0]}
        assert {m["name"]: m["workers"] for m in c.call("models")["models"]} == {"a": 1, "bytes": 1}
