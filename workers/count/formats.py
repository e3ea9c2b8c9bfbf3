"""Harvesting provider request bodies: what each format's own schema says the model will read.

Each `harvest_*` function walks one provider's schema (never a generic walk over key names) and
returns a `Harvest`: the texts of each message (each encoded on its own), function definitions,
images, and what was skipped, said in `Notes`. Framing lives in __init__.py (Anthropic), openai.py
and gemini.py; image rules in images.py.

What is counted, per format (anything else is skipped, with a warning where it could cost tokens):

| format | counted | skipped |
|---|---|---|
| openai.chat | `messages[]`: role, content (str, or text/refusal parts joined), name, refusal, tool_calls[].function name and arguments (custom: name and input), legacy function_call, a tool message's called function; `tools[]` and legacy `functions[]` (function and custom); tool_choice/function_call; a JSON-schema response_format; images | ids, audio, input_audio and file parts, other response formats, built-in tools |
| openai.responses | `instructions`, `input` (str, or items: messages with input_text/output_text/refusal parts, function_call name and arguments, function_call_output and its called function, custom_tool_call(_output), current-turn reasoning summary and content text, mcp_call, code_interpreter_call code); `tools[]` function and custom; tool_choice; a JSON-schema text.format; images | ids, input_file and input_audio, encrypted reasoning, earlier turns' reasoning, item_reference, previous_response_id, prompt, built-in tools |
| anthropic.messages | `system` (str or text blocks), `messages[]` content (str or blocks: text, thinking, tool_use and server_tool_use name and input, tool_result content, document text/content sources with title and context, search_result); `tools[]` name, description, input_schema; images | signatures, redacted_thinking, PDF/URL/file documents, server tool results, built-in tools |
| gemini.generate | `systemInstruction`, `contents[]` parts: text (thoughts too), functionCall name and args, functionResponse name and response, executableCode, codeExecutionResult; `tools[].functionDeclarations`; images in inlineData/fileData | thoughtSignature, non-image inline/file data, built-in tools, cachedContent |

Objects (`arguments` given as objects, `input`, `args`, `response`, schemas) are serialised as compact
JSON by the count's Walk (json_writer.py: recursion-free, under a node budget). Base64 data is never text: an image's size is read
from its header where the body carries it (images.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from .images import Image, base64_image_size, url_image
from .json_writer import Walk

FORMATS = ("openai.chat", "openai.responses", "anthropic.messages", "gemini.generate", "text")

@dataclass(frozen=True)
class FunctionDef:
    name: str
    description: str
    parameters: Any = None  # a JSON schema object, or None


@dataclass
class Message:
    texts: list[str] = field(default_factory=list)  # each encoded on its own
    named: bool = False  # carries OpenAI's `name` (tokens_per_name)
    role: str | None = None  # OpenAI: the framing differs for system, function and tool messages
    content_at: int | None = None  # OpenAI: which of `texts` is the content (a system message's gains a newline with tools)
    calls: int = 0  # OpenAI: function or tool calls this assistant message makes


@dataclass
class Harvest:
    messages: list[Message] = field(default_factory=list)
    functions: list[FunctionDef] = field(default_factory=list)
    images: list[Image] = field(default_factory=list)
    tool_choice_forced: bool = False  # Anthropic tool_choice any/tool (its tool-use system prompt differs)
    tools_given: bool = False
    choice: str | None = None  # OpenAI tool_choice/function_call given as a string ("none", "auto", "required")
    choice_name: str | None = None  # OpenAI tool_choice/function_call naming one function
    response_format: tuple[str, str, Any] | None = None  # OpenAI structured output: (name, description, JSON schema)


# --- small typed readers ---------------------------------------------------------------------------


def _s(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _list(value: Any) -> list:
    return value if isinstance(value, list) else []


def _dict(value: Any) -> dict:
    return value if isinstance(value, dict) else {}


def _parts(content: Any) -> list:
    """Content parts: a list, or one part given alone as a map (an image is never lost to the shape)."""
    return [content] if isinstance(content, dict) else _list(content)


def _get(d: dict, *names: str) -> Any:
    """The first of a field's spellings that is present (Gemini's REST API takes camelCase and snake_case)."""
    for name in names:
        if name in d:
            return d[name]
    return None


def _args_text(walk: Walk, value: Any) -> str:
    """Arguments or input: a JSON string as given, an object serialised as JSON."""
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    return walk.to_json(value)


def _messages(walk: Walk, body: dict) -> Iterator[dict]:
    """The maps in the body's `messages` list, lazily, so each skip is noted in the order it is met."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        walk.notes.add("The body has no 'messages' list: no messages were counted.")
    for msg in _list(messages):
        if not isinstance(msg, dict):
            walk.notes.add("A message that is not an object was not counted.")
            continue
        yield msg


