"""Chat rendering: a model's chat template rendered exactly as transformers' apply_chat_template does.

The reference is transformers 5.24 (`utils/chat_template_utils.py` and `apply_chat_template` in
`tokenization_utils_base.py`): the same sandboxed Jinja environment and options, the same filters and
globals, the same message preparation (None-valued keys dropped, reasoning fields aliased), the same
`continue_final_message` cut and the same template choice among named templates (chat/templates.py finds
the templates). transformers itself is never imported here; tests compare our prompts with its output
byte for byte.

Templates come from the Hub, so they are untrusted code: they render in chat/sandbox.py's sandboxed
environment, bounded in time, output size and every value's size (max_seconds, max_output_bytes), inside
a child process with an address-space limit and a kill timer (chat/process.py; max_memory_bytes).

>>> r = ChatRenderer(ChatTemplates("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}", {}, "doc"), {})
>>> r.render([{"role": "user", "content": "hi"}], add_generation_prompt=False)
'<user>hi'
"""

from __future__ import annotations

from typing import Any

from tokenbroker.common.errors import ProtocolError
from tokenbroker.common.protocol import type_name

from .process import DEFAULT_MAX_MEMORY_BYTES, shared_render_process
from .templates import ChatTemplates, discover_chat_templates, special_tokens_from_config

__all__ = [
    "ChatRenderer", "ChatTemplates", "discover_chat_templates", "special_tokens_from_config",
    "DEFAULT_MAX_OUTPUT_BYTES", "DEFAULT_MAX_SECONDS", "DEFAULT_MAX_MEMORY_BYTES",
]

DEFAULT_MAX_OUTPUT_BYTES = 16 * 2**20
DEFAULT_MAX_SECONDS = 10.0

# Names a message's reasoning comes under; the first is the one templates read (transformers' _REASONING_FIELDS).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# What transformers appends to the final message to find where it ends in the prompt.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
# apply_chat_template's own parameters: as template kwargs they clash with it (a TypeError there).
_RESERVED_KWARGS = frozenset({
    "conversation", "messages", "tools", "chat_template", "add_generation_prompt", "continue_final_message",
    "tokenize", "sanitize_control_tokens", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})


# --- message preparation ----------------------------------------------------------------------------


def _plain(value: Any, path: str) -> Any:
    """A fresh copy of MessagePack data for the template; a bin anywhere is a bad_request naming it."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, (bytes, bytearray, memoryview)):
        raise ProtocolError("bad_request", f"field '{path}' is a bin; text must be a str")
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise ProtocolError("bad_request", f"field '{path}' has a {type_name(k)} key; keys must be str")
            out[k] = _plain(v, f"{path}.{k}")
        return out
    if isinstance(value, (list, tuple)):
        return [_plain(v, f"{path}[{i}]") for i, v in enumerate(value)]
    raise ProtocolError("bad_request", f"field '{path}' has unsupported type {type_name(value)}")


def _prepare_messages(messages: Any) -> list[dict]:
    """What transformers does to a conversation: maps only, None-valued keys dropped, reasoning aliased.

    We also require a str `role` in every message, which every template reads.
    """
    if not isinstance(messages, list):
        raise ProtocolError("bad_request", f"field 'messages' must be a list, got {type_name(messages)}")
    if not messages:
        raise ProtocolError("bad_request", "field 'messages' is empty; give at least one message")
    chat = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ProtocolError("bad_request", f"field 'messages[{i}]' must be a map, got {type_name(message)}")
        message = _plain({k: v for k, v in message.items() if v is not None}, f"messages[{i}]")
        role = message.get("role")
        if role is None:
            raise ProtocolError("bad_request", f"field 'messages[{i}].role' is missing")
        if not isinstance(role, str):
            raise ProtocolError("bad_request", f"field 'messages[{i}].role' must be a str, got {type_name(role)}")
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        chat.append(message)
    return chat


def _prepare_kwargs(extra: dict | None, named_specials: dict[str, str]) -> tuple[dict, list | None]:
    """Template variables: the special tokens, overridden by chat_template_kwargs; and the documents."""
    if extra is None:
        extra = {}
    if not isinstance(extra, dict):
        raise ProtocolError("bad_request", f"field 'chat_template_kwargs' must be a map, got {type_name(extra)}")
    kwargs = _plain(extra, "chat_template_kwargs")
    for name in kwargs:
        if name in _RESERVED_KWARGS:
            raise ProtocolError(
                "bad_request",
                f"field 'chat_template_kwargs.{name}' is not allowed: it is a parameter of the chat op itself",
            )
    documents = kwargs.pop("documents", None)
    if documents is not None:
        if not isinstance(documents, list):
            raise ProtocolError("bad_request", "field 'chat_template_kwargs.documents' must be a list of maps")
        for i, d in enumerate(documents):
            if not isinstance(d, dict):
                raise ProtocolError("bad_request", f"field 'chat_template_kwargs.documents[{i}]' must be a map")
    return {**named_specials, **kwargs}, documents


def _prepare_tools(tools: Any) -> list | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ProtocolError("bad_request", f"field 'tools' must be a list, got {type_name(tools)}")
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise ProtocolError("bad_request", f"field 'tools[{i}]' must be a map (a JSON schema), got {type_name(tool)}")
    return _plain(tools, "tools")


def _tag_final_message(chat: list[dict], source: str) -> str:
    """Mark the end of the final message's content as transformers does; returns the text to continue."""
    last = len(chat) - 1
    content = chat[-1].get("content")
    if content is None:
        raise ProtocolError(
            "bad_request", f"continue_final_message is set but messages[{last}] has no content to continue"
        )
    if "content" not in source:
        raise ProtocolError(
            "bad_request", "continue_final_message is set but this model's chat template never reads 'content'"
        )
    if isinstance(content, list):
        for j in range(len(content) - 1, -1, -1):
            block = content[j]
            if isinstance(block, str) and "text" in block or isinstance(block, dict) and "text" in block:
                if not isinstance(block, dict) or not isinstance(block["text"], str):
                    raise ProtocolError(
                        "bad_request", f"field 'messages[{last}].content[{j}].text' must be a str to continue it"
                    )
                final = block["text"]
                block["text"] = final + _CONTINUE_TAG
                return final
        raise ProtocolError(
            "bad_request", f"continue_final_message is set but messages[{last}].content has no text part to continue"
        )
    if not isinstance(content, str):
        raise ProtocolError(
            "bad_request",
            f"field 'messages[{last}].content' must be a str or a list of parts to continue it, got {type_name(content)}",
        )
    chat[-1]["content"] = content + _CONTINUE_TAG
    return content


