"""Every fuzz target in tests/fuzz/ (one file per target, `fuzz_<name>.py`: see tests/fuzz/_harness.py),
run briefly in the suite: its seeds replayed in this process under the harness's per-input bound of
CPU and memory, then a bounded atheris run (the same bound) in a child process (a crash in compiled code ends that child, not the suite, and fails the test with libFuzzer's
report). Long runs are by hand: .venv/bin/python tests/fuzz/fuzz_<name>.py -max_total_time=300
"""

from __future__ import annotations

import importlib.util
import resource
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

FUZZ = Path(__file__).parent / "fuzz"


TARGETS = sorted(FUZZ.glob("fuzz_*.py"))
RUNS = 2000  # a few seconds per target (10-20 s on a 2-core machine at load 10); libFuzzer's -seed fixes the inputs


def load(target: Path) -> ModuleType:
    sys.path.insert(0, str(FUZZ))
    try:
        spec = importlib.util.spec_from_file_location(target.stem, target)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(FUZZ))
    return module


def test_there_are_targets():
    assert {"fuzz_wire", "fuzz_broker_peek", "fuzz_broker_bounds"} <= {t.stem for t in TARGETS}


def test_nesting_depth_reads_ext_types_as_leaves_and_maps_by_their_type():
    sys.path.insert(0, str(FUZZ))
    try:
        import msgpack
        from _msgpack_values import nesting_depth, reference
    finally:
        sys.path.remove(str(FUZZ))
    ext = msgpack.ExtType(1, b"x")
    assert nesting_depth([ext, 1]) == 1  # an ExtType is a tuple, not a map's pair
    assert nesting_depth([ext, [ext]]) == 2 and nesting_depth({"a": [ext, {"b": [1]}]}) == 4
    verdict, _, value = reference(msgpack.packb([[(1, 2)], {"k": [3]}]), 0)
    assert verdict == "ok" and nesting_depth(value) == 3  # [[[1, 2]], {"k": [3]}]: array, map, array


def test_a_slow_input_is_a_finding():
    sys.path.insert(0, str(FUZZ))
    try:
        from _harness import TIME_BOUND_S, Overrun, bounded
    finally:
        sys.path.remove(str(FUZZ))

    def slow(data: bytes) -> None:
        import time

        start = time.thread_time()
        while time.thread_time() - start < 2 * TIME_BOUND_S:
            pass

    with pytest.raises(Overrun, match="a slow path"):
        bounded(slow)(b"short")
    bounded(slow)(b"x" * 70_000)  # only inputs under the size bound are bounded


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: t.stem)
def test_target_follows_the_harness(target: Path):
    """Every target is written to tests/fuzz/_harness.py's convention, so this file runs them all
    and none needs a test of its own."""
    module = load(target)
    assert callable(getattr(module, "fuzz_one", None)) and callable(getattr(module, "seeds", None))
    assert "run(fuzz_one, seeds)" in target.read_text()


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: t.stem)
def test_seeds_pass(target: Path):
    module = load(target)
    sys.path.insert(0, str(FUZZ))
    try:
        from _harness import bounded, warm
    finally:
        sys.path.remove(str(FUZZ))
    seeds = module.seeds()
    assert seeds
    warm(module.fuzz_one, seeds)
    one = bounded(module.fuzz_one)
    for seed in seeds:
        one(seed)
        for cut in (0, 1, len(seed) // 2):  # shorter inputs decode too (the choices run out as zeros)
            one(seed[:cut])


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: t.stem)
def test_bounded_fuzz_run(target: Path, tmp_path: Path):
    pytest.importorskip("atheris", reason="atheris (a test extra) cannot be imported here: no fuzz run",
                        exc_type=ImportError)  # a missing or a broken install (its native library) alike
    # libFuzzer's RSS limit reads the peak RSS, which Linux carries across fork and exec: the child of
    # a suite that has grown to 1.4 GB starts "out of memory" under a flat 1 GB limit. So the bound
    # is 1 GB above this process's peak.
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    argv = [sys.executable, str(target), f"-runs={RUNS}", "-seed=1", "-max_total_time=60",
            f"-rss_limit_mb={peak_mb + 1024}", f"-artifact_prefix={tmp_path}/", str(tmp_path / "corpus")]
    (tmp_path / "corpus").mkdir()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    report = done.stderr[-4000:]
    assert done.returncode == 0, f"{target.name} found a failing input (rc {done.returncode}):\n{report}"
    assert "Done " in done.stderr, report  # libFuzzer's summary: the runs really happened
    assert not list(tmp_path.glob("crash-*")) and not list(tmp_path.glob("timeout-*")), report