# --- OpenAI chat completions -----------------------------------------------------------------------


def _chat_content(walk: Walk, content: Any, h: Harvest) -> str:
    """The text of a chat `content`: a str, or its text parts joined (images go to h.images)."""
    if isinstance(content, str):
        return content
    texts: list[str] = []
    for part in _parts(content):
        kind = _dict(part).get("type")
        if kind == "text":
            texts.append(_s(part.get("text")) or "")
        elif kind == "refusal":
            texts.append(_s(part.get("refusal")) or "")
        elif isinstance(kind, str) and "image" in kind:  # image_url, and the spellings of other APIs
            h.images.append(_part_image(part))
        elif kind in ("input_audio", "file"):
            walk.notes.add(f"Content parts of type '{kind}' are not counted (audio and files are not text).")
        else:
            walk.notes.add(f"A content part of type {kind!r} was not recognised and not counted.")
    return "".join(texts)


def _part_image(part: dict) -> Image:
    """An image part of any OpenAI spelling: `image_url` as a str or {url, detail}, or `url`/`file_id` with `detail`.

    An image is charged even when nothing tells its size: it is never counted as nothing.
    """
    ref = part.get("image_url")
    detail = part.get("detail")
    if isinstance(ref, dict):
        detail = ref.get("detail", detail)
        ref = ref.get("url")
    return url_image(ref if ref is not None else part.get("url"), detail)


def _tool_call_texts(walk: Walk, call: Any) -> list[str]:
    call = _dict(call)
    if call.get("type") == "custom" or "custom" in call:
        c = _dict(call.get("custom"))
        return [_s(c.get("name")) or "", _args_text(walk, c.get("input"))]
    f = _dict(call.get("function"))
    return [_s(f.get("name")) or "", _args_text(walk, f.get("arguments"))]


def _openai_tools(walk: Walk, tools: Any, h: Harvest, *, nested: bool) -> None:
    """Function and custom tools; chat nests a function under `function`, Responses does not."""
    for tool in _list(tools):
        tool = _dict(tool)
        h.tools_given = True
        kind = tool.get("type", "function")
        if kind == "function":
            f = _dict(tool.get("function")) if nested else tool
            h.functions.append(FunctionDef(_s(f.get("name")) or "", _s(f.get("description")) or "", f.get("parameters")))
        elif kind == "custom":
            c = _dict(tool.get("custom")) if nested else tool
            h.functions.append(FunctionDef(_s(c.get("name")) or "", _s(c.get("description")) or ""))
        else:
            walk.notes.add(f"Built-in tools (type {kind!r}) are not counted.")


def _openai_choice(value: Any, h: Harvest) -> None:
    """tool_choice or function_call: a string mode, or one named function (chat nests it, Responses does not)."""
    if isinstance(value, str):
        h.choice = value
    elif isinstance(value, dict):
        named = _dict(value.get("function")) if "function" in value else value
        name = _s(named.get("name"))
        if name is not None:
            h.choice_name = name


def _response_format(value: Any, h: Harvest) -> None:
    """A JSON-schema structured output (chat's response_format, Responses' text.format)."""
    value = _dict(value)
    if value.get("type") != "json_schema":
        return
    spec = _dict(value.get("json_schema")) if "json_schema" in value else value
    h.response_format = (_s(spec.get("name")) or "", _s(spec.get("description")) or "", spec.get("schema"))


