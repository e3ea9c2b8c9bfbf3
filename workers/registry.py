"""The models a worker holds: tokenizer, cache and chat template per model, and name resolution.

Configured models load at start (a worker that cannot load says so and exits): all of them, or only
the default with --max-models-per-worker, the rest installed and let go as the broker says
(loader.py loads them off the main thread; `install` and `unload` run on the main thread only, so
`resolve` never sees a half-built state). The template that local workers fork from
(workers/zygote.py) loads the rest too, dormant: not served, not counted against the cap, shared
by every forked worker; a LOAD of one of them wakes it at once instead of parsing it again, and an
UNLOAD puts it back to sleep (docs/sizing.md, "What the cap means"). The counting ladder's OpenAI encodings and fallback load
on first use, the encodings from local files only. The registry is an object the worker owns, never
a module global.
"""

from __future__ import annotations

import logging
import threading
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from tokenbroker.common.config import DEFAULT_ALIAS, EMBEDDED_DEFAULT, EMBEDDED_DEFAULT_NAME, CacheConfig, Limits, ModelConfig, ModelSpec
from tokenbroker.common.errors import BootError, ProtocolError
from tokenbroker.common.process import release_memory
from tokenbroker.common.protocol import MAX_SPECIAL_TOKENS, ModelInfo

from .cache import TokenCache
from .chat import ChatRenderer, ChatTemplates, discover_chat_templates, special_tokens_from_config
from .count.encodings import local_encoding, where_to_put
from .engine import EnginePlan, engine_limit
from .stream import StreamDecoder
from .tokenizer_map import TokenizerMap
from .tokenin import reference
from .tokenizers import Tokenizer, load_tokenizer, wrap_encoding

log = logging.getLogger(__name__)

_ABSENT = object()
OPENAI_ENCODINGS = ("o200k_base", "o200k_harmony", "cl100k_base", "p50k_base", "r50k_base", "gpt2")


@dataclass
class Model:
    """One loaded model: what `model` resolves to."""

    spec: ModelSpec
    tokenizer: Tokenizer
    cache: TokenCache
    templates: ChatTemplates | None
    _renderer: ChatRenderer | None = field(default=None, repr=False)
    _fingerprint: str | None = field(default=None, repr=False)
    _tokenizer_fingerprint: str | None = field(default=None, repr=False)
    _decoder: StreamDecoder | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return self.spec.name

    def sharing(self, spec: ModelSpec) -> "Model":
        """Another name for this model's tokenizer, caches and templates (LOAD with `share`)."""
        return Model(spec=spec, tokenizer=self.tokenizer, cache=self.cache, templates=self.templates,
                     _fingerprint=self._fingerprint, _tokenizer_fingerprint=self._tokenizer_fingerprint,
                     _decoder=self._decoder)

    def over(self, engine: "Model") -> "Model":
        """This model served by `engine`'s tokenizer and caches (the same tokenizer fingerprint): its
        own names, templates and fingerprint, and not one more engine or cache. A cached entry is
        the tokenizer's ids, whatever the model: it serves every model over that tokenizer."""
        return Model(spec=self.spec, tokenizer=engine.tokenizer, cache=engine.cache, templates=self.templates,
                     _fingerprint=self.fingerprint, _tokenizer_fingerprint=self.tokenizer_fingerprint)

    @property
    def fingerprint(self) -> str:
        """The hex SHA-256 of all that can change an id or a prompt (workers/fingerprint.py), computed once."""
        if self._fingerprint is None:
            self._hash()
        return cast(str, self._fingerprint)

    @property
    def tokenizer_fingerprint(self) -> str:
        """The fingerprint of its tokenizer alone (no chat template): models that share it share one
        engine and one pair of caches (ModelRegistry.engine_for)."""
        if self._tokenizer_fingerprint is None:
            self._hash()
        return cast(str, self._tokenizer_fingerprint)

    def _hash(self) -> None:
        from .fingerprint import fingerprints  # hashes the whole vocabulary: only when first asked

        self._fingerprint, self._tokenizer_fingerprint = fingerprints(self.tokenizer, self.templates)

    def renderer(self) -> ChatRenderer:
        """The compiled chat template, built on first use and kept."""
        if self.templates is None:
            raise ProtocolError(
                "template_error",
                f"model {self.name!r} has no chat template (give one with --chat-template or --model-chat-template)",
            )
        if self._renderer is None:
            # what transformers passes: the named specials plus the config's model-specific ones
            specials = {**self.tokenizer.named_specials, **special_tokens_from_config(self.tokenizer.tokenizer_config)}
            self._renderer = ChatRenderer(self.templates, specials)
        return self._renderer

    def chat_renderer(self) -> str:
        """The engine that renders its chat template (chat/probes.py proves it when the template loads),
        "" without a template."""
        return "" if self.templates is None else self.renderer().engine

    @property
    def names(self) -> tuple[str, ...]:
        """Its name, then its aliases: what resolves to it."""
        return (self.spec.name, *self.spec.aliases)

    def stream_decoder(self) -> StreamDecoder:
        """The `detokenize_stream` decoder, built on first use and kept here, so it goes with the model."""
        if self._decoder is None:
            self._decoder = StreamDecoder(self.tokenizer, self.fingerprint)
        return self._decoder

    def info(self) -> ModelInfo:
        """What READY and LOADED tell the broker of this model, within the bounds ModelInfo.from_wire checks."""
        t = self.tokenizer
        specials = sorted(s for s in t.special_tokens if len(s) <= 1024)[:MAX_SPECIAL_TOKENS]
        facts = model_facts(t)
        bounded: dict[str, Any] = {k: v[:1024] if isinstance(v, str) else v for k, v in facts.items()}
        return ModelInfo(kind=t.kind[:64], vocab_size=t.vocab_size, special_tokens=specials,
                         chat_template=self.templates is not None, cached=self.cache.enabled,
                         source=t.description[:1024], backend=t.backend, chat_renderer=self.chat_renderer()[:256],
                         tokenizer=self.tokenizer_fingerprint, **bounded)

    def describe(self) -> dict:
        t = self.tokenizer
        return {
            "name": self.name,
            "aliases": list(self.spec.aliases),
            "kind": t.kind,
            "backend": t.backend,
            "chat_renderer": self.chat_renderer(),
            "vocab_size": t.vocab_size,
            "special_tokens": sorted(t.special_tokens),
            "chat_template": self.templates is not None,
            "cached": self.cache.enabled,
            "l1_bypass_reason": self.cache.l1_bypass_reason,
            "source": t.description,
            "fingerprint": self.fingerprint,
            **model_facts(t),
        }


