"""Loading models while the worker serves: the broker's B_LOAD and B_UNLOAD, and the W_LOADED answers.

A tokenizer takes from a fraction of a second to many seconds to load (a 150,000-token vocabulary
parsed, its fingerprint hashed), so it never loads on the main thread, which serves jobs: one loader
thread takes loads one after another and hands each finished one back through a queue, writing a
byte to a pipe that the main thread's poller watches, so a finished load is installed at once,
between two rounds of jobs. The same thread then builds each new tokenizer's fast engine and runs
its probes (workers/engine.py): the model is served by its reference library meanwhile, and the
main thread switches it over between two rounds, with no pause and the same ids. The loader thread
never touches the registry; `ModelInstaller` does, on the main thread only, and turns every outcome
into the `Loaded` the broker reads (docs/protocol.md, "The model catalog"; the catalog itself is
the broker's, broker/catalog.py).

A forked local worker rarely loads at all: the template loaded every configured model before the
fork, and the ones the cap left out wait dormant in the registry (workers/registry.py `preload`),
so a LOAD of one wakes it between two rounds. That matters beyond speed: a tokenizer's parse
(`tokenizers.Tokenizer.from_file`, building the fast engine) holds the GIL for the whole of it,
0.4-1.7 s for the models of scripts/bench_placement and several seconds under load, so a worker
that loads serves nothing and beats no heartbeat meanwhile (the broker grants it a grace while a
LOAD is outstanding, broker/backend.py).
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, replace

from tokenbroker.common.config import CacheConfig, ModelSpec
from tokenbroker.common.errors import BootError
from tokenbroker.common.process import drain_pipe, release_memory
from tokenbroker.common.protocol import LoadSpec, Loaded

from .engine import FastEngine, speed_up
from .registry import Model, ModelRegistry, load_model
from .tokenizers import Tokenizer

log = logging.getLogger(__name__)

MAX_ERROR_CHARS = 4000  # Loaded.from_wire takes at most 4096


@dataclass(eq=False)
class Ticket:
    """One load asked for. `cancelled` is set by the main thread (an UNLOAD came first): the loader
    skips it if it has not started, and the main thread discards its result."""

    spec: ModelSpec
    cancelled: bool = False


# Under a cap, a model loaded on demand gets its fast engine only once it has stayed this long:
# building and probing fastokens holds the GIL as a parse does (1-6 s for these models), more than
# a model that takes its turn in a slot for a few seconds saves with it.
ENGINE_AFTER_S = 30.0


@dataclass(eq=False)
class EngineTicket:
    """A loaded tokenizer to give its fast engine, under --tokenizer-backend `mode`, not before
    `not_before` (monotonic); `cancelled` (main thread): its model was let go, build nothing.

    A cancelled ticket lets go of its tokenizer at once (`cancel`): a deferred one waits in the
    loader's queue until ENGINE_AFTER_S after its load, and behind a ticket that is not due yet
    longer still, so holding the tokenizer pinned every model unloaded meanwhile. A capped exec
    worker that loaded about a model a second held up to 30 of them (issue 35: 650-700 MiB
    after 166 loads and unloads).
    """

    tokenizer: Tokenizer | None  # None once cancelled
    name: str
    mode: str
    not_before: float = 0.0
    fingerprint: str = ""  # the tokenizer's: the probes' verdict is kept on disk under it
    cancelled: bool = False

    def cancel(self) -> None:
        """Main thread: build nothing, and keep nothing of the model alive."""
        self.cancelled = True
        self.tokenizer = None


@dataclass(frozen=True)
class EngineOutcome:
    """The fast engine built and probed for a ticket's tokenizer, or None and why not."""

    ticket: EngineTicket
    tokenizer: Tokenizer  # the ticket's, as it was built for (the ticket lets go of it if cancelled meanwhile)
    engine: FastEngine | None
    reason: str | None
    seconds: float


@dataclass(frozen=True)
class Outcome:
    """A finished load: the model with its fingerprint and info, or the loader's message."""

    ticket: Ticket
    model: Model | None
    error: str
    seconds: float
    info: dict | None = None  # ModelInfo.to_wire()

    def loaded(self) -> Loaded:
        """The LOADED message for it."""
        name = self.ticket.spec.name
        if self.model is None:
            return Loaded(name, False, error=self.error, seconds=self.seconds)
        return Loaded(name, True, fingerprint=self.model.fingerprint, info=self.info or {}, seconds=self.seconds)


