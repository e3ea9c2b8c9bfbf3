"""What each format's schema contributes to a count: every harvested field, every skipped one, images, detection.

Each test compares the count of a body with and without one field, so the difference is exactly what that
field costs: its text through a real tokenizer (o200k_base for OpenAI, DeepSeek's tokenizer.json mapped to
claude-* and gemini-*), plus the documented framing.
"""

from __future__ import annotations

import base64
import json
import struct
import zlib
from collections.abc import Callable
from functools import lru_cache

import pytest
import tiktoken
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import deepseek_tokenizer
from tokenbroker.workers.count import CountResult, count_request
from tokenbroker.workers.count.detect import detect_format
from tokenbroker.workers.count.images import anthropic_image_tokens, gemini_image_tokens, image_size, openai_image_tokens
from tokenbroker.workers.count.json_writer import Notes, Walk
from tokenbroker.workers.tokenizer_map import TokenizerMap

Encoder = Callable[[str], int]


@lru_cache(maxsize=None)
def o200k() -> Encoder:
    enc = tiktoken.get_encoding("o200k_base")
    return lambda text: len(enc.encode(text, allowed_special="all"))


@lru_cache(maxsize=None)
def cl100k() -> Encoder:
    enc = tiktoken.get_encoding("cl100k_base")
    return lambda text: len(enc.encode(text, allowed_special="all"))


@lru_cache(maxsize=None)
def deepseek() -> Encoder:
    tok = deepseek_tokenizer()
    return lambda text: len(tok.encode(text, add_special_tokens=False).ids)


class Env:
    """Real tokenizers: OpenAI encodings by name; claude-* and gemini-* mapped to DeepSeek's tokenizer."""

    map = TokenizerMap([("claude-*", "deepseek"), ("gemini-*", "deepseek")])

    def tiktoken(self, encoding: str) -> Encoder | None:
        return o200k() if encoding == "o200k_base" else cl100k() if encoding == "cl100k_base" else None

    def loaded(self, model: str) -> tuple[str, str, Encoder] | None:
        return ("deepseek", "huggingface", deepseek()) if self.map.lookup(model) else None

    def fallback(self) -> tuple[str, Encoder] | None:
        return None


MODEL = {"openai.chat": "gpt-4o", "openai.responses": "gpt-4o", "anthropic.messages": "claude-sonnet-4", "gemini.generate": "gemini-2.5-pro"}


def count(body: dict, fmt: str, model: str | None = None) -> CountResult:
    return count_request(body, format=fmt, model=model or MODEL[fmt], strict=False, env=Env())


def delta(fmt: str, base: dict, extended: dict, model: str | None = None) -> tuple[int, list[str]]:
    """What `extended` costs beyond `base`, and the warnings it brings."""
    a, b = count(base, fmt, model), count(extended, fmt, model)
    return b.count - a.count, [w for w in b.warnings if w not in a.warnings]


def enc(fmt: str) -> Encoder:
    return o200k() if fmt.startswith("openai.") else deepseek()


# --- images: real files built here -----------------------------------------------------------------


def png(width: int, height: int) -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    rows = (b"\x00" + b"\x80" * (3 * width)) * height
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")


def b64png(width: int, height: int) -> str:
    return base64.b64encode(png(width, height)).decode()


def test_image_sizes_are_read_from_png_gif_jpeg_and_webp_headers() -> None:
    gif = b"GIF89a" + struct.pack("<HH", 321, 123) + b"\x00\x00\x00;"
    app0 = b"\xff\xe0" + struct.pack(">H", 16) + b"JFIF\x00\x01\x01\x00\x00\x01\x00\x01\x00\x00"
    jpeg = b"\xff\xd8" + app0 + b"\xff\xc0" + struct.pack(">HBHHB", 11, 8, 480, 640, 1) + b"\x01\x11\x00\xff\xd9"
    vp8x = b"RIFF" + struct.pack("<I", 30) + b"WEBPVP8X" + struct.pack("<I", 10) + b"\x00" * 4 + (799).to_bytes(3, "little") + (599).to_bytes(3, "little")
    assert image_size(png(37, 11)) == (37, 11)
    assert image_size(gif) == (321, 123)
    assert image_size(jpeg) == (640, 480)
    assert image_size(vp8x) == (800, 600)
    assert image_size(b"not an image") is None


