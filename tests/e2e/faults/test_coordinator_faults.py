"""Faults of the coordinator, through the daemons (docs/operations.md §8):

* killed between the end-of-run purge's record and its unlinks: after the restart no payload file
  is left and the audit log lists what the start-up sweep removed;
* a full disk that is freed within the sites' retry window: the sites retry RESOURCE_EXHAUSTED
  ("try later") with back-off, the stage stays open past its upload timeout, and every site's data
  is in the model (W equals the independent solve of the plaintext sums);
* a state it refuses at start-up: the sites stop within 30 s with the coordinator's reason (not
  after their 180 s retry windows).
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from tests.e2e.faults.harness import (
    assert_every_site_in_the_model,
    audit_events,
    federation,
    payload_files,
    wait_for,
)
from tests.e2e.processes import Daemons

pytestmark = pytest.mark.slow


def test_a_coordinator_killed_inside_the_purge_leaves_no_payload_after_restart(
    tmp_path: Path,
) -> None:
    loop = federation(tmp_path, serve=True)
    daemons = Daemons(loop)
    try:
        daemons.start_server(crash_at=("purge", "run-1"))
        daemons.start_clients()
        assert daemons.wait_server_exit() == -9, daemons.log_tail()
        left = payload_files(loop)
        assert left, "the purge was to be interrupted with its files still on disk"
        daemons.start_server()
        assert_every_site_in_the_model(daemons, "run-1")
        assert payload_files(loop) == []
        swept = [d for e, d in audit_events(loop) if e == "payloads-swept"]
        assert len(swept) == 1
        assert sorted(swept[0]["removed"]) == sorted(
            str(p.relative_to(loop.server_config.parent / "state")) for p in left
        )
    finally:
        daemons.stop()


def test_a_full_disk_freed_within_the_retry_window_ends_with_every_site_in_the_model(
    tmp_path: Path,
) -> None:
    # The upload timeout (20 s) is shorter than the time the disk stays full: only the hold of a
    # stage whose uploads are refused for a full disk keeps the round open for the retrying sites.
    loop = federation(tmp_path, round_settings={"upload_timeout_s": 20.0})
    flag = tmp_path / "disk-full"
    flag.write_text("full\n")
    daemons = Daemons(loop)
    try:
        daemons.start_server(crash_at=("disk-full", str(flag)))
        daemons.start_clients()
        wait_for(
            "every site retrying a refused upload",
            lambda: all(
                "RESOURCE_EXHAUSTED" in (daemons.logs / f"{site}.log").read_text(errors="replace")
                for site in loop.site_ids
            ),
            timeout_s=240,
            logs=daemons.log_tail,
        )
        time.sleep(25)  # longer than upload_timeout_s: the stage is held open meanwhile
        flag.unlink()  # the operator frees space
        assert_every_site_in_the_model(daemons, "run-1")
        for site, proc in daemons.clients.items():
            assert proc.wait(timeout=120) == 0, (site, daemons.log_tail())
        text = (daemons.logs / f"{loop.site_ids[0]}.log").read_text(errors="replace")
        assert "the coordinator's disk is full" in text  # the retry is logged with its cause
    finally:
        daemons.stop()


@pytest.mark.parametrize("mode", ["plaintext", "ckks"])  # ckks: the decryptor stops too
def test_sites_stop_within_30_s_of_a_coordinator_that_refuses_its_state(
    tmp_path: Path, mode: str
) -> None:
    loop = federation(tmp_path, mode, server_tables={"server": {"refusal_serve_s": 45.0}})
    daemons = Daemons(loop)
    try:
        daemons.start_server(crash_at=("upload:1", "run-1"))
        daemons.start_clients()
        assert daemons.wait_server_exit() == -9, daemons.log_tail()
        # The committed upload's file (others may have left staged files, written outside the
        # lock before the kill: the start-up sweep erases those).
        (missing,) = [p for p in payload_files(loop) if not p.name.startswith(".")]
        missing.unlink()  # damaged state: the coordinator refuses to start
        daemons.start_server()
        server_log = daemons.logs / f"server-{daemons.servers_started}.log"
        wait_for(
            "the refusal",
            lambda: (
                "refuses the state" in server_log.read_text(errors="replace")
                or "answering every call" in server_log.read_text(errors="replace")
            ),
            timeout_s=120,
            logs=daemons.log_tail,
        )
        refused_at = time.monotonic()
        for site, proc in daemons.clients.items():
            try:
                code = proc.wait(timeout=max(0.0, refused_at + 30 - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(
                    f"{site} still runs 30 s after the refusal\n{daemons.log_tail()}"
                ) from None
            assert code == 1, (site, code)
            text = (daemons.logs / f"{site}.log").read_text(errors="replace")
            assert "the coordinator refuses to start" in text and "is missing" in text, text
        assert daemons.wait_server_exit(timeout_s=120) == 2
    finally:
        daemons.stop()
