"""Model names to tokenizers: `--tokenizer-map` globs and OpenAI model families.

Clients name models the way their provider does (`openai/gpt-4o-2024-08-06`, `claude-sonnet-4`);
these two pure functions decide which tokenizer answers such a name, without loading anything.

>>> TokenizerMap([("claude-*", "deepseek"), ("claude-3-*", "qwen")]).lookup("claude-3-haiku")
'qwen'
>>> openai_encoding_for("Azure/GPT-4o-mini-2024-07-18")
'o200k_base'
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from tokenbroker.common.protocol import glob_pattern


@dataclass(frozen=True)
class _Rule:
    glob: str
    target: str
    pattern: re.Pattern[str]

    @property
    def rank(self) -> tuple[int, str]:
        # The most literal characters wins (the most specific glob), then the pattern that sorts first.
        return (-len(self.glob.replace("*", "")), self.glob)


_compile = glob_pattern  # the broker routes by the same semantics (common/protocol.py)


class TokenizerMap:
    """`--tokenizer-map GLOB=NAME` pairs; `lookup` answers the target of the best-matching glob.

    Globs are anchored and case-sensitive; `*` is the only wildcard. Among matching globs the one with
    the most non-`*` characters wins, then the one that sorts first; for a glob given twice the first
    pair counts.
    """

    def __init__(self, pairs: Sequence[tuple[str, str]]) -> None:
        rules: dict[str, _Rule] = {}
        for glob, target in pairs:
            rules.setdefault(glob, _Rule(glob, target, _compile(glob)))
        self._rules = sorted(rules.values(), key=lambda r: r.rank)

    def lookup(self, model: str) -> str | None:
        for rule in self._rules:
            if rule.pattern.fullmatch(model):
                return rule.target
        return None

    def __len__(self) -> int:
        return len(self._rules)


# --- OpenAI model families ---------------------------------------------------------------

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
