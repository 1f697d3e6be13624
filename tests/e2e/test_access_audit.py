"""Who received what, through the daemons (docs/protocol.md M-160..M-165; docs/compliance.md
"Access, audit and evidence"). One federation of four sites whose run names three of them:

* the site outside the run cannot fetch the run's model or evaluation (PERMISSION_DENIED), and
  its attempt is recorded;
* every read (the sites' GetModel/GetEvaluation) and every admin call leaves an audit record;
* each site's signed consent is kept, and verifies, after the run's payloads were purged;
* `afl audit-export` of the finished run verifies offline, lists exactly the releases the
  coordinator decoded and who received the model and evaluation, and detects tampering.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from afl.client.config import load_client_config
from afl.client.daemon.transport import open_channel
from afl.crypto.identity.signed_blobs import verify_plan_decision
from afl.proto.v1 import admin_pb2 as apb
from afl.proto.v1 import common_pb2 as cpb
from afl.proto.v1 import coordinator_pb2 as pb
from afl.proto.v1 import coordinator_pb2_grpc
from afl.server.store import Store
from tests.e2e.faults.harness import federation
from tests.e2e.processes import Daemons

RUN = ["site-1", "site-2", "site-3"]
OUTSIDE = "site-4"
ADMIN_RPCS = (
    "SubmitRun",
    "ListRuns",
    "GetRun",
    "AbortRun",
    "GetLogs",
    "GetRunModel",
    "GetRunEvaluation",
)


def _afl(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "afl.lab.cli", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A federation whose run-1 (sites 1-3, with its evaluation round) published; site-4 tried
    to read its model and evaluation; every admin RPC was called once; the daemons stopped."""
    root = tmp_path_factory.mktemp("access")
    loop = federation(
        root,
        sites=4,
        serve=True,
        evaluate=True,
        round_settings={"participants": RUN, "min_participants": 3},
    )
    daemons = Daemons(loop)
    refusals: dict[str, Any] = {}
    try:
        daemons.start_server()
        daemons.start_clients()
        info = daemons.wait_run("run-1")
        assert info.state == "published", daemons.log_tail()
        model_round, eval_round = info.model_round_id, info.evaluation_round_id
        assert model_round and eval_round, info
        for site in (OUTSIDE, "site-1"):
            channel = open_channel(load_client_config(loop.client_configs[site]))
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            calls = {
                "model": (stub.GetModel, pb.ModelRequest(round_id=model_round)),
                "evaluation": (stub.GetEvaluation, pb.EvaluationRequest(round_id=eval_round)),
            }
            for what, (method, request) in calls.items():
                try:
                    method(request, timeout=60)
                    refusals[f"{site} {what}"] = grpc.StatusCode.OK
                except grpc.RpcError as exc:
                    refusals[f"{site} {what}"] = exc.code()
                    refusals[f"{site} {what} message"] = exc.details()
            channel.close()
        admin = daemons.admin
        daemons.call(admin.ListRuns, apb.ListRunsRequest())
        daemons.call(admin.GetLogs, apb.LogRequest(run_id="run-1"))
        daemons.call(admin.GetRunModel, apb.RunRef(run_id="run-1"))
        daemons.call(admin.GetRunEvaluation, apb.RunRef(run_id="run-1"))
        daemons.submit('classes = ["A"]', name="aborted at once")
        daemons.call(admin.AbortRun, apb.AbortRunRequest(run_id="run-2", reason="not needed"))
        assert daemons.wait_run("run-2").state == "aborted"
    finally:
        code = daemons.stop()
    assert code == 0, daemons.log_tail()
    yield {"loop": loop, "info": info, "refusals": refusals, "root": root}


def _store(loop: Any) -> Store:
    return Store(
        loop.server_config.parent / "state",
        federation_id=loop.provisioned.federation_id,
        read_only=True,
    )


def _audit(loop: Any) -> list[tuple[str, dict[str, Any]]]:
    return [(event, detail) for _, event, detail, _, _ in _store(loop).audit_entries()]


def test_a_site_outside_the_run_cannot_fetch_its_model_or_evaluation(
    finished: dict[str, Any],
) -> None:
    refusals = finished["refusals"]
    assert refusals[f"{OUTSIDE} model"] == grpc.StatusCode.PERMISSION_DENIED, refusals
    assert refusals[f"{OUTSIDE} evaluation"] == grpc.StatusCode.PERMISSION_DENIED, refusals
    assert "need-to-know" in refusals[f"{OUTSIDE} model message"]
    assert refusals["site-1 model"] == refusals["site-1 evaluation"] == grpc.StatusCode.OK
    refused = [d for e, d in _audit(finished["loop"]) if e == "read-refused"]
    assert {(d["site_id"], d["what"]) for d in refused} == {
        (OUTSIDE, "model"),
        (OUTSIDE, "evaluation"),
    }


