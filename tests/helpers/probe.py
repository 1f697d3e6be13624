"""Run a snippet in a fresh Python process (what a daemon imports shows only there: the test
process has imported everything already)."""

from __future__ import annotations

import subprocess
import sys


def run_probe(code: str) -> str:
    """The stripped stdout of ``python -c code`` (CalledProcessError with its stderr if it fails)."""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    return out.stdout.strip()
