"""The model catalog: every model the broker may serve, and what is known of each. No socket, no clock.

Models come from the broker's flags and from `add_model` (docs/protocol.md, "The model catalog").
The broker never loads a tokenizer: a model's kind, vocabulary and fingerprint are what the first
worker that loaded it said. A worker may also bring models of its own (a remote worker started with
other flags): they are listed as it reported them, routed by the names it gave, and never placed
elsewhere (no other worker can load them from where they are).

The catalog resolves a request's `model` to an entry, the way a worker would: a name or alias, then
the broker's `--tokenizer-map` globs (the most non-`*` characters wins, then the pattern that sorts
first). Which workers hold an entry is broker/placement.py's.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any
from dataclasses import dataclass, field

from tokenbroker.common.config import ModelConfig
from tokenbroker.common.errors import ProtocolError
from tokenbroker.common.protocol import MAX_TEXT_FIELD, LoadSpec, glob_pattern, opt, req

LOADING, READY, FAILED = "loading", "ready", "failed"
FLAG, ADMIN, WORKER = "flag", "admin", "worker"  # where an entry came from


@dataclass
class Entry:
    """One model of the catalog."""

    spec: LoadSpec
    origin: str
    state: str = LOADING
    error: str = ""
    info: dict = field(default_factory=dict)  # ModelInfo.to_wire() from the first worker that loaded it
    fingerprint: str = ""
    removing: bool = False  # remove_model: its queued jobs are being served, then it goes

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def placeable(self) -> bool:
        """Whether the broker may ask a worker to load it."""
        return self.origin != WORKER and self.state != FAILED and not self.removing


class Catalog:
    def __init__(self, config: ModelConfig) -> None:
        self.entries: dict[str, Entry] = {}
        self._names: dict[str, str] = {}  # name or alias -> entry name
        for spec in config.models:
            self._add(Entry(LoadSpec(spec.name, spec.source, list(spec.aliases), None, spec.chat_template,
                                     spec.tokenizer_path), FLAG))
        self.default = config.default.name
        globs = sorted(config.tokenizer_map, key=lambda gt: (-len(gt[0].replace("*", "")), gt[0]))
        self._globs: list[tuple[re.Pattern[str], str]] = [(glob_pattern(g), target) for g, target in globs]

    # --- resolving names -----------------------------------------------------------------

    def resolve(self, model: str | None) -> Entry | None:
        """The entry a request's `model` names (None: the default), or None when the catalog has none.

        An entry being removed resolves to nothing: new requests for it are unknown_model.

        >>> from tokenbroker.common.config import ModelSpec
        >>> c = Catalog(ModelConfig((ModelSpec("deepseek", "x", ("default",)), ModelSpec("bert", "y")), (("bert-*", "bert"),)))
        >>> c.resolve(None).name, c.resolve("default").name, c.resolve("bert-base").name, c.resolve("nope")
        ('deepseek', 'deepseek', 'bert', None)
        """
        name = self.default if model is None else model
        if not name:
            return None
        target = self._names.get(name)
        if target is None:
            target = next((t for pattern, t in self._globs if pattern.fullmatch(name)), None)
        entry = self.entries.get(target) if target is not None else None
        if entry is None or entry.removing or entry.origin == WORKER:
            return None
        return entry

    # --- changes -------------------------------------------------------------------------

    def add(self, spec: LoadSpec) -> Entry:
        """add_model: a new entry in state loading, or the entry already there with that source.

        A failed entry added again with the same source is retried. A name or alias taken by
        another model, or the same name with another source, is a bad_request naming the field.
        """
        existing = self.entries.get(spec.name)
        if existing is not None and not existing.removing and existing.origin != WORKER:
            if existing.spec.source != spec.source:
                raise ProtocolError("bad_request", f"field 'name': model {spec.name!r} is already in the catalog "
                                    f"with source {existing.spec.source!r}; remove it first to change its source")
            if existing.state == FAILED:
                existing.state, existing.error = LOADING, ""
            return existing
        for name in (spec.name, *spec.aliases):
            owner = self._names.get(name)
            if owner is not None and owner != spec.name:
                raise ProtocolError("bad_request", f"field {'name' if name == spec.name else 'aliases'!r}: "
                                    f"{name!r} already names model {owner!r}")
        if existing is not None:  # a removed (or a worker's own) entry of that name gives way
            self.drop(spec.name)
        entry = Entry(spec, ADMIN)
        self._add(entry)
        return entry

    def adopt(self, name: str, info: dict, fingerprint: str) -> None:
        """A model a worker brought that the catalog does not have: listed, never placed elsewhere."""
        if name not in self.entries and name not in self._names:
            self.entries[name] = Entry(LoadSpec(name, info.get("source", "")), WORKER, READY, info=info,
                                       fingerprint=fingerprint)

    def loaded(self, name: str, info: dict, fingerprint: str) -> None:
        entry = self.entries.get(name)
        if entry is not None:
            entry.state, entry.error = READY, ""
            entry.info = entry.info or info
            entry.fingerprint = entry.fingerprint or fingerprint

    def failed(self, name: str, error: str) -> None:
        entry = self.entries.get(name)
        if entry is not None and entry.state != READY:
            entry.state, entry.error = FAILED, error

    def drop(self, name: str) -> Entry | None:
        """Forget an entry and its names."""
        entry = self.entries.pop(name, None)
        if entry is not None:
            for n in (entry.name, *entry.spec.aliases):
                if self._names.get(n) == name:
                    del self._names[n]
        return entry

    def _add(self, entry: Entry) -> None:
        self.entries[entry.name] = entry
        for n in (entry.name, *entry.spec.aliases):
            self._names[n] = entry.name

    # --- the `models` reply --------------------------------------------------------------

    def describe(self, workers: dict[str, int], backends: dict[str, str] | None = None) -> list[dict]:
        """The `models` reply: every entry not being removed; `workers`: how many hold each;
        `backends`: the engine its workers' heartbeats say serves it (served_backends)."""
        out = []
        backends = backends or {}
        for entry in self.entries.values():
            if entry.removing:
                continue
            info = entry.info
            item = {
                "name": entry.name,
                "aliases": list(entry.spec.aliases),
                "kind": info.get("kind", ""),
                "backend": backends.get(entry.name) or info.get("backend", ""),
                "chat_renderer": info.get("chat_renderer", ""),  # docs/chat.md
                "vocab_size": info.get("vocab_size", 0),
                "special_tokens": list(info.get("special_tokens", [])),
                "chat_template": bool(info.get("chat_template", entry.spec.chat_template is not None)),
                "cached": bool(info.get("cached", False)),
                "source": info.get("source") or entry.spec.source,
                **{k: info.get(k, unknown) for k, unknown in MODEL_FACTS.items()},
                "fingerprint": entry.fingerprint,
                "state": entry.state,
                "workers": workers.get(entry.name, 0),
            }
            if entry.state == FAILED:
                item["error"] = entry.error
            out.append(item)
        return out


