"""Fixtures shared by the afl.core tests."""

from __future__ import annotations

import pytest

from afl.core.data import nih


@pytest.fixture(scope="session")
def pa() -> nih.NihLabels:
    """The embedded NIH ChestX-ray14 PA-view labels over the paper's eight classes (read-only)."""
    return nih.load_pa_labels(classes=nih.PAPER_CLASSES)