def test_published_image_rules() -> None:
    assert openai_image_tokens(1024, 1024, detail="high", model="gpt-4o") == 765
    assert openai_image_tokens(2048, 4096, detail="high", model="gpt-4o") == 1105
    assert openai_image_tokens(4096, 4096, detail="low", model="gpt-4o") == 85
    assert openai_image_tokens(1024, 1024, detail="auto", model="gpt-4o-mini") == 2833 + 4 * 5667
    assert openai_image_tokens(1024, 1024, detail=None, model="gpt-4.1-mini") == 1659  # 1024 patches x 1.62
    assert openai_image_tokens(1800, 2400, detail=None, model="o4-mini") == 2498  # OpenAI's worked example: 1452 patches, x 1.72
    assert anthropic_image_tokens(1092, 1092) == 1590
    assert anthropic_image_tokens(200, 200) == 54
    assert gemini_image_tokens(384, 384) == 258
    assert gemini_image_tokens(1000, 500) == 516


# --- openai.chat -----------------------------------------------------------------------------------

CHAT = {"messages": [{"role": "user", "content": "What is the capital of France?"}]}


def chat_with(*messages: dict, **top: object) -> dict:
    return {"messages": CHAT["messages"] + list(messages), **top}


def test_chat_message_costs_role_content_and_three() -> None:
    e = o200k()
    assert delta("openai.chat", CHAT, chat_with({"role": "assistant", "content": "Paris."})) == (3 + e("assistant") + e("Paris."), [])


