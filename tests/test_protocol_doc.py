"""docs/protocol.md cannot drift: every MUST has an id, every id is in the table of §13, and every
test the table names exists (collected by pytest itself) — and no table row names an unknown id."""

from __future__ import annotations

import re

from tests.helpers.doc_tests import ROOT

DOC = ROOT / "docs" / "protocol.md"
ROW = re.compile(r"^\| (M-\d{2,3}) \| (.+) \|$")


def must_table() -> dict[str, list[str]]:
    """MUST id -> pytest node ids, from the table of §13."""
    table: dict[str, list[str]] = {}
    for line in DOC.read_text(encoding="utf-8").splitlines():
        match = ROW.match(line)
        if match:
            assert match[1] not in table, f"{match[1]} listed twice"
            table[match[1]] = re.findall(r"`([^`]+::[^`]+)`", match[2])
    return table


def test_every_must_has_an_id_and_a_row() -> None:
    text = DOC.read_text(encoding="utf-8")
    body = text.split("## 13.")[0]
    defined = re.findall(r"\[(M-\d{2,3})\]", body)  # definitions; references are bare M-nn
    assert len(defined) == len(set(defined)), "a MUST id is defined twice"
    # Every sentence with MUST (outside the RFC 2119 paragraph) carries an id.
    for paragraph in re.split(r"\n(?=\* |\n)", body):
        if re.search(r"\bMUST\b", paragraph) and "RFC 2119" not in paragraph:
            assert re.search(r"\[M-\d{2,3}\]", paragraph), (
                f"MUST without an id: {paragraph[:120]!r}"
            )
    table = must_table()
    assert set(defined) == set(table), set(defined) ^ set(table)
    assert all(table.values()), "every MUST needs at least one test"


def test_every_listed_test_exists(documented_tests: set[str]) -> None:
    missing = [n for nodes in must_table().values() for n in nodes if n not in documented_tests]
    assert not missing, f"docs/protocol.md names tests that do not exist: {missing}"
