"""A worker's memory ceiling (`serve --worker-max-memory`, docs/sizing.md): a worker whose private
memory passes it finishes its round, says BYE, serves what the broker sent before it read the BYE,
and leaves; the supervisor forks a fresh one from the template. Driven here through a real broker
and a real forked worker, with L0 on and unbounded for the test, so every distinct text the worker
keeps adds to its private memory, past a low ceiling: every request is answered exactly once, with
the reference library's ids, and the worker was replaced (the replies' `worker`, the exporter's
recycle counter, the old process gone).
"""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

from tokenbroker.common.process import EXIT_RECYCLED, memory_figures

from helpers import BERT_DIR, Conn, deepseek_tokenizer, free_port, sample, scrape, start_broker, wait_until

MiB = 1 << 20
CEILING = 36 * MiB  # a forked DeepSeek worker starts at ~5 MiB private, ~29 MiB after 200 of these, then +6 MiB per 200
WAVE = 200  # requests in flight at once (under --max-client-pending)
MAX_REQUESTS = 4000  # ~30 KiB each: the ceiling is passed well before
CHECKED = 7  # every 7th reply's ids are compared with the reference library's


WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "naïve", "café", "東京", "42", "tokens", "ceiling")


def _text(rng: random.Random, i: int) -> str:
    """About 8 KB no other request has (so each is a new L0 entry) of words every encoder knows (cheap)."""
    return f"request {i}: " + " ".join(rng.choice(WORDS) for _ in range(1400))


def test_a_worker_past_its_memory_ceiling_is_replaced_and_every_request_is_answered_once() -> None:
    broker = start_broker("--worker-max-memory", str(CEILING), "--metrics-port", str(free_port()),
                          "--tokenizer-cache-enable-l0", "--tokenizer-cache-l0-max-entries", "1000000",
                          "--tokenizer-cache-l0-max-bytes", str(1 << 30), workers=1)
    conn = Conn(broker.endpoint)
    reference = deepseek_tokenizer()
    rng = random.Random(32)
    texts: dict[str, str] = {}
    replies: dict[str, dict] = {}
    try:
        (first_pid,) = broker.worker_pids()

        def wave() -> None:
            ids = []
            for _ in range(WAVE):
                rid = f"r{len(texts)}"
                texts[rid] = _text(rng, len(texts))
                conn.send({"id": rid, "op": "tokenize", "text": texts[rid]})
                ids.append(rid)
            for _ in ids:
                reply = conn.recv(timeout=60)
                assert reply["id"] not in replies, f"{reply['id']} answered twice"
                replies[reply["id"]] = reply

        def recycles() -> float:
            return sample(scrape(broker.metrics), "tokenbroker_worker_recycles_total")

        def private() -> int:  # what the worker's heartbeat compares with its ceiling
            figures = memory_figures(first_pid)
            return CEILING + 1 if figures is None else figures[1]  # gone: it left at its ceiling

        # Requests until the worker is past its ceiling (it looks at each heartbeat, so a fast worker
        # may answer many more before it does): then it leaves, and its replacement serves.
        while private() <= CEILING and recycles() == 0:
            assert len(texts) < MAX_REQUESTS, "the worker never passed its memory ceiling"
            wave()
        while recycles() == 0:  # its next heartbeat sees it; traffic goes on meanwhile
            assert len(texts) < 4 * MAX_REQUESTS, "the worker passed its ceiling and was never replaced"
            wave()
        wave()  # and the fresh worker serves
        wait_until(lambda: first_pid not in broker.worker_pids(), what="the old worker to exit")
        assert conn.sock.poll(500) == 0, "a request was answered twice"

        assert set(replies) == set(texts)  # every request answered, none twice (checked as they came)
        assert all(reply["ok"] for reply in replies.values())
        for rid in sorted(replies)[::CHECKED]:  # the ids are the reference's (a sample: each costs ms here)
            assert replies[rid]["tokens"] == reference.encode(texts[rid]).ids, rid
        workers = {reply["worker"] for reply in replies.values()}
        assert len(workers) >= 2, workers  # the replacement answered too
        (new_pid,) = wait_until(broker.worker_pids, what="the new worker")
        assert new_pid != first_pid
        assert broker.logged("past the ceiling of 36 MiB (--max-memory)")
        assert broker.logged("left at its memory ceiling (--worker-max-memory)")
        samples = scrape(broker.metrics)
        assert sample(samples, "tokenbroker_worker_recycles_total") >= 1
        assert sample(samples, "tokenbroker_worker_restarts_total") == 0  # a recycle is not a crash
    finally:
        conn.close()
        broker.stop()


def test_a_remote_worker_past_its_own_max_memory_says_bye_and_exits_recycled(tmp_path: Path) -> None:
    """`worker --max-memory` (contract 1.4): a remote worker, whose private memory is its whole heap,
    joins, passes a 1 MiB ceiling at its first heartbeat, says BYE and exits with EXIT_RECYCLED; the
    broker then counts no worker (a remote worker has no supervisor here to replace it)."""
    port = free_port()
    broker = start_broker("--model", f"bert={BERT_DIR}", "--backend", f"tcp://127.0.0.1:{port}", workers=0, timeout=60)
    conn = Conn(broker.endpoint)
    log = tmp_path / "worker.log"
    try:
        with open(log, "w") as err:
            worker = subprocess.Popen([sys.executable, "-m", "tokenbroker", "worker", "--connect", f"tcp://127.0.0.1:{port}",
                                       "--model", f"bert={BERT_DIR}", "--max-memory", str(MiB)],
                                      stdout=subprocess.DEVNULL, stderr=err)
        assert worker.wait(60) == EXIT_RECYCLED
        said = log.read_text()
        assert "past the ceiling of 1 MiB (--max-memory)" in said and "Traceback" not in said, said
        wait_until(lambda: conn.call("ping")["workers"] == 0, what="the broker to let the worker go")
    finally:
        conn.close()
        broker.stop()
