"""`--tokenizer-map` globs: the loaded model that answers a name no model or alias has.

Clients name models the way their provider does (`openai/gpt-4o-2024-08-06`, `claude-sonnet-4`);
the registry asks this map, without loading anything, after exact names and aliases.

>>> TokenizerMap([("claude-*", "deepseek"), ("claude-3-*", "qwen")]).lookup("claude-3-haiku")
'qwen'
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
