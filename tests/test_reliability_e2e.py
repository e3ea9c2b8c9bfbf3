"""The hostile cases of issue 24, end to end through a real broker and real workers.

- detokenize of 2,000,000 ids (an 8 MB u32 bin) decoding to ~290 MB: answered too_large before any
  text is built, the worker's resident size bounded (it reached 1,220 MiB before);
- a 5 MB frame to a broker taking 2 MB: answered too_large with its id (ZeroMQ dropped the
  connection before), and the connection still works;
- a chat template sorting a long list for seconds while small requests arrive: they are answered
  while it renders (they waited for it before), counted, not timed;
- detokenize_stream of one sequence of those ids, row and columnar: too_large the same way;
- `serve` without --workers starts one worker per usable core.
"""

from __future__ import annotations

import math
import os
from array import array

import msgpack
import pytest

from helpers import (Conn, children, deepseek_tokenizer, error_code, free_port, rss, sample, scrape, start_broker, status_bytes,
                     wait_until)
from tokenbroker.broker.config import cgroup_cpu_quota

MiB = 2**20
WORKER_GROWTH = 150 * MiB  # the 8 MB request held a few times over; building the text took 1,220 MiB
SORTS = r"""{%- for i in range(rounds) -%}{%- set x = messages[0].content | list | sort -%}{%- endfor -%}
{%- for m in messages %}<{{ m.role }}>{{ m.content[:8] }}{% endfor -%}"""


@pytest.fixture(scope="module")
def default_broker():
    """A broker started as a new user would: no --workers."""
    broker = start_broker(workers=None)
    conn = Conn(broker.endpoint)
    yield broker, conn
    conn.close()
    broker.stop()


@pytest.fixture(scope="module")
def small_frames(tmp_path_factory):
    template = tmp_path_factory.mktemp("sorts") / "sorts.jinja"
    template.write_text(SORTS, encoding="utf-8")
    broker = start_broker("--max-request-bytes", "2000000", "--chat-template", str(template), workers=1)
    conn = Conn(broker.endpoint)
    yield broker, conn
    conn.close()
    broker.stop()


@pytest.fixture(scope="module")
def one_worker():
    """One worker as served by default (fastokens, caches off, default limits): every request lands
    where a large one runs."""
    broker = start_broker("--tokenizer-backend", "auto", workers=1)
    conn = Conn(broker.endpoint)
    yield broker, conn
    conn.close()
    broker.stop()


def _longest_token() -> tuple[int, int]:
    """The DeepSeek id whose text is longest, and that text's UTF-8 length."""
    tok = deepseek_tokenizer()
    texts = tok.decode_batch([[i] for i in range(tok.get_vocab_size())])
    best = max(range(len(texts)), key=lambda i: len(texts[i].encode()))
    return best, len(texts[best].encode())


def test_workers_default_to_the_cores_this_process_may_use(default_broker):
    _, conn = default_broker
    expected = len(os.sched_getaffinity(0))
    quota = cgroup_cpu_quota()
    if quota is not None:  # a container limited to fewer CPUs than its affinity mask shows
        expected = min(expected, math.ceil(quota))
    assert conn.call("ping")["workers"] == expected


def test_detokenize_of_two_million_long_ids_is_too_large_before_any_text_is_built(default_broker):
    broker, conn = default_broker
    token, length = _longest_token()
    ids = array("I", [token]) * 2_000_000
    assert length * len(ids) > 64 * MiB  # the text would be over --max-reply-bytes (its default)
    workers = broker.worker_pids()
    before = {pid: (rss(pid), status_bytes(pid, "VmHWM")) for pid in workers}
    reply = conn.call("detokenize", tokens=ids.tobytes(), timeout=60)
    assert error_code(reply) == "too_large" and "--max-reply-bytes" in reply["error"]["message"], reply
    for pid in workers:
        resident, peak = before[pid]
        assert status_bytes(pid, "VmHWM") <= max(peak, resident + WORKER_GROWTH), "the worker built the text"
    # Near the limit, the bound is counted id by id and does not refuse a text that fits.
    short = conn.call("detokenize", tokens=(array("I", [token]) * 1000 + array("I", [64]) * 600_000).tobytes())
    assert short["ok"] and len(short["text"].encode()) == 1000 * length + 600_000, error_code(short)


