"""What the broker and its workers both read: the models, their caches and limits, and their flags.

Each flag is declared once, on the configuration field it sets (`flag()`): its name, help, type
(which validates it), env var and --help section. `add_flags` builds the argparse options from
those declarations, `from_args` the configuration from the parsed options, and `flags_argv` the
flags again from a configuration, so nothing about a flag is written twice. A nested
configuration's flags (`nested()`) come where its field stands: the field order is the order of
`--help`.

The `serve` and `worker` command lines share the model and cache flags (docs/protocol.md,
"Starting it"); `model_argv()` turns a parsed ModelConfig back into those flags so the supervisor
can start local workers with exactly what the operator gave. Each side's own configuration lives
with it: broker/config.py, workers/config.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import MISSING, dataclass, field
from typing import Any, Callable

EMBEDDED_DEFAULT = "embedded:deepseek"
EMBEDDED_DEFAULT_NAME = "deepseek"
DEFAULT_ALIAS = "default"
TOKENIZER_BACKENDS = ("auto", "fast", "reference")
# The default of --tokenizer-backend when the flag is not given (the test suite sets it to
# `reference`: most tests are about the pool, and a fast engine built per worker start doubles them).
BACKEND_ENV = "TOKENBROKER_TOKENIZER_BACKEND"

MiB = 1024 * 1024

# A worker's memory ceiling unless told otherwise (`serve --worker-max-memory`, `worker --max-memory`;
# docs/sizing.md, "A worker's memory ceiling"): room for a few tokenizers' engine caches on two
# threads (~130 MiB each for DeepSeek), L0 and L1 at their default bounds, and the models a worker
# loads itself; what passes it is growth nothing else bounds.
DEFAULT_WORKER_MAX_MEMORY = 2048 * MiB

# The broker's frontend, where clients connect unless told otherwise (docs/protocol.md, "Sockets").
DEFAULT_FRONTEND = "tcp://127.0.0.1:5555"


# --- flags: one declaration per flag, on the field it sets --------------------------------------


@dataclass(frozen=True)
class Flag:
    """How a configuration field is given on the command line (the argparse options it becomes)."""

    name: str  # "--max-pending"
    help: str | None = None
    type: Callable[[str], Any] | None = None  # parses and validates (argparse.ArgumentTypeError names the rule)
    action: str | None = None  # "store_true", "append", "extend"
    nargs: str | None = None
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    group: str | None = None  # the --help section; None: the command's own options
    env: str | None = None  # the default is read from this environment variable when the parser is built
    parse_default: str | None = None  # the text argparse parses (with `type`) where no flag is given, if not the field's default (`--workers auto`)
    required: bool = False

    @property
    def dest(self) -> str:
        return self.name.lstrip("-").replace("-", "_")

    @property
    def many(self) -> bool:
        """Repeated or multi-valued: parsed into a list, held in the configuration as a tuple."""
        return self.action in ("append", "extend")


def flag(name: str, default: Any = MISSING, *, default_factory: Any = MISSING, **how: Any) -> Any:
    """A dataclass field set by the command-line flag `name` (`how`: the other Flag fields)."""
    return field(default=default, default_factory=default_factory, metadata={"flag": Flag(name, **how)})


def nested(cls: type, build: Callable[[argparse.Namespace], Any] | None = None, *,
           default_factory: Any = MISSING) -> Any:
    """A field holding a configuration built from `cls`'s flags (by `build`, default `from_args(cls, ...)`)."""
    return field(default_factory=default_factory, metadata={"flags_of": cls, "build": build})


