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


def shot_path(tmp: Path, name: str) -> Path:
    """Where a test writes a screenshot: ``$AFL_REPORT_SHOTS/name`` when set (to look at it),
    else the test's own temporary folder."""
    import os

    folder = Path(os.environ.get("AFL_REPORT_SHOTS") or tmp)
    folder.mkdir(parents=True, exist_ok=True)
    return folder / name


def full_page_screenshot(chromium: str, page: Path, out: Path, *, profile: Path) -> Path:
    """A screenshot of the whole page at 1280 px wide: the page's own height is measured first
    (a fixed tall window would end in blank space), then the window is sized to it."""
    import json
    import re
    import subprocess

    probe = (
        '<pre id="height-probe"></pre><script>document.getElementById("height-probe")'
        ".textContent=JSON.stringify(document.documentElement.scrollHeight);</script>"
    )
    measured = page.with_name(page.stem + ".measure.html")
    measured.write_text(page.read_text(encoding="utf-8").replace("</body>", probe + "</body>"))
    dom = subprocess.run(
        [chromium, *headless_flags(profile), "--window-size=1280,800", "--dump-dom",
         measured.as_uri()],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout  # fmt: skip
    found = re.search(r'<pre id="height-probe">(\d+)</pre>', dom)
    assert found is not None, "the page's height could not be measured"
    height = json.loads(found.group(1))
    subprocess.run(
        [chromium, *headless_flags(profile), f"--screenshot={out}",
         f"--window-size=1280,{height}", "--hide-scrollbars", page.as_uri()],
        capture_output=True, timeout=180, check=True,
    )  # fmt: skip
    return out


def blank_tail_fraction(png: Path) -> float:
    """The fraction of the screenshot's height, from the bottom, that is plain white."""
    import numpy as np
    from PIL import Image

    with Image.open(png) as im:
        gray = np.asarray(im.convert("L"))
    inked = np.flatnonzero((gray < 245).any(axis=1))
    if inked.size == 0:
        return 1.0
    return float(gray.shape[0] - 1 - int(inked[-1])) / float(gray.shape[0])
