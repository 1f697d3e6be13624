"""`afl bench startup`: every measured command runs and answers (against a running afl-server for
`afl admin ls`), with this install as its own baseline; a folder without afl is refused."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from afl.lab.bench.daemons.e2e import COMMANDS, run_startup_bench


def test_every_command_is_measured_against_a_baseline() -> None:
    result = run_startup_bench(repeats=1, baseline_bin=Path(sys.executable).parent)
    assert [row["command"] for row in result["commands"]] == [name for name, _ in COMMANDS]
    for row in result["commands"]:
        for install in ("this", "baseline"):
            assert row[install]["wall_seconds"] > 0 and row[install]["cpu_seconds"] > 0
            assert row[install]["wall_seconds_all"] == [row[install]["wall_seconds"]]
        assert row["wall_seconds_ratio"] > 0 and row["cpu_seconds_ratio"] > 0


def test_a_baseline_without_afl_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="has no afl, afl-client, afl-server"):
        run_startup_bench(repeats=1, baseline_bin=tmp_path)