def test_chat_text_parts_count_like_their_joined_text() -> None:
    parts = chat_with({"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "world"}]})
    joined = chat_with({"role": "user", "content": "Hello world"})
    assert count(parts, "openai.chat").count == count(joined, "openai.chat").count


def test_chat_name_costs_its_tokens_and_one() -> None:
    e = o200k()
    assert delta("openai.chat", chat_with({"role": "user", "content": "x"}), chat_with({"role": "user", "content": "x", "name": "alice"}))[0] == e("alice") + 1


def test_chat_tool_calls_cost_name_arguments_and_three_each_and_tool_results_the_called_name() -> None:
    e = o200k()
    one = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_abc123", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]}
    two = {"role": "assistant", "content": None, "tool_calls": [
        *one["tool_calls"], {"id": "call_def456", "type": "custom", "custom": {"name": "run_sql", "input": "SELECT 1"}}]}
    result = {"role": "tool", "tool_call_id": "call_abc123", "content": "18C and sunny"}
    assert delta("openai.chat", CHAT, chat_with(one)) == (3 + e("assistant") + e("get_weather") + e('{"city":"Paris"}') + 3, [])
    cost, warnings = delta("openai.chat", CHAT, chat_with(two))
    assert cost == 3 + e("assistant") + e("get_weather") + e('{"city":"Paris"}') + e("run_sql") + e("SELECT 1") + 2 * 3
    assert warnings == ["OpenAI renders several tool calls in one message as one parallel call: their count is an estimate."]
    # a tool result is its role, the name of the function it answers (found by its call id), its content,
    # and 2 more on the gpt-4o families (none on gpt-4 and gpt-3.5)
    assert delta("openai.chat", chat_with(one), chat_with(one, result))[0] == 3 + e("tool") + e("get_weather") + e("18C and sunny") + 2
    c = cl100k()
    assert delta("openai.chat", chat_with(one), chat_with(one, result), model="gpt-4")[0] == 3 + c("tool") + c("get_weather") + c("18C and sunny")
    cost, warnings = delta("openai.chat", CHAT, chat_with(result))
    assert cost == 3 + e("tool") + e("18C and sunny") + 2
    assert warnings == ["A tool result answers no call in the body: the name of its function was not counted."]


def test_chat_legacy_function_call_and_refusal_are_counted() -> None:
    e = o200k()
    legacy = {"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}}
    refusal = {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't help."}], "refusal": "No."}
    assert delta("openai.chat", CHAT, chat_with(legacy))[0] == 3 + e("assistant") + e("f") + e("{}") + 3
    function = {"role": "function", "name": "f", "content": "42"}
    assert delta("openai.chat", CHAT, chat_with(function))[0] == 3 + e("f") + e("42")  # its name stands for the role
    assert delta("openai.chat", CHAT, chat_with(refusal))[0] == 3 + e("assistant") + e("I can't help.") + e("No.")


def test_chat_audio_file_parts_and_a_plain_response_format_are_not_counted() -> None:
    user = {"role": "user", "content": [{"type": "text", "text": "Transcribe"}]}
    extended = {"role": "user", "content": [{"type": "text", "text": "Transcribe"},
                                            {"type": "input_audio", "input_audio": {"data": "UklGRg==" * 500, "format": "wav"}},
                                            {"type": "file", "file": {"file_data": "JVBERi0=" * 500, "filename": "a.pdf"}}]}
    cost, warnings = delta("openai.chat", chat_with(user), chat_with(extended, response_format={"type": "json_object"}))
    assert cost == 0
    assert warnings == ["Content parts of type 'input_audio' are not counted (audio and files are not text).",
                        "Content parts of type 'file' are not counted (audio and files are not text)."]


def test_chat_tools_and_legacy_functions_cost_their_namespace_block() -> None:
    f = {"name": "lookup", "description": "Find a record.", "parameters": {"type": "object", "required": ["id"], "properties": {
        "id": {"type": "string", "description": "The id."},
        "filter": {"type": "object", "description": "Filter", "properties": {"year": {"type": "integer", "description": "Year"},
                                                                                "tags": {"type": "array", "items": {"type": "string"}}}},
        "sort": {"anyOf": [{"type": "string", "enum": ["asc", "desc"]}, {"type": "null"}]}}}}
    tools = count(chat_with(tools=[{"type": "function", "function": f}]), "openai.chat").count
    assert count(chat_with(functions=[f]), "openai.chat").count == tools
    block = ("namespace functions {\n\n// Find a record.\ntype lookup = (_: {\n// The id.\nid: string,\n// Filter\n"
             "filter?: {\n  year?: number,\n  tags?: string[],\n},\nsort?: \"asc\" | \"desc\" | null,\n}) => any;\n\n"
             "} // namespace functions")
    assert tools - count(CHAT, "openai.chat").count == o200k()(block) + 9  # nested descriptions are not rendered
    with_system = {"messages": [{"role": "system", "content": "Be brief."}, *CHAT["messages"]]}
    e = o200k()
    extra = count({**with_system, "tools": [{"type": "function", "function": f}]}, "openai.chat").count - count(with_system, "openai.chat").count
    assert extra == o200k()(block) + 9 - 4 + e("Be brief.\n") - e("Be brief.")  # they join the system message


def test_chat_tool_choice_none_costs_one_and_a_named_function_four_and_its_name() -> None:
    f = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}
    base = chat_with(tools=[f])
    assert delta("openai.chat", base, {**base, "tool_choice": "none"})[0] == 1
    assert delta("openai.chat", base, {**base, "tool_choice": "auto"})[0] == 0
    named = {**base, "tool_choice": {"type": "function", "function": {"name": "lookup"}}}
    assert delta("openai.chat", base, named)[0] == 4 + o200k()("lookup")


def test_structured_output_schemas_cost_their_response_format_block() -> None:
    schema = {"type": "object", "properties": {"answer": {"type": "string"}, "required": {"type": "boolean"}},
              "required": ["answer"], "additionalProperties": False}
    shown = '{"type":"object","properties":{"answer":{"type":"string"},"required":{"type":"boolean"}}}'  # keywords dropped, names kept
    block = "# Response Formats\n\n## reply\n\n// One answer.\n" + shown
    spec = {"name": "reply", "description": "One answer.", "schema": schema, "strict": True}
    assert delta("openai.chat", CHAT, chat_with(response_format={"type": "json_schema", "json_schema": spec})) == (o200k()(block), [])
    assert delta("openai.responses", RESP, resp_with(text={"format": {"type": "json_schema", **spec}})) == (o200k()(block), [])
    system = {"messages": [{"role": "system", "content": "Be brief."}, *CHAT["messages"]]}  # joined to it after a blank line
    cost = delta("openai.chat", system, {**system, "response_format": {"type": "json_schema", "json_schema": spec}})[0]
    assert cost == o200k()("\n\n" + block)


def test_chat_builtin_tools_are_not_counted_and_say_so() -> None:
    cost, warnings = delta("openai.chat", CHAT, chat_with(tools=[{"type": "web_search_preview"}]))
    assert cost == 0 and warnings == ["Built-in tools (type 'web_search_preview') are not counted."]


def test_chat_images_follow_openai_rules_and_base64_is_never_text() -> None:
    def image(url: str, detail: str | None = None) -> dict:
        return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url, **({"detail": detail} if detail else {})}}]}

    e = o200k()
    empty = 3 + e("user")
    data = "data:image/png;base64," + b64png(1024, 1024)
    assert delta("openai.chat", CHAT, chat_with(image(data)))[0] == empty + 765
    assert delta("openai.chat", CHAT, chat_with(image(data, "low")))[0] == empty + 85
    assert delta("openai.chat", CHAT, chat_with(image(data)), model="gpt-4o-mini")[0] == empty + 2833 + 4 * 5667
    cost, warnings = delta("openai.chat", CHAT, chat_with(image("https://example.com/cat.jpg")))
    assert cost == empty + 765
    assert warnings == ["An image whose size could not be read (a URL, a file, or data that is not PNG, GIF, WebP or JPEG) "
                        "was counted as a 1024x1024 image (765 tokens), an estimate."]
    assert delta("openai.chat", CHAT, chat_with(image("https://example.com/cat.jpg", "low"))) == (empty + 85, [])
    cost, warnings = delta("openai.chat", CHAT, chat_with(image("data:image/heic;base64,AAAAGGZ0eXBoZWlj", "high")))
    assert cost == empty + 765 and "at detail 'high' (765 tokens)" in warnings[0]  # bytes it cannot size: still an image
    other = {"role": "user", "content": [{"type": "input_image", "image_url": "https://example.com/a.png", "detail": "low"}]}
    assert delta("openai.chat", CHAT, chat_with(other)) == (empty + 85, [])  # another API's spelling is an image too
    alone = {"role": "user", "content": other["content"][0]}  # one part given as a map, not a list
    assert delta("openai.chat", CHAT, chat_with(alone)) == (empty + 85, [])