def _tool_message(walk: Walk, role: str, called: str | None, content: str) -> Message:
    """A tool result: its role, the name of the function it answers, its content."""
    if called is None:
        walk.notes.add("A tool result answers no call in the body: the name of its function was not counted.")
    return Message(texts=[role, called or "", content], role=role, content_at=2)


def harvest_openai_chat(walk: Walk, body: dict) -> Harvest:
    h = Harvest()
    called: dict[str, str] = {}  # tool_call_id -> function name
    for msg in _messages(walk, body):
        role = _s(msg.get("role")) or ""
        content = _chat_content(walk, msg.get("content"), h)
        if role == "tool":
            h.messages.append(_tool_message(walk, role, called.get(_s(msg.get("tool_call_id")) or ""), content))
            continue
        m = Message(texts=[role, content], role=role, content_at=1)
        name = _s(msg.get("name"))
        if name is not None:
            m.texts.append(name)
            m.named = True
        refusal = _s(msg.get("refusal"))
        if refusal:
            m.texts.append(refusal)
        calls = _list(msg.get("tool_calls"))
        for call in calls:
            texts = _tool_call_texts(walk, call)
            m.texts += texts
            called[_s(_dict(call).get("id")) or ""] = texts[0]
        if len(calls) > 1:
            walk.notes.add("OpenAI renders several tool calls in one message as one parallel call: their count is an estimate.")
        if isinstance(msg.get("function_call"), dict):
            m.texts += _tool_call_texts(walk, {"function": msg["function_call"]})
            calls = [*calls, msg["function_call"]]
        m.calls = len(calls)
        h.messages.append(m)
    _openai_tools(walk, body.get("tools"), h, nested=True)
    for f in _list(body.get("functions")):
        _openai_tools(walk, [{"type": "function", "function": f}], h, nested=True)
    _openai_choice(body.get("tool_choice", body.get("function_call")), h)
    _response_format(body.get("response_format"), h)
    return h


# --- OpenAI responses ------------------------------------------------------------------------------


def _responses_parts(walk: Walk, content: Any, h: Harvest) -> str:
    if isinstance(content, str):
        return content
    texts: list[str] = []
    for part in _parts(content):
        part = _dict(part)
        kind = part.get("type")
        if kind in ("input_text", "output_text", "text", "summary_text", "reasoning_text"):
            texts.append(_s(part.get("text")) or "")
        elif kind == "refusal":
            texts.append(_s(part.get("refusal")) or "")
        elif isinstance(kind, str) and "image" in kind:  # input_image, and chat's image_url
            h.images.append(_part_image(part))
        elif kind in ("input_file", "input_audio"):
            walk.notes.add(f"Content parts of type '{kind}' are not counted (audio and files are not text).")
        else:
            walk.notes.add(f"A content part of type {kind!r} was not recognised and not counted.")
    return "".join(texts)


def _responses_item(walk: Walk, item: dict, h: Harvest, called: dict[str, str], current_turn: bool) -> Message | None:
    kind = _item_kind(item)
    if kind == "message":
        role = _s(item.get("role")) or ""
        return Message(texts=[role, _responses_parts(walk, item.get("content"), h)], role=role, content_at=1)
    if kind in ("function_call", "custom_tool_call"):
        args = item.get("arguments") if kind == "function_call" else item.get("input")
        name = _s(item.get("name")) or ""
        called[_s(item.get("call_id")) or ""] = name
        return Message(texts=["assistant", name, _args_text(walk, args)], role="assistant", calls=1)
    if kind in ("function_call_output", "custom_tool_call_output"):
        output = _responses_parts(walk, item.get("output"), h)
        return _tool_message(walk, "tool", called.get(_s(item.get("call_id")) or ""), output)
    if kind == "reasoning":
        if not current_turn:
            walk.notes.add("Reasoning items of earlier turns are not counted: OpenAI strips them from the context.")
            return None
        texts = [_s(_dict(p).get("text")) or "" for p in _list(item.get("summary")) + _list(item.get("content"))]
        walk.notes.add("Reasoning kept for the current turn is counted by its visible text; its hidden tokens are not known here (an estimate).")
        return Message(texts=texts)
    if kind == "mcp_call":
        return Message(texts=[_s(item.get("name")) or "", _args_text(walk, item.get("arguments")), _s(item.get("output")) or ""])
    if kind == "code_interpreter_call":
        return Message(texts=[_s(item.get("code")) or ""])
    walk.notes.add(f"Input items of type {kind!r} are not counted.")
    return None