def _cut_after_final_message(prompt: str, final: str) -> str:
    """transformers' cut: end the prompt where the tagged final message ends."""
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in prompt or tag not in prompt:
        raise ProtocolError(
            "template_error",
            "continue_final_message is set but the final message does not appear in the rendered chat: "
            "the chat template drops or changes part of it",
        )
    at = prompt.rindex(tag)
    if prompt[at: at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return prompt[:at]
    return prompt[:at].rstrip()


# --- rendering --------------------------------------------------------------------------------------


class ChatRenderer:
    """Renders one model's chat templates in the worker's render child (chat/process.py), which compiles
    each template once and keeps it."""

    def __init__(
        self,
        templates: ChatTemplates,
        named_specials: dict[str, str],
        *,
        max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES,
        max_seconds: float = DEFAULT_MAX_SECONDS,
        max_memory_bytes: int = DEFAULT_MAX_MEMORY_BYTES,
    ) -> None:
        self.templates = templates
        self._specials = dict(named_specials)
        self._max_bytes = max_output_bytes
        self._max_seconds = max_seconds
        self.sandbox = shared_render_process(max_memory_bytes)

    def render(
        self,
        messages: list,
        *,
        tools: list | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        extra: dict | None = None,
    ) -> str:
        """The prompt transformers' apply_chat_template(tokenize=False) gives for the same input.

        `extra` is chat_template_kwargs: extra template variables (overriding the special tokens), and
        `documents`. Raises ProtocolError: bad_request for malformed input (naming the field),
        template_error when there is no template, it fails to compile, raises, or exceeds its bounds.
        """
        for name, flag in (("add_generation_prompt", add_generation_prompt),
                           ("continue_final_message", continue_final_message)):
            if type(flag) is not bool:
                raise ProtocolError("bad_request", f"field '{name}' must be a bool, got {type_name(flag)}")
        source = self.templates.select(tools)
        chat = _prepare_messages(messages)
        if continue_final_message and add_generation_prompt:
            raise ProtocolError(
                "bad_request",
                "continue_final_message and add_generation_prompt cannot both be true: continue the final "
                "message, or start a new assistant message",
            )
        tool_schemas = _prepare_tools(tools)
        kwargs, documents = _prepare_kwargs(extra, self._specials)
        final = _tag_final_message(chat, source) if continue_final_message else None
        prompt = self.sandbox.render(source, self.templates.source, {
            **kwargs, "messages": chat, "tools": tool_schemas, "documents": documents,
            "add_generation_prompt": add_generation_prompt,
        }, max_seconds=self._max_seconds, max_bytes=self._max_bytes)
        return prompt if final is None else _cut_after_final_message(prompt, final)
