"""Routing over real sockets and real worker processes: affinity, spills under load, worker loss.

What a client can observe is the reply's `worker` (which worker served it) and `cache`
(`l1_reused_tokens`: ids taken from that worker's L1). Every request here goes through a real
broker to real workers tokenizing with the embedded DeepSeek tokenizer. Where a test needs the
router's choice to be the unloaded preference, it keeps at most three requests in flight: with the
default bound (max(1.25 x mean, mean + 2)) three requests never push a worker over it, so no spill
can move a key behind the test's back.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from collections import Counter, defaultdict

import pytest
from helpers import Conn, free_port, start_broker, wait_until

EOS = "<｜end▁of▁sentence｜>"  # marked special in the embedded tokenizer: L1 cuts prefixes after it
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
WORDS = ("token cache prefix worker broker route model answer question latency throughput "
         "conversation system prompt user agent schedule batch").split()


def _words(rng: random.Random, n_bytes: int) -> str:
    out: list[str] = []
    size = 0
    while size < n_bytes:
        out.append(rng.choice(WORDS))
        size += len(out[-1]) + 1
    return " ".join(out)


def _opening(rng: random.Random, name: str) -> str:
    """A conversation's own system prompt, over 256 bytes so its first route block is its own."""
    return f"system prompt of {name}: " + _words(rng, 400) + EOS


def _next_turn(rng: random.Random, text: str, name: str, turn: int) -> str:
    return (text + f"{USER}{name} asks #{turn}: " + _words(rng, rng.randint(100, 300))
            + f"{ASSISTANT}answer #{turn}: " + _words(rng, rng.randint(150, 400)) + EOS)


def _pipeline(c: Conn, requests: list[dict], window: int) -> dict:
    """Send `requests` keeping at most `window` in flight; the replies by id."""
    replies: dict = {}
    sent = 0
    while len(replies) < len(requests):
        while sent < len(requests) and sent - len(replies) < window:
            c.send(requests[sent])
            sent += 1
        r = c.recv(timeout=60)
        replies[r["id"]] = r
    return replies


