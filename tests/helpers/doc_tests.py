"""The pytest node ids a document names, and the ones pytest collects from their files (for the
docs tests: tests/test_protocol_doc.py, tests/test_compliance_doc.py)."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

__all__ = ["DOCS", "ROOT", "collected_node_ids", "documented_node_ids", "node_ids_in"]

ROOT = Path(__file__).resolve().parents[2]
#: The documents whose named tests must exist.
DOCS = (ROOT / "docs" / "protocol.md", ROOT / "docs" / "compliance.md")


def node_ids_in(text: str) -> list[str]:
    """Every `tests/...::name` node id quoted in backticks in ``text``."""
    return re.findall(r"`(tests/[^`]+::[^`]+)`", text)


def documented_node_ids() -> list[str]:
    """Every node id :data:`DOCS` name."""
    return [n for doc in DOCS for n in node_ids_in(doc.read_text(encoding="utf-8"))]


def collected_node_ids(
    node_ids: Iterable[str], *, session: Mapping[str, set[str]] | None = None
) -> set[str]:
    """The node ids (parameters stripped) pytest collects from the files of ``node_ids``.

    ``session`` maps each test file the running session collected in full to its node ids
    (recorded as pytest collected them, before ``-m``/``-k`` deselection: tests/conftest.py);
    when it holds every file needed, its ids are the answer (the suite collects every file anyway,
    in every xdist worker); otherwise a ``pytest --collect-only`` of those files gives them."""
    files = sorted({n.split("::")[0] for n in node_ids})
    if session is not None and all(f in session for f in files):
        return set().union(*(session[f] for f in files))
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *files],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return {line.split("[")[0] for line in result.stdout.splitlines() if "::" in line}
