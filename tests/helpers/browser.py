"""Headless Chromium for the report tests (skipped when it is not installed; nothing is
installed by the tests)."""

from __future__ import annotations

import shutil
from pathlib import Path

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
SKIP_REASON = "headless Chromium not installed (apt package: chromium); the test installs nothing"


def headless_flags(profile: Path) -> list[str]:
    """Flags for an offline, sandbox-free headless run with a throw-away profile."""
    return [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={profile}",
        "--virtual-time-budget=5000",
    ]
