"""Progress lines for commands that take longer than a few seconds (`afl demo`, `afl export`,
`afl report`, `afl bench`): one line per stage on stderr, ``<command>: <stage> (<seconds> s)``,
and nothing when stderr is not a terminal (logs and pipes get only the results)."""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["Progress"]


class Progress:
    """Prints a stage when it differs from the previous one; quiet off a terminal."""

    def __init__(
        self, command: str, *, stream: TextIO | None = None, enabled: bool | None = None
    ) -> None:
        self.command = command
        self.stream = stream if stream is not None else sys.stderr
        isatty = getattr(self.stream, "isatty", None)
        self.enabled = bool(isatty and isatty()) if enabled is None else enabled
        self.start = time.monotonic()
        self.last = ""

    def __call__(self, stage: str) -> None:
        if not self.enabled or stage == self.last:
            return
        self.last = stage
        elapsed = time.monotonic() - self.start
        print(f"{self.command}: {stage} ({elapsed:.0f} s)", file=self.stream, flush=True)
