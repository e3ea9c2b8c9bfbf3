"""Memory that does not grow as workers x models: local workers fork from one template that loaded
the startup models (workers/zygote.py), and share its pages; respawn, boot errors and stopping work
as with workers started one interpreter each.

Memory is asserted from /proc (PSS and RSS), never time. The figures behind the bounds are in
docs/sizing.md ("Memory") and scripts/bench_placement.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

from helpers import BERT_DIR, QWEN_TIKTOKEN, Conn, alive, children, cmdline, deepseek_tokenizer_json, serving, smaps_rollup, start_broker, wait_until

MODELS = ("--model", f"deepseek={deepseek_tokenizer_json()}", "--model", f"bert={BERT_DIR}", "--model", f"qwen={QWEN_TIKTOKEN}", "--model", "o200k=o200k_base")
NAMES = ("deepseek", "bert", "qwen", "o200k")


def _texts(n: int) -> list[str]:
    return [f"request {i}: the quick brown fox {i * 7919} jumps over the lazy dog, naïve café 東京 {i}" for i in range(n)]


def _serve_on_every_worker(conn: Conn, want: int, models: tuple[str, ...] = NAMES,
                           at_least: int = 0) -> dict[tuple[str, str], list[int]]:
    """Tokenize distinct texts with every model until `want` workers have answered each model (and
    at least `at_least` texts were sent); the ids per (model, text)."""
    ids: dict[tuple[str, str], list[int]] = {}
    seen: dict[str, set[str]] = {m: set() for m in models}
    for text in _texts(400):
        for model in models:
            reply = conn.call("tokenize", model=model, text=text)
            assert reply["ok"], reply
            ids[(model, text)] = reply["tokens"]
            seen[model].add(reply["worker"])
        if len(ids) >= at_least * len(models) and all(len(s) >= want for s in seen.values()):
            return ids
    raise AssertionError(f"not every worker answered every model: {seen}")


def test_two_forked_workers_hold_four_models_for_about_one_copy():
    with serving(*MODELS, workers=2) as (broker, conn):
        _serve_on_every_worker(conn, want=2)  # traffic first: pages written while serving stop being shared
        workers, template = broker.worker_pids(), broker.template_pids()
        assert len(workers) == 2 and len(template) == 1
        assert all(pid in children(template[0]) for pid in workers)
        mem = {pid: smaps_rollup(pid) for pid in (*workers, *template)}
        pool_pss = sum(m["Pss"] for m in mem.values())
        worker_rss = max(mem[pid]["Rss"] for pid in workers)
        # One interpreter per worker holds a worker's RSS each: 2 x worker_rss for the pool. Forked,
        # the models are held once (by the template, counted 1/3 in each process's PSS).
        assert pool_pss < 1.4 * worker_rss, {pid: (m["Pss"] >> 20, m["Rss"] >> 20) for pid, m in mem.items()}
        for pid in workers:
            private = mem[pid]["Private_Clean"] + mem[pid]["Private_Dirty"]
            assert private < 0.5 * mem[pid]["Rss"], (pid, private >> 20, mem[pid]["Rss"] >> 20)
        # The template holds nothing its workers do not share: its own private pages are only those
        # the workers wrote over (9 MiB with 10 tokenizers, docs/sizing.md). fastokens' per-thread
        # word caches (16-32 MiB a model) are made on a builder thread that ends before the fork.
        template_private = mem[template[0]]["Private_Clean"] + mem[template[0]]["Private_Dirty"]
        assert template_private < 32 << 20, (template_private >> 20, mem[template[0]]["Rss"] >> 20)


def test_a_killed_forked_worker_is_forked_again_and_serves_the_same_ids():
    with serving(*MODELS[:4], workers=2) as (broker, conn):
        before = _serve_on_every_worker(conn, want=2, models=NAMES[:2])
        template = broker.template_pids()
        victim = broker.worker_pids()[0]
        os.kill(victim, signal.SIGKILL)
        wait_until(lambda: victim not in broker.worker_pids() and len(broker.worker_pids()) == 2
                   and conn.call("ping")["workers"] == 2, what="the pool back to two workers")
        assert broker.template_pids() == template  # forked by the same template: nothing loaded again
        assert broker.logged("restarting it")
        after = _serve_on_every_worker(conn, want=2, models=NAMES[:2], at_least=len(before) // 2)
        assert {k: after[k] for k in before} == before
        everyone = [*broker.worker_pids(), *template]
        assert broker.stop() == 0
        assert not [pid for pid in everyone if alive(pid)]


def test_a_dead_template_takes_its_workers_and_a_new_one_forks_them_again():
    with serving(workers=2) as (broker, conn):
        ids = conn.call("tokenize", text="hello template")["tokens"]
        old_workers, (template,) = broker.worker_pids(), broker.template_pids()
        os.kill(template, signal.SIGKILL)
        wait_until(lambda: broker.template_pids() not in ([], [template]) and len(broker.worker_pids()) == 2
                   and not set(broker.worker_pids()) & set(old_workers) and conn.call("ping")["workers"] == 2,
                   what="a new template with two new workers")
        assert broker.logged("its template process")
        assert conn.call("tokenize", text="hello template")["tokens"] == ids
        assert not [pid for pid in old_workers if alive(pid)]


def test_a_boot_error_in_the_template_stops_the_broker_and_leaves_nothing(tmp_path):
    missing = tmp_path / "no-such-model"
    broker = start_broker("--model", f"bad={missing}", workers=2, expect_ready=False)
    out, err = broker.proc.communicate(timeout=120)
    assert broker.proc.returncode == 1
    assert "ready" not in out and "no-such-model" in err and "cannot start" in err
    left = [pid for pid in map(int, filter(str.isdigit, os.listdir("/proc")))
            if str(missing).encode() in cmdline(pid) and alive(pid)]
    assert not left


def test_exec_mode_still_starts_one_interpreter_per_worker():
    with serving("--worker-start", "exec", workers=1) as (broker, conn):
        assert not broker.template_pids() and len(broker.worker_pids()) == 1
        assert conn.call("tokenize", text="hello exec")["ok"]

