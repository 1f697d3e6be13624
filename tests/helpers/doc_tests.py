"""The pytest node ids a document names, and the ones pytest collects from their files (for the
docs tests: tests/test_protocol_doc.py, tests/test_compliance_doc.py)."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterable
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


def collected_node_ids(node_ids: Iterable[str]) -> set[str]:
    """The node ids (parameters stripped) pytest collects from the files of ``node_ids``."""
    files = sorted({n.split("::")[0] for n in node_ids})
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *files],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return {line.split("[")[0] for line in result.stdout.splitlines() if "::" in line}