def spec_from_load(load: LoadSpec) -> ModelSpec:
    """The ModelSpec a B_LOAD describes: `chat_template` is text (add_model), `chat_template_file` a path.

    >>> spec = spec_from_load(LoadSpec("m", "/models/m", ["m-alias"], chat_template="{{ messages }}"))
    >>> spec.aliases, spec.chat_template_text, spec.chat_template
    (('m-alias',), '{{ messages }}', None)
    """
    return ModelSpec(name=load.name, source=load.source, aliases=tuple(load.aliases),
                     tokenizer_path=load.tokenizer_path, chat_template=load.chat_template_file,
                     chat_template_text=load.chat_template)


def load_outcome(ticket: Ticket, cache_config: CacheConfig) -> Outcome:
    """Load a model and compute all the broker will be told of it (the costly part, off the main thread).
    Any failure becomes the message: BootError says what was wrong with which path or id."""
    spec = ticket.spec
    start = time.monotonic()
    try:
        model = load_model(spec, cache_config)
        outcome = Outcome(ticket, model, "", 0.0, model.info().to_wire())
        # .loaded() hashes the vocabulary (Model.fingerprint, kept); from_wire: the broker will take it
        Loaded.from_wire(outcome.loaded().to_wire())
        return replace(outcome, seconds=time.monotonic() - start)
    except Exception as e:  # BootError, OSError, ValueError, a tokenizer library's own: all the source's fault
        message = str(e) if isinstance(e, BootError) else f"{type(e).__name__}: {e}"
        error = f"cannot load model {spec.name!r} from {spec.source!r}: {message}"
        return Outcome(ticket, None, error[:MAX_ERROR_CHARS], time.monotonic() - start)


class Loader:
    """One background thread that loads tickets in order; `fd` becomes readable when one is done."""

    def __init__(self, cache_config: CacheConfig) -> None:
        self._cache_config = cache_config
        # Loads go before fast engines: a model the broker waits for is never held up by a speed-up.
        self._todo: queue.PriorityQueue[tuple[float, int, Ticket | EngineTicket | None]] = queue.PriorityQueue()
        self._order = itertools.count()
        self._done: queue.SimpleQueue[Outcome | EngineOutcome] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._thread: threading.Thread | None = None
        self._submitted = threading.Event()  # wakes a thread waiting out a deferred engine ticket

    @property
    def fd(self) -> int:
        """Poll this for reading: a load has finished."""
        return self._wake_r

    def wake(self) -> None:
        """Make the main poll return now: a load finished, or SIGTERM came (it must not wait for a beat)."""
        try:
            os.write(self._wake_w, b"!")
        except OSError:  # the pipe is full: the poll returns anyway
            pass

    def submit(self, ticket: Ticket | EngineTicket) -> None:
        if self._thread is None:  # started on the first load: a worker that never loads has no thread
            self._thread = threading.Thread(target=self._run, name="tokenbroker-loader", daemon=True)
            self._thread.start()
        # engine builds after every load, the one due first first
        self._todo.put((max(1.0, ticket.not_before) if isinstance(ticket, EngineTicket) else 0.0, next(self._order), ticket))
        self._submitted.set()

    def finished(self) -> list[Outcome | EngineOutcome]:
        """Every load finished since the last call (main thread)."""
        drain_pipe(self._wake_r)
        out = []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                return out

    def close(self) -> None:
        """Stop the thread after the load it is running (it is a daemon: a process leaving does not wait)."""
        self._todo.put((-1.0, next(self._order), None))
        self._submitted.set()

    def idle(self, timeout: float) -> bool:
        """After close(): True once the thread has ended (or never started), waiting at most `timeout`."""
        if self._thread is None:
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        while (item := self._todo.get())[2] is not None:
            ticket = item[2]
            if isinstance(ticket, EngineTicket) and not ticket.cancelled and ticket.not_before > time.monotonic():
                self._submitted.clear()  # a submit from now on wakes the wait
                self._todo.put(item)
                with self._todo.mutex:
                    first = self._todo.queue[0][2] is ticket  # else something submitted meanwhile goes first
                if first:
                    self._submitted.wait(ticket.not_before - time.monotonic())
                continue
            outcome: Outcome | EngineOutcome
            if isinstance(ticket, EngineTicket):
                tok = ticket.tokenizer  # held while it is built: the main thread may cancel meanwhile
                if ticket.cancelled or tok is None:
                    continue
                start = time.monotonic()
                engine, reason = speed_up(tok, ticket.mode, name=ticket.name, fingerprint=ticket.fingerprint)
                outcome = EngineOutcome(ticket, tok, engine, reason, time.monotonic() - start)
                del tok, engine
            elif ticket.cancelled:
                outcome = Outcome(ticket, None, "cancelled", 0.0)
            else:
                loaded = load_outcome(ticket, self._cache_config)
                log.info("model %s: %s in %.2fs", ticket.spec.name, "loaded" if loaded.model else loaded.error,
                         loaded.seconds)
                outcome = loaded
            del ticket, item
            self._done.put(outcome)
            del outcome  # the main thread holds the only reference: unloading it frees it
            self.wake()