def _item_kind(item: dict) -> Any:
    return item.get("type", "message" if "role" in item else None)


def harvest_openai_responses(walk: Walk, body: dict) -> Harvest:
    h = Harvest()
    instructions = body.get("instructions")
    if isinstance(instructions, str) and instructions:  # "" is no instructions
        h.messages.append(Message(texts=["system", instructions], role="system", content_at=1))
    items = body.get("input")
    if isinstance(items, str):
        h.messages.append(Message(texts=["user", items], role="user", content_at=1))
    elif isinstance(instructions, list):
        items = instructions + _list(items)
    items = _list(items)
    # the current turn starts at the last user message; reasoning before it is stripped by the API
    turn = max((i for i, it in enumerate(items) if isinstance(it, dict) and _item_kind(it) == "message"
                and it.get("role") == "user"), default=0)
    called: dict[str, str] = {}  # call_id -> function name
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            walk.notes.add("An input item that is not an object was not counted.")
            continue
        m = _responses_item(walk, item, h, called, current_turn=i > turn)
        if m is not None:
            h.messages.append(m)
    _openai_choice(body.get("tool_choice"), h)
    _response_format(_dict(body.get("text")).get("format"), h)
    if body.get("previous_response_id") or body.get("conversation"):
        walk.notes.add("Earlier turns referenced by previous_response_id or conversation are not counted.")
    if body.get("prompt") is not None:
        walk.notes.add("A stored prompt referenced by 'prompt' is not counted.")
    _openai_tools(walk, body.get("tools"), h, nested=False)
    return h


# --- Anthropic messages ----------------------------------------------------------------------------


def _anthropic_image(walk: Walk, source: Any) -> Image:
    source = _dict(source)
    if source.get("type") == "base64" and isinstance(source.get("data"), str):
        size = base64_image_size(source["data"])
        if size:
            return Image(*size)
    return Image()


def _anthropic_blocks(walk: Walk, content: Any, h: Harvest) -> list[str]:
    """Texts of a content (str or blocks); tool_result and document content are walked one level down."""
    if isinstance(content, str):
        return [content]
    texts: list[str] = []
    pending = list(reversed(_list(content)))
    while pending:
        block = _dict(pending.pop())
        kind = block.get("type")
        if kind == "text":
            texts.append(_s(block.get("text")) or "")
        elif kind == "thinking":
            texts.append(_s(block.get("thinking")) or "")
        elif kind in ("tool_use", "server_tool_use"):
            texts += [_s(block.get("name")) or "", _args_text(walk, block.get("input"))]
        elif kind == "tool_result":
            inner = block.get("content")
            if isinstance(inner, str):
                texts.append(inner)
            else:
                pending.extend(reversed([b for b in _list(inner) if _dict(b).get("type") != "tool_result"]))
        elif kind == "image":
            h.images.append(_anthropic_image(walk, block.get("source")))
        elif kind == "document":
            texts += [t for t in (_s(block.get("title")), _s(block.get("context"))) if t]
            source = _dict(block.get("source"))
            if source.get("type") == "text":
                texts.append(_s(source.get("data")) or "")
            elif source.get("type") == "content":
                inner = source.get("content")
                if isinstance(inner, str):
                    texts.append(inner)
                else:
                    pending.extend(reversed([b for b in _list(inner) if _dict(b).get("type") in ("text", "image")]))
            else:
                walk.notes.add("Documents given as PDF, URL or file are not counted.")
        elif kind == "search_result":
            texts += [_s(block.get("title")) or "", _s(block.get("source")) or ""]
            pending.extend(reversed([b for b in _list(block.get("content")) if _dict(b).get("type") == "text"]))
        elif kind == "redacted_thinking":
            walk.notes.add("Redacted thinking is not counted (its data is encrypted).")
        else:
            walk.notes.add(f"Content blocks of type {kind!r} are not counted.")
    return texts


