"""docs/compliance.md cannot drift: every test it names exists (collected by pytest itself), every
`afl...` module, class or function it names as a mechanism imports, and every link stays inside
the repository."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

from tests.helpers.doc_tests import ROOT, node_ids_in

DOC = ROOT / "docs" / "compliance.md"


def _text() -> str:
    return DOC.read_text(encoding="utf-8")


def _resolves(dotted: str) -> bool:
    """``afl.a.b.C.d``: the longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 1, -1):
        try:
            found: object = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for name in parts[cut:]:
            if not hasattr(found, name):
                return False
            found = getattr(found, name)
        return True
    return False


def test_every_named_test_exists(documented_tests: set[str]) -> None:
    named = node_ids_in(_text())
    assert len(named) >= 30, "the checklist links its claims to tests"
    missing = sorted(n for n in set(named) if n not in documented_tests)
    assert not missing, f"docs/compliance.md names tests that do not exist: {missing}"


def test_every_named_mechanism_exists() -> None:
    named = set(re.findall(r"`(afl(?:\.[A-Za-z_][A-Za-z0-9_]*)+)`", _text()))
    assert len(named) >= 20
    missing = sorted(n for n in named if not _resolves(n))
    assert not missing, (
        f"docs/compliance.md names modules or attributes that do not exist: {missing}"
    )


def test_every_checklist_claim_names_a_mechanism_and_a_test() -> None:
    section = _text().split("## 8. The §12 checklist, linked")[1].split("\n## ")[0]
    rows = [
        r for r in section.splitlines() if r.startswith("| ") and not r.startswith("| question")
    ]
    assert len(rows) >= 25
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert len(cells) == 4, row
        claim, mechanism, tests = cells[1:]
        assert claim, row
        elsewhere = 'section "' in mechanism and 'section "' in tests  # another section's
        assert elsewhere or (("`afl." in mechanism or mechanism == "—") and node_ids_in(tests)), row


@pytest.mark.parametrize("target", re.findall(r"\]\(([^)]+)\)", DOC.read_text(encoding="utf-8")))
def test_links_stay_inside_the_repository(target: str) -> None:
    assert not re.match(r"[a-z]+:", target), f"{target} points outside the repository"
    path = (DOC.parent / target.split("#")[0]).resolve()
    assert path.is_relative_to(ROOT) and path.exists(), target


def test_nothing_points_outside_the_repository() -> None:
    assert not re.search(r"https?://|www\.", _text())
    for path in re.findall(r"`((?:docs|tests|server|client|core|crypto|ops|lab)/[^` ]+)`", _text()):
        assert (ROOT / path.split("::")[0]).exists(), path
    assert Path(DOC).is_relative_to(ROOT)
