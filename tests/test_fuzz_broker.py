"""A short run of the broker parser's fuzz target (tests/fuzz/fuzz_broker_peek.py) in the suite:
single maps, arrays, truncations and nesting through the compiled core, a bounded number of
inputs. Longer runs: `.venv/bin/python tests/fuzz/fuzz_broker_peek.py -atheris_runs=10000000`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("atheris", reason="atheris (the test extra) is not installed on this platform")

TARGET = Path(__file__).parent / "fuzz" / "fuzz_broker_peek.py"


def test_the_broker_parser_survives_a_short_fuzz_run(tmp_path: Path) -> None:
    run = subprocess.run([sys.executable, str(TARGET), "-atheris_runs=30000", "-seed=7", f"-artifact_prefix={tmp_path}/"],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-4000:]
    assert "Done 30000" in run.stderr
