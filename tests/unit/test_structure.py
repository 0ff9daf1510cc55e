"""The packages' structure rules that no type checker sees: every error under StrataError (the
data plane and the operator)."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

import strata
import strata_operator
from strata.errors import StrataError

# Modules that need an optional dependency, or torch, are still imported: the test venv has
# them. Only entry points that run on import are skipped.
_SKIP = {
    "strata.__main__",
    "strata.peers.__main__",
    "strata.cli.__main__",
    "strata.demo",
    "strata_operator.__main__",
    "strata_operator.kubectl.__main__",
}


def _runtime_modules() -> list[str]:
    names = []
    for info in pkgutil.walk_packages(strata.__path__, "strata."):
        if info.name in _SKIP or info.name.startswith("strata.testing"):
            continue
        names.append(info.name)
    for info in pkgutil.walk_packages(strata_operator.__path__, "strata_operator."):
        if info.name not in _SKIP:
            names.append(info.name)
    return sorted(names)


@pytest.mark.parametrize("name", _runtime_modules())
def test_every_error_class_derives_from_strata_error(name: str) -> None:
    module = importlib.import_module(name)
    stray = [
        cls.__qualname__
        for _, cls in inspect.getmembers(module, inspect.isclass)
        if cls.__module__ == name
        and not cls.__name__.startswith("_")  # private control flow, never raised out
        and issubclass(cls, Exception)
        and not issubclass(cls, StrataError)
    ]
    assert not stray, f"{name}: errors outside strata.errors.StrataError: {stray}"


def test_commit_error_is_exported_with_the_other_errors() -> None:
    assert "CommitError" in strata.__all__
    assert issubclass(strata.CommitError, strata.FormatError)