# transformers writes this for "no limit" (VERY_LARGE_INTEGER, int(1e30)); anything this large means none.
_NO_MAX_LENGTH = int(1e30)


def model_facts(t: Tokenizer) -> dict:
    """`models` (1.2): bos_token and eos_token (str or None), model_max_length (int, or None when
    the model's tokenizer_config.json gives none or transformers' "no limit" sentinel), and
    added_tokens (tokenizer.json's added tokens; a tiktoken encoding's special tokens)."""
    max_length = t.tokenizer_config.get("model_max_length")
    if type(max_length) is not int or not 0 < max_length < min(_NO_MAX_LENGTH, 2**63):
        max_length = None
    ref = reference(t)
    added = len(ref.special_tokens_set) if t.kind == "tiktoken" else len(ref.get_added_tokens_decoder())
    return {"bos_token": t.named_specials.get("bos_token"), "eos_token": t.named_specials.get("eos_token"),
            "model_max_length": max_length, "added_tokens": added}


def load_model(spec: ModelSpec, cache_config: CacheConfig) -> Model:
    """Tokenizer, cache and chat templates of `spec`; BootError (or OSError, ValueError) says what is wrong."""
    tokenizer = load_tokenizer(spec.source, tokenizer_path=spec.tokenizer_path)
    cache = TokenCache(tokenizer, cache_config, name=spec.name)
    if cache_config.l1_enabled and not cache.l1_active:
        log.warning("model %s: L1 cache bypassed: %s", spec.name, cache.l1_bypass_reason)
    model_dir = tokenizer.model_dir
    if spec.source != EMBEDDED_DEFAULT and model_dir is None:
        candidate = Path(spec.source)
        model_dir = candidate if candidate.is_dir() else None
    try:
        templates = discover_chat_templates(model_dir, tokenizer.tokenizer_config, spec.chat_template,
                                            text=spec.chat_template_text)
    except (OSError, ValueError) as e:
        raise BootError(f"model {spec.name!r}: cannot read its chat template: {e}") from e
    return Model(spec=spec, tokenizer=tokenizer, cache=cache, templates=templates)


