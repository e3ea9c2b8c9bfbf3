"""Every docstring example in the installed package runs and shows what it says (`>>>` lines).

The modules are imported by their installed names (tokenbroker.workers.chat.render_budget, not
workers.chat.render_budget), which is why this is a test module rather than `pytest --doctest-modules`:
with the package-dir layout that option imports broker/, workers/ and common/ under their folder
names, a second copy of each module whose exception names no longer match the examples, and
outside tests/, where conftest's offline tiktoken cache does not apply.
"""

from __future__ import annotations

import doctest
import importlib
import importlib.util
import pkgutil
from pathlib import Path

import pytest

PACKAGES = ("tokenbroker", "tokenbroker.broker", "tokenbroker.common", "tokenbroker.workers")


def _modules() -> list[str]:
    """Every module of the four installed packages, subpackages and their modules included."""
    names = set(PACKAGES)
    for package in PACKAGES:
        path = importlib.import_module(package).__path__
        names.update(info.name for info in pkgutil.walk_packages(path, package + "."))
    names.discard("tokenbroker.__main__")  # running it would start the CLI
    return sorted(names)


MODULES = _modules()


def _source_files() -> set[Path]:
    """The .py files on disk under the four packages' folders: what MODULES must cover."""
    files: set[Path] = set()
    for package in PACKAGES:
        for folder in importlib.import_module(package).__path__:
            files.update(Path(folder).rglob("*.py"))
    return {f.resolve() for f in files if "__pycache__" not in f.parts}


def test_every_source_file_is_a_module_whose_examples_run() -> None:
    covered = {Path(importlib.util.find_spec(name).origin).resolve() for name in [*MODULES, "tokenbroker.__main__"]}
    assert _source_files() - covered == set()


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_hold(name: str) -> None:
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS, verbose=False, report=True)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples in {name} failed (the report is above)"
