"""The site as a witness of the federation log (docs/protocol.md §11a, M-192, M-193), against the
coordinator's real log (:class:`afl.server.transparency.FederationLog` on a real store) behind a
stand-in for the RPCs: the checkpoint is on disk before the cosignature leaves, a split view is
kept as evidence and stops the site, and a plan is accepted only under a quorum of roster
cosignatures verified with the kit's keys."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from afl.client.daemon import transparency as transparency_module
from afl.client.daemon.transparency import WITNESS_STATE, Call, LogWitness, SplitViewDetected
from afl.client.daemon.transport import DaemonError
from afl.crypto.identity.signatures import generate_identity_key, public_key_to_raw
from afl.crypto.transparency import checkpoint as checkpoint_module
from afl.crypto.transparency.checkpoint import Checkpoint, cosign, sign_checkpoint
from afl.crypto.transparency.merkle import leaf_hash
from afl.crypto.transparency.statements import plan_statement, statement_bytes
from afl.proto import wire
from afl.proto.v1 import common_pb2 as cpb
from afl.proto.v1 import coordinator_pb2 as pb
from tests.helpers.calls import record_calls
from tests.helpers.fedlog import LogService, site_witness

FED = "fed-witness"
COORDINATOR = generate_identity_key()
SITES = {f"site-{i}": generate_identity_key() for i in (1, 2, 3)}
ROSTER = {s: public_key_to_raw(k) for s, k in SITES.items()}


def _coordinator(state: Path) -> LogService:
    service = LogService(state, key=COORDINATOR, federation_id=FED)
    for site, key in ROSTER.items():
        service.enrol(site, key)
    return service


def _witness(state: Path, site: str = "site-1", quorum: int = 0) -> LogWitness:
    return site_witness(
        state, federation=FED, site=site, keys=SITES, coordinator=COORDINATOR, quorum=quorum
    )


def test_the_cosigned_checkpoint_is_on_disk_before_the_cosignature_leaves(tmp_path: Path) -> None:
    coordinator = _coordinator(tmp_path / "server")
    witness = _witness(tmp_path / "site")

    def on_disk(request: pb.LogCosignature) -> None:
        held = json.loads((tmp_path / "site" / WITNESS_STATE).read_text())["checkpoint"]
        assert (held["size"], held["root"]) == (request.size, request.root.hex())

    coordinator.on_cosign = on_disk
    witness.witness(coordinator.call)
    coordinator.store.create_run(run_id="run-1", name="a", settings={}, submitted_by="op")
    witness.witness(coordinator.call)  # an extension: consistency proof checked, cosigned
    witness.witness(coordinator.call)  # the same checkpoint: nothing new to cosign
    assert coordinator.cosigned == ["site-1", "site-1"]
    assert _witness(tmp_path / "site").last == witness.last  # a restart keeps it


def test_a_split_view_keeps_both_checkpoints_and_stops(tmp_path: Path) -> None:
    coordinator = _coordinator(tmp_path / "server")
    witness = _witness(tmp_path / "site")
    honest = witness.witness(coordinator.call).checkpoint
    other = sign_checkpoint(COORDINATOR, Checkpoint(FED, honest.size, leaf_hash(b"other")))
    coordinator.offer = lambda _: pb.CosignedLogCheckpoint(
        checkpoint=wire.checkpoint_to_proto(other)
    )
    with pytest.raises(SplitViewDetected) as caught:
        witness.witness(coordinator.call)
    line = str(caught.value)
    assert "\n" not in line and "two inconsistent checkpoints" in line
    assert f"size {honest.size} root {honest.root.hex()[:16]}" in line
    assert f"root {other.checkpoint.root.hex()[:16]}" in line
    (evidence,) = (tmp_path / "site" / "log-evidence").glob("split-view-*.json")
    doc = json.loads(evidence.read_text())
    assert doc["cosigned"]["root"] == honest.root.hex()
    assert doc["offered"]["root"] == other.checkpoint.root.hex()
    assert doc["offered"]["signature"] == other.signature.hex()
    assert witness.last is not None and witness.last.checkpoint.root == honest.root  # unchanged
    assert coordinator.cosigned == ["site-1"]  # the second view is never cosigned


def test_a_plan_is_accepted_only_under_a_quorum_of_roster_cosignatures(tmp_path: Path) -> None:
    coordinator = _coordinator(tmp_path / "server")
    plan_sha = coordinator.publish_plan("r1-abc", b"the signed plan")
    site1 = _witness(tmp_path / "s1")

    def problem(round_id: str = "r1-abc", sha: bytes = plan_sha) -> str:
        why, checkpoint = site1.plan_problem(
            coordinator.call, round_id=round_id, plan_sha256=sha, wait_s=0.0, poll_s=0.01,
            max_poll_s=0.01,
        )  # fmt: skip
        assert (checkpoint is None) == bool(why)  # the quorum checkpoint comes with ""
        return why

    assert site1.quorum == 2  # a majority of 3
    why = problem()  # site-1's own cosignature only
    assert "cosigned by a quorum of 2 roster sites" in why and "1 witness(es)" in why, why
    # A cosignature under a key that is not the roster's (the coordinator forging site-3's) is
    # not counted: the coordinator's store would refuse it, so it is slipped into the answer.
    checkpoint = coordinator.log.checkpoint().signed.checkpoint
    forged = cosign(generate_identity_key(), witness="site-3", checkpoint=checkpoint)

    def with_forged(request: pb.CheckpointRequest) -> pb.CosignedLogCheckpoint:
        answer = coordinator.log.answer(request)
        answer.cosignatures.append(wire.cosignature_to_proto(forged))
        return answer

    coordinator.offer = with_forged
    assert "1 witness(es)" in problem()
    coordinator.offer = None
    _witness(tmp_path / "s2", "site-2").witness(coordinator.call)  # a second roster site
    assert problem() == ""
    assert "not in log checkpoint" in problem(sha=hashlib.sha256(b"another plan").digest())


def test_a_quorum_wait_ends_when_the_site_refuses_the_plan_meanwhile(tmp_path: Path) -> None:
    """The plan's log check runs while the site checks the plan itself (client/daemon/loop.py,
    ``PlanLogCheck``); when the site refuses it meanwhile, the wait for a quorum that never comes
    ends at once instead of at the stage deadline."""
    coordinator = _coordinator(tmp_path / "server")
    plan_sha = coordinator.publish_plan("r1-abc", b"the signed plan")
    site1 = _witness(tmp_path / "s1")
    stop = threading.Event()
    result: list[str] = []

    def wait() -> None:
        why, checkpoint = site1.plan_problem(
            coordinator.call, round_id="r1-abc", plan_sha256=plan_sha, wait_s=3600.0,
            poll_s=0.01, max_poll_s=0.05, stop=stop,
        )  # fmt: skip
        assert checkpoint is None
        result.append(why)

    waiting = threading.Thread(target=wait)
    waiting.start()
    while not coordinator.cosigned:  # site-1 cosigned; alone, it is no quorum of 2
        waiting.join(0.01)
    stop.set()
    waiting.join(60)  # generous: a wait on the hour-long deadline would not end here
    assert not waiting.is_alive()
    (why,) = result
    assert why.startswith("the log check of the plan was stopped") and "1 witness(es)" in why, why


def test_the_log_s_statements_are_read_only_when_they_hash_to_the_cosigned_root(
    tmp_path: Path,
) -> None:
    """M-207: the site rebuilds the history from entries whose leaf hashes give the root of the
    quorum checkpoint, fetched page by page; a served statement that is not the logged one, or an
    entry missing, is refused with the cause."""
    coordinator = _coordinator(tmp_path / "server")
    fields = {"round_id": "r1", "run_id": "run-1", "survivors": ["site-1"], "releases": []}
    coordinator.store.append_log("release", fields)
    witness = _witness(tmp_path / "site")
    answer = witness.witness(coordinator.call)
    statements = witness.statements(coordinator.call, answer)
    assert len(statements) == answer.checkpoint.size
    assert statements[-1] == ("release", fields)
    assert [k for k, _ in statements[:3]] == ["enrolment"] * 3

    def forged(served: pb.LogEntries) -> pb.LogEntries:
        for entry in served.entries:
            if entry.kind == "release":  # the same statement with site-5 dropped from history
                forged = statement_bytes(
                    federation=FED, kind="release", fields={**fields, "survivors": []}
                )
                entry.statement = forged
        return served

    fresh = _witness(tmp_path / "other-site", site="site-2")
    coordinator.serve_entries = forged
    with pytest.raises(DaemonError, match="do not hash to the root of the cosigned checkpoint"):
        fresh.statements(coordinator.call, fresh.witness(coordinator.call))
    coordinator.serve_entries = lambda served: pb.LogEntries()
    more = witness.statements(coordinator.call, answer)  # a verified prefix is not fetched again
    assert more == statements
    with pytest.raises(DaemonError, match="served no log entry from index 0"):
        fresh.statements(coordinator.call, answer)


def test_the_statements_a_checkpoint_answer_carries_are_read_as_served_ones(
    tmp_path: Path,
) -> None:
    """A witnessing step that asks for the log's statements (``with_entries``) gets them in the
    checkpoint's answer, and :meth:`LogWitness.statements` on that answer reads them without
    GetLogEntries, verified as GetLogEntries' (docs/protocol.md §11a): statements that are not
    the logged ones, or carried at another index, are refused with the cause; where the answer
    stops short of its checkpoint, the rest is fetched."""
    coordinator = _coordinator(tmp_path / "server")
    fields = {"round_id": "r1", "run_id": "run-1", "survivors": ["site-1"], "releases": []}
    coordinator.store.append_log("release", fields)
    calls: list[str] = []

    def call(what: str, request: Any) -> Any:
        calls.append(what)
        return coordinator.call(what, request)

    witness = _witness(tmp_path / "site")
    answer = witness.witness(call, with_entries=True)
    assert len(answer.entries) == answer.checkpoint.size
    statements = witness.statements(call, answer)
    assert calls == ["GetCheckpoint", "CosignCheckpoint"]  # no GetLogEntries
    assert statements[-1] == ("release", fields) and len(statements) == answer.checkpoint.size
    coordinator.store.append_log("release", {**fields, "round_id": "r2"})
    newer = witness.witness(call, with_entries=True)  # only what the site does not hold
    assert [e.index for e in newer.entries] == [answer.checkpoint.size]
    assert witness.statements(call, newer)[:-1] == statements
    assert "GetLogEntries" not in calls

    def forged(served: pb.LogEntries) -> pb.LogEntries:
        for entry in served.entries:
            if entry.kind == "release":
                entry.statement = statement_bytes(
                    federation=FED, kind="release", fields={**fields, "survivors": []}
                )
        return served

    def shifted(served: pb.LogEntries) -> pb.LogEntries:
        for entry in served.entries:
            entry.index += 1
        return served

    def short(served: pb.LogEntries) -> pb.LogEntries:
        del served.entries[2:]  # as an answer capped below its checkpoint's size
        return served

    for n, (serve, error) in enumerate(
        (
            (forged, "do not hash to the root of the cosigned checkpoint"),
            (shifted, "served log entry 1 where entry 0 of"),
        )
    ):
        fresh = _witness(tmp_path / f"fresh-{n}", site="site-2")
        coordinator.serve_entries = serve
        with pytest.raises(DaemonError, match=error):
            fresh.statements(call, fresh.witness(call, with_entries=True))
    coordinator.serve_entries = short
    fresh = _witness(tmp_path / "fresh-short", site="site-3")
    carried = fresh.witness(call, with_entries=True)
    assert len(carried.entries) == 2
    coordinator.serve_entries = lambda served: served
    del calls[:]
    assert fresh.statements(call, carried) == witness.statements(call, newer)
    assert calls == ["GetLogEntries"]  # the rest, from index 2


def _released(coordinator: LogService, round_id: str) -> cpb.ReleasePlan:
    """A plan of ``round_id`` over site-1 and site-2, in the log with its `release` statement."""
    members = ["site-1", "site-2"]
    plan = cpb.ReleasePlan(
        round_id=round_id,
        run_id="run-1",
        participants=members,
        aggregation=cpb.AGGREGATION_MODE_MASK,
        releases=[
            cpb.Release(name="gram[all]", kind=cpb.STATISTIC_KIND_GRAM, member_site_ids=members)
        ],
    )
    coordinator.publish_plan(round_id, plan.SerializeToString())
    coordinator.publish_release(round_id, plan.SerializeToString(), survivors=members)
    return plan


def test_the_release_check_s_cosignature_goes_after_the_check_and_before_any_later_step(
    tmp_path: Path,
) -> None:
    """The check of a published round's `release` statement (M-230) verifies and keeps the
    newest checkpoint but sends its cosignature only when the daemon flushes it (after the
    round's model is kept) or before its next witnessing step, once; an acknowledged restore
    drops it (the restored log may not hold that checkpoint)."""
    coordinator = _coordinator(tmp_path / "server")
    calls: list[str] = []

    def call(what: str, request: Any) -> Any:
        calls.append(what)
        return coordinator.call(what, request)

    witness = _witness(tmp_path / "site")
    witness.check_release(call, _released(coordinator, "r1"), survivors={"site-1", "site-2"})
    assert calls == ["GetCheckpoint"] and coordinator.cosigned == []
    assert witness.last is not None and witness.last.checkpoint.size == coordinator.store.log_size()
    witness.flush(call)
    witness.flush(call)  # sent once
    assert calls == ["GetCheckpoint", "CosignCheckpoint"] and coordinator.cosigned == ["site-1"]
    witness.check_release(call, _released(coordinator, "r2"), survivors={"site-1", "site-2"})
    del calls[:]
    witness.witness(call)  # the deferred cosignature first; the checkpoint is cosigned then
    assert calls == ["CosignCheckpoint", "GetCheckpoint"]
    assert coordinator.cosigned == ["site-1", "site-1"]
    witness.check_release(call, _released(coordinator, "r3"), survivors={"site-1", "site-2"})
    witness.restore_acknowledged(1)
    del calls[:]
    witness.flush(call)
    assert calls == [] and coordinator.cosigned == ["site-1", "site-1"]
    # the history it read is read afresh from the restored log: all of it in the next answer
    answer = witness.witness(call, with_entries=True)
    assert len(answer.entries) == answer.checkpoint.size


def test_a_cosignature_that_failed_to_leave_is_sent_by_the_next_step_on_its_checkpoint(
    tmp_path: Path,
) -> None:
    """A deferred cosignature whose send failed (or was lost to a crash after the checkpoint was
    kept) is not lost: the next witnessing step that finds that checkpoint without this site's
    cosignature sends it (the same bytes); once the coordinator holds it, none is sent again."""
    coordinator = _coordinator(tmp_path / "server")
    witness = _witness(tmp_path / "site")
    witness.check_release(
        coordinator.call, _released(coordinator, "r1"), survivors={"site-1", "site-2"}
    )

    def failing(what: str, request: Any) -> Any:
        if what == "CosignCheckpoint":
            raise DaemonError("CosignCheckpoint: UNAVAILABLE: the coordinator is restarting")
        return coordinator.call(what, request)

    with pytest.raises(DaemonError, match="UNAVAILABLE"):
        witness.flush(failing)
    assert coordinator.cosigned == []
    calls: list[str] = []

    def call(what: str, request: Any) -> Any:
        calls.append(what)
        return coordinator.call(what, request)

    answer = witness.witness(call)
    assert calls == ["GetCheckpoint", "CosignCheckpoint"] and coordinator.cosigned == ["site-1"]
    assert [c.witness for c in answer.cosignatures] == ["site-1"]
    witness.witness(call)
    assert calls == ["GetCheckpoint", "CosignCheckpoint", "GetCheckpoint"]


def test_a_quorum_on_the_first_checkpoint_by_size_keeps_what_its_first_answer_carried(
    tmp_path: Path,
) -> None:
    """The quorum gathers on the first checkpoint that held the statement while the log grew
    past it (asked for again by size, without its statements): the checkpoint returned keeps
    the statements the first answer carried, so reading the history costs no GetLogEntries;
    a coordinator that carries no second inclusion proof (stripped here) leaves it to
    GetInclusionProof."""
    coordinator = _coordinator(tmp_path / "server")
    plan_sha = coordinator.publish_plan("r1", b"the plan of r1")
    statement = plan_statement(federation=FED, round_id="r1", plan_sha256=plan_sha)
    also = coordinator.store.log_entries(0, 1)[0][2]  # an earlier statement of the log
    calls: list[str] = []

    def call(what: str, request: Any) -> Any:
        calls.append(what)
        answer = coordinator.call(what, request)
        if what == "GetCheckpoint":
            answer.ClearField("also_inclusion")  # a coordinator that does not carry it
        return answer

    witness = _witness(tmp_path / "site", quorum=2)
    result: list[tuple[str, pb.CosignedLogCheckpoint | None]] = []
    waiting = threading.Thread(
        target=lambda: result.append(
            witness.quorum_problem(
                call,
                statement=statement,
                what="the plan",
                wait_s=60,
                poll_s=0.01,
                max_poll_s=0.05,
                with_entries=True,
                also=also,
            )
        )
    )
    waiting.start()
    deadline = time.monotonic() + 60
    while not coordinator.cosigned and time.monotonic() < deadline:
        time.sleep(0.01)
    first = witness.last
    assert first is not None and coordinator.cosigned == ["site-1"]
    coordinator.store.append_log("run-ended", {"run_id": "run-0", "state": "x", "reason": ""})
    other = cosign(SITES["site-2"], witness="site-2", checkpoint=first.checkpoint)
    coordinator.call("CosignCheckpoint", wire.cosignature_to_proto(other))
    waiting.join(60)
    [(problem, found)] = result
    assert problem == "" and found is not None
    assert found.checkpoint.size == first.checkpoint.size < coordinator.store.log_size()
    assert [e.index for e in found.entries] == list(range(first.checkpoint.size))
    del calls[:]
    assert len(witness.statements(call, found)) == first.checkpoint.size
    witness.prove_included(call, also, found, also=True)
    assert calls == ["GetInclusionProof"]  # no GetLogEntries; the proof asked for


def test_a_quorum_wait_verifies_each_cosignature_once_and_the_history_is_decoded_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Polling the same checkpoint verifies only cosignatures not verified before (and stops
    at the quorum); the log's verified prefix is decoded once, and handed out read-only."""
    coordinator = _coordinator(tmp_path / "server")
    for site in SITES:
        _witness(tmp_path / site, site).witness(coordinator.call)
    site1 = _witness(tmp_path / "site-1")
    answer = site1.witness(coordinator.call)
    assert len(answer.cosignatures) == 3
    verified = record_calls(
        monkeypatch, checkpoint_module, "verify_cosignature", lambda key, c: c.witness
    )
    assert site1.quorum_on(answer) == {"site-1", "site-2"}  # a majority of 3, in name order
    assert verified == ["site-1", "site-2"]
    assert site1.quorum_on(answer) == {"site-1", "site-2"}
    assert verified == ["site-1", "site-2"]  # nothing verified twice
    decoded = record_calls(monkeypatch, transparency_module, "decode_statement")
    transparency_module._statement.cache_clear()
    first = site1.statements(coordinator.call, answer)
    assert len(decoded) == answer.checkpoint.size
    assert site1.statements(coordinator.call, answer) == first
    assert len(decoded) == answer.checkpoint.size  # the verified prefix is not decoded again
    other = _witness(tmp_path / "site-2", "site-2")  # another site of the same host process
    assert other.statements(coordinator.call, other.witness(coordinator.call)) == first
    assert len(decoded) == answer.checkpoint.size  # nor by another site
    with pytest.raises(TypeError):
        first[0][1]["site"] = "another"  # type: ignore[index]


def _calls(coordinator: LogService, seen: list[str]) -> Call:
    def call(what: str, request: Any) -> Any:
        seen.append(what)
        return coordinator.call(what, request)

    return call


def test_a_witnessing_step_is_one_checkpoint_call_and_the_cosignature(tmp_path: Path) -> None:
    """The consistency proof and the plan's inclusion proof come with the checkpoint: a site
    that witnesses a grown log and finds its plan under a quorum calls GetCheckpoint and
    CosignCheckpoint only, and the proofs it verified are the ones it asked for."""
    coordinator = _coordinator(tmp_path / "server")
    site1, site2 = _witness(tmp_path / "s1"), _witness(tmp_path / "s2", "site-2")
    site1.witness(coordinator.call)
    plan_sha = coordinator.publish_plan("r1-abc", b"the signed plan")
    site2.witness(coordinator.call)  # the quorum's other cosignature, on the grown log
    asked: list[pb.CheckpointRequest] = []

    def answer(request: pb.CheckpointRequest) -> pb.CosignedLogCheckpoint:
        asked.append(request)
        return coordinator.log.answer(request)

    coordinator.offer = answer
    seen: list[str] = []
    why, found = site1.plan_problem(
        _calls(coordinator, seen), round_id="r1-abc", plan_sha256=plan_sha, wait_s=60.0,
        poll_s=0.01, max_poll_s=0.05,
    )  # fmt: skip
    assert why == "" and found is not None
    assert seen == ["GetCheckpoint", "CosignCheckpoint"]
    (request,) = asked
    statement = plan_statement(federation=FED, round_id="r1-abc", plan_sha256=plan_sha)
    assert request.consistency_from == len(ROSTER) < found.checkpoint.size  # the enrolments
    assert request.inclusion_leaf == leaf_hash(statement)


def _tampered(coordinator: LogService, change: Callable[[pb.CosignedLogCheckpoint], None]) -> None:
    def offer(request: pb.CheckpointRequest) -> pb.CosignedLogCheckpoint:
        answer = coordinator.log.answer(request)
        change(answer)
        return answer

    coordinator.offer = offer


def test_a_wrong_consistency_proof_in_the_answer_is_a_split_view(tmp_path: Path) -> None:
    coordinator = _coordinator(tmp_path / "server")
    witness = _witness(tmp_path / "site")
    cosigned = witness.witness(coordinator.call).checkpoint
    coordinator.store.create_run(run_id="run-1", name="a", settings={}, submitted_by="op")

    def wrong(answer: pb.CosignedLogCheckpoint) -> None:
        assert answer.consistency  # the honest proof, then one hash of it replaced
        answer.consistency[0] = leaf_hash(b"not the log")

    _tampered(coordinator, wrong)
    with pytest.raises(SplitViewDetected, match="two inconsistent checkpoints"):
        witness.witness(coordinator.call)
    (evidence,) = (tmp_path / "site" / "log-evidence").glob("split-view-*.json")
    doc = json.loads(evidence.read_text())
    assert doc["cosigned"]["root"] == cosigned.root.hex()
    assert doc["consistency_proof"][0] == leaf_hash(b"not the log").hex()
    assert coordinator.cosigned == ["site-1"]  # the grown checkpoint is never cosigned
    assert witness.last is not None and witness.last.checkpoint.size == cosigned.size


def test_a_checkpoint_without_its_consistency_proof_is_refused_and_not_cosigned(
    tmp_path: Path,
) -> None:
    coordinator = _coordinator(tmp_path / "server")
    witness = _witness(tmp_path / "site")
    cosigned = witness.witness(coordinator.call).checkpoint
    coordinator.store.create_run(run_id="run-1", name="a", settings={}, submitted_by="op")
    _tampered(coordinator, lambda answer: answer.ClearField("consistency"))
    with pytest.raises(
        DaemonError, match=f"without the consistency proof from size {cosigned.size}"
    ):
        witness.witness(coordinator.call)
    assert coordinator.cosigned == ["site-1"]
    assert witness.last is not None and witness.last.checkpoint.size == cosigned.size
    assert not (tmp_path / "site" / "log-evidence").exists()  # no evidence of a split: refused
    coordinator.offer = None
    witness.witness(coordinator.call)  # the honest answer is cosigned
    assert coordinator.cosigned == ["site-1", "site-1"]


@pytest.mark.parametrize(
    ("change", "refusal"),
    [
        (lambda a: a.inclusion.hashes.__setitem__(0, leaf_hash(b"x")), "does not lead to the"),
        (lambda a: setattr(a.inclusion, "index", a.inclusion.index - 1), "does not lead to the"),
        (lambda a: a.inclusion.hashes.pop(), "shorter than the tree needs"),
        (lambda a: a.ClearField("inclusion"), "answered no inclusion proof"),
    ],
)
def test_a_wrong_or_missing_inclusion_proof_in_the_answer_is_refused(
    tmp_path: Path, change: Callable[[pb.CosignedLogCheckpoint], None], refusal: str
) -> None:
    coordinator = _coordinator(tmp_path / "server")
    plan_sha = coordinator.publish_plan("r1-abc", b"the signed plan")
    for site in SITES:  # the whole roster cosigned: only the inclusion proof is missing
        _witness(tmp_path / site, site).witness(coordinator.call)
    _tampered(coordinator, change)
    why, found = _witness(tmp_path / "site-1").plan_problem(
        coordinator.call, round_id="r1-abc", plan_sha256=plan_sha, wait_s=0.0, poll_s=0.01,
        max_poll_s=0.01,
    )  # fmt: skip
    assert found is None and refusal in why, why
    assert why.startswith("the plan is not in a federation-log checkpoint cosigned by a quorum")


def test_the_cosignature_s_answer_shows_a_quorum_completed_meanwhile(tmp_path: Path) -> None:
    """CosignCheckpoint answers the cosignatures the coordinator holds once it kept the caller's:
    a quorum another site completed between this site's GetCheckpoint and its cosignature is
    seen without another poll."""
    coordinator = _coordinator(tmp_path / "server")
    plan_sha = coordinator.publish_plan("r1-abc", b"the signed plan")
    site1, site2 = _witness(tmp_path / "s1"), _witness(tmp_path / "s2", "site-2")
    seen: list[str] = []

    def call(what: str, request: Any) -> Any:
        seen.append(what)
        if what == "CosignCheckpoint" and request.witness == "site-1":
            site2.witness(coordinator.call)  # site-2 cosigns the same checkpoint meanwhile
        return coordinator.call(what, request)

    why, found = site1.plan_problem(
        call, round_id="r1-abc", plan_sha256=plan_sha, wait_s=60.0, poll_s=0.01,
        max_poll_s=0.05,
    )  # fmt: skip
    assert why == "" and found is not None
    assert seen == ["GetCheckpoint", "CosignCheckpoint"]
    assert {c.witness for c in found.cosignatures} == {"site-1", "site-2"}
    assert found.HasField("inclusion")  # the answer keeps the proof the site verified


def _cosigned_meanwhile(coordinator: LogService, witness: LogWitness) -> None:
    """``witness`` cosigns the newest checkpoint while a call is held (its own calls go to the
    log as they are, past the coordinator's ``offer``)."""
    offer, coordinator.offer = coordinator.offer, None
    try:
        witness.witness(coordinator.call)
    finally:
        coordinator.offer = offer


def test_a_quorum_wait_asks_for_held_answers_and_waits_out_a_hold_the_coordinator_did_not_honour(
    tmp_path: Path,
) -> None:
    """After its first step (answered at once: its cosignature goes first), a quorum wait asks
    for answers held until the quorum's count of cosignatures or a newer checkpoint (M-236).
    A coordinator that answers at once anyway is waited out at the site, as it was polled
    before: a second's wait asks a dozen times at most, not hundreds. A coordinator that holds
    the answer while the quorum's other cosignature comes ends the wait in two calls."""
    coordinator = _coordinator(tmp_path / "server")
    plan_sha = coordinator.publish_plan("r1-abc", b"the signed plan")
    site1 = _witness(tmp_path / "s1")
    asked: list[pb.CheckpointRequest] = []

    def at_once(request: pb.CheckpointRequest) -> pb.CosignedLogCheckpoint:
        asked.append(request)
        return coordinator.log.answer(request)

    coordinator.offer = at_once
    why, found = site1.plan_problem(
        coordinator.call, round_id="r1-abc", plan_sha256=plan_sha, wait_s=1.0, poll_s=0.01,
        max_poll_s=0.05,
    )  # fmt: skip
    assert found is None and "1 witness(es)" in why, why
    first, *then = asked
    assert first.wait_ms == 0
    held = [r for r in then if r.wait_ms]
    assert held == then[: len(held)] and len(then) - len(held) <= 1  # past the deadline: none
    assert 1 <= len(held) <= 12, len(held)
    size = coordinator.log.checkpoint().signed.checkpoint.size
    for request in held:
        assert request.wait_cosignatures == site1.quorum == 2
        assert request.wait_grown_past == size  # the newest it had seen
        assert 0 < request.wait_ms <= transparency_module.HOLD_MIN_S * 1000
    # A coordinator that honours the hold: site-2 cosigns while site-1's call is held.
    site2 = _witness(tmp_path / "s2", "site-2")
    coordinator.store.create_run(run_id="run-1", name="a", settings={}, submitted_by="op")
    asked.clear()

    def holding(request: pb.CheckpointRequest) -> pb.CosignedLogCheckpoint:
        asked.append(request)
        if request.wait_ms:
            _cosigned_meanwhile(coordinator, site2)
        return coordinator.log.answer(request)

    coordinator.offer = holding
    why, found = site1.plan_problem(
        coordinator.call, round_id="r1-abc", plan_sha256=plan_sha, wait_s=60.0, poll_s=0.01,
        max_poll_s=0.05,
    )  # fmt: skip
    assert why == "" and found is not None
    assert [r.wait_ms > 0 for r in asked] == [False, True]
    assert {c.witness for c in found.cosignatures} == {"site-1", "site-2"}


def test_a_held_answer_made_stale_by_another_step_is_asked_for_again(tmp_path: Path) -> None:
    """A held GetCheckpoint runs outside the witness's lock (M-236): when another witnessing
    step of the site cosigns a newer checkpoint meanwhile, the held answer (an older checkpoint,
    its proof from a size the site no longer holds) is not taken for a split view; the site
    asks again."""
    coordinator = _coordinator(tmp_path / "server")
    site1 = _witness(tmp_path / "s1")
    site1.witness(coordinator.call)

    def stale(request: pb.CheckpointRequest) -> pb.CosignedLogCheckpoint:
        if not request.wait_ms:
            return coordinator.log.answer(request)
        old = coordinator.log.answer(request)
        coordinator.store.create_run(run_id="run-1", name="a", settings={}, submitted_by="op")
        site1.witness(coordinator.call)  # the other step: cosigns the grown log
        return old

    coordinator.offer = stale
    last = site1.last
    assert last is not None
    answer = site1.witness(coordinator.call, hold_s=1.0, wait_grown_past=last.checkpoint.size)
    assert site1.last is not None and answer.checkpoint.size == site1.last.checkpoint.size
    assert answer.checkpoint.size > last.checkpoint.size
    assert not (tmp_path / "s1" / "log-evidence").exists()
    assert coordinator.cosigned == ["site-1", "site-1"]


def test_a_held_answer_from_before_an_acknowledged_restore_is_asked_for_again(
    tmp_path: Path,
) -> None:
    """An acknowledged restore during a held call (M-142, M-236) makes its answer stale even when
    the site held no checkpoint before it (an earlier restore cleared it): the site witnesses the
    restored log afresh, and the restored, shorter log is no split view."""
    before = _coordinator(tmp_path / "before")
    before.store.create_run(run_id="run-1", name="a", settings={}, submitted_by="op")
    restored = _coordinator(tmp_path / "restored")  # fewer statements: what the backup held
    serving = [before]

    def call(what: str, request: Any) -> Any:
        return serving[0].call(what, request)

    site1 = _witness(tmp_path / "s1")
    site1.witness(call)
    site1.restore_acknowledged(1)  # the site now holds no checkpoint
    assert site1.last is None

    def restore_meanwhile(request: pb.CheckpointRequest) -> pb.CosignedLogCheckpoint:
        answer = before.log.answer(request)
        if request.wait_ms:
            site1.restore_acknowledged(2)
            serving[0] = restored
        return answer

    before.offer = restore_meanwhile
    answer = site1.witness(call, hold_s=1.0, wait_grown_past=1)
    assert answer.checkpoint.size == restored.log.checkpoint().signed.checkpoint.size
    assert answer.checkpoint.size < before.log.checkpoint().signed.checkpoint.size
    site1.witness(call)  # the restored log again: no split view
    assert not list((tmp_path / "s1" / "log-evidence").glob("split-view-*.json"))


def test_a_hold_that_a_newer_checkpoint_ended_is_followed_at_once_but_not_twice_in_a_row(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When a held answer comes early because the log grew (M-236), the site cosigns the newer
    checkpoint and asks again at once, without waiting out the rest of the step (a second
    here). A log that keeps growing is followed at once only every other time, so a
    coordinator that grows its log without end gets two cosignatures a step, as it did when it
    was polled: here four growths in a row give two waits."""
    coordinator = _coordinator(tmp_path / "server")
    plan_sha = coordinator.publish_plan("r1-abc", b"the signed plan")
    site1, site2 = _witness(tmp_path / "s1"), _witness(tmp_path / "s2", "site-2")
    slept: list[float] = []

    class Clock:
        monotonic = staticmethod(time.monotonic)

        @staticmethod
        def sleep(seconds: float) -> None:
            slept.append(seconds)

    monkeypatch.setattr(transparency_module, "time", Clock)
    asked: list[pb.CheckpointRequest] = []  # for the newest (the checkpoint that first held
    # the plan is asked for again by size after each, its quorum counted there too)

    def growing(request: pb.CheckpointRequest) -> pb.CosignedLogCheckpoint:
        if request.size:
            return coordinator.log.answer(request)
        asked.append(request)
        if request.wait_ms:
            if len(asked) < 6:  # the log grows while the call is held
                coordinator.store.create_run(
                    run_id=f"run-{len(asked)}", name="a", settings={}, submitted_by="op"
                )
            else:  # then the quorum's other cosignature comes
                _cosigned_meanwhile(coordinator, site2)
        return coordinator.log.answer(request)

    coordinator.offer = growing
    why, found = site1.plan_problem(
        coordinator.call, round_id="r1-abc", plan_sha256=plan_sha, wait_s=60.0, poll_s=1.0,
        max_poll_s=1.0,
    )  # fmt: skip
    assert why == "" and found is not None
    assert [r.wait_ms > 0 for r in asked] == [False] + [True] * 5
    assert [r.wait_grown_past for r in asked[1:]] == [r.consistency_from for r in asked[1:]]
    assert len(slept) == 2 and all(0.5 < s <= 1.0 for s in slept), slept
    assert coordinator.cosigned.count("site-1") == 5  # the first checkpoint, the 4 grown ones


def test_a_lying_held_answer_is_refused_as_any_other(tmp_path: Path) -> None:
    """A held answer (M-236) is checked as an unheld one: one whose consistency proof is wrong is
    a split view, kept as evidence and never cosigned, and a cosignature the coordinator forged
    into held answers does not count towards the quorum a wait asks for."""
    coordinator = _coordinator(tmp_path / "server")
    witness = _witness(tmp_path / "site")
    cosigned = witness.witness(coordinator.call).checkpoint
    coordinator.store.create_run(run_id="run-1", name="a", settings={}, submitted_by="op")
    held: list[pb.CheckpointRequest] = []

    def wrong_proof(answer: pb.CosignedLogCheckpoint) -> None:
        answer.consistency[0] = leaf_hash(b"not the log")

    def offer(request: pb.CheckpointRequest) -> pb.CosignedLogCheckpoint:
        if request.wait_ms:
            held.append(request)
        answer = coordinator.log.answer(request)
        wrong_proof(answer)
        return answer

    coordinator.offer = offer
    with pytest.raises(SplitViewDetected, match="two inconsistent checkpoints"):
        witness.witness(coordinator.call, hold_s=1.0, wait_grown_past=cosigned.size)
    assert len(held) == 1  # the lie came in the held answer
    assert coordinator.cosigned == ["site-1"]
    assert witness.last is not None and witness.last.checkpoint.size == cosigned.size
    # A forged cosignature of site-3 (a key not the roster's) in every held answer.
    plan_sha = coordinator.publish_plan("r1-abc", b"the signed plan")
    site1 = _witness(tmp_path / "s1")
    held.clear()

    def forged(request: pb.CheckpointRequest) -> pb.CosignedLogCheckpoint:
        answer = coordinator.log.answer(request)
        if request.wait_ms:
            held.append(request)
            checkpoint = wire.checkpoint_from_proto(answer.checkpoint).checkpoint
            fake = cosign(generate_identity_key(), witness="site-3", checkpoint=checkpoint)
            answer.cosignatures.append(wire.cosignature_to_proto(fake))
        return answer

    coordinator.offer = forged
    why, found = site1.plan_problem(
        coordinator.call, round_id="r1-abc", plan_sha256=plan_sha, wait_s=0.5, poll_s=0.01,
        max_poll_s=0.05,
    )  # fmt: skip
    assert found is None and "1 witness(es)" in why, why
    assert held  # the waits were held answers, each with the forged cosignature
