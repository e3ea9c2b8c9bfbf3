"""OpenAI model families: which tiktoken encoding counts a model name the way OpenAI's API would.

The counting ladder's first rung (count/__init__.py) and OpenAI's framing (openai.py) ask it; names are
matched as clients write them (`openai/gpt-4o-2024-08-06`, `Azure/GPT-35-Turbo`, `ft:gpt-4o-mini:org::id`).

>>> openai_encoding_for("Azure/GPT-4o-mini-2024-07-18")
'o200k_base'
"""

from __future__ import annotations

import re

# Family name (after normalise_openai_model) -> tiktoken encoding. A family matches the whole name or the
# name followed by "-anything" (dates, sizes, versions: gpt-4o-mini-2024-07-18), so gpt-4 never takes gpt-4o.
_OPENAI_FAMILIES: tuple[tuple[str, str], ...] = (
    (r"gpt-oss", "o200k_harmony"),
    (r"gpt-4o|chatgpt-4o|gpt-4\.1|gpt-4\.5|gpt-5(?:\.\d+)?|o1|o3|o4|codex-mini", "o200k_base"),
    (r"gpt-4|gpt-3\.5", "cl100k_base"),
)
_FAMILY_PATTERNS = tuple((re.compile(rf"(?:{alts})(?:-.*)?", re.DOTALL), enc) for alts, enc in _OPENAI_FAMILIES)
_FINE_TUNED = re.compile(r"ft:([^:]+)(?::.*)?", re.DOTALL)  # ft:gpt-4o-mini-2024-07-18:org::abc123


def normalise_openai_model(model: str) -> str:
    """Lower case, no provider prefix (`openai/`, `azure/`, `models/`), fine-tune wrapper off, Azure's `gpt-35` spelled `gpt-3.5`.

    >>> normalise_openai_model("openrouter/openai/GPT-35-Turbo-0301")
    'gpt-3.5-turbo-0301'
    """
    name = model.strip().lower()
    m = _FINE_TUNED.fullmatch(name)
    if m:
        name = m.group(1)
    name = name.rsplit("/", 1)[-1]
    if name.startswith("gpt-35"):
        name = "gpt-3.5" + name[len("gpt-35"):]
    return name


def openai_encoding_for(model: str) -> str | None:
    """The tiktoken encoding of an OpenAI model family, or None for any other name.

    >>> openai_encoding_for("gpt-4-0613"), openai_encoding_for("o3-mini"), openai_encoding_for("gpt-oss-20b")
    ('cl100k_base', 'o200k_base', 'o200k_harmony')
    >>> openai_encoding_for("claude-sonnet-4") is None
    True
    """
    name = normalise_openai_model(model)
    for pattern, encoding in _FAMILY_PATTERNS:
        if pattern.fullmatch(name):
            return encoding
    return None
