"""Every docstring example in the installed package runs and shows what it says (`>>>` lines)."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import tokenbroker


def _modules() -> list[str]:
    """The package's modules, its three installed subpackages included (they live in their own folders)."""
    names = ["tokenbroker"]
    for package in ("tokenbroker", "tokenbroker.broker", "tokenbroker.common", "tokenbroker.workers"):
        path = importlib.import_module(package).__path__
        for info in pkgutil.walk_packages(path, package + "."):  # subpackages too (workers.cache, workers.count)
            if info.name != "tokenbroker.__main__" and info.name not in names:
                names.append(info.name)
    return sorted(names)


@pytest.mark.parametrize("name", _modules())
def test_docstring_examples_hold(name: str) -> None:
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS, verbose=False, report=True)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples in {name} failed (the report is above)"
