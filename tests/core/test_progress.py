"""Progress lines (afl.core.progress): one line per new stage on a terminal, nothing otherwise."""

from __future__ import annotations

import io

from afl.core.progress import Progress


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_stages_on_a_terminal_and_silence_elsewhere() -> None:
    tty = _Terminal()
    progress = Progress("afl demo", stream=tty)
    for stage in ("3 of 8 sites enrolled", "3 of 8 sites enrolled", "round 1 (r1): upload"):
        progress(stage)
    lines = tty.getvalue().splitlines()
    assert [line.rsplit(" (", 1)[0] for line in lines] == [
        "afl demo: 3 of 8 sites enrolled",
        "afl demo: round 1 (r1): upload",
    ]
    assert all(line.endswith(" s)") for line in lines)
    pipe = io.StringIO()  # not a terminal: a log or a pipe gets nothing
    Progress("afl export", stream=pipe)("tracing the classifier")
    assert pipe.getvalue() == ""
