"""What the broker and its workers both read: the models, their caches and limits, and their flags.

The `serve` and `worker` command lines share the model and cache flags (docs/protocol.md,
"Starting it"); `model_argv()` turns a parsed ModelConfig back into those flags so the supervisor
can start local workers with exactly what the operator gave. Each side's own configuration lives
with it: broker/config.py, workers/config.py.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

EMBEDDED_DEFAULT = "embedded:deepseek"
EMBEDDED_DEFAULT_NAME = "deepseek"
DEFAULT_ALIAS = "default"
TOKENIZER_BACKENDS = ("auto", "fast", "reference")
# The default of --tokenizer-backend when the flag is not given (the test suite sets it to
# `reference`: most tests are about the pool, and a fast engine built per worker start doubles them).
BACKEND_ENV = "TOKENBROKER_TOKENIZER_BACKEND"

MiB = 1024 * 1024

# The broker's frontend, where clients connect unless told otherwise (docs/protocol.md, "Sockets").
DEFAULT_FRONTEND = "tcp://127.0.0.1:5555"


@dataclass(frozen=True)
class ModelSpec:
    """One model to load: a name, where its tokenizer comes from, and its aliases."""

    name: str
    source: str  # folder, tokenizer.json, .tiktoken file, Hub id, encoding name, OpenAI model name, or EMBEDDED_DEFAULT
    aliases: tuple[str, ...] = ()
    tokenizer_path: str | None = None  # overrides where the tokenizer itself is loaded from
    chat_template: str | None = None  # a template file that wins over the model's own
    chat_template_text: str | None = None  # a template's text (add_model), winning over both


@dataclass(frozen=True)
class CacheConfig:
    l0_enabled: bool = False
    l0_max_entries: int = 10000
    l0_max_bytes: int = 256 * MiB
    l1_enabled: bool = False
    l1_max_memory: int = 50 * MiB


@dataclass(frozen=True)
class Limits:
    """Work one request may ask of a worker; over them it is answered `too_large`."""

    max_batch_items: int = 65536  # texts in a tokenize batch, sequences in a detokenize batch
    max_reply_bytes: int = 64 * MiB  # a reply larger than this is not sent


@dataclass(frozen=True)
class ModelConfig:
    """What every worker loads. The first model is the default."""

    models: tuple[ModelSpec, ...]
    tokenizer_map: tuple[tuple[str, str], ...] = ()  # (glob, model name)
    cache: CacheConfig = field(default_factory=CacheConfig)
    limits: Limits = field(default_factory=Limits)
    max_models: int = 0  # --max-models-per-worker: 0 loads every model at start; N loads the default, the rest on demand
    backend: str = "auto"  # --tokenizer-backend: auto (fastokens where probes prove it exact), fast, reference

    @property
    def default(self) -> ModelSpec:
        return self.models[0]


# --- argv --------------------------------------------------------------------------------


def positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _pair(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name or not value:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    return name, value


def add_model_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("models")
    g.add_argument("--model-path", help="the default model: folder, tokenizer.json, .tiktoken, Hub id, encoding or OpenAI model name")
    g.add_argument("--tokenizer-path", help="load the default model's tokenizer from here instead")
    g.add_argument("--chat-template", help="a chat template file for the default model")
    g.add_argument("--served-model-name", nargs="+", action="extend", default=[], metavar="NAME",
                   help="names the default model answers to (the first is its name)")
    g.add_argument("--model", action="append", type=_pair, default=[], metavar="NAME=PATH_OR_HUB_ID",
                   help="another model, under NAME")
    g.add_argument("--model-chat-template", action="append", type=_pair, default=[], metavar="NAME=FILE",
                   help="a chat template file for the model NAME")
    g.add_argument("--tokenizer-map", action="append", type=_pair, default=[], metavar="GLOB=NAME",
                   help="send model names matching GLOB (only '*', anchored) to the loaded model NAME")
    c = p.add_argument_group("caches")
    c.add_argument("--tokenizer-cache-enable-l0", action="store_true")
    c.add_argument("--tokenizer-cache-l0-max-entries", type=positive_int, default=CacheConfig.l0_max_entries)
    c.add_argument("--tokenizer-cache-l0-max-bytes", type=positive_int, default=CacheConfig.l0_max_bytes)
    c.add_argument("--tokenizer-cache-enable-l1", action="store_true")
    c.add_argument("--tokenizer-cache-l1-max-memory", type=positive_int, default=CacheConfig.l1_max_memory)
    g.add_argument("--tokenizer-backend", choices=TOKENIZER_BACKENDS, default=os.environ.get(BACKEND_ENV, "auto"),
                   help="auto: fastokens for every model where probes at load prove it gives the reference's "
                        "ids, the model's own library otherwise; fast: fastokens wherever it loads, unprobed; "
                        "reference: always the model's own library (tokenizers, tiktoken)")
    g.add_argument("--max-models-per-worker", type=non_negative_int, default=0, metavar="N",
                   help="a worker holds at most N tokenizers, loaded on demand (0: every worker loads every model)")
    lim = p.add_argument_group("limits")
    lim.add_argument("--max-batch-items", type=positive_int, default=Limits.max_batch_items,
                     help="texts (or id sequences) one batch request may hold; more is answered too_large")
    lim.add_argument("--max-reply-bytes", type=positive_int, default=Limits.max_reply_bytes,
                     help="a reply larger than this is answered too_large instead")


def model_config_from_args(a: argparse.Namespace) -> ModelConfig:
    templates = dict(a.model_chat_template)
    served = list(a.served_model_name)
    extra = [ModelSpec(name, src, chat_template=templates.get(name)) for name, src in a.model]
    if a.model_path or a.tokenizer_path or not extra:
        source = a.model_path or a.tokenizer_path or EMBEDDED_DEFAULT
        name = served[0] if served else (EMBEDDED_DEFAULT_NAME if source == EMBEDDED_DEFAULT else source)
        default = ModelSpec(
            name=name,
            source=source,
            aliases=_aliases(name, served),
            tokenizer_path=a.tokenizer_path,
            chat_template=a.chat_template or templates.get(name),
        )
        models = (default, *extra)
    else:
        first = extra[0]
        first = ModelSpec(first.name, first.source, aliases=_aliases(first.name, served),
                          chat_template=a.chat_template or first.chat_template)
        models = (first, *extra[1:])
    names = [n for m in models for n in (m.name, *m.aliases)]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise SystemExit(f"tokenbroker: model name given twice: {', '.join(dupes)}")
    for glob, target in a.tokenizer_map:
        if target not in names:
            raise SystemExit(f"tokenbroker: --tokenizer-map {glob}={target}: no model is named {target!r}")
    cache = CacheConfig(
        l0_enabled=a.tokenizer_cache_enable_l0,
        l0_max_entries=a.tokenizer_cache_l0_max_entries,
        l0_max_bytes=a.tokenizer_cache_l0_max_bytes,
        l1_enabled=a.tokenizer_cache_enable_l1,
        l1_max_memory=a.tokenizer_cache_l1_max_memory,
    )
    limits = Limits(max_batch_items=a.max_batch_items, max_reply_bytes=a.max_reply_bytes)
    return ModelConfig(models=models, tokenizer_map=tuple(a.tokenizer_map), cache=cache, limits=limits,
                       max_models=a.max_models_per_worker, backend=a.tokenizer_backend)


def _aliases(name: str, served: list[str]) -> tuple[str, ...]:
    """The default model also answers to the served names after its own and to 'default'."""
    return tuple(n for n in dict.fromkeys([*served, DEFAULT_ALIAS]) if n != name)


def model_argv(m: ModelConfig) -> list[str]:
    """The flags that make a worker load exactly `m` (the inverse of model_config_from_args)."""
    argv: list[str] = []
    d = m.default
    if d.source != EMBEDDED_DEFAULT or len(m.models) > 1:  # else the first --model would become the default
        argv += ["--model-path", d.source]
    if d.tokenizer_path:
        argv += ["--tokenizer-path", d.tokenizer_path]
    if d.chat_template:
        argv += ["--chat-template", d.chat_template]
    argv += ["--served-model-name", d.name, *[x for x in d.aliases if x != DEFAULT_ALIAS]]
    for spec in m.models[1:]:
        argv += ["--model", f"{spec.name}={spec.source}"]
        if spec.chat_template:
            argv += ["--model-chat-template", f"{spec.name}={spec.chat_template}"]
    for glob, target in m.tokenizer_map:
        argv += ["--tokenizer-map", f"{glob}={target}"]
    c = m.cache
    if c.l0_enabled:
        argv.append("--tokenizer-cache-enable-l0")
    if c.l1_enabled:
        argv.append("--tokenizer-cache-enable-l1")
    argv += [
        "--tokenizer-cache-l0-max-entries", str(c.l0_max_entries),
        "--tokenizer-cache-l0-max-bytes", str(c.l0_max_bytes),
        "--tokenizer-cache-l1-max-memory", str(c.l1_max_memory),
        "--max-batch-items", str(m.limits.max_batch_items),
        "--max-reply-bytes", str(m.limits.max_reply_bytes),
        "--max-models-per-worker", str(m.max_models),
        "--tokenizer-backend", m.backend,
    ]
    return argv