def add_flags(p: argparse.ArgumentParser, cls: type, groups: dict[str, Any] | None = None) -> None:
    """Add the flags of `cls`'s fields (and of its nested configurations) to `p`, in field order."""
    groups = {} if groups is None else groups
    for f in dataclasses.fields(cls):
        if "flags_of" in f.metadata:
            add_flags(p, f.metadata["flags_of"], groups)
            continue
        fl: Flag | None = f.metadata.get("flag")
        if fl is None:
            continue
        if fl.group is None:
            target: Any = p
        elif fl.group in groups:
            target = groups[fl.group]
        else:
            target = groups[fl.group] = p.add_argument_group(fl.group)
        target.add_argument(fl.name, **_argparse_kwargs(f, fl))


def _argparse_kwargs(f: dataclasses.Field, fl: Flag) -> dict[str, Any]:
    kwargs: dict[str, Any] = {k: v for k, v in (("help", fl.help), ("type", fl.type), ("action", fl.action),
                                                ("nargs", fl.nargs), ("choices", fl.choices), ("metavar", fl.metavar))
                              if v is not None}
    if fl.required:
        kwargs["required"] = True
        return kwargs
    default: Any
    if fl.parse_default is not None:
        default = fl.parse_default
    elif fl.many:
        default = []  # argparse copies it before appending
    else:
        default = f.default
    if fl.env is not None:
        default = os.environ.get(fl.env, default)
    kwargs["default"] = default
    return kwargs


def from_args(cls: type, a: argparse.Namespace, **given: Any) -> Any:
    """`cls` built from the parsed flags of its fields (nested configurations too); `given` wins."""
    values = dict(given)
    for f in dataclasses.fields(cls):
        if f.name in values:
            continue
        if "flags_of" in f.metadata:
            build = f.metadata["build"]
            values[f.name] = build(a) if build is not None else from_args(f.metadata["flags_of"], a)
        elif "flag" in f.metadata:
            fl: Flag = f.metadata["flag"]
            value = getattr(a, fl.dest)
            values[f.name] = tuple(value) if fl.many else value
    return cls(**values)


def flags_argv(config: Any) -> list[str]:
    """The flags that give `config`'s flag fields (and its nested configurations') their values."""
    argv: list[str] = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if "flags_of" in f.metadata and dataclasses.is_dataclass(value):
            argv += flags_argv(value)
            continue
        fl: Flag | None = f.metadata.get("flag")
        if fl is None or value is None:
            continue
        if fl.action == "store_true":
            argv += [fl.name] if value else []
        elif fl.many:
            for item in value:
                argv += [fl.name, "=".join(item) if isinstance(item, tuple) else str(item)]
        else:
            argv += [fl.name, str(value)]
    return argv


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


