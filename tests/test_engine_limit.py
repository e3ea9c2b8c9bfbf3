"""Never more fast engines on a thread than fastokens' per-thread state holds, and verdicts kept on disk.

In process, on real fastokens instances: the alternation probe finds a limit (and, past it, encodes
far slower than with one engine); EnginePlan puts at most that many on the calling thread and the
rest on threads of their own, where they encode the same ids; the limit and the probes' verdicts
are kept per engine version in $TOKENBROKER_ENGINE_CACHE and read back at the next start.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from helpers import LSTRIP_DIR

from tokenbroker.workers import engine
from tokenbroker.workers.engine import (LIMIT_PROBE_MAX, EnginePlan, FastEngine, build_fast, measure_limit, read_verdict,
                                        speed_up, write_verdict)
from tokenbroker.workers.tokenizers import load_tokenizer

TEXTS = ["hello <|user|> world", "", "  spaces  and <|end|> ends", "ünïcödé 🙂 " * 20]


@pytest.fixture
def verdicts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(engine.ENGINE_CACHE_ENV, str(tmp_path))
    engine.engine_limit.cache_clear()
    yield tmp_path
    engine.engine_limit.cache_clear()


def test_the_alternation_probe_finds_where_a_thread_stops_keeping_up() -> None:
    limit, seconds = measure_limit()
    assert 1 <= limit <= LIMIT_PROBE_MAX and len(seconds) == LIMIT_PROBE_MAX
    if limit < LIMIT_PROBE_MAX:  # the cliff: fastokens 0.3.5 keeps state for four engines a thread
        assert min(seconds[limit:]) > 10 * seconds[0], seconds


def test_the_limit_is_measured_once_then_read_back_from_disk(verdicts: Path) -> None:
    first = engine.engine_limit()
    kept = read_verdict("limit")
    assert kept is not None and kept["limit"] == first
    engine.engine_limit.cache_clear()
    write_verdict("limit", {"limit": 2})  # what a later start reads instead of probing again
    assert engine.engine_limit() == 2


def _engines(n: int) -> list[FastEngine]:
    tok = load_tokenizer(str(LSTRIP_DIR))
    return [build_fast(tok) for _ in range(n)]


def test_engines_beyond_the_limit_encode_on_threads_of_their_own_with_the_same_ids() -> None:
    tok = load_tokenizer(str(LSTRIP_DIR))
    want = [tok.encode(t) for t in TEXTS]
    engines = _engines(5)
    plan = EnginePlan(2)
    plan.place(engines)
    assert [e.home is None for e in engines] == [True, True, False, False, False]
    homes = {e.home for e in engines if e.home is not None}
    assert len(homes) == 2 and plan.report() == {"limit": 2, "fast": 5, "threads": 2}
    for e in engines:
        assert e.encode_many(TEXTS, True) == want
        assert [e.encode(t, True) for t in TEXTS] == want
        assert e.decode(want[0], False) == tok.decode(want[0], skip_special_tokens=False)
    seen: list[str] = []
    engines[4].home.call(lambda: seen.append(threading.current_thread().name))
    assert seen == [engines[4].home.name] != [threading.current_thread().name]
    with pytest.raises(ZeroDivisionError):  # what the engine raises reaches the caller
        engines[4].home.call(lambda: 1 / 0)
    plan.place(engines[2:])  # two let go: the next engine takes a place on this thread
    more = _engines(1)
    plan.place([*engines[2:], *more])
    assert more[0].home is None and plan.report()["fast"] == 4


def test_the_probes_verdict_is_kept_per_tokenizer_and_read_back(verdicts: Path) -> None:
    tok = load_tokenizer(str(LSTRIP_DIR))
    fast, why = speed_up(tok, "auto", fingerprint="f" * 64)
    assert fast is not None and why is None
    assert read_verdict("probe-" + "f" * 64) == {"ok": True, "guard": []}
    again, why = speed_up(tok, "auto", fingerprint="f" * 64)  # built, not probed
    assert again is not None and again.encode_many(TEXTS, True) == [tok.encode(t) for t in TEXTS]
    write_verdict("probe-" + "e" * 64, {"ok": False, "failed": "a kept refusal"})
    refused, why = speed_up(tok, "auto", fingerprint="e" * 64)  # not even built
    assert refused is None and why == "probe failed: a kept refusal"
