"""Configuration: one dataclass per concern, built from argv once and passed down.

The `serve` and `worker` command lines share the model and cache flags (docs/protocol.md,
"Starting it"); `model_argv()` turns a parsed ModelConfig back into those flags so the supervisor
can start local workers with exactly what the operator gave.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

EMBEDDED_DEFAULT = "embedded:deepseek"
EMBEDDED_DEFAULT_NAME = "deepseek"
DEFAULT_ALIAS = "default"

MiB = 1024 * 1024


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
    l1_max_memory: int = 52428800


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

    @property
    def default(self) -> ModelSpec:
        return self.models[0]


@dataclass(frozen=True)
class CurveConfig:
    """The broker's CURVE flags (docs/security.md); all None: no CURVE."""

    secret_key: str | None = None
    clients: str | None = None
    workers: str | None = None
    admins: str | None = None
    insecure: bool = False


@dataclass(frozen=True)
class BrokerConfig:
    frontend: str = "tcp://127.0.0.1:5555"
    backend: str | None = None  # None: an ipc:// path in a private runtime dir
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 9464
    workers: int = 1
    request_timeout_ms: int = 30000
    max_request_bytes: int = 32 * MiB
    max_pending: int = 4096
    max_pending_bytes: int = 1024 * MiB  # payload bytes held at once (queued and in flight)
    max_client_pending: int = 1024  # requests one client connection may have held at once
    balance_factor: float = 1.25
    balance_margin: int = 2
    spill_wait_ms: int = 20  # a job waits this long for its full (but not overloaded) preferred worker
    worker_max_bytes: int = 1 * MiB  # payload bytes a worker holds before it gets more (past its first job)
    worker_capacity: int = 64  # jobs each local worker holds at once
    routing: str = "affinity"  # or "least-loaded": no affinity keys at all (for comparison and debugging)
    models: ModelConfig = field(default_factory=lambda: ModelConfig(models=(ModelSpec(EMBEDDED_DEFAULT_NAME, EMBEDDED_DEFAULT),)))
    curve: CurveConfig = field(default_factory=CurveConfig)  # broker/security.py reads it


@dataclass(frozen=True)
class WorkerConfig:
    connect: str
    models: ModelConfig
    capacity: int = 64  # jobs held at once: a pipeline deep enough that the worker never waits for the broker
    name: str | None = None
    curve_server_key: str | None = None  # the broker's public .key (common/curve.py)
    curve_secret_key: str | None = None  # this worker's own .key_secret