# --- openai.responses ------------------------------------------------------------------------------

RESP = {"input": [{"role": "user", "content": "Plan a trip."}]}


def resp_with(*items: dict, **top: object) -> dict:
    return {"input": RESP["input"] + list(items), **top}


def test_responses_items_cost_their_text() -> None:
    e = o200k()
    message = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Where to?"}]}
    call = {"type": "function_call", "call_id": "call_1", "name": "search", "arguments": '{"q":"Rome"}'}
    output = {"type": "function_call_output", "call_id": "call_1", "output": "3 results"}
    custom = {"type": "custom_tool_call", "call_id": "c", "name": "shell", "input": "ls -la"}
    assert delta("openai.responses", RESP, resp_with(message))[0] == 3 + e("assistant") + e("Where to?")
    # a call is an assistant message with a call, its output a tool message naming the called function (as in chat)
    assert delta("openai.responses", RESP, resp_with(call))[0] == 3 + e("assistant") + e("search") + e('{"q":"Rome"}') + 3
    assert delta("openai.responses", resp_with(call), resp_with(call, output))[0] == 3 + e("tool") + e("search") + e("3 results")
    assert delta("openai.responses", RESP, resp_with(custom))[0] == 3 + e("assistant") + e("shell") + e("ls -la") + 3


def test_responses_reasoning_counts_only_in_the_current_turn_and_by_its_visible_text() -> None:
    e = o200k()
    item = {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "Compared prices."}],
            "encrypted_content": "gAAAAB" * 300}
    assert delta("openai.responses", RESP, resp_with(item)) == (
        3 + e("Compared prices."),
        ["Reasoning kept for the current turn is counted by its visible text; its hidden tokens are not known here (an estimate)."])
    later = {"role": "user", "content": "And in May?"}
    assert delta("openai.responses", resp_with(later), {"input": [*RESP["input"], item, later]}) == (
        0, ["Reasoning items of earlier turns are not counted: OpenAI strips them from the context."])


def test_responses_images_files_references_and_builtin_tools() -> None:
    e = o200k()
    image = {"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64," + b64png(512, 512), "detail": "high"}]}
    assert delta("openai.responses", RESP, resp_with(image))[0] == 3 + e("user") + 85 + 170
    pdf = {"role": "user", "content": [{"type": "input_file", "file_data": "JVBERi0=" * 100}]}
    assert delta("openai.responses", RESP, resp_with(pdf)) == (3 + e("user"), ["Content parts of type 'input_file' are not counted (audio and files are not text)."])
    assert delta("openai.responses", RESP, resp_with({"type": "item_reference", "id": "msg_1"})) == (0, ["Input items of type 'item_reference' are not counted."])
    cost, warnings = delta("openai.responses", RESP, resp_with(tools=[{"type": "web_search"}], previous_response_id="resp_1"))
    assert cost == 0 and warnings == ["Earlier turns referenced by previous_response_id or conversation are not counted.",
                                      "Built-in tools (type 'web_search') are not counted."]


