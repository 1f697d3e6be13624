"""`afl bench` where a suite's optional dependency is missing (a coordinator image has no torch):
the `afl` command still builds its parser, and that suite alone answers with one line naming
the missing module, exit status 2."""

from __future__ import annotations

import importlib
from types import ModuleType

import pytest

from afl.lab import cli


def _extract_needs(missing: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Importing the extract suite fails as if module ``missing`` were not installed."""
    real = importlib.import_module

    def fake(name: str, package: str | None = None) -> ModuleType:
        if name == "afl.lab.bench.extract":
            raise ModuleNotFoundError(f"No module named {missing!r}", name=missing)
        return real(name, package)

    monkeypatch.setattr(importlib, "import_module", fake)


def test_a_suite_without_its_dependency_names_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _extract_needs("torch", monkeypatch)
    assert cli.main(["bench", "extract"]) == 2
    err = capsys.readouterr().err
    assert "afl bench extract: needs the Python module 'torch'" in err
    assert err.count("\n") == 1


def test_a_missing_module_of_afl_itself_is_not_hidden(monkeypatch: pytest.MonkeyPatch) -> None:
    _extract_needs("afl.gone", monkeypatch)
    with pytest.raises(ModuleNotFoundError):
        cli.main(["bench", "extract"])