def harvest_anthropic(walk: Walk, body: dict) -> Harvest:
    h = Harvest()
    system = body.get("system")
    if system is not None:
        h.messages.append(Message(texts=_anthropic_blocks(walk, system, h)))
    for msg in _messages(walk, body):
        h.messages.append(Message(texts=_anthropic_blocks(walk, msg.get("content"), h)))
    for tool in _list(body.get("tools")):
        tool = _dict(tool)
        h.tools_given = True
        if tool.get("type", "custom") == "custom":
            h.functions.append(FunctionDef(_s(tool.get("name")) or "", _s(tool.get("description")) or "", tool.get("input_schema")))
        else:
            walk.notes.add(f"Built-in tools (type {tool.get('type')!r}) are not counted.")
    h.tool_choice_forced = _dict(body.get("tool_choice")).get("type") in ("any", "tool")
    return h


# --- Gemini generateContent ------------------------------------------------------------------------


def _gemini_parts(walk: Walk, content: Any, h: Harvest) -> list[str]:
    if isinstance(content, str):
        return [content]
    texts: list[str] = []
    for part in _list(_dict(content).get("parts")):
        part = _dict(part)
        if isinstance(part.get("text"), str):
            texts.append(part["text"])
        inline = _dict(_get(part, "inlineData", "inline_data"))
        file = _dict(_get(part, "fileData", "file_data"))
        for blob, has_data in ((inline, True), (file, False)):
            if not blob:
                continue
            mime = _s(_get(blob, "mimeType", "mime_type")) or ""
            if mime.startswith("image/"):
                size = base64_image_size(blob["data"]) if has_data and isinstance(blob.get("data"), str) else None
                h.images.append(Image(*(size or (None, None))))
            else:
                walk.notes.add(f"Inline and file data of type {mime or 'unknown'!r} are not counted (only images are).")
        call = _dict(_get(part, "functionCall", "function_call"))
        if call:
            texts += [_s(call.get("name")) or "", _args_text(walk, call.get("args"))]
        response = _dict(_get(part, "functionResponse", "function_response"))
        if response:
            texts += [_s(response.get("name")) or "", _args_text(walk, response.get("response"))]
        code = _dict(_get(part, "executableCode", "executable_code"))
        if code:
            texts.append(_s(code.get("code")) or "")
        result = _dict(_get(part, "codeExecutionResult", "code_execution_result"))
        if result:
            texts.append(_s(result.get("output")) or "")
    return texts


def harvest_gemini(walk: Walk, body: dict) -> Harvest:
    h = Harvest()
    system = _get(body, "systemInstruction", "system_instruction")
    if system is not None:
        h.messages.append(Message(texts=_gemini_parts(walk, system, h)))
    contents = body.get("contents")
    if isinstance(contents, (str, dict)):
        contents = [contents]
    if not isinstance(contents, list):
        walk.notes.add("The body has no 'contents' list: no contents were counted.")
    for content in _list(contents):
        if not isinstance(content, (dict, str)):
            walk.notes.add("A content that is not an object was not counted.")
            continue
        h.messages.append(Message(texts=_gemini_parts(walk, content, h)))
    for tool in _list(body.get("tools")):
        tool = _dict(tool)
        h.tools_given = True
        declarations = _get(tool, "functionDeclarations", "function_declarations")
        for f in _list(declarations):
            f = _dict(f)
            schema = _get(f, "parameters", "parametersJsonSchema", "parameters_json_schema")
            h.functions.append(FunctionDef(_s(f.get("name")) or "", _s(f.get("description")) or "", schema))
        if declarations is None or len(tool) > 1:
            walk.notes.add("Built-in tools (search, code execution, ...) are not counted.")
    if _get(body, "cachedContent", "cached_content"):
        walk.notes.add("Cached content referenced by cachedContent is not counted.")
    return h


HARVESTERS = {
    "openai.chat": harvest_openai_chat,
    "openai.responses": harvest_openai_responses,
    "anthropic.messages": harvest_anthropic,
    "gemini.generate": harvest_gemini,
}
