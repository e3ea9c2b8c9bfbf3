"""Hostile chat templates through a real broker and worker: every budget holds, the worker keeps serving.

Issue 11 row 5 measured these on the old sandbox: each value below reached 1-1.9 GiB resident and
rendered "ok", and `sort`/`urlize` over big input ran 13-19 s against a 10 s budget. One template
(given with --chat-template, as an operator or an `add_model` client would) holds every case; the
request's chat_template_kwargs pick one, and the message is 16 MB of client text. Memory bounds are
asserted on the peak resident size (VmHWM) of the worker and of its render child; nothing is timed.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import Conn, deepseek_tokenizer_json, start_broker, status_bytes

HOSTILE = r"""
{%- set s = messages[0].content -%}
{%- if case == 'join' -%}{{ ([s] * 64) | join | length }}
{%- elif case == 'concat' -%}{{ (s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s
    ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s
    ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s) | length }}
{%- elif case == 'str_replace' -%}{{ s.replace('a', s) | length }}
{%- elif case == 'replace_filter' -%}{{ s | replace('a', s) | length }}
{%- elif case == 'tojson_indent' -%}{{ messages | tojson(indent=1000000) | length }}
{%- elif case == 'format_width' -%}{{ ('{:9999999}' * 200).format(*range(200)) | length }}
{%- elif case == 'sort_unique' -%}{{ s | list | sort | unique | list | length }}
{%- elif case == 'urlize' -%}{{ s | urlize | length }}
{%- elif case == 'set_block' -%}{% set x %}{% for i in range(100000) %}{{ s }}{% endfor %}{% endset %}{{ x | length }}
{%- elif case == 'sum_lists' -%}{{ ([[1]] * 300000) | sum(start=[]) | length }}
{%- else -%}{% for m in messages %}<{{ m.role }}>{{ m.content[:20] }}{% endfor %}
{%- endif -%}
"""

BIG = ("a b http://x.io <" * 1_000_000)[:16_000_000]
# The conversation: 16 MB of client text, then 200 short turns (they make tojson's indentation deep and long).
CONVERSATION = [{"role": "user", "content": BIG}] + [{"role": "user", "content": "x"}] * 200

# case: what the error must name (the budget that was exceeded)
REFUSED_BEFORE_BUILDING = {
    "join": "repeated value (*) of 1024000256 characters or more, over its size budget",
    "concat": "concatenation (~) of 32000000 characters or more, over its size budget",
    "str_replace": "replaced string (str.replace)",
    "replace_filter": "replaced string (replace)",
    "tojson_indent": "JSON text (tojson)",
    "format_width": "formatted string (str.format)",
    "sort_unique": "`sort` to order more than 100000 items (its item budget)",
    "urlize": "`urlize` 16000000 characters or more, over its input budget",
}
# Peak resident bounds: the measured cases reached 1-1.9 GiB. The worker holds the 16 MB request a few
# times over (payload, messages, the frame to its render child); the render child's address space is
# capped at its baseline + 512 MiB, and the cases refused before building stay far below that.
WORKER_PEAK = 400 * 2**20
CHILD_PEAK = 600 * 2**20


def _peak_resident(pid: int) -> int:
    """VmHWM: the most this process has ever had resident, in bytes."""
    return status_bytes(pid, "VmHWM")


def _children(pid: int) -> list[int]:
    """The process's children, whichever of its threads started them (renders start theirs on the render thread)."""
    tasks = Path(f"/proc/{pid}/task")
    return sorted(int(x) for t in tasks.iterdir() if (t / "children").exists() for x in (t / "children").read_text().split())


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    path = tmp_path_factory.mktemp("hostile") / "hostile.jinja"
    path.write_text(HOSTILE, encoding="utf-8")
    broker = start_broker("--model-path", str(deepseek_tokenizer_json()), "--chat-template", str(path), workers=1)
    (worker,) = broker.worker_pids()
    conn = Conn(broker.endpoint)
    yield broker, conn, worker
    conn.close()
    broker.stop()


def _chat(conn: Conn, case: str, messages: list = CONVERSATION) -> dict:
    return conn.call("chat", timeout=90, messages=messages, chat_template_kwargs={"case": case}, return_prompt=True)


def _assert_serves_normally(conn: Conn, broker, worker: int) -> None:
    reply = _chat(conn, "normal", [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}])
    assert reply["ok"], reply
    assert reply["prompt"] == "<user>hi<assistant>hello" and reply["count"] > 0
    assert broker.worker_pids() == [worker], "the worker was replaced"


def _assert_template_error(reply: dict, needle: str) -> str:
    assert not reply["ok"], f"rendered {str(reply.get('prompt'))[:80]!r}"
    assert reply["error"]["code"] == "template_error"
    assert needle in reply["error"]["message"], reply["error"]["message"]
    return reply["error"]["message"]


@pytest.mark.parametrize("case", list(REFUSED_BEFORE_BUILDING))
def test_hostile_template_value_is_refused_before_it_is_built_and_the_worker_keeps_serving(hostile, case):
    broker, conn, worker = hostile
    _assert_template_error(_chat(conn, case), REFUSED_BEFORE_BUILDING[case])
    (child,) = _children(worker)
    assert _peak_resident(worker) < WORKER_PEAK
    assert _peak_resident(child) < CHILD_PEAK
    _assert_serves_normally(conn, broker, worker)
    assert _children(worker) == [child], "a refused value must not cost the render child its life"


def test_a_value_no_check_predicts_hits_the_render_childs_memory_budget_and_the_child_is_replaced(hostile):
    """A set block buffers 100,000 references to the 16 MB text and joins them: 1.6 TB, in one C call."""
    broker, conn, worker = hostile
    _chat(conn, "normal", [{"role": "user", "content": "warm up"}])
    (before,) = _children(worker)
    _assert_template_error(_chat(conn, "set_block"), "ran past its memory budget of 512 MiB")
    assert _peak_resident(worker) < WORKER_PEAK
    _assert_serves_normally(conn, broker, worker)
    (after,) = _children(worker)
    assert after != before
    assert _peak_resident(after) < CHILD_PEAK


def test_one_long_c_call_is_cut_at_the_time_budget_by_killing_the_render_child(hostile):
    """Summing 300,000 one-item lists copies the growing sum each time: ~130 s in one C call (sum)."""
    broker, conn, worker = hostile
    _chat(conn, "normal", [{"role": "user", "content": "warm up"}])
    (before,) = _children(worker)
    reply = _chat(conn, "sum_lists", [{"role": "user", "content": "x"}])
    _assert_template_error(reply, "took longer than 10 s (its time budget)")
    _assert_serves_normally(conn, broker, worker)
    assert _children(worker) not in ([], [before]), "the stuck render child was not replaced"