def test_responses_flat_function_tools_render_like_chat_tools_with_their_own_framing() -> None:
    f = {"name": "lookup", "description": "Find a record.", "parameters": {"type": "object", "properties": {"id": {"type": "string", "description": "The id."}}}}
    chat = count({"messages": [], "tools": [{"type": "function", "function": f}]}, "openai.chat").count
    responses = count({"input": [], "tools": [{"type": "function", **f}]}, "openai.responses").count
    assert chat - responses == 9 - 3  # the same block; Responses frames it with 3, chat with 9
    plain = {"name": "lookup", "parameters": {"type": "object", "properties": {"id": {"type": "string"}}, "required": ["id"]}}
    described = json.loads(json.dumps(plain))
    described["parameters"]["properties"]["id"]["description"] = "The id."
    e = o200k()
    plain_cost = count({"input": [], "tools": [{"type": "function", **plain}]}, "openai.responses").count
    # every property required and none described: one less on the gpt-4o families (recorded usage)
    assert plain_cost == count({"input": []}, "openai.responses").count + e(
        "namespace functions {\n\ntype lookup = (_: {\nid: string,\n}) => any;\n\n} // namespace functions") + 3 - 1
    described_cost = count({"input": [], "tools": [{"type": "function", **described}]}, "openai.responses").count
    assert described_cost == count({"input": []}, "openai.responses").count + e(
        "namespace functions {\n\ntype lookup = (_: {\n// The id.\nid: string,\n}) => any;\n\n} // namespace functions") + 3
    reasoning = count({"input": [], "tools": [{"type": "function", **plain}]}, "openai.responses", model="o3").count
    assert reasoning - count({"input": []}, "openai.responses", model="o3").count == plain_cost - count({"input": []}, "openai.responses").count + 5


# --- anthropic.messages ----------------------------------------------------------------------------

ANT = {"messages": [{"role": "user", "content": "Summarise this."}]}


def ant_with(*messages: dict, **top: object) -> dict:
    return {"messages": ANT["messages"] + list(messages), **top}


def test_anthropic_system_text_thinking_and_tool_use() -> None:
    e = deepseek()
    assert delta("anthropic.messages", ANT, ant_with(system="You are terse."))[0] == 3 + e("You are terse.")
    assert delta("anthropic.messages", ANT, ant_with(system=[{"type": "text", "text": "You are terse."}]))[0] == 3 + e("You are terse.")
    turn = {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "The user wants brevity.", "signature": "EqQBCgIYAhIM" * 50},
        {"type": "text", "text": "Sure."},
        {"type": "tool_use", "id": "toolu_01", "name": "fetch", "input": {"url": "https://a.b", "max": 3}}]}
    assert delta("anthropic.messages", ANT, ant_with(turn)) == (
        3 + e("The user wants brevity.") + e("Sure.") + e("fetch") + e('{"url":"https://a.b","max":3}'), [])


def test_anthropic_tool_results_documents_and_redacted_thinking() -> None:
    e = deepseek()
    result = {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_01", "content": "200 OK"},
        {"type": "tool_result", "tool_use_id": "toolu_02", "content": [{"type": "text", "text": "page body"}], "is_error": False}]}
    assert delta("anthropic.messages", ANT, ant_with(result))[0] == 3 + e("200 OK") + e("page body")
    doc = {"role": "user", "content": [{"type": "document", "title": "Memo", "source": {"type": "text", "media_type": "text/plain", "data": "Q3 is up."}}]}
    assert delta("anthropic.messages", ANT, ant_with(doc))[0] == 3 + e("Memo") + e("Q3 is up.")
    pdf = {"role": "user", "content": [{"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBERi0=" * 100}}]}
    assert delta("anthropic.messages", ANT, ant_with(pdf)) == (3, ["Documents given as PDF, URL or file are not counted."])
    redacted = {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "EmwKAhgB" * 40}]}
    assert delta("anthropic.messages", ANT, ant_with(redacted)) == (3, ["Redacted thinking is not counted (its data is encrypted)."])