def non_negative_float(text: str) -> float:
    value = float(text)
    if not 0.0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def _pair(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name or not value:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    return name, value


# --- the configuration both sides read ----------------------------------------------------------


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
    l0_enabled: bool = flag("--tokenizer-cache-enable-l0", False, action="store_true", group="caches")
    l0_max_entries: int = flag("--tokenizer-cache-l0-max-entries", 10000, type=positive_int, group="caches")
    l0_max_bytes: int = flag("--tokenizer-cache-l0-max-bytes", 256 * MiB, type=positive_int, group="caches")
    l1_enabled: bool = flag("--tokenizer-cache-enable-l1", False, action="store_true", group="caches")
    l1_max_memory: int = flag("--tokenizer-cache-l1-max-memory", 50 * MiB, type=positive_int, group="caches")


@dataclass(frozen=True)
class Limits:
    """Work one request may ask of a worker; over them it is answered `too_large`."""

    max_batch_items: int = flag("--max-batch-items", 65536, type=positive_int, group="limits",
                                help="texts (or id sequences) one batch request may hold; more is answered too_large")
    max_reply_bytes: int = flag("--max-reply-bytes", 64 * MiB, type=positive_int, group="limits",
                                help="a reply larger than this is answered too_large instead")


@dataclass(frozen=True)
class ModelFlags:
    """The models as the command line names them; `specs()` turns them into the ModelSpecs to load."""

    model_path: str | None = flag("--model-path", None, group="models",
                                  help="the default model: folder, tokenizer.json, .tiktoken, Hub id, encoding or OpenAI model name")
    tokenizer_path: str | None = flag("--tokenizer-path", None, group="models",
                                      help="load the default model's tokenizer from here instead")
    chat_template: str | None = flag("--chat-template", None, group="models",
                                     help="a chat template file for the default model")
    served_model_name: tuple[str, ...] = flag("--served-model-name", (), nargs="+", action="extend", metavar="NAME",
                                              group="models", help="names the default model answers to (the first is its name)")
    model: tuple[tuple[str, str], ...] = flag("--model", (), action="append", type=_pair, metavar="NAME=PATH_OR_HUB_ID",
                                              group="models", help="another model, under NAME")
    model_chat_template: tuple[tuple[str, str], ...] = flag("--model-chat-template", (), action="append", type=_pair,
                                                            metavar="NAME=FILE", group="models",
                                                            help="a chat template file for the model NAME")

    def specs(self) -> tuple[ModelSpec, ...]:
        """The default model first (`--model-path`, else the first `--model`, else the embedded one)."""
        templates = dict(self.model_chat_template)
        served = list(self.served_model_name)
        extra = [ModelSpec(name, src, chat_template=templates.get(name)) for name, src in self.model]
        if self.model_path or self.tokenizer_path or not extra:
            source = self.model_path or self.tokenizer_path or EMBEDDED_DEFAULT
            name = served[0] if served else (EMBEDDED_DEFAULT_NAME if source == EMBEDDED_DEFAULT else source)
            default = ModelSpec(
                name=name,
                source=source,
                aliases=_aliases(name, served),
                tokenizer_path=self.tokenizer_path,
                chat_template=self.chat_template or templates.get(name),
            )
            return (default, *extra)
        first = extra[0]
        first = ModelSpec(first.name, first.source, aliases=_aliases(first.name, served),
                          chat_template=self.chat_template or first.chat_template)
        return (first, *extra[1:])


@dataclass(frozen=True)
class ModelConfig:
    """What every worker loads. The first model is the default."""

    models: tuple[ModelSpec, ...] = nested(ModelFlags, lambda a: from_args(ModelFlags, a).specs())
    tokenizer_map: tuple[tuple[str, str], ...] = flag("--tokenizer-map", (), action="append", type=_pair,  # (glob, model name)
                                                      metavar="GLOB=NAME", group="models",
                                                      help="send model names matching GLOB (only '*', anchored) to the loaded model NAME")
    cache: CacheConfig = nested(CacheConfig, default_factory=CacheConfig)
    backend: str = flag("--tokenizer-backend", "auto", choices=TOKENIZER_BACKENDS, env=BACKEND_ENV, group="models",
                        help="auto: fastokens for every model where probes at load prove it gives the reference's "
                             "ids, the model's own library otherwise; fast: fastokens wherever it loads, unprobed; "
                             "reference: always the model's own library (tokenizers, tiktoken)")
    max_models: int = flag("--max-models-per-worker", 0, type=non_negative_int, metavar="N", group="models",
                           help="a worker holds at most N tokenizers, loaded on demand (0: every worker loads every model)")
    limits: Limits = nested(Limits, default_factory=Limits)

    @property
    def default(self) -> ModelSpec:
        return self.models[0]


def model_config_from_args(a: argparse.Namespace) -> ModelConfig:
    m: ModelConfig = from_args(ModelConfig, a)
    names = [n for spec in m.models for n in (spec.name, *spec.aliases)]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise SystemExit(f"tokenbroker: model name given twice: {', '.join(dupes)}")
    for glob, target in m.tokenizer_map:
        if target not in names:
            raise SystemExit(f"tokenbroker: --tokenizer-map {glob}={target}: no model is named {target!r}")
    return m


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
    return argv + flags_argv(m)  # the map, caches, backend and limits: every flag field of ModelConfig
