"""A file eraser that fails on demand (the background eraser's retries, afl.core.erase)."""

from __future__ import annotations

from pathlib import Path

import pytest

from afl.core import erase


def refuse_erasing(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Patch :func:`afl.core.erase.erase_file` to fail with a permission error while the returned
    flag's first item is True (it starts True); set it False to let erasures through."""
    real, refusing = erase.erase_file, [True]

    def flaky(path: Path, *, evidence: bool = True) -> dict[str, object]:
        if refusing[0]:
            raise PermissionError(13, "Permission denied", str(path))
        return real(path, evidence=evidence)

    monkeypatch.setattr(erase, "erase_file", flaky)
    return refusing