def test_anthropic_images_use_the_published_rule() -> None:
    source = {"type": "base64", "media_type": "image/png", "data": b64png(1000, 1000)}
    assert delta("anthropic.messages", ANT, ant_with({"role": "user", "content": [{"type": "image", "source": source}]}))[0] == 3 + 1334
    url = {"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "https://x.y/a.png"}}]}
    assert delta("anthropic.messages", ANT, ant_with(url)) == (
        3 + 1399, ["An image whose size could not be read (a URL, a file, or data that is not PNG, GIF, WebP or JPEG) "
                        "was counted as a 1024x1024 image (1399 tokens), an estimate."])


def test_anthropic_tools_cost_their_schema_and_the_tool_use_system_prompt() -> None:
    e = deepseek()
    tool = {"name": "fetch", "description": "Fetch a URL.", "input_schema": {"type": "object", "properties": {"url": {"type": "string"}}}}
    schema = '{"type":"object","properties":{"url":{"type":"string"}}}'
    per_tool = 3 + e("fetch") + e("Fetch a URL.") + e(schema)
    assert delta("anthropic.messages", ANT, ant_with(tools=[tool]))[0] == per_tool + 346
    assert delta("anthropic.messages", ANT, ant_with(tools=[tool], tool_choice={"type": "any"}))[0] == per_tool + 313
    cost, warnings = delta("anthropic.messages", ANT, ant_with(tools=[tool, {"type": "bash_20250124", "name": "bash"}]))
    assert cost == per_tool + 346 and warnings == ["Built-in tools (type 'bash_20250124') are not counted."]


# --- gemini.generate -------------------------------------------------------------------------------

GEM = {"contents": [{"role": "user", "parts": [{"text": "Explain tides."}]}]}


def gem_with(*contents: dict, **top: object) -> dict:
    return {"contents": GEM["contents"] + list(contents), **top}


def test_gemini_parts_in_both_spellings() -> None:
    e = deepseek()
    system = {"parts": [{"text": "Answer in one line."}]}
    # Google counts the text, and from Gemini 2.5 on one more per content (the system instruction is one)
    assert delta("gemini.generate", GEM, gem_with(systemInstruction=system))[0] == e("Answer in one line.") + 1
    assert delta("gemini.generate", GEM, gem_with(systemInstruction=system), model="gemini-2.0-flash")[0] == e("Answer in one line.")
    assert count(gem_with(system_instruction=system), "gemini.generate").count == count(gem_with(systemInstruction=system), "gemini.generate").count
    turn = {"role": "model", "parts": [
        {"text": "Gravity of the moon.", "thought": True, "thoughtSignature": "CiQB" * 80},
        {"functionCall": {"name": "moon_phase", "args": {"date": "2025-01-01"}}},
        {"executableCode": {"language": "PYTHON", "code": "print(1)"}},
        {"codeExecutionResult": {"outcome": "OUTCOME_OK", "output": "1"}}]}
    expected = 1 + e("Gravity of the moon.") + e("moon_phase") + e('{"date":"2025-01-01"}') + e("print(1)") + e("1")
    assert delta("gemini.generate", GEM, gem_with(turn)) == (expected, [])
    reply = {"role": "user", "parts": [{"function_response": {"name": "moon_phase", "response": {"phase": "full"}}}]}
    assert delta("gemini.generate", GEM, gem_with(reply))[0] == 1 + e("moon_phase") + e('{"phase":"full"}')


def test_gemini_images_count_by_tiles_and_other_media_not_at_all() -> None:
    inline = {"role": "user", "parts": [{"inlineData": {"mimeType": "image/png", "data": b64png(300, 300)}}]}
    assert delta("gemini.generate", GEM, gem_with(inline)) == (1 + 258, [])
    file = {"role": "user", "parts": [{"fileData": {"mimeType": "image/jpeg", "fileUri": "gs://b/big.jpg"}}]}
    assert delta("gemini.generate", GEM, gem_with(file))[0] == 1 + 1032
    audio = {"role": "user", "parts": [{"inline_data": {"mime_type": "audio/wav", "data": "UklGRg==" * 300}}]}
    assert delta("gemini.generate", GEM, gem_with(audio)) == (1, ["Inline and file data of type 'audio/wav' are not counted (only images are)."])


def test_gemini_function_declarations_count_and_builtin_tools_do_not() -> None:
    e = deepseek()
    decl = {"name": "moon_phase", "description": "Phase of the moon.", "parameters": {"type": "OBJECT", "properties": {"date": {"type": "STRING"}}}}
    schema = '{"type":"OBJECT","properties":{"date":{"type":"STRING"}}}'
    assert delta("gemini.generate", GEM, gem_with(tools=[{"functionDeclarations": [decl]}])) == (
        2 + e("moon_phase") + e("Phase of the moon.") + 2 + e("date"),  # their text, 2 per declaration and property
        ["Gemini function declarations are counted as their text and 2 per declaration and property, an estimate."])
    assert len(schema) > 40  # not their JSON
    assert delta("gemini.generate", GEM, gem_with(tools=[{"googleSearch": {}}])) == (0, ["Built-in tools (search, code execution, ...) are not counted."])


# --- detection -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("body", "expected"), [
    (GEM, "gemini.generate"),
    ({"system_instruction": {"parts": []}, "contents": []}, "gemini.generate"),
    (RESP, "openai.responses"),
    ({"instructions": "x", "input": "y"}, "openai.responses"),
    (ant_with(system="s"), "anthropic.messages"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "ok"}]}]}, "anthropic.messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "u"}}]}]}, "anthropic.messages"),
    ({"messages": [], "tools": [{"name": "f", "input_schema": {}}]}, "anthropic.messages"),
    ({"model": "claude-opus-4", "messages": [{"role": "user", "content": "hi"}]}, "anthropic.messages"),
    ({"messages": [{"role": "system", "content": "s"}]}, "openai.chat"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]}, "openai.chat"),
    (CHAT, "openai.chat"),
    ({"prompt": "text completion"}, None),
], ids=lambda v: v if isinstance(v, str) or v is None else "")
def test_format_detection_from_the_body_shape(body: dict, expected: str | None) -> None:
    assert detect_format(body, body.get("model")) == expected