# --- argv --------------------------------------------------------------------------------


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _factor(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not value >= 1.0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number >= 1.0, got {text}")
    return value


def _pair(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name or not value:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    return name, value


def _workers(text: str) -> int:
    if text == "auto":
        return usable_cores()
    return _non_negative_int(text)


def usable_cores() -> int:
    """The cores this process may run on (affinity and cgroup-pinned sets), not the host's count."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


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
    c.add_argument("--tokenizer-cache-l0-max-entries", type=_positive_int, default=CacheConfig.l0_max_entries)
    c.add_argument("--tokenizer-cache-l0-max-bytes", type=_positive_int, default=CacheConfig.l0_max_bytes)
    c.add_argument("--tokenizer-cache-enable-l1", action="store_true")
    c.add_argument("--tokenizer-cache-l1-max-memory", type=_positive_int, default=CacheConfig.l1_max_memory)
    g.add_argument("--max-models-per-worker", type=_non_negative_int, default=0, metavar="N",
                   help="a worker holds at most N tokenizers, loaded on demand (0: every worker loads every model)")
    lim = p.add_argument_group("limits")
    lim.add_argument("--max-batch-items", type=_positive_int, default=Limits.max_batch_items,
                     help="texts (or id sequences) one batch request may hold; more is answered too_large")
    lim.add_argument("--max-reply-bytes", type=_positive_int, default=Limits.max_reply_bytes,
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
                       max_models=a.max_models_per_worker)


def _aliases(name: str, served: list[str]) -> tuple[str, ...]:
    """The default model also answers to the served names after its own and to 'default'."""
    return tuple(n for n in dict.fromkeys([*served, DEFAULT_ALIAS]) if n != name)


def model_argv(m: ModelConfig) -> list[str]:
    """The flags that make a worker load exactly `m` (the inverse of model_config_from_args)."""
    argv: list[str] = []
    d = m.default
    if d.source != EMBEDDED_DEFAULT:
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
    ]
    return argv


def add_serve_flags(p: argparse.ArgumentParser) -> None:
    add_model_flags(p)
    d = BrokerConfig()
    p.add_argument("--workers", type=_workers, default=d.workers, metavar="N|auto",
                   help="local worker processes (auto: the cores this process may use)")
    p.add_argument("--frontend", default=d.frontend)
    p.add_argument("--backend", default=None, help="default: ipc:// in a private runtime dir; tcp://HOST:PORT lets remote workers join")
    p.add_argument("--metrics-host", default=d.metrics_host)
    p.add_argument("--metrics-port", type=_non_negative_int, default=d.metrics_port, help="0 turns the exporter off")
    p.add_argument("--request-timeout-ms", type=_positive_int, default=d.request_timeout_ms)
    p.add_argument("--max-request-bytes", type=_positive_int, default=d.max_request_bytes)
    p.add_argument("--max-pending", type=_positive_int, default=d.max_pending,
                   help="queued requests beyond this are answered overloaded")
    p.add_argument("--max-pending-bytes", type=_positive_int, default=d.max_pending_bytes,
                   help="payload bytes held (queued and in flight) beyond this are answered overloaded")
    p.add_argument("--max-client-pending", type=_positive_int, default=d.max_client_pending,
                   help="requests one client connection may have held at once; more are answered overloaded")
    p.add_argument("--balance-factor", type=_factor, default=d.balance_factor,
                   help="a worker above mean*factor and mean+margin in-flight jobs is passed over")
    p.add_argument("--balance-margin", type=_non_negative_int, default=d.balance_margin)
    p.add_argument("--spill-wait-ms", type=_non_negative_int, default=d.spill_wait_ms,
                   help="how long a job waits for its busy preferred worker before going to another (0: never waits)")
    p.add_argument("--worker-capacity", type=_positive_int, default=d.worker_capacity,
                   help="jobs each local worker holds at once: deep enough that it never waits for the broker")
    p.add_argument("--worker-max-bytes", type=_positive_int, default=d.worker_max_bytes,
                   help="payload bytes a worker may hold before it is sent more (a huge request holds up its own worker only)")
    p.add_argument("--routing", choices=("affinity", "least-loaded"), default=d.routing,
                   help="affinity: keep a conversation's prefixes on one worker; least-loaded: ignore keys")
    s = p.add_argument_group("security (docs/security.md)")
    s.add_argument("--curve-secret-key", metavar="FILE", help="the broker's .key_secret: CURVE on the frontend and a tcp:// backend")
    s.add_argument("--curve-clients", metavar="DIR", help="admit only clients whose public .key is in DIR (default: any key)")
    s.add_argument("--curve-workers", metavar="DIR", help="admit only workers whose public .key is in DIR (required for a tcp:// backend)")
    s.add_argument("--curve-admins", metavar="DIR", help="public .key files of the clients allowed the admin ops")
    s.add_argument("--insecure", action="store_true", help="allow binding a non-loopback address without CURVE")


def broker_config_from_args(a: argparse.Namespace) -> BrokerConfig:
    return BrokerConfig(
        frontend=a.frontend,
        backend=a.backend,
        metrics_host=a.metrics_host,
        metrics_port=a.metrics_port,
        workers=a.workers,
        request_timeout_ms=a.request_timeout_ms,
        max_request_bytes=a.max_request_bytes,
        max_pending=a.max_pending,
        max_pending_bytes=a.max_pending_bytes,
        max_client_pending=a.max_client_pending,
        balance_factor=a.balance_factor,
        balance_margin=a.balance_margin,
        routing=a.routing,
        spill_wait_ms=a.spill_wait_ms,
        worker_max_bytes=a.worker_max_bytes,
        worker_capacity=a.worker_capacity,
        models=model_config_from_args(a),
        curve=CurveConfig(a.curve_secret_key, a.curve_clients, a.curve_workers, a.curve_admins, a.insecure),
    )


def add_worker_flags(p: argparse.ArgumentParser) -> None:
    add_model_flags(p)
    p.add_argument("--connect", required=True, help="the broker's backend endpoint")
    p.add_argument("--capacity", type=_positive_int, default=WorkerConfig.capacity,
                   help="jobs the worker holds at once")
    p.add_argument("--name", default=None, help="worker name shown in replies and metrics")
    p.add_argument("--curve-server-key", metavar="FILE", help="the broker's public .key: connect with CURVE")
    p.add_argument("--curve-secret-key", metavar="FILE", help="this worker's own .key_secret (its .key is in the broker's --curve-workers)")


def worker_config_from_args(a: argparse.Namespace) -> WorkerConfig:
    from .curve import CurveKeyError, load_client_keys

    try:  # a missing or malformed key file stops the worker here, before it loads a tokenizer
        if a.curve_server_key or a.curve_secret_key:
            load_client_keys(a.curve_server_key, a.curve_secret_key, own_key_required=True)
    except CurveKeyError as e:
        raise SystemExit(f"tokenbroker: {e}") from None
    return WorkerConfig(connect=a.connect, models=model_config_from_args(a), capacity=a.capacity, name=a.name,
                        curve_server_key=a.curve_server_key, curve_secret_key=a.curve_secret_key)