def _stream_fields(ids: array, columnar: bool) -> dict:
    """One sequence of `ids` in a detokenize_stream request, in the row or the columnar form."""
    if not columnar:
        return {"seqs": [{"tokens": ids.tobytes()}]}
    return {"columns": {"tokens": ids.tobytes(), "lengths": array("I", [len(ids)]).tobytes(), "states": b"",
                        "state_lengths": array("I", [0]).tobytes()}}


@pytest.mark.parametrize("columnar", [False, True], ids=["rows", "columns"])
def test_a_stream_step_whose_text_would_pass_the_reply_limit_is_too_large_before_it_is_built(default_broker, columnar):
    broker, conn = default_broker
    token, length = _longest_token()
    ids = array("I", [token]) * 2_000_000
    workers = broker.worker_pids()
    before = {pid: (rss(pid), status_bytes(pid, "VmHWM")) for pid in workers}
    reply = conn.call("detokenize_stream", **_stream_fields(ids, columnar), timeout=60)
    assert error_code(reply) == "too_large" and "--max-reply-bytes" in reply["error"]["message"], reply
    for pid in workers:
        resident, peak = before[pid]
        assert status_bytes(pid, "VmHWM") <= max(peak, resident + WORKER_GROWTH), "the worker built the text"
    # Near the limit the bound is counted id by id: a step that fits is served, text and all.
    fits = array("I", [token]) * 1000 + array("I", [64]) * 600_000
    reply = conn.call("detokenize_stream", **_stream_fields(fits, columnar), timeout=60)
    assert reply["ok"], reply
    text = reply["columns"]["text"] if columnar else reply["seqs"][0]["text"].encode()
    assert len(text) == 1000 * length + 600_000


def _send(conn: Conn, body: bytes) -> None:
    conn.send_raw(b"", body)


@pytest.mark.parametrize("id_first", [True, False])
def test_a_frame_over_max_request_bytes_is_answered_too_large_with_its_id(small_frames, id_first):
    _, conn = small_frames
    fields = [("id", "big-1"), ("op", "tokenize"), ("text", "x" * 5_000_000)]
    body = msgpack.packb(dict(fields if id_first else fields[::-1]))
    _send(conn, body)
    reply = conn.recv(timeout=30)
    assert reply["id"] == "big-1" and error_code(reply) == "too_large", reply
    assert str(len(body)) in reply["error"]["message"] and "2000000" in reply["error"]["message"]
    assert conn.call("tokenize", text="still connected")["ok"]


def test_a_frame_of_many_times_the_limit_is_answered_and_the_broker_stays_small(small_frames):
    broker, conn = small_frames
    before = max(rss(broker.proc.pid), status_bytes(broker.proc.pid, "VmHWM"))
    frames = 4
    body = msgpack.packb({"op": "tokenize", "text": "y" * 60_000_000, "id": 7})  # under max(8 x 2 MB, 64 MiB)
    for _ in range(frames):
        _send(conn, body)
    replies = [conn.recv(timeout=60) for _ in range(frames)]
    assert [(r["id"], error_code(r)) for r in replies] == [(7, "too_large")] * frames
    assert conn.call("ping")["ok"]
    # Answered from ZeroMQ's own buffer and freed: at most the frames ZeroMQ queued, never a copy more.
    print("broker peak growth MiB", (status_bytes(broker.proc.pid, "VmHWM") - before) / MiB)
    assert status_bytes(broker.proc.pid, "VmHWM") < before + frames * len(body)


def _small_answered_while(conn: Conn, slow: dict, copies: int = 1, most: int = 200) -> tuple[int, dict]:
    """Send `copies` of `slow`, then tiny tokenize requests one after another (each awaits its reply)
    until every slow reply came or `most` went: how many were answered before, and the last slow reply."""
    for k in range(copies):
        conn.send({**slow, "id": f"slow{k}"})
    answered, reply, pending = 0, None, copies
    for i in range(most):
        conn.send({"id": i, "op": "tokenize", "text": f"small request {i}"})
        while True:
            got = conn.recv(timeout=60)
            if str(got["id"]).startswith("slow"):
                reply, pending = got, pending - 1
                continue
            assert got["id"] == i and got["ok"], got
            break
        if not pending:
            break
        answered += 1
    while pending:
        reply, pending = conn.recv(timeout=60), pending - 1
        assert str(reply["id"]).startswith("slow")
    return answered, reply