def test_a_detected_format_is_said_in_a_warning_and_counts_like_the_named_one() -> None:
    detected = count_request(ANT | {"system": "Be brief."}, format=None, model="claude-x", strict=False, env=Env())
    named = count(ANT | {"system": "Be brief."}, "anthropic.messages", model="claude-x")
    assert detected.count == named.count
    assert "The format was not given: the body's shape says anthropic.messages." in detected.warnings


# --- JSON serialisation ----------------------------------------------------------------------------

_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4), max_leaves=25)


@settings(max_examples=150, deadline=None)
@given(value=_values)
def test_the_recursion_free_serialiser_writes_what_json_dumps_writes(value: object) -> None:
    expected = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    assert Walk(Notes())._to_json_iterative(value) == expected
    assert Walk(Notes()).to_json(value) == expected


# --- the remaining fields, per format --------------------------------------------------------------


def test_chat_assistant_audio_reference_is_not_counted() -> None:
    plain = {"role": "assistant", "content": "Hi"}
    assert delta("openai.chat", chat_with(plain), chat_with(plain | {"audio": {"id": "audio_abc123"}})) == (0, [])


def test_responses_mcp_code_interpreter_custom_output_and_reasoning_content() -> None:
    e = o200k()
    mcp = {"type": "mcp_call", "id": "m", "server_label": "s", "name": "list_repos", "arguments": "{}", "output": "3 repos"}
    code = {"type": "code_interpreter_call", "id": "ci", "code": "print(2+2)", "container_id": "c"}
    custom_out = {"type": "custom_tool_call_output", "call_id": "c", "output": "total 0"}
    reasoning = {"type": "reasoning", "id": "rs", "summary": [], "content": [{"type": "reasoning_text", "text": "Add them."}]}
    assert delta("openai.responses", RESP, resp_with(mcp))[0] == 3 + e("list_repos") + e("{}") + e("3 repos")
    assert delta("openai.responses", RESP, resp_with(code))[0] == 3 + e("print(2+2)")
    assert delta("openai.responses", RESP, resp_with(custom_out))[0] == 3 + e("tool") + e("total 0")
    assert delta("openai.responses", RESP, resp_with(reasoning))[0] == 3 + e("Add them.")


