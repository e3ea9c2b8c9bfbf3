"""OpenAI encodings for counting, built from local files only: the request path never touches the network.

`tiktoken.get_encoding` downloads a missing rank file with no timeout; on a worker's compute thread
that wedged the worker for good behind a proxy that never answered (issue 11, row 2). Here an
encoding is built from a rank file already on disk, checked by its sha256, or not at all:

1. tiktoken's own download cache, where tiktoken would have put it: `TIKTOKEN_CACHE_DIR`, else
   `DATA_GYM_CACHE_DIR`, else `<tempdir>/data-gym-cache`, under the sha1 of the file's URL
   (an empty `TIKTOKEN_CACHE_DIR` turns tiktoken's cache off, and so this place too);
2. a file named as OpenAI names it (`o200k_base.tiktoken`) in that same folder.

The split pattern and special tokens are tiktoken's (tiktoken_files.KNOWN_TIKTOKEN_FILES, checked
against tiktoken_ext by the tests); o200k_harmony is o200k_base's ranks with harmony's specials.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..tiktoken_files import KNOWN_TIKTOKEN_FILES, parse_ranks

_BLOBS = "https://openaipublic.blob.core.windows.net/encodings/"


@dataclass(frozen=True)
class RankFile:
    """Where tiktoken fetches an encoding's ranks from, and the sha256 it checks them against."""

    file: str
    sha256: str

    @property
    def url(self) -> str:
        return _BLOBS + self.file


_O200K = RankFile("o200k_base.tiktoken", "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d")
RANK_FILES: dict[str, RankFile] = {
    "o200k_base": _O200K,
    "o200k_harmony": _O200K,
    "cl100k_base": RankFile("cl100k_base.tiktoken", "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7"),
    "p50k_base": RankFile("p50k_base.tiktoken", "94b5ca7dff4d00767bc256fdd1b27e5b17361d7b8a5f968547f9f23eb70d2069"),
    "r50k_base": RankFile("r50k_base.tiktoken", "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"),
}


def harmony_specials() -> dict[str, int]:
    """o200k_harmony's special tokens: o200k_base's, the harmony format's, and the reserved range up to 201088."""
    named = {
        199998: "<|startoftext|>", 199999: "<|endoftext|>", 200002: "<|return|>", 200003: "<|constrain|>",
        200005: "<|channel|>", 200006: "<|start|>", 200007: "<|end|>", 200008: "<|message|>", 200012: "<|call|>",
    }
    specials = dict(KNOWN_TIKTOKEN_FILES[_O200K.sha256].special_tokens)
    specials.update({named.get(i, f"<|reserved_{i}|>"): i for i in (199998, 199999, *range(200000, 201088))})
    return specials


def tiktoken_cache_dir() -> Path | None:
    """The folder tiktoken downloads into, as tiktoken itself chooses it; None when its cache is off."""
    if "TIKTOKEN_CACHE_DIR" in os.environ:
        where = os.environ["TIKTOKEN_CACHE_DIR"]
    elif "DATA_GYM_CACHE_DIR" in os.environ:
        where = os.environ["DATA_GYM_CACHE_DIR"]
    else:
        where = os.path.join(tempfile.gettempdir(), "data-gym-cache")
    return Path(where) if where else None


def _candidates(rank: RankFile) -> list[Path]:
    folder = tiktoken_cache_dir()
    if folder is None:
        return []
    return [folder / hashlib.sha1(rank.url.encode()).hexdigest(), folder / rank.file]


def _read_verified(rank: RankFile) -> bytes | None:
    """The rank file's bytes from the first local candidate whose sha256 is right; None when there is none."""
    for path in _candidates(rank):
        try:
            data = path.read_bytes()
        except OSError:
            continue
        if hashlib.sha256(data).hexdigest() == rank.sha256:
            return data
    return None


def where_to_put(name: str) -> str:
    """A sentence for an operator: where a local copy of the encoding `name` would be found."""
    folder = tiktoken_cache_dir()
    if folder is None:
        return "tiktoken's cache is turned off (TIKTOKEN_CACHE_DIR is empty)"
    rank = RANK_FILES.get(name)
    file = rank.file if rank else f"{name}.tiktoken"
    return f"no verified copy of {file} in tiktoken's cache {folder}"


def local_encoding(name: str) -> Any | None:
    """A tiktoken.Encoding for the OpenAI encoding `name`, built from a local rank file; None when there is none.

    Never downloads: unlike tiktoken.get_encoding, a missing or corrupt file is an answer (None), not a fetch.
    """
    import tiktoken

    rank = RANK_FILES.get(name)
    if rank is None:
        return None
    data = _read_verified(rank)
    if data is None:
        return None
    known = KNOWN_TIKTOKEN_FILES[rank.sha256]
    specials = harmony_specials() if name == "o200k_harmony" else dict(known.special_tokens)
    ranks = parse_ranks(data, Path(rank.file))
    return tiktoken.Encoding(name, pat_str=known.pat_str, mergeable_ranks=ranks, special_tokens=specials)