def test_every_read_and_admin_call_leaves_an_audit_record(finished: dict[str, Any]) -> None:
    info, records = finished["info"], _audit(finished["loop"])
    store = _store(finished["loop"])
    model = store.model(info.model_round_id)
    evaluation = store.evaluation(info.evaluation_round_id)
    assert model is not None and evaluation is not None
    model_sha = hashlib.sha256(model[1]).hexdigest()
    reads = {(d["site_id"], d["round_id"], d["sha256"]) for e, d in records if e == "model-read"}
    # Every participant fetched the model in the run, site-1 once more in the test.
    assert {(s, info.model_round_id, model_sha) for s in RUN} <= reads
    assert all(site in RUN for site, _, _ in reads)
    evaluation_sha = hashlib.sha256(evaluation[0]).hexdigest()
    eval_reads = [d for e, d in records if e == "evaluation-read"]
    assert eval_reads and all(d["sha256"] == evaluation_sha for d in eval_reads)
    assert {d["site_id"] for d in eval_reads} <= set(RUN)
    calls = [d for e, d in records if e == "admin-call"]
    assert {d["rpc"] for d in calls} >= set(ADMIN_RPCS), calls
    assert all(d["admin"] == "operator" for d in calls)
    by_rpc = {d["rpc"]: d for d in calls}
    assert by_rpc["GetRunModel"]["sha256"] == model_sha
    assert by_rpc["GetRunEvaluation"]["sha256"] == evaluation_sha
    assert by_rpc["AbortRun"]["run_id"] == "run-2" and by_rpc["SubmitRun"]["run_id"] == "run-2"


def test_signed_consents_are_kept_after_the_payloads_are_purged(
    finished: dict[str, Any],
) -> None:
    loop, info = finished["loop"], finished["info"]
    store = _store(loop)
    assert not list((loop.server_config.parent / "state" / "payloads").rglob("*.bin"))
    deleted = [d for e, d in _audit(loop) if e == "payloads-deleted" and d["run_id"] == "run-1"]
    assert len(deleted) == 1
    uploads = {
        (r.round_id, s, name, u.sha256.hex())
        for r in info.round_history
        for (s, name), u in store.uploads(r.round_id).items()
    }
    assert (
        uploads
        and {
            (p["round_id"], p["site_id"], p["release"], p["sha256"]) for p in deleted[0]["payloads"]
        }
        == uploads
    )
    for summary in info.round_history:
        row = store.round(summary.round_id)
        assert row is not None and row.plan is not None
        consents = store.signed_decisions(summary.round_id)
        assert sorted(consents) == sorted(row.participants) == RUN
        for site, raw in consents.items():
            decision = pb.PlanDecision.FromString(raw)
            assert decision.accept and decision.plan_sha256 == hashlib.sha256(row.plan).digest()
            key = store.enrolment(site)
            assert key is not None
            verify_plan_decision(  # raises when the kept consent is not the site's signature
                key.identity_public_key,
                decision.signature,
                round_id=summary.round_id,
                accept=True,
                plan_sha256=decision.plan_sha256,
                graph_commitment=decision.graph_commitment,
                evaluation_rows=decision.evaluation_rows,
            )


def test_the_audit_export_verifies_offline_and_lists_exactly_the_releases_decoded(
    finished: dict[str, Any],
) -> None:
    loop, info, root = finished["loop"], finished["info"], finished["root"]
    bundle = root / "bundle"
    made = _afl("audit-export", "--config", str(loop.server_config), "--out", str(bundle))
    assert made.returncode == 0, made.stdout + made.stderr
    checked = _afl("audit-export", "--verify", str(bundle), "--json")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    report = json.loads(checked.stdout)
    assert report["ok"] and report["problems"] == []
    run = report["runs"]["run-1"]
    store = _store(loop)
    for summary in info.round_history:
        row = store.round(summary.round_id)
        assert row is not None and row.plan is not None
        plan_bytes = row.plan
        planned = sorted(r.name for r in cpb.ReleasePlan.FromString(plan_bytes).releases)
        got = run["rounds"][summary.round_id]
        assert sorted(d["release"] for d in got["decoded"]) == planned
        assert all(sorted(d["contributors"]) == RUN for d in got["decoded"])
        assert got["consents"] == dict.fromkeys(RUN, "accepted")
    assert report["runs"]["run-2"]["rounds"] == {} or all(
        not r["decoded"] for r in report["runs"]["run-2"]["rounds"].values()
    )
    recipients = {(r["role"], r["who"], r["what"]) for r in run["recipients"]}
    assert {("site", s, "model") for s in RUN} <= recipients
    assert ("admin", "operator", "model") in recipients
    assert ("admin", "operator", "evaluation") in recipients
    assert not any(who == OUTSIDE for _, who, _ in recipients)
    assert {(r["who"], r["what"]) for r in run["refused"]} == {
        (OUTSIDE, "model"),
        (OUTSIDE, "evaluation"),
    }
    assert len(run["deletions"]) == 1

    # Tampering: a changed consent, and an edited audit record, are each detected.
    consent = next(bundle.glob(f"runs/run-1/{info.model_round_id}/consents/site-1.pb"))
    original = consent.read_bytes()
    consent.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))
    tampered = _afl("audit-export", "--verify", str(bundle))
    assert tampered.returncode == 1 and "consents/site-1.pb" in tampered.stdout, tampered.stdout
    consent.write_bytes(original)
    audit = bundle / "audit.jsonl"
    lines = audit.read_text(encoding="utf-8").splitlines()
    refused = next(i for i, line in enumerate(lines) if '"read-refused"' in line)
    edited = [*lines]
    edited[refused] = lines[refused].replace(OUTSIDE, "site-1")  # hide who was refused
    assert edited != lines
    audit.write_text("\n".join(edited) + "\n", encoding="utf-8")
    tampered = _afl("audit-export", "--verify", str(bundle))
    assert tampered.returncode == 1 and "audit.jsonl" in tampered.stdout, tampered.stdout
