"""A CKKS site dies as its upload stage begins, before its `opening` statement is logged
(docs/protocol.md M-232): the coordinator re-plans with the sites that uploaded, and every one
of them accepts the new plan. The aborted round's openings (the other sites') count as a release
over those sites only (a CKKS sum is decrypted only once every participant's ciphertext is in it,
and the dead site sent none), so the re-plan over the same sites adds nothing to the history and
differences nothing out (M-206)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from afl.crypto.transparency.statements import decode_statement
from afl.proto.v1 import coordinator_pb2 as pb
from tests.e2e.faults.harness import federation
from tests.e2e.processes import Daemons
from tests.e2e.test_whole_history_audit import _refusals, _store

VICTIM = "site-4"


def test_a_ckks_site_lost_before_its_opening_lets_the_others_re_plan_and_publish(
    tmp_path: Path,
) -> None:
    loop = federation(
        tmp_path, "ckks", sites=4, round_settings={"min_participants": 3, "upload_timeout_s": 20.0}
    )
    daemons = Daemons(loop)
    try:
        daemons.start_server()
        daemons.start_clients(crash_at={VICTIM: "before-opening"})
        assert daemons.clients[VICTIM].wait(timeout=400) == -9, daemons.log_tail()
        run = daemons.wait_run("run-1")
        assert run.state == "published", (run, daemons.log_tail())
    finally:
        daemons.stop()

    store = _store(loop)
    first, second = store.rounds("run-1")[:2]
    assert first.stage == pb.ROUND_STAGE_ABORTED and VICTIM in first.participants
    assert second.stage == pb.ROUND_STAGE_PUBLISHED
    assert sorted(second.participants) == ["site-1", "site-2", "site-3"]
    assert _refusals("run-1", store) == {}  # nobody refused the re-plan
    fed = loop.provisioned.federation_id
    statements: list[tuple[str, Any]] = [
        decode_statement(entry, federation=fed)
        for _, _, entry, _ in store.log_entries(0, store.log_size())
    ]
    openings = [
        fields
        for kind, fields in statements
        if kind == "opening" and fields["release"]["round_id"] == first.round_id
    ]
    assert sorted(f["site"] for f in openings) == ["site-1", "site-2", "site-3"], openings
    assert {f["mode"] for f in openings} == {"ckks"}
    assert all(f["release"]["survivors"] == sorted(first.participants) for f in openings)
