"""Many sites in one process (afl.client.daemon.host, ``afl-client run-many``): each site's daemon runs
in its own thread and its outcome is its own (one site's error or crash leaves the others
running), two sites never share a site id or a state folder, a decryptor runs alone, and the
exit codes are written where asked. Through the real daemons: tests/e2e/test_federation_sparse.py."""

from __future__ import annotations

import json
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from afl.client import cli
from afl.client.config import ClientConfig, load_client_config
from afl.client.daemon.host import EXIT_SITE_CRASHED, run_sites, worst_exit_code
from afl.client.daemon.transport import DaemonError
from afl.core.memory import map_large_blocks
from tests.helpers.federation import FederationSpec

FEDERATION = FederationSpec(
    sites=["site-1", "site-2", "site-3", "site-4"],
    round_settings={"classes": ["A"], "feature_dim": 4},
)


def _configs(federation: Any) -> list[ClientConfig]:
    return [load_client_config(d / "client.toml") for d in federation.site_dirs.values()]


def test_each_site_runs_in_its_own_thread_and_keeps_its_own_outcome(
    federation: Any, tmp_path: Path
) -> None:
    configs = _configs(federation)
    barrier = threading.Barrier(len(configs), timeout=60)  # all four run at the same time
    threads: dict[str, str] = {}

    def runner(config: ClientConfig) -> int:
        threads[config.site_id] = threading.current_thread().name
        barrier.wait()
        if config.site_id == "site-2":
            raise DaemonError("the coordinator is unreachable")  # a condition a user can cause
        if config.site_id == "site-3":
            raise KeyError("a bug")
        return 4 if config.site_id == "site-4" else 0

    summary = tmp_path / "codes.json"
    codes = run_sites(configs, runner=runner, summary=summary, known_errors=(DaemonError,))
    assert codes == {"site-1": 0, "site-2": 1, "site-3": EXIT_SITE_CRASHED, "site-4": 4}
    assert json.loads(summary.read_text()) == codes
    assert len(set(threads.values())) == 4
    assert worst_exit_code(codes) == EXIT_SITE_CRASHED and worst_exit_code({"a": 0}) == 0


def test_a_site_twice_or_a_shared_state_folder_is_refused(federation: Any) -> None:
    one, two = _configs(federation)[:2]
    with pytest.raises(ValueError, match="given twice"):
        run_sites([one, one], runner=lambda c: 0)
    with pytest.raises(ValueError, match="share a state_dir"):
        run_sites([one, replace(two, state_dir=one.state_dir)], runner=lambda c: 0)


def test_run_many_refuses_in_one_line(
    federation: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = str(federation.site_dirs["site-1"] / "client.toml")
    assert cli.main(["run-many", "--config", path, "--config", path]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("afl-client run-many: error: run-many: a site is given twice")
    assert cli.main(["run-many", "--config", str(tmp_path / "missing.toml")]) == 1
    assert "no such config file" in capsys.readouterr().err


def test_large_blocks_are_mapped_on_their_own_on_linux() -> None:
    import sys

    assert map_large_blocks() == sys.platform.startswith("linux")