def test_responses_stored_prompts_and_conversations_are_not_counted() -> None:
    cost, warnings = delta("openai.responses", RESP, resp_with(prompt={"id": "pmpt_1"}, conversation="conv_1"))
    assert cost == 0 and warnings == ["Earlier turns referenced by previous_response_id or conversation are not counted.",
                                      "A stored prompt referenced by 'prompt' is not counted."]


def test_anthropic_server_tools_search_results_content_documents_and_tool_result_images() -> None:
    e = deepseek()
    server = {"role": "assistant", "content": [
        {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search", "input": {"query": "tides"}},
        {"type": "web_search_tool_result", "tool_use_id": "srvtoolu_1", "content": [{"type": "web_search_result", "encrypted_content": "Eq" * 50}]}]}
    assert delta("anthropic.messages", ANT, ant_with(server)) == (
        3 + e("web_search") + e('{"query":"tides"}'), ["Content blocks of type 'web_search_tool_result' are not counted."])
    search = {"role": "user", "content": [{"type": "search_result", "source": "https://t.org", "title": "Tides",
                                           "content": [{"type": "text", "text": "Moon pulls water."}], "citations": {"enabled": True}}]}
    assert delta("anthropic.messages", ANT, ant_with(search))[0] == 3 + e("Tides") + e("https://t.org") + e("Moon pulls water.")
    doc = {"role": "user", "content": [{"type": "document", "context": "From the wiki", "source": {"type": "content", "content": [{"type": "text", "text": "Part one."}]}}]}
    assert delta("anthropic.messages", ANT, ant_with(doc))[0] == 3 + e("From the wiki") + e("Part one.")
    shot = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64png(200, 200)}}
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [{"type": "text", "text": "screenshot:"}, shot]}]}
    assert delta("anthropic.messages", ANT, ant_with(result)) == (3 + e("screenshot:") + 54, [])


def test_gemini_cached_content_is_not_counted() -> None:
    assert delta("gemini.generate", GEM, gem_with(cachedContent="cachedContents/abc")) == (0, ["Cached content referenced by cachedContent is not counted."])


def test_deep_or_huge_tool_schemas_render_bounded_with_a_warning() -> None:
    deep: dict = {"type": "string"}
    for i in range(5000):  # alternating unions, arrays and objects, deeper than any recursion limit
        deep = [{"anyOf": [deep]}, {"type": "array", "items": deep}, {"type": "object", "properties": {"p": deep}}][i % 3]
    f = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": deep}}}}
    result = count(chat_with(tools=[f]), "openai.chat")
    assert result.count > 0
    assert "The tool definitions are too large or too deep to render fully: some of them were not counted." in result.warnings
    wide = {"type": "function", "function": {"name": "g", "parameters": {"type": "object", "properties": {
        f"p{i}": {"anyOf": [{"type": "string"}] * 50} for i in range(10_000)}}}}
    result = count(chat_with(tools=[wide]), "openai.chat")
    assert "The tool definitions are too large or too deep to render fully: some of them were not counted." in result.warnings


@settings(max_examples=300, deadline=None)
@given(params=_values, choice=_values, fmt_spec=_values, call=_values, required=_values)
def test_any_shape_of_tools_choices_formats_and_calls_is_counted_without_failing(params, choice, fmt_spec, call, required) -> None:
    """Tool schemas, choices, structured outputs and calls of any JSON shape: a count, never an exception."""
    parameters = {"type": "object", "properties": {"p": params, "q": {"type": "object", "properties": params}}, "required": required}
    chat = {"messages": [{"role": "system", "content": "s"}, {"role": "assistant", "tool_calls": [call, {"id": call, "function": call}]},
                         {"role": "tool", "tool_call_id": call, "content": "r"}],
            "tools": [{"type": "function", "function": {"name": "f", "parameters": parameters}}, params],
            "functions": [params], "tool_choice": choice, "response_format": {"type": "json_schema", "json_schema": fmt_spec}}
    responses = {"instructions": "i", "input": [{"type": "function_call", "call_id": call, "name": "f", "arguments": call},
                                               {"type": "function_call_output", "call_id": call, "output": call}],
                 "tools": [{"type": "function", "name": "f", "parameters": parameters}], "tool_choice": choice,
                 "text": {"format": {"type": "json_schema", "schema": fmt_spec}}}
    for fmt, body in (("openai.chat", chat), ("openai.responses", responses)):
        for model in ("gpt-4o", "gpt-4", "o3"):
            assert count(body, fmt, model).count >= 0
