"""MiniJinja renders what jinja2 renders, on every template it serves; what it cannot bound goes to jinja2.

The exactness against transformers itself is tests/test_chat_render.py's (its renderers use MiniJinja
wherever it serves); here random conversations go through both engines directly, and hostile
templates and inputs show where the in-process bounds hold.
"""

from __future__ import annotations

import resource

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import CHAT_TEMPLATES
from tokenbroker.common.errors import ProtocolError
from tokenbroker.workers.chat import ChatRenderer, ChatTemplates
from tokenbroker.workers.chat.gate import gate_reason
from tokenbroker.workers.chat.mini import shared_engine
from tokenbroker.workers.chat.probes import MINIJINJA, _jinja2_outcome, _mini_outcome
from tokenbroker.workers.chat.sandbox import ChatEnvironment

SPECIALS = {"bos_token": "<s>", "eos_token": "</s>"}
SHIPPED = sorted(p.name for p in CHAT_TEMPLATES.glob("*.jinja"))


def _renderer(source: str, **kw) -> ChatRenderer:
    return ChatRenderer(ChatTemplates(source, {}, "test"), SPECIALS, **kw)


@pytest.fixture(scope="module")
def served() -> dict[str, tuple[ChatRenderer, object, int]]:
    """Every shipped template MiniJinja serves: its renderer, its jinja2 template, its MiniJinja number."""
    out = {}
    chatml = (CHAT_TEMPLATES / "chatml.jinja").read_text(encoding="utf-8")
    for name in SHIPPED:
        source = (CHAT_TEMPLATES / name).read_text(encoding="utf-8")
        if "tool_use" in name:  # a named template transformers picks only when tools are given
            r = ChatRenderer(ChatTemplates(chatml, {"default": chatml, "tool_use": source}, "test"), SPECIALS)
        else:
            r = _renderer(source)
        choice = r._choices[source]
        if choice.engine == MINIJINJA:
            out[name] = (r, ChatEnvironment().compile_template(source), choice.number)
    return out


def test_every_shipped_template_is_served_by_minijinja(served):
    """docs/chat.md lists them; a template that starts falling back must be noticed (and documented)."""
    assert sorted(served) == SHIPPED


_text = st.one_of(
    st.text(max_size=30),
    st.sampled_from(["", " ", "\n", "  a  ", "<think>\nr\n</think>\n\nanswer", "{{ x }}", "Zürich 東京 🌤️", "\t\r\n"]),
)
_role = st.sampled_from(["user", "assistant", "system", "tool", "developer"])
_part = st.one_of(st.builds(lambda t: {"type": "text", "text": t}, _text), st.just({"type": "image"}))
_content = st.one_of(_text, st.none(), st.lists(_part, max_size=3))
_call = st.builds(lambda name, args: {"id": "c1", "type": "function", "function": {"name": name, "arguments": args}},
                  st.sampled_from(["get_weather", "search"]),
                  st.one_of(st.dictionaries(st.sampled_from(["city", "n"]), _text, max_size=2), _text))
_message = st.builds(
    lambda role, content, calls, reasoning: {
        "role": role, "content": content,
        **({"tool_calls": calls} if calls and role == "assistant" else {}),
        **({"reasoning_content": reasoning} if reasoning is not None and role == "assistant" else {}),
        **({"tool_call_id": "c1", "name": "get_weather"} if role == "tool" else {}),
    },
    _role, _content, st.lists(_call, max_size=2), st.one_of(st.none(), _text))
