"""Each flag is declared once, on the configuration field it sets (common/config.flag): the parser,
the configuration built from argv and the argv handed to local workers all come from that one
declaration. And the protocol's error codes are one list (common/errors.ERROR_CODES).

The `--help` texts themselves are what they were before the declarations moved (checked by diffing
them when they did); these tests hold the properties a later flag could break.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from tokenbroker._client_errors import ERRORS
from tokenbroker.broker.config import BrokerConfig, CurveConfig, broker_config_from_args
from tokenbroker.cli import build_parser
from tokenbroker.common.config import CacheConfig, Limits, ModelConfig, ModelFlags, model_argv
from tokenbroker.common.errors import ERROR_CODES
from tokenbroker.common.protocol import OUTCOMES
from tokenbroker.workers.config import WorkerConfig, worker_config_from_args

PROTOCOL = Path(__file__).parent.parent / "docs" / "protocol.md"

SERVE_ARGVS = [
    [],
    ["--model", "a=b", "--served-model-name", "x", "y", "--tokenizer-cache-enable-l1", "--tokenizer-map", "q*=a"],
    ["--model-path", "p", "--tokenizer-path", "t", "--chat-template", "c", "--model", "m=s=t",
     "--model-chat-template", "m=f", "--max-models-per-worker", "2", "--tokenizer-backend", "reference",
     "--tokenizer-cache-enable-l0", "--tokenizer-cache-l0-max-entries", "7", "--max-batch-items", "9"],
]


def _serve(argv: list[str]) -> BrokerConfig:
    return broker_config_from_args(build_parser().parse_args(["serve", *argv]))


@pytest.mark.parametrize("argv", SERVE_ARGVS, ids=["defaults", "first-model-default", "every-model-flag"])
def test_a_local_worker_given_model_argv_loads_exactly_what_serve_was_told(argv):
    models = _serve(argv).models
    worker = worker_config_from_args(build_parser().parse_args(["worker", "--connect", "ipc:///x", *model_argv(models)]))
    assert worker.models == models


def test_a_flag_sets_its_field_and_an_absent_flag_leaves_the_field_default(monkeypatch):
    monkeypatch.delenv("TOKENBROKER_TOKENIZER_BACKEND", raising=False)  # conftest's `reference`
    default = _serve([])
    assert dataclasses.replace(default, workers=0) == dataclasses.replace(BrokerConfig(), workers=0)
    given = _serve(["--max-pending", "7", "--routing", "least-loaded", "--curve-admins", "d", "--insecure", "--workers", "3"])
    assert (given.max_pending, given.routing, given.workers) == (7, "least-loaded", 3)
    assert given.curve == CurveConfig(admins="d", insecure=True)
    assert given.max_pending_bytes == BrokerConfig.max_pending_bytes


def test_the_tokenizer_backend_default_comes_from_its_environment_variable(monkeypatch):
    monkeypatch.setenv("TOKENBROKER_TOKENIZER_BACKEND", "fast")
    assert _serve([]).models.backend == "fast"
    assert _serve(["--tokenizer-backend", "auto"]).models.backend == "auto"


def test_every_configuration_field_is_set_by_a_flag_or_holds_a_configuration_that_is():
    for cls in (BrokerConfig, CurveConfig, WorkerConfig, ModelConfig, ModelFlags, CacheConfig, Limits):
        for f in dataclasses.fields(cls):
            assert "flag" in f.metadata or "flags_of" in f.metadata, f"{cls.__name__}.{f.name}"


def test_the_one_list_of_error_codes_is_the_contracts_table_and_numbers_the_outcomes():
    text = PROTOCOL.read_text()
    table = text[text.index("| code | when |"):].split("\n\n")[0]
    assert list(ERROR_CODES) == re.findall(r"^\| `([a-z_]+)`(?: \(\d\.\d\))? \|", table, flags=re.M)
    assert OUTCOMES == ("ok", "skipped", *ERROR_CODES)  # a worker's outcome byte indexes this: append only
    assert set(ERRORS) == {*ERROR_CODES, "unavailable"}
