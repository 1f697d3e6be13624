"""Makes the top-level packages named in ``AFL_TEST_UNIMPORTABLE`` (comma-separated) unimportable
in a Python process that has this folder on its ``PYTHONPATH``: importing one raises
ModuleNotFoundError, as on a machine where that package is not installed.

The tests put this folder on the PYTHONPATH of the commands a party runs with only its extra
installed (tests/test_operations_doc.py: the operator and the coordinator, without torch,
torchvision, matplotlib and scikit-learn), so that a command needing another party's packages fails
the test instead of passing here, where every extra is installed.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType

_BLOCKED = frozenset(
    name.strip() for name in os.environ.get("AFL_TEST_UNIMPORTABLE", "").split(",") if name.strip()
)


class _Unimportable:
    """A meta path finder that refuses the blocked packages and their submodules."""

    @staticmethod
    def find_spec(
        fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname.partition(".")[0] in _BLOCKED:
            raise ModuleNotFoundError(
                f"No module named {fullname!r} (made unimportable by AFL_TEST_UNIMPORTABLE)",
                name=fullname,
            )
        return None


if _BLOCKED:
    sys.meta_path.insert(0, _Unimportable())