def test_small_requests_are_served_while_a_chat_template_sorts_for_seconds(small_frames):
    broker, conn = small_frames
    (worker,) = broker.worker_pids()  # one worker: every request below lands where the render runs
    answered, chat = _small_answered_while(conn, {
        "op": "chat", "messages": [{"role": "user", "content": "qwertyuiopasdfghjklzxcvbnm" * 3800}],
        "chat_template_kwargs": {"rounds": 3}})
    assert chat["ok"], chat
    # Served inline, every small request waited behind the render: none was answered before it.
    assert answered >= 20, answered
    assert broker.worker_pids() == [worker]


def test_small_requests_are_served_while_a_long_text_encodes(small_frames):
    _, conn = small_frames
    words = [f"w{i % 5000}x{i % 7}" for i in range(100_000)]
    answered, long = _small_answered_while(conn, {"op": "tokenize", "text": " ".join(words), "tokens_format": "u32"})
    assert long["ok"] and long["count"] >= 100_000, long.get("error")
    assert answered >= 10, answered  # inline (and with the worker's bytes full at the broker), none was
    # The list form of the same ids, packed in chunks on the lane, is the same reply.
    _, listed = _small_answered_while(conn, {"op": "tokenize", "text": " ".join(words)})
    assert listed["ok"] and array("I", listed["tokens"]).tobytes() == long["tokens"], listed.get("error")


def test_small_requests_keep_being_answered_while_30_mb_frames_are_read_and_encoded(one_worker):
    """The frames are taken without a copy, parsed and encoded on the encode lane in steps that each
    hold the GIL for about a millisecond, and answered from the engine's packed ids: small requests
    on the same worker keep being answered meanwhile. Before, each frame held the round loop (copy,
    parse) and then the GIL (6,000,000 ids made Python ints, then packed) for about a second."""
    _, conn = one_worker
    text = "word " * 6_000_000
    answered, big = _small_answered_while(conn, {"op": "tokenize", "text": text, "tokens_format": "u32"}, copies=4, most=5000)
    assert big["ok"] and big["count"] >= 6_000_000, big.get("error")
    print("small requests answered during four 30 MB frames:", answered)
    assert answered >= 100, answered


# `'-' * 0` keeps it on jinja2, in the render child (chat/gate.py): MiniJinja would stop the burn by fuel.
BURN = r"""{%- set jinja2_only = '-' * 0 -%}{%- if case == 'burn' -%}{%- for i in range(100000) -%}{%- for j in range(100000) -%}{%- endfor -%}{%- endfor -%}{%- endif -%}
{%- for m in messages %}<{{ m.role }}>{{ m.content[:8] }}{% endfor -%}"""


def test_a_render_past_its_deadline_is_given_up_and_the_render_lane_goes_on(tmp_path):
    """A render that would use its whole 10 s budget, sent with a 1.5 s deadline: the lane's watchdog
    answers it (timeout) once it runs a second past its deadline, kills its render child and takes
    the next chat on a fresh thread and child (before, the next chat waited out the 10 s); the
    heartbeat says the render lane gave up once and has no thread left inside a call."""
    template = tmp_path / "burn.jinja"
    template.write_text(BURN, encoding="utf-8")
    port = free_port()
    broker = start_broker("--chat-template", str(template), "--metrics-port", str(port), workers=1)
    conn = Conn(broker.endpoint)
    try:
        (worker,) = broker.worker_pids()
        chat = {"messages": [{"role": "user", "content": "hello"}]}
        assert conn.call("chat", **chat)["ok"]
        (child,) = children(worker)  # the render child, started by that render
        slow = conn.call("chat", **chat, chat_template_kwargs={"case": "burn"}, deadline_ms=1500, timeout=30)
        assert error_code(slow) == "timeout", slow
        assert conn.call("chat", **chat, timeout=30)["ok"]
        assert child not in children(worker), "the overdue render's child was left to run out its budget"
        url = f"http://127.0.0.1:{port}/metrics"

        def render_lane() -> dict[str, float]:
            return {k[0]: v for k, v in scrape(url).items() if dict(k[1]).get("lane") == "render"}

        # The thread given up on comes back once its child is killed: no thread is left inside a call.
        wait_until(lambda: render_lane().get("tokenbroker_worker_lane_replaced") == 1
                   and render_lane().get("tokenbroker_worker_lane_wedged") == 0, what="the heartbeat's lane report")
        assert broker.worker_pids() == [worker]
    finally:
        conn.close()
        broker.stop()