class ModelInstaller:
    """Installs and lets go the worker's models as the broker says, on the main thread: answers
    B_LOAD and B_UNLOAD, and installs finished loads. Every method returns the `Loaded` messages to
    send, in order.

    - a LOAD for a model already loaded answers ok at once; one already loading answers when it ends;
    - a LOAD of a dormant model (loaded by the template before the fork) wakes it and answers at once;
    - with `max_models` > 0, a LOAD that would take the worker past it (loaded + loading) answers
      retry=True at once (the broker unloads before it loads: this is a guard), as does one while leaving;
    - an UNLOAD of a loading model discards its result when it finishes: no LOADED is sent.
    """

    def __init__(self, registry: ModelRegistry, loader: Loader, max_models: int) -> None:
        self.registry = registry
        self.loader = loader
        self.max_models = max_models
        self.loading: dict[str, Ticket] = {}  # name -> the load that will install it
        self.engines: dict[str, EngineTicket] = {}  # name -> its fast engine's build, deferred or under way
        for model in registry.models:  # loaded at start with their reference library
            self._speed_up(model)
        registry.place_engines()  # built before the fork: placed and warmed before READY

    def _speed_up(self, model: Model, *, after: float = 0.0) -> None:
        """Have the loader build and probe `model`'s fast engine (unless --tokenizer-backend reference),
        not before `after` seconds from now."""
        tok = model.tokenizer
        if any(t.tokenizer is tok for t in self.engines.values()):
            return  # another model over this tokenizer has its build on the way: one engine per tokenizer
        if self.registry.backend_mode != "reference" and tok.fast is None and tok not in self.registry.engine_refused:
            ticket = EngineTicket(tok, model.name, self.registry.backend_mode, time.monotonic() + after,
                                  fingerprint=model.tokenizer_fingerprint)
            self.engines[model.name] = ticket
            self.loader.submit(ticket)

    def load(self, body: bytes, *, leaving: bool = False) -> list[Loaded]:
        try:
            wire = LoadSpec.from_wire(body)
            spec = spec_from_load(wire)
        except Exception as e:  # not MessagePack, a field missing or mistyped: drop it, keep serving
            log.warning("ignoring a malformed LOAD (%d bytes): %s", len(body), e)
            return []
        name = spec.name
        shared = self.registry.get(wire.share) if wire.share else None
        if shared is not None and self.registry.get(name) is None and name not in self.loading:
            return self._share(spec, shared)
        model = self.registry.get(name)
        if model is not None:
            return [Loaded(name, True, fingerprint=model.fingerprint, info=model.info().to_wire())]
        if name in self.loading:
            return []  # its LOADED goes out when it finishes
        if leaving:
            return [Loaded(name, False, error="this worker is leaving (SIGTERM): load it elsewhere", retry=True)]
        held = self.registry.tokenizers() + len(self.loading)
        if self.max_models > 0 and held >= self.max_models and not self._over_held(spec):
            return [Loaded(name, False, retry=True, error=f"this worker holds {held} models (loaded and loading), "
                           f"its most (--max-models-per-worker {self.max_models}): unload one first")]
        taken = self._taken((name, *spec.aliases))
        if taken is not None:
            return [Loaded(name, False, error=f"the name {taken!r} is already taken by another model on this worker")]
        woken = self.registry.wake(spec)
        if woken is not None:
            self._speed_up(woken)
            self.registry.place_engines()
            log.info("model %s: served from the template's copy (no load)", name)
            return [Loaded(name, True, fingerprint=woken.fingerprint, info=woken.info().to_wire(), seconds=0.0)]
        ticket = Ticket(spec)
        self.loading[name] = ticket
        self.loader.submit(ticket)
        log.info("model %s: loading %s in the background", name, spec.source)
        return []

    def _over_held(self, spec: ModelSpec) -> bool:
        """`spec` reads the tokenizer files of a loaded model (another template or name over them): it
        will share that model's engine (registry.engine_for), so it takes no slot of the cap."""
        return any(m.spec.source == spec.source and m.spec.tokenizer_path == spec.tokenizer_path
                   for m in self.registry.models)

    def _share(self, spec: ModelSpec, shared: Model) -> list[Loaded]:
        """Serve `spec`'s names with a loaded model's tokenizer, caches and templates (the broker
        says their fingerprints are equal): installed at once, no new tokenizer held."""
        taken = self._taken((spec.name, *spec.aliases))
        if taken is not None:
            return [Loaded(spec.name, False, error=f"the name {taken!r} is already taken by another model on this worker")]
        model = shared.sharing(spec)
        self.registry.install(model)
        log.info("model %s: served with the tokenizer of model %s (same fingerprint)", spec.name, shared.name)
        return [Loaded(spec.name, True, fingerprint=model.fingerprint, info=model.info().to_wire())]

    def _taken(self, names: tuple[str, ...]) -> str | None:
        """A name among `names` that a loaded or loading model answers to."""
        loading = {n for t in self.loading.values() for n in (t.spec.name, *t.spec.aliases)}
        return self.registry.clash(names) or next((n for n in names if n in loading), None)

    def unload(self, body: bytes) -> None:
        try:
            name = body.decode("utf-8")
        except UnicodeDecodeError:
            log.warning("ignoring an UNLOAD whose name is not UTF-8 (%d bytes)", len(body))
            return
        ticket = self.loading.pop(name, None)
        if ticket is not None:
            ticket.cancelled = True
            log.info("model %s: unloaded while loading; its load will be discarded", name)
        elif self.registry.unload(name) is not None:
            engine = self.engines.pop(name, None)
            if engine is not None and not self.registry.holds(engine.tokenizer):
                engine.cancel()  # not built yet (or its result is skipped): the model is gone
            self.registry.place_engines()  # its engine's place is free
            if name in self.registry.dormant:
                log.info("model %s: unloaded (dormant again: the template's copy stays shared)", name)
                return
            release_memory()
            log.info("model %s: unloaded", name)
        else:
            log.debug("ignoring an UNLOAD of %r: not loaded here", name)

    def finished(self) -> list[Loaded]:
        """Install the loads that finished; their LOADED messages (none for a cancelled one)."""
        out = []
        for outcome in self.loader.finished():
            if isinstance(outcome, EngineOutcome):
                self._switch(outcome)
                continue
            ticket, name = outcome.ticket, outcome.ticket.spec.name
            if ticket.cancelled or self.loading.get(name) is not ticket:
                continue  # unloaded meanwhile: its model goes with this outcome
            del self.loading[name]
            model = outcome.model
            if model is not None:
                served = self.registry.engine_for(model)  # `model` itself unless its tokenizer is held here
                shared, model = served is not model, served
                if shared:  # the same tokenizer is here already: serve this name with its engine, drop the copy
                    outcome = replace(outcome, model=model, info=model.info().to_wire())
                    release_memory()
                try:
                    self.registry.install(model)
                except ValueError as e:  # cannot happen while `load` checks names; said, never raised
                    out.append(Loaded(name, False, error=str(e)[:MAX_ERROR_CHARS], seconds=outcome.seconds))
                    continue
                if not shared:  # under a cap, a model taking its turn in a slot may never need it
                    self._speed_up(model, after=ENGINE_AFTER_S if self.max_models > 0 else 0.0)
            out.append(outcome.loaded())
        return out

    def _switch(self, outcome: EngineOutcome) -> None:
        """Serve a tokenizer with its fast engine from the next round on (main thread, between rounds:
        one attribute set, so no job sees half a switch). A tokenizer let go meanwhile is skipped."""
        tok = outcome.tokenizer
        if self.engines.get(outcome.ticket.name) is outcome.ticket:
            del self.engines[outcome.ticket.name]
        if outcome.engine is None:
            self.registry.engine_refused[tok] = outcome.reason or "refused"
            return
        if not self.registry.holds(tok):
            return
        serve_fast(self.registry, tok, outcome.engine)
        self.registry.place_engines()  # warmed on the thread that will encode with it, before a job does
        log.info("model %s: now served by %s (engine ready %.2fs after its load)", outcome.ticket.name,
                 tok.backend, outcome.seconds)


def serve_fast(registry: ModelRegistry, tok: Tokenizer, engine: FastEngine) -> None:
    """Serve `tok` with `engine` from now on: every model of the registry that shares it lets its L1
    go (re-encoding with fastokens costs less than L1's cuts and copies)."""
    tok.fast = engine
    models = (*registry.models, *registry.dormant.values())
    for cache in {id(m.cache): m.cache for m in models if m.tokenizer is tok}.values():
        cache.fast_engine_serves()
