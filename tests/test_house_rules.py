"""The house rules of CONTRIBUTING.md that a file can hold: the layout's size rule, the changelog
naming the versions the code carries, the pre-commit hooks running what `make test` runs, and every
path CONTRIBUTING.md names existing."""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path

import pytest
import yaml

from afl.proto.wire import PROTOCOL_VERSION
from afl.server.store import SCHEMA_VERSION

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ["core", "crypto", "client", "server", "ops", "lab", "flower", "proto/afl/proto"]
#: "No package folder holds more than about 15 modules flat" (CONTRIBUTING.md).
MAX_FLAT_MODULES = 15


def _make_recipe(target: str) -> list[str]:
    """The commands of a Makefile target's recipe."""
    lines = (ROOT / "Makefile").read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"{target}:"))
    recipe = []
    for line in lines[start + 1 :]:
        if not line.startswith("\t"):
            break
        recipe.append(line.strip())
    return recipe


def _hooks() -> dict[str, dict[str, object]]:
    config = yaml.safe_load((ROOT / ".pre-commit-config.yaml").read_text(encoding="utf-8"))
    return {hook["id"]: hook for repo in config["repos"] for hook in repo["hooks"]}


@pytest.mark.parametrize("package", PACKAGES)
def test_no_package_folder_holds_more_than_about_15_modules_flat(package: str) -> None:
    for folder in [ROOT / package, *(p for p in (ROOT / package).rglob("*") if p.is_dir())]:
        modules = [
            p for p in folder.glob("*.py") if p.name != "__init__.py" and "_pb2" not in p.name
        ]
        rel = folder.relative_to(ROOT)
        assert len(modules) <= MAX_FLAT_MODULES, f"{rel}: {len(modules)} modules flat"


def test_the_changelog_names_the_versions_the_code_carries() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    text = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    first = re.search(r"^## (.+)$", text, re.MULTILINE)
    assert first is not None, "CHANGELOG.md has no version heading"
    heading = first.group(1)
    assert f"package {project['version']}" in heading or heading.startswith(project["version"])
    assert f"wire {PROTOCOL_VERSION}" in heading
    assert f"store {SCHEMA_VERSION}" in heading


def test_the_pre_commit_hooks_run_what_make_test_runs() -> None:
    hooks = _hooks()
    typecheck = next(c for c in _make_recipe("typecheck") if "mypy" in c)
    made = shlex.split(typecheck.replace("$(BIN)/", ".venv/bin/"))
    hooked = shlex.split(str(hooks["mypy"]["entry"]))
    assert hooked == made, "the mypy hook and `make typecheck` check different things"
    lint = " ".join(_make_recipe("lint"))
    assert "ruff check ." in lint and "ruff format --check ." in lint
    assert str(hooks["ruff"]["entry"]).startswith(".venv/bin/ruff check")
    assert str(hooks["ruff-format"]["entry"]).startswith(".venv/bin/ruff format --check")
    assert "scripts/check_proto_drift.sh" in lint
    assert "scripts/check_proto_drift.sh" in str(hooks["proto-drift"]["entry"])


def test_every_path_contributing_names_exists() -> None:
    text = (ROOT / "CONTRIBUTING.md").read_text(encoding="utf-8")
    paths = set(
        re.findall(
            r"`((?:core|crypto|client|server|ops|lab|flower|proto|tests|docs|scripts)/[\w/.]+?)`",
            text,
        )
    )
    assert paths, "CONTRIBUTING.md names no paths"
    missing = sorted(p for p in paths if "<" not in p and not (ROOT / p.rstrip("/")).exists())
    assert missing == [], f"CONTRIBUTING.md names paths that do not exist: {missing}"
