"""A restored old backup is noticed (docs/operations.md §9, docs/protocol.md M-142):
after a completed run the coordinator's state folder is replaced by a backup taken before that run
ended; every site names the regression in one line and refuses to take part; once the operator
acknowledges the restore (``afl-server ack-restore``, in the audit log) the run in flight in the
restored state is aborted (its round id, which the sites completed, is never offered again) and a
new run completes with every site, its W equal to the independent solve."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from afl.proto.v1 import admin_pb2 as apb
from tests.e2e.faults.harness import (
    assert_every_site_in_the_model,
    audit_events,
    federation,
    restore,
    server_tool,
    site_state,
    stop_server,
    wait_for,
)
from tests.e2e.processes import Daemons

pytestmark = pytest.mark.slow


def test_a_restored_old_backup_is_named_by_the_sites_and_refused_until_acknowledged(
    tmp_path: Path,
) -> None:
    loop = federation(tmp_path, serve=True)
    config = str(loop.server_config)
    backup = tmp_path / "backup"
    daemons = Daemons(loop)
    try:
        daemons.start_server()
        info = daemons.call(daemons.admin.GetRun, apb.RunRef(run_id="run-1"))
        assert info.state == "active"
        made = server_tool("backup", "--config", config, "--out", str(backup))
        assert made.returncode == 0, made.stderr  # the old copy: run-1 still in its first stage
        daemons.start_clients()
        assert daemons.wait_run("run-1").state == "published"
        completed = {}
        for site in loop.site_ids:
            path = site_state(loop, site) / "witness.json"
            wait_for("the sites' witness", path.is_file, timeout_s=120, logs=daemons.log_tail)
            wait_for(
                f"{site} completing run-1",
                lambda p=path: bool(json.loads(p.read_text())["completed"]),  # type: ignore[misc]
                timeout_s=120,
                logs=daemons.log_tail,
            )
            completed[site] = set(json.loads(path.read_text())["completed"])
        (round_id,) = set.union(*completed.values())

        stop_server(daemons)
        restore(loop, backup)
        daemons.start_server()  # the restored copy passes its own anchor check and starts
        for site, proc in daemons.clients.items():
            try:
                code = proc.wait(timeout=300)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"{site} took part\n{daemons.log_tail()}") from None
            text = (daemons.logs / f"{site}.log").read_text(errors="replace")
            assert code == 1, (site, code, text[-2000:])
            line = next(x for x in text.splitlines() if "afl-client run: error:" in x)
            assert "older than this site has seen" in line and "ack-restore" in line, line
        restored = daemons.call(daemons.admin.GetRun, apb.RunRef(run_id="run-1"))
        assert restored.state == "active"  # the coordinator itself would go on with run-1
        assert not any(
            e == "upload" and d.get("round_id") == round_id for e, d in audit_events(loop)
        )  # no site uploaded to the restored round again

        stop_server(daemons)
        acked = server_tool(
            "ack-restore", "--config", config, "--by", "operator", "--reason", "disk replaced"
        )
        assert acked.returncode == 0, acked.stderr
        assert "run-1" in acked.stdout
        records = [d for e, d in audit_events(loop) if e == "restore-acknowledged"]
        assert records == [
            {"by": "operator", "reason": "disk replaced", "count": 1, "aborted_runs": ["run-1"]}
        ]
        daemons.start_server()
        daemons.start_clients()
        assert daemons.call(daemons.admin.GetRun, apb.RunRef(run_id="run-1")).state == "aborted"
        run = daemons.submit(name="after the restore")
        assert_every_site_in_the_model(daemons, run.run_id)
        rounds = {e[1]["round_id"] for e in audit_events(loop) if e[0] == "round-created"}
        assert round_id in rounds  # the restored round ...
        reused = [d for e, d in audit_events(loop) if e == "upload" and d["round_id"] == round_id]
        assert reused == []  # ... was never taken part in again
    finally:
        daemons.stop()
