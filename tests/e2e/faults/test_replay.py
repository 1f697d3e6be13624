"""A restored coordinator that offers a DP round again is refused by every site (docs/protocol.md
M-200..M-203, docs/operations.md §9 "A round offered again").

The patched coordinator copies its state (as ``afl-server backup`` does) right before it stores
the first upload, the plan signed and accepted by every site; the round then fails after every
upload arrived (its solve fails: nothing is published, no site completes the
round, so the sites' witness of the coordinator, M-142, has nothing to compare); the coordinator
is restarted on the copy, which offers the same round again, and the sites are restarted. Before
the upload register a site uploaded the round again with fresh DP noise while its ledger kept
one entry (ε composed over two noisy copies, the ledger's one). Each site now refuses in one
line naming the round and its earlier upload (or, when it cosigned a checkpoint of the federation
log after the copy, stops at start-up on the shorter log, M-192), sends nothing, and its ledger,
its register and what the coordinator received agree: one upload per release of the round, ever.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from afl.client.policy.ledger import DpLedger
from afl.client.policy.uploads import UploadRegister
from afl.proto.v1 import admin_pb2 as apb
from tests.e2e.dp_scenario import dp_federation
from tests.e2e.faults.harness import (
    audit_events,
    restore,
    site_state,
    stop_server,
)
from tests.e2e.processes import Daemons

pytestmark = pytest.mark.slow

SITES = 3


def _wait_clients(daemons: Daemons, expected: int) -> None:
    for site, proc in daemons.clients.items():
        code = proc.wait(timeout=400)
        assert code == expected, (site, code, daemons.log_tail())


def test_a_dp_round_offered_again_by_a_restored_coordinator_is_refused(tmp_path: Path) -> None:
    loop = dp_federation(tmp_path, SITES, round_settings={"min_participants": SITES})
    backup = tmp_path / "backup"
    daemons = Daemons(loop)
    try:
        # The coordinator copies its state right before the first upload (the plan signed and
        # accepted by every site), then the round fails after every upload arrived.
        daemons.start_server(crash_at=(f"copy-then-fail:{backup}", "run-1"))
        daemons.start_clients()
        _wait_clients(daemons, 4)  # the round aborted after the uploads (exit 4)
        assert daemons.wait_run("run-1").state == "aborted"
        assert backup.is_dir()
        first = [(d["round_id"], d["site_id"], d["sha256"]) for e, d in audit_events(loop) if e == "upload"]  # fmt: skip
        (round_id,) = {r for r, _, _ in first}
        sent: dict[str, list[str]] = {}
        for site in loop.site_ids:
            record = UploadRegister(site_state(loop, site) / "uploads").get(round_id)
            assert record is not None and record.sent, site
            sent[site] = sorted(s.sha256 for s in record.slots)
            # What the coordinator received of the site is what the site recorded before it sent.
            assert sorted(h for _, s, h in first if s == site) == sent[site]
            assert [e.round_id for e in DpLedger(site_state(loop, site) / "dp-ledger").entries()] == [round_id]  # fmt: skip

        stop_server(daemons)
        restore(loop, backup)
        daemons.start_server()  # the copy: run-1 in flight, its round offered again
        daemons.start_clients()
        # Every site refuses: a site that cosigned a checkpoint of the log after the copy (its
        # dp-release, published before its upload, docs/protocol.md M-195) sees a shorter log at
        # start-up and stops on the split view (exit 1, M-192); the others are offered the round
        # again and refuse it (exit 3, M-201).
        codes = {site: proc.wait(timeout=400) for site, proc in daemons.clients.items()}
        assert set(codes.values()) <= {1, 3}, (codes, daemons.log_tail())
        for site in loop.site_ids:
            text = (daemons.logs / f"{site}.log").read_text(errors="replace")
            state = site_state(loop, site)
            if codes[site] == 1:
                assert "two inconsistent checkpoints" in text, text[-2000:]
                assert list((state / "log-evidence").glob("split-view-*.json")), site
            else:
                line = next(x for x in text.splitlines() if f"REFUSED round {round_id}" in x)
                assert f"round {round_id} is offered again" in line, line
                assert "uploaded to it before (run run-1, sent" in line, line
                refused = json.loads((state / "reports" / f"{round_id}.refused_plan.json").read_text())  # fmt: skip
                assert refused["outcome"] == "REFUSED_PLAN" and refused["bytes_sent"] == 0
            assert [e.round_id for e in DpLedger(state / "dp-ledger").entries()] == [round_id]
            record = UploadRegister(state / "uploads").get(round_id)
            assert record is not None and sorted(s.sha256 for s in record.slots) == sent[site]
            earlier = json.loads((state / "reports" / f"{round_id}.json").read_text())
            assert earlier["bytes_sent"] > 0  # the report of the upload is kept
        offered = daemons.call(daemons.admin.GetRun, apb.RunRef(run_id="run-1"))
        assert offered.state == "active"  # the restored coordinator would go on with the round
        again = [d for e, d in audit_events(loop) if e == "upload" and d["round_id"] == round_id]
        assert again == []  # nothing of the round reached the restored coordinator
    finally:
        daemons.stop()