def _local_encoding_model(name: str, cache_config: CacheConfig) -> Model | None:
    """An OpenAI encoding from a local rank file (count/encodings.py), or None, said in the log once."""
    enc = local_encoding(name)
    if enc is None:
        log.warning("tiktoken encoding %s is not available for counting: %s", name, where_to_put(name))
        return None
    tokenizer = wrap_encoding(enc, f"tiktoken encoding {name} (local file)")
    return Model(spec=ModelSpec(name=name, source=name), tokenizer=tokenizer,
                 cache=TokenCache(tokenizer, cache_config, name=name), templates=None)


class ModelRegistry:
    """The models loaded now, and how request model names resolve to them.

    At start it loads every configured model, or only the default when `max_models` > 0. Only the
    main thread (the one that serves jobs) calls `install`, `wake` and `unload` (the loader thread
    builds a `Model` apart and never sees the registry). The counting ladder's `encoding`,
    `fallback` and `find` are called by a count on the encode lane too (workers/count_lane.py):
    its on-demand models (`_extras`) change under `_extras_lock`, so one is loaded once.
    """

    def __init__(self, config: ModelConfig) -> None:
        self._config = config
        # Loaded before the fork but not served (the template's `preload`): name -> model. `_resident`
        # is every model this process had before it forked, served or not: unloading one of them puts
        # it back here (freeing it would write to, and so copy, the pages the pool shares).
        self.dormant: dict[str, Model] = {}
        self._resident: dict[str, Model] = {}
        # Tokenizers whose fast engine was built and refused (fastokens cannot load it, or a probe
        # differed), here or in the template: never built again (a forked worker retried every one,
        # each a second of CPU with the GIL held, and again on every wake of a dormant model).
        self.engine_refused: weakref.WeakKeyDictionary[Tokenizer, str] = weakref.WeakKeyDictionary()
        specs = config.models[:1] if config.max_models > 0 else config.models
        self._default_name = config.models[0].name
        self.models: list[Model] = []
        for spec in specs:
            self.models.append(self._once(load_model(spec, config.cache)))
        self._by_name: dict[str, Model] = {}
        for m in self.models:
            for n in m.names:
                self._by_name[n] = m
        self._map = TokenizerMap(config.tokenizer_map)
        self._extras: dict[str, Model | None] = {}
        self._extras_lock = threading.Lock()
        self._plan: EnginePlan | None = None  # made in the serving process, at its first place_engines

    def preload(self) -> int:
        """The template, before it forks (workers/zygote.py): load, dormant, every configured model
        that the cap left out, so every forked worker can wake any of them without a load. Returns
        how many distinct tokenizers that added."""
        held = {m.tokenizer_fingerprint for m in self.models}
        for spec in self._config.models:
            if self.get(spec.name) is None and spec.name not in self.dormant:
                self.dormant[spec.name] = self._once(load_model(spec, self._config.cache))
        self._resident = {m.name: m for m in (*self.models, *self.dormant.values())}
        return len({m.tokenizer_fingerprint for m in self.dormant.values()} - held)

    def wake(self, spec: ModelSpec) -> Model | None:
        """Serve a dormant model now (main thread), if one was loaded from this very spec: the LOAD
        costs a dict move instead of a parse. None when there is none (load it)."""
        model = self.dormant.get(spec.name)
        if model is None or model.spec != spec:
            return None
        del self.dormant[spec.name]
        self.install(model)
        return model

    def _once(self, model: Model) -> Model:
        """A startup model whose tokenizer another one already loaded (same tokenizer fingerprint: two
        names for one file, copies of it, other chat templates over it) is served by that one's
        engine and caches, as a B_LOAD would: one copy held."""
        shared = self.engine_for(model)
        if shared is model:
            return model
        del model
        release_memory()
        return shared

    def engine_for(self, model: Model) -> Model:
        """`model`, or `model` over the tokenizer and caches of a held model (loaded or dormant) with its
        tokenizer fingerprint: one engine and one pair of L0/L1 caches per distinct tokenizer."""
        fingerprint = model.tokenizer_fingerprint
        twin = next((m for m in (*self.models, *self.dormant.values())
                     if m.tokenizer_fingerprint == fingerprint and m.tokenizer is not model.tokenizer), None)
        if twin is None:
            return model
        if twin.fingerprint == model.fingerprint:  # the very same model under another name: templates too
            log.info("model %s: served with the tokenizer of model %s (same fingerprint)", model.name, twin.name)
            return twin.sharing(model.spec)
        log.info("model %s: served by the engine and caches of model %s (same tokenizer)", model.name, twin.name)
        return model.over(twin)

    @property
    def l0_enabled(self) -> bool:
        return self._config.cache.l0_enabled

    @property
    def cache_config(self) -> CacheConfig:
        return self._config.cache

    @property
    def limits(self) -> Limits:
        return self._config.limits

    @property
    def backend_mode(self) -> str:
        """--tokenizer-backend: auto, fast or reference (workers/engine.py)."""
        return self._config.backend

    def place_engines(self) -> None:
        """Main thread (the serving thread), whenever the fast engines served change (a switch, a wake,
        an unload, the start before READY): each new engine goes where it will encode, at most
        engine_limit() on the serving thread and the rest on threads of their own (workers/engine.py
        EnginePlan), and is warmed there. Never in the template (no thread survives a fork)."""
        if self.backend_mode == "reference":
            return
        engines = {id(m.tokenizer.fast): m.tokenizer.fast for m in self.models if m.tokenizer.fast is not None}
        if self._plan is None:
            if not engines:
                return
            self._plan = EnginePlan(engine_limit())
        self._plan.place(engines.values())

    @property
    def engine_limit(self) -> int:
        """What READY tells placement: the fast engines one serving thread holds (0 under
        --tokenizer-backend reference, where there is none)."""
        return 0 if self.backend_mode == "reference" else engine_limit()

    def engines(self) -> dict[str, int]:
        """What heartbeats carry of the fast engines: the per-thread limit, the engines served, and
        the threads of their own serving those beyond it (all 0 before the first fast engine)."""
        return self._plan.report() if self._plan is not None else {"limit": 0, "fast": 0, "threads": 0}

    def backends(self) -> dict[str, str]:
        """Model name -> the library that encodes it now; heartbeats carry it, as the switch to the
        fast engine comes after the model's LOADED."""
        return {m.name: m.tokenizer.backend for m in self.models}

    def holds(self, tokenizer: object) -> bool:
        """Some loaded model is served by this very tokenizer object."""
        return any(m.tokenizer is tokenizer for m in self.models)

    @property
    def default(self) -> Model:
        """The configured default model; unknown_model once the broker has had this worker let it go."""
        model = self._by_name.get(DEFAULT_ALIAS)  # the broker's default once it had it loaded here
        if model is None:
            model = self._by_name.get(self._default_name)
        if model is None or (model.name != self._default_name and DEFAULT_ALIAS not in model.names):
            raise ProtocolError("unknown_model", f"field 'model': the default model {self._default_name!r} is not "
                                "loaded on this worker")
        return model

    def tokenizers(self) -> int:
        """How many distinct tokenizers (engines) are loaded: models of one tokenizer fingerprint
        count once, as the broker counts a worker's models against --max-models-per-worker."""
        return len({m.tokenizer_fingerprint for m in self.models})

    def get(self, name: str) -> Model | None:
        """The loaded model with this exact name (not an alias), or None."""
        model = self._by_name.get(name)
        return model if model is not None and model.name == name else None

    def clash(self, names: tuple[str, ...] | list[str]) -> str | None:
        """Among a model's `names` (its name first, then its aliases), one that is taken, or None.

        Its name clashes with anything a loaded model answers to; an alias only with another
        model's own name. An alias of a loaded model is taken over: the broker owns the names, so
        its default model, loaded here, answers to `default` instead of this worker's own default.
        """
        for i, n in enumerate(names):
            model = self._by_name.get(n)
            if model is not None and (i == 0 or model.name == n):
                return n
        return None

    def install(self, model: Model) -> None:
        """Serve `model` from now on (main thread only). Its names must be free (see `clash`)."""
        taken = self.clash(model.names)
        if taken is not None:
            raise ValueError(f"model {model.name!r}: the name {taken!r} is already taken by model {self._by_name[taken].name!r}")
        self.models.append(model)
        for n in model.names:
            prior = self._by_name.get(n)
            if prior is not None and prior is not model:
                log.info("the alias %r moves from model %s to model %s", n, prior.name, model.name)
            self._by_name[n] = model
        with self._extras_lock:
            self._extras.pop(model.spec.source, None)  # counting finds this model for its source next time, not a copy loaded apart

    def unload(self, name: str) -> Model | None:
        """Let the model named `name` go (main thread only): its names, and every other reference this
        registry holds, so its memory goes once the caller drops the returned model. None: not loaded."""
        model = self.get(name)
        if model is None:
            return None
        self.models.remove(model)
        for n in model.names:
            if self._by_name.get(n) is model:
                del self._by_name[n]
        with self._extras_lock:
            for source in [s for s, m in self._extras.items() if m is model]:
                del self._extras[source]
        if self._resident.get(name) is model:  # loaded before the fork: asleep again, its pages still shared
            self.dormant[name] = model
            if not any(m.cache is model.cache for m in self.models):  # what it cached while awake goes
                model.cache.clear()
        return model

    def find(self, name: str) -> Model | None:
        """Exact name or alias, then the --tokenizer-map globs; "" names nothing (even for a `*` glob)."""
        if not name:
            return None
        model = self._by_name.get(name)
        if model is None:
            target = self._map.lookup(name)
            model = self._by_name.get(target) if target is not None else None
        return model

    def resolve(self, name: str | None) -> Model:
        if name is None:
            return self.default
        model = self.find(name)
        if model is None:
            known = ", ".join(sorted(self._by_name))
            raise ProtocolError("unknown_model", f"field 'model': no tokenizer answers to {name!r} (known: {known})")
        return model

    def encoding(self, name: str) -> Model | None:
        """An OpenAI encoding for counting, built on first use from a local file only (never downloaded: this
        runs on the request path); None if unavailable. A configured model with that source serves first."""
        return self._extra(name) if name in OPENAI_ENCODINGS else None

    def fallback(self) -> Model | None:
        """The embedded tokenizer, the counting ladder's last tokenizer rung (whatever the default model is)."""
        return self._extra(EMBEDDED_DEFAULT)

    def counting_ready(self, model: str | None) -> bool:
        """Whether the counting ladder serves `model` (None: the body names none) without building a
        tokenizer first: its OpenAI encoding or a loaded model answers to it, or the fallback is
        built. A count that would build one (an encoding's first use: ~1.6 s) goes to a lane."""
        from .count.openai_families import openai_encoding_for

        encoding = openai_encoding_for(model) if model else None
        if encoding is not None:
            built = self._extras.get(encoding, _ABSENT)
            if built is _ABSENT and not self._holds_source(encoding):
                return False
            if built is not None:
                return True  # else its file is not here: the ladder goes on down
        if model and self.find(model) is not None:
            return True
        return EMBEDDED_DEFAULT in self._extras or self._holds_source(EMBEDDED_DEFAULT)

    def _holds_source(self, source: str) -> bool:
        return any(m.spec.source == source for m in (*self.models, *self.dormant.values()))

    def _extra(self, source: str) -> Model | None:
        """A model loaded on demand for counting, once; a loaded model with that source serves instead."""
        extra = self._extras.get(source, _ABSENT)
        if extra is not _ABSENT:
            return cast("Model | None", extra)
        with self._extras_lock:
            return self._load_extra(source)

    def _load_extra(self, source: str) -> Model | None:
        if source not in self._extras:
            loaded = next((m for m in (*self.models, *self.dormant.values()) if m.spec.source == source), None)
            if loaded is None and source in OPENAI_ENCODINGS:
                loaded = _local_encoding_model(source, self._config.cache)
            elif loaded is None:
                name = EMBEDDED_DEFAULT_NAME if source == EMBEDDED_DEFAULT else source
                try:
                    loaded = load_model(ModelSpec(name=name, source=source), self._config.cache)
                except BootError as e:
                    log.warning("tokenizer %s is not available here: %s", source, e)
            self._extras[source] = loaded
        return self._extras[source]

    def describe(self) -> list[dict]:
        return [m.describe() for m in self.models]

    def cache_stats(self) -> dict[str, dict[str, int]]:
        """Cache counters summed over every tokenizer this worker holds (encodings for counting too)."""
        total: dict[str, dict[str, int]] = {}
        extras = [m for m in list(self._extras.values()) if m is not None]
        # a loaded model may serve as an extra too; a dormant one's counters stay in the sums (its
        # entries and bytes are 0 once it sleeps: `unload` cleared them)
        caches = {id(m.cache): m.cache for m in (*self.models, *self.dormant.values(), *extras)}.values()
        for cache in caches:
            for layer, counters in cache.stats().items():
                acc = total.setdefault(layer, {})
                for key, value in counters.items():
                    acc[key] = acc.get(key, 0) + value
        return total