_tool = {"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
_conversation = st.fixed_dictionaries({
    "messages": st.lists(_message, min_size=1, max_size=8),
    "tools": st.one_of(st.none(), st.just([_tool])),
    "add_generation_prompt": st.booleans(),
    "extra": st.fixed_dictionaries({}, optional={"enable_thinking": st.booleans(), "thinking": st.booleans(),
                                                 "documents": st.just([{"title": "t", "text": "x"}])}),
})


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(conversation=_conversation, template=st.sampled_from(SHIPPED))
def test_random_conversations_render_the_same_with_both_engines(served, conversation, template):
    """Whatever MiniJinja answers (a prompt or a raise_exception message) is jinja2's answer. (When it
    fails otherwise, the renderer renders with jinja2: that costs time, not exactness.)"""
    renderer, jinja_template, number = served[template]
    if "tool_use" in template and conversation["tools"] is None:
        return
    try:
        _, variables, _, fuel = renderer.variables(**conversation, source=renderer.templates.by_name()["tool_use"]
                                                   if "tool_use" in template else None)
    except ProtocolError:
        return
    mini = _mini_outcome(shared_engine(), number, variables, fuel, 1 << 24)
    if mini[0] == "error":
        return
    _, variables, _, _ = renderer.variables(**conversation, source=renderer.templates.by_name()["tool_use"]
                                            if "tool_use" in template else None)
    assert mini == _jinja2_outcome(jinja_template, variables, 1 << 24)


def test_minijinja_is_what_renders_the_common_case(served):
    """Guards the test above against comparing only fallbacks."""
    renderer, _, number = served["qwen3.jinja"]
    _, variables, _, fuel = renderer.variables([{"role": "user", "content": "hi"}])
    assert _mini_outcome(shared_engine(), number, variables, fuel, 1 << 20)[0] == "ok"
    before = renderer.fallbacks
    assert "hi" in renderer.render([{"role": "user", "content": "hi"}])
    assert renderer.fallbacks == before and renderer.sandbox.pid() is None or renderer.fallbacks == before


# --- what the gate sends to jinja2 --------------------------------------------------------------------

GROWS_AT_NO_FUEL = {
    "list_doubling": "{% set ns = namespace(l=[1]) %}{% for i in range(40) %}{% set ns.l = ns.l + ns.l %}{% endfor %}",
    "tree_doubling": "{% set ns = namespace(l=[1]) %}{% for i in range(40) %}{% set ns.l = [ns.l, ns.l] %}{% endfor %}",
    "map_doubling": "{% set ns = namespace(l=1) %}{% for i in range(40) %}{% set ns.l = {'a': ns.l, 'b': ns.l} %}{% endfor %}",
    "namespace_doubling": "{% set ns = namespace(l=1) %}{% for i in range(40) %}{% set ns.l = namespace(a=ns.l, b=ns.l) %}{% endfor %}",
    "aliased_doubling": "{% set ns = namespace(l=[1]) %}{% for i in range(40) %}{% set x = ns.l %}{% set ns.l = x + ns.l %}{% endfor %}",
    "list_append_copying": "{% set ns = namespace(l=[]) %}{% for i in range(100000) %}{% set ns.l = ns.l + [i] %}{% endfor %}",
    "macro_doubling": "{% macro g(s) %}{{ g([s, s]) }}{% endmacro %}{{ g(1) }}",
    "lazy_repeat": "{{ (['x' * 1000] * 1000000) | join | length }}",
    "format_precision": "{{ '{:.999999999f}'.format(1.0) | length }}",
    "unknown_filter": "{{ 'x' | center(1000000000) }}",
    "include": "{% include 'other' %}",
    "generation_tag": "{% generation %}{{ messages[0].content }}{% endgeneration %}",
}


@pytest.mark.parametrize("template", list(GROWS_AT_NO_FUEL.values()), ids=list(GROWS_AT_NO_FUEL))
def test_templates_fuel_cannot_bound_render_with_jinja2_and_say_why(template, caplog):
    assert gate_reason(template) is not None
    with caplog.at_level("INFO", logger="tokenbroker.workers.chat"):
        r = _renderer(template)
    assert r.engine == "jinja2"
    (line,) = [rec.getMessage() for rec in caplog.records if "renders with jinja2" in rec.getMessage()]
    assert "outside the subset" in line


def test_a_template_whose_probes_differ_renders_with_jinja2(caplog):
    """MiniJinja iterates none as empty; jinja2 (and transformers) raise: the probes see it."""
    template = "{% for t in tools %}{{ t }}{% endfor %}{{ messages[0].content }}"
    with caplog.at_level("INFO", logger="tokenbroker.workers.chat"):
        r = _renderer(template)
    assert r.engine == "jinja2"
    assert any("differs" in rec.getMessage() for rec in caplog.records)


# --- bounds in process ---------------------------------------------------------------------------------

# Templates the gate admits and the probes prove exact, which turn hostile on one input.
TRIGGERED = {
    "string_doubling": "{% if messages[0].content == 'boom' %}{% set ns = namespace(s='ab') %}{% for i in range(60) %}"
                       "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s | length }}{% endif %}{{ messages[0].content }}",
    "nested_loops": "{% if messages[0].content == 'boom' %}{% for i in range(100000) %}{% for j in range(100000) %}"
                    "{% endfor %}{% endfor %}{% endif %}{{ messages[0].content }}",
    "macro_recursion": "{% macro g(s, n) %}{% if n %}{{ g(s ~ s, n - 1) }}{% else %}{{ s | length }}{% endif %}"
                       "{% endmacro %}{% if messages[0].content == 'boom' %}{{ g('ab', 60) }}{% endif %}"
                       "{{ messages[0].content }}",
    "split_growth": "{% if messages[0].content == 'boom' %}{% set ns = namespace(s='a ') %}{% for i in range(40) %}"
                    "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s.split() | length }}{% endif %}{{ messages[0].content }}",
}


@pytest.mark.parametrize("template", list(TRIGGERED.values()), ids=list(TRIGGERED))
def test_a_served_template_turned_hostile_by_its_input_is_stopped_by_fuel_then_jinja2_names_the_budget(template):
    r = _renderer(template, max_output_bytes=1_000_000, max_seconds=1.0)
    assert r.engine == MINIJINJA
    assert r.render([{"role": "user", "content": "fine"}]) == "fine"
    source = r.templates.default
    _, variables, _, fuel = r.variables([{"role": "user", "content": "boom"}])
    before = resource.getrusage(resource.RUSAGE_SELF)
    assert _mini_outcome(shared_engine(), r._choices[source].number, variables, fuel, 1_000_000) == ("error", None)
    after = resource.getrusage(resource.RUSAGE_SELF)
    # The in-process part (the GIL held, the worker's round loop waiting) is bounded by fuel:
    assert after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime < 1.0
    assert after.ru_maxrss < before.ru_maxrss + 256 * 1024  # KiB: under 256 MiB more at peak
    with pytest.raises(ProtocolError) as e:  # then jinja2, in the render child, names the budget
        r.render([{"role": "user", "content": "boom"}])
    assert e.value.code == "template_error"
    assert "budget" in e.value.message, e.value.message
    assert r.fallbacks >= 1


def test_output_over_the_budget_is_refused_with_jinja2s_message():
    r = _renderer("{% for m in messages %}{{ m.content }}{% endfor %}", max_output_bytes=100)
    assert r.engine == MINIJINJA
    with pytest.raises(ProtocolError) as e:
        r.render([{"role": "user", "content": "é" * 60}])
    assert e.value.message == "chat template output is longer than 100 bytes (its output budget)"


def test_raise_exception_message_is_the_templates_own_without_the_render_child():
    r = _renderer("{% if messages[0].role != 'user' %}{{ raise_exception('Roles must start with user, got ' ~ "
                  "messages[0].role) }}{% endif %}{{ messages[0].content }}", prefer="auto")
    assert r.engine == MINIJINJA
    with pytest.raises(ProtocolError) as e:
        r.render([{"role": "system", "content": "s"}])
    assert e.value.code == "template_error" and e.value.message == "Roles must start with user, got system"
    assert r.fallbacks == 0


def test_python_only_whitespace_renders_with_jinja2():
    """U+001C..U+001F are whitespace to Python's strip (jinja2's trim) and not to Rust's."""
    r = _renderer("{% for m in messages %}[{{ m.content | trim }}]{% endfor %}")
    assert r.engine == MINIJINJA
    assert r.render([{"role": "user", "content": "\x1f a \x1c"}]) == "[a]"