def test_turns_of_a_conversation_stay_on_one_worker_local_or_remote_and_reuse_its_l1():
    port = free_port()
    broker = start_broker("--backend", f"tcp://127.0.0.1:{port}", "--tokenizer-cache-enable-l1", workers=2)
    remote = subprocess.Popen(
        [sys.executable, "-m", "tokenbroker", "worker", "--connect", f"tcp://127.0.0.1:{port}",
         "--name", "remote-1", "--tokenizer-cache-enable-l1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    c = Conn(broker.endpoint)
    rng = random.Random(4)
    try:
        wait_until(lambda: c.call("ping")["workers"] == 3, timeout=60, what="the remote worker to join")
        # Open conversations one at a time until every worker, the remote one too, holds two.
        texts: dict[str, str] = {}
        home: dict[str, str] = {}
        while len(texts) < 40 and (len(set(home.values())) < 3 or min(Counter(home.values()).values()) < 2):
            name = f"conv{len(texts)}"
            texts[name] = _next_turn(rng, _opening(rng, name), name, 1)
            reply = c.call("tokenize", text=texts[name])
            assert reply["ok"], reply
            home[name] = reply["worker"]
        assert "remote-1" in home.values() and len(set(home.values())) == 3, Counter(home.values())

        served: dict[str, set[str]] = defaultdict(set)
        for name, worker in home.items():
            served[name].add(worker)
        previous_count = {name: None for name in texts}
        for turn in range(2, 9):  # all conversations' turn k interleaved, three in flight
            names = list(texts)
            rng.shuffle(names)
            requests = []
            for name in names:
                texts[name] = _next_turn(rng, texts[name], name, turn)
                requests.append({"id": f"{name}/{turn}", "op": "tokenize", "text": texts[name]})
            replies = _pipeline(c, requests, window=3)
            for name in names:
                r = replies[f"{name}/{turn}"]
                assert r["ok"], r
                served[name].add(r["worker"])
                reused = r["cache"]["l1_reused_tokens"]
                assert reused > 0, (name, turn, r["worker"], r["cache"])
                if previous_count[name] is not None:
                    # The whole previous turn ends at a special token: its ids come from L1.
                    assert reused >= previous_count[name] // 2, (name, turn, reused, previous_count[name])
                previous_count[name] = r["count"]
        assert {name: ws for name, ws in served.items() if len(ws) != 1} == {}
    finally:
        remote.kill()
        remote.wait()
        c.close()
        broker.stop()


def test_hot_key_stays_home_within_the_bound_and_spills_over_it():
    broker = start_broker(workers=3)
    c = Conn(broker.endpoint)
    try:
        # Three in flight never go over the bound (the third one makes it exactly 3): all stay home.
        within = _pipeline(c, [{"id": i, "op": "tokenize", "text": f"{i} " + "word " * 20000, "affinity": "hot"}
                               for i in range(3)], window=3)
        assert all(r["ok"] for r in within.values())
        assert len({r["worker"] for r in within.values()}) == 1

        # A burst of 36 on one key, three times the pool's slots (3 workers x 4): the preferred
        # worker is full and over the bound while jobs wait, so the key spills to the others.
        burst = [{"id": f"b{i}", "op": "tokenize", "text": f"{i} " + "word " * 20000, "affinity": "hot"}
                 for i in range(36)]
        for request in burst:
            c.send(request)
        replies = [c.recv(timeout=60) for _ in burst]
        assert sorted(r["id"] for r in replies) == sorted(r["id"] for r in burst)
        assert all(r["ok"] for r in replies), [r.get("error") for r in replies if not r["ok"]]
        per_worker = Counter(r["worker"] for r in replies)
        # Spilling goes to the least loaded worker with a free slot: every worker takes a share.
        assert len(per_worker) == 3, per_worker
        assert c.call("ping")["workers"] == 3
    finally:
        c.close()
        broker.stop()


def test_killed_worker_moves_only_its_own_keys():
    broker = start_broker(workers=3)
    c = Conn(broker.endpoint)
    keys = [f"session-{i}" for i in range(60)]

    def where() -> dict[str, str]:
        requests = [{"id": k, "op": "tokenize", "text": f"hello from {k}", "affinity": k} for k in keys]
        replies = _pipeline(c, requests, window=3)
        assert all(r["ok"] for r in replies.values())
        return {k: replies[k]["worker"] for k in keys}

    try:
        before = where()
        assert len(set(before.values())) == 3, Counter(before.values())
        assert where() == before  # stable while nothing changes
        pids = broker.worker_pids()
        victim_pid = pids[0]
        os.kill(victim_pid, signal.SIGKILL)
        wait_until(lambda: victim_pid not in broker.worker_pids() and c.call("ping")["workers"] == 3,
                   timeout=30, what="the killed worker to be replaced")
        after = where()
        gone = set(before.values()) - set(after.values())
        assert len(gone) == 1, (Counter(before.values()), Counter(after.values()))
        victim = gone.pop()
        moved = {k for k in keys if after[k] != before[k]}
        assert moved == {k for k in keys if before[k] == victim}
        assert moved  # the victim held keys, and they found new homes
    finally:
        c.close()
        broker.stop()


@pytest.mark.parametrize("spill_wait_ms,spreads", [(60000, False), (0, True)], ids=["waits", "spills"])
def test_a_busy_preferred_worker_is_waited_for_only_as_long_as_spill_wait(spill_wait_ms, spreads):
    """Workers of capacity 1 are full but never over the load bound: the wait alone decides."""
    port = free_port()
    broker = start_broker("--backend", f"tcp://127.0.0.1:{port}", "--spill-wait-ms", str(spill_wait_ms), workers=0)
    workers = [subprocess.Popen([sys.executable, "-m", "tokenbroker", "worker", "--connect", f"tcp://127.0.0.1:{port}",
                                 "--capacity", "1", "--name", f"cap1-{i}"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for i in range(2)]
    c = Conn(broker.endpoint)
    try:
        wait_until(lambda: c.call("ping")["workers"] == 2, timeout=60, what="two remote workers")
        text = "word " * 100_000  # long enough that the next request arrives while the first still runs
        replies = _pipeline(c, [{"id": i, "op": "tokenize", "text": text, "affinity": "one-key"} for i in range(6)], window=6)
        served = {r["worker"] for r in replies.values()}
        assert all(r["ok"] for r in replies.values())
        assert (len(served) > 1) is spreads, served
    finally:
        c.close()
        for w in workers:
            w.send_signal(signal.SIGTERM)
        for w in workers:
            w.wait(30)
        broker.stop()