def backend_counts(reports: Iterable[Any]) -> dict[str, Counter]:
    """Model name -> how many workers serve it with each engine (heartbeat `backends`: a worker
    switches a model to fastokens after its LOADED). Reports are untrusted: non-str entries are skipped."""
    seen: dict[str, Counter] = {}
    for report in reports:
        backends = report.get("backends") if isinstance(report, Mapping) else None
        if not isinstance(backends, Mapping):
            continue
        for name, backend in backends.items():
            if isinstance(name, str) and isinstance(backend, str) and len(backend) <= 64:
                seen.setdefault(name, Counter())[backend] += 1
    return seen


def served_backends(reports: Iterable[Any]) -> dict[str, str]:
    """Model name -> the engine most of the workers holding it report (ties: the first by name)."""
    return {name: min(c.items(), key=lambda kv: (-kv[1], kv[0]))[0] for name, c in backend_counts(reports).items()}


# (1.2) as the worker read them; before a worker has loaded the model, these
MODEL_FACTS = {"bos_token": None, "eos_token": None, "model_max_length": None, "added_tokens": 0}
MAX_MODEL_NAME = 1024  # characters in a model name or alias
MAX_ALIASES = 64


def add_model_spec(payload: dict) -> LoadSpec:
    """The fields of an add_model request, checked (ProtocolError naming the field).

    >>> add_model_spec({"name": "m", "source": "/models/m", "aliases": ["a"]}).aliases
    ['a']
    """
    name = req(payload, "name", str)
    source = req(payload, "source", str)
    aliases = opt(payload, "aliases", list, [])
    template = opt(payload, "chat_template", str, None)
    if not name or len(name) > MAX_MODEL_NAME or not name.isprintable():
        raise ProtocolError("bad_request", f"field 'name' must be 1..{MAX_MODEL_NAME} printable characters")
    if not source or len(source) > 4096:
        raise ProtocolError("bad_request", "field 'source' must be 1..4096 characters")
    if len(aliases) > MAX_ALIASES:
        raise ProtocolError("bad_request", f"field 'aliases' holds {len(aliases)} names; at most {MAX_ALIASES}")
    for i, alias in enumerate(aliases):
        if not isinstance(alias, str) or not alias or len(alias) > MAX_MODEL_NAME or not alias.isprintable():
            raise ProtocolError("bad_request", f"field 'aliases[{i}]' must be a str of 1..{MAX_MODEL_NAME} printable characters")
    if template is not None and len(template) > MAX_TEXT_FIELD:
        raise ProtocolError("bad_request", f"field 'chat_template' is {len(template)} characters; at most {MAX_TEXT_FIELD}")
    return LoadSpec(name, source, list(dict.fromkeys(a for a in aliases if a != name)), template)
