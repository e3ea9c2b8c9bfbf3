"""Counting's OpenAI encodings come from local files only, and equal tiktoken's own.

conftest points TIKTOKEN_CACHE_DIR at a copy of tests/fixtures/tiktoken_cache, where tiktoken finds
the same files offline: so tiktoken.get_encoding is the reference here.
"""

from __future__ import annotations

import hashlib

import pytest
import tiktoken

from tokenbroker.workers.count.encodings import RANK_FILES, local_encoding, tiktoken_cache_dir, where_to_put


@pytest.mark.parametrize("name", sorted(RANK_FILES))
def test_a_local_encoding_equals_tiktokens_own(name: str) -> None:
    ours, theirs = local_encoding(name), tiktoken.get_encoding(name)
    assert ours is not None
    assert ours._pat_str == theirs._pat_str
    assert ours._special_tokens == theirs._special_tokens
    assert ours._mergeable_ranks == theirs._mergeable_ranks
    text = "Hello <|endoftext|> wörld 12345 <|start|>"
    assert ours.encode(text, allowed_special="all") == theirs.encode(text, allowed_special="all")


def test_no_local_file_means_no_encoding_and_says_where_it_looked(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    assert tiktoken_cache_dir() == tmp_path
    assert local_encoding("o200k_base") is None
    assert str(tmp_path) in where_to_put("o200k_base") and "o200k_base.tiktoken" in where_to_put("o200k_base")
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")
    assert local_encoding("o200k_base") is None and "turned off" in where_to_put("o200k_base")


def test_a_corrupt_cached_file_is_refused_not_refetched(monkeypatch, tmp_path) -> None:
    source = tiktoken_cache_dir()
    rank = RANK_FILES["cl100k_base"]
    cached = source / hashlib.sha1(rank.url.encode()).hexdigest()  # where tiktoken caches it
    assert cached.is_file()
    damaged = tmp_path / cached.name
    damaged.write_bytes(cached.read_bytes()[:-10])
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    assert local_encoding("cl100k_base") is None
    assert damaged.exists()  # tiktoken would delete it and download again; we only refuse it
    (tmp_path / rank.file).write_bytes(cached.read_bytes())  # OpenAI's own file name serves too
    assert local_encoding("cl100k_base") is not None


def test_an_unknown_encoding_name_is_none() -> None:
    assert local_encoding("gpt2") is None and local_encoding("nope") is None
