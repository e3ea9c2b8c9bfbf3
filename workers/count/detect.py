"""Which provider format a request body is, from its shape, when the `count` request does not say.

Only keys and content-part types that one provider's schema has and the others lack decide; a
`messages` list with nothing telling is OpenAI chat unless the model is a Claude.

>>> detect_format({"contents": [{"parts": [{"text": "hi"}]}]}, None), detect_format({"input": "hi"}, None)
('gemini.generate', 'openai.responses')
"""

from __future__ import annotations

from collections.abc import Iterable

_ANTHROPIC_BLOCKS = frozenset({"tool_use", "tool_result", "thinking", "redacted_thinking", "document", "search_result", "server_tool_use"})
_ANTHROPIC_KEYS = frozenset({"system", "anthropic_version", "stop_sequences", "top_k"})
_OPENAI_ROLES = ("system", "developer", "tool", "function")


def _content_types(messages: list) -> Iterable[tuple[str | None, dict]]:
    """(type, part) of each map part in the messages' list contents."""
    for msg in messages:
        content = msg.get("content") if isinstance(msg, dict) else None
        if isinstance(content, list):
            for part in content:
                if isinstance(part, dict):
                    yield part.get("type"), part


def detect_format(body: dict, model: str | None) -> str | None:
    """The format a body's shape says, or None when it looks like none of them."""
    if "contents" in body or "systemInstruction" in body or "system_instruction" in body:
        return "gemini.generate"
    messages = body.get("messages")
    if isinstance(messages, list):
        tools = body.get("tools")
        tools = tools if isinstance(tools, list) else []
        if _ANTHROPIC_KEYS & body.keys() or any(isinstance(t, dict) and "input_schema" in t for t in tools):
            return "anthropic.messages"
        for kind, part in _content_types(messages):
            if kind in _ANTHROPIC_BLOCKS or (kind == "image" and "source" in part):
                return "anthropic.messages"
            if kind in ("image_url", "input_audio", "file"):
                return "openai.chat"
        if any(isinstance(m, dict) and (m.get("role") in _OPENAI_ROLES or "tool_calls" in m) for m in messages):
            return "openai.chat"
        if model and model.lower().rsplit("/", 1)[-1].startswith("claude"):
            return "anthropic.messages"
        return "openai.chat"
    if "input" in body or "instructions" in body:
        return "openai.responses"
    return None
