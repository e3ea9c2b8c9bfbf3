"""What every fuzz target in this folder shares: how atheris runs it, and the byte source its
structure-aware generators read their choices from.

A target is one file, `fuzz_<name>.py` (tests/test_fuzz.py finds it by that name), with three things:

- `fuzz_one(data: bytes) -> None`: runs one input through the compiled code and checks it against
  the reference (msgpack, the reply contract, ...); it raises (AssertionError) on a disagreement.
  It imports no atheris, so the suite can replay inputs without it.
- `seeds() -> list[bytes]`: the starting corpus, written in code (the repository keeps no binary
  corpus; libFuzzer writes what it finds to a temporary folder, never into the tree).
- `if __name__ == "__main__": run(fuzz_one, seeds)`.

Targets that read requests build their inputs with _msgpack_values (any value, request-shaped maps,
arrays of them, deep nesting, lying headers) and judge them against its `reference` (msgpack).

Run one by hand for minutes:  .venv/bin/python tests/fuzz/fuzz_wire.py -max_total_time=300
(any libFuzzer flag works: -runs=N, -seed=S, -jobs; a folder given last is the corpus to grow).
tests/test_fuzz.py runs every target for a bounded number of inputs, and replays its seeds.

A slow path is a finding as a crash is: `bounded` (which `run` and the suite's replay put around
every target) fails an input under BOUNDED_BELOW bytes that costs more than TIME_BOUND_S of CPU or
raises the process's peak RSS by more than MEMORY_BOUND (a hostile frame that makes the broker
walk, allocate or raise per element is caught here, not in production). CPU time of this thread,
not wall time: a loaded machine does not fail an input. The garbage collector is held off during
an input (its pauses belong to no input) and runs between them.

Coverage: atheris instruments the Python code (the generators, the oracle's branches); the Cython
core is compiled by gcc without libFuzzer's coverage hooks, so the search is guided by the shape
of the generated values, not by the core's branches. That is why the generators build values
header by header (every width of every kind, non-canonical encodings msgpack never writes, lengths
that lie) instead of leaving the structure to blind byte flips.
"""

from __future__ import annotations

import gc
import inspect
import resource
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any


TIME_BOUND_S = 0.050  # CPU seconds one input may cost
MEMORY_BOUND = 50 * 2**20  # bytes one input may add to the process's peak RSS
BOUNDED_BELOW = 64 * 1024  # inputs shorter than this are bounded (libFuzzer's default -max_len is 4,096)


class Overrun(AssertionError):
    """An input cost more CPU or memory than the bound: a slow path, reported as a crash is."""


def bounded(fuzz_one: Callable[[bytes], None]) -> Callable[[bytes], None]:
    """`fuzz_one` failing (Overrun) on an input under BOUNDED_BELOW bytes that costs more than
    TIME_BOUND_S of CPU or grows the peak RSS by more than MEMORY_BOUND. The peak is the kernel's
    (ru_maxrss): it sees what the compiled code allocates, which tracemalloc would not, for the
    price of one system call."""

    def one(data: bytes) -> None:
        enabled = gc.isenabled()
        gc.disable()
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        start = time.thread_time()
        try:
            fuzz_one(data)
        finally:
            spent = time.thread_time() - start
            grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak) * 1024
            if enabled:
                gc.enable()
        if len(data) < BOUNDED_BELOW:
            if spent > TIME_BOUND_S:
                raise Overrun(f"an input of {len(data)} bytes cost {spent * 1000:.0f} ms of CPU "
                              f"(bound {TIME_BOUND_S * 1000:.0f} ms): a slow path")
            if grown > MEMORY_BOUND:
                raise Overrun(f"an input of {len(data)} bytes grew the peak RSS by {grown / 2**20:.0f} MiB "
                              f"(bound {MEMORY_BOUND / 2**20:.0f} MiB)")

    return one


class Choices:
    """The fuzzer's bytes read as a stream of decisions; zeros once they run out, so every input,
    however short, decodes to a finished value."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.at = 0
        self.lies = False  # whether builders may write headers that claim more than follows

    def byte(self) -> int:
        if self.at >= len(self.data):
            return 0
        b = self.data[self.at]
        self.at += 1
        return b

    def below(self, n: int) -> int:
        """A number in [0, n) (n <= 65536)."""
        if n <= 256:
            return self.byte() % n
        return (self.byte() << 8 | self.byte()) % n

    def take(self, n: int) -> bytes:
        got = self.data[self.at:self.at + n]
        self.at += len(got)
        return got.ljust(n, b"\0")

    def left(self) -> int:
        return len(self.data) - self.at


def _instrument(atheris: Any, target: ModuleType) -> None:
    """Coverage hooks in the target's functions and in the builders it imports from this folder
    (_msgpack_values), only. Not atheris.instrument_all (a minute at start, every loaded module),
    nor Choices' readers: called per decision, their hooks cost 4x the executions per second and
    cover nothing worth reaching."""
    here = Path(__file__).resolve().parent
    for module in list(sys.modules.values()):
        source = getattr(module, "__file__", None)
        if module is not target and (not source or Path(source).resolve().parent != here or module.__name__ == __name__):
            continue
        for obj in vars(module).values():
            if inspect.isfunction(obj) and obj.__module__ == module.__name__:
                atheris.instrument_func(obj)


def warm(fuzz_one: Callable[[bytes], None], seeds: list[bytes]) -> None:
    """Run each seed once unbounded: the first calls pay for imports and caches no input causes."""
    for seed in seeds:
        fuzz_one(seed)


def run(fuzz_one: Callable[[bytes], None], seeds: Callable[[], list[bytes]]) -> None:
    """libFuzzer's main over `fuzz_one` under the per-input bound (`bounded`), the seeds written to a
    temporary corpus folder (after any folder named on the command line, which is the one libFuzzer
    adds new inputs to)."""
    import atheris

    argv = list(sys.argv)
    seed_dir = Path(tempfile.mkdtemp(prefix="tb-fuzz-seeds-"))
    starting = seeds()
    for i, seed in enumerate(starting):
        (seed_dir / f"seed-{i:04d}").write_bytes(seed)
    argv.append(str(seed_dir))
    _instrument(atheris, sys.modules[fuzz_one.__module__])
    warm(fuzz_one, starting)
    atheris.Setup(argv, bounded(fuzz_one))
    atheris.Fuzz()
