"""MUSTs of docs/protocol.md checked on the in-process coordinator (no network): the per-class audit
gate [M-23], accept-before-upload [M-05], and what the audit log records about uploads [M-30]."""

from __future__ import annotations

import hashlib
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from afl.core.packing import packed_length
from afl.crypto.identity import signatures
from afl.crypto.identity.signed_blobs import (
    PLAN_DECISION_CONTEXT,
    blob_sha256,
    plan_decision_fields,
)
from afl.ops.provisioning import ProvisionedFederation
from afl.proto.v1 import common_pb2
from afl.proto.v1 import coordinator_pb2 as pb
from afl.proto.wire import AssembledPayload
from afl.server.config import load_config
from afl.server.coordinator import Coordinator
from afl.server.errors import WrongStageError
from afl.server.rounds import Stage
from afl.server.store import Store
from tests.helpers.enrol import enrol_in_process
from tests.helpers.federation import FederationSpec

SITES = ["p1", "p2", "p3"]
COVERAGE = {"p1": ["a"], "p2": ["a", "b"], "p3": ["b"]}  # per-class sums have 2 members < 3
D = 4
FEDERATION = FederationSpec(
    sites=SITES, round_settings={"classes": ["a", "b"], "feature_dim": D, "min_participants": 3}
)


def _coordinator(fed: ProvisionedFederation, state: Path, **round_settings: Any) -> Coordinator:
    config = load_config(fed.server_dir / "server.toml")
    config = replace(config, state_dir=state, round=replace(config.round, **round_settings))
    key = signatures.load_private_key_pem(config.identity_key.read_bytes())
    return Coordinator(config, Store(state, federation_id=config.federation_id), key)


def _key(fed: ProvisionedFederation, site: str) -> Any:
    return signatures.load_private_key_pem((fed.site_dirs[site] / "identity.key").read_bytes())


def _enrol_all(coordinator: Coordinator, fed: ProvisionedFederation) -> None:
    for site in SITES:
        enrol_in_process(
            coordinator, site, _key(fed, site), labelled_classes=COVERAGE[site], feature_dim=D
        )


def _accept(coordinator: Coordinator, fed: ProvisionedFederation, site: str) -> None:
    view = coordinator.machine.current()
    assert view.row.plan is not None
    digest = blob_sha256(view.row.plan)
    fields = plan_decision_fields(round_id=view.round_id, accept=True, plan_sha256=digest)
    signature = signatures.sign_fields(
        _key(fed, site), context=PLAN_DECISION_CONTEXT, fields=fields
    )
    decision = pb.PlanDecision(
        round_id=view.round_id, accept=True, plan_sha256=digest, signature=signature
    )
    coordinator.decide(site, decision)


def test_per_class_plan_failing_the_audit_is_not_opened(
    federation: ProvisionedFederation, tmp_path: Path
) -> None:
    """[M-23] no plan is published for a failing per-class plan; an override is recorded."""
    refused = _coordinator(federation, tmp_path / "a", gram_scope="per-class")
    _enrol_all(refused, federation)
    view = refused.machine.current()
    assert view.row.stage == Stage.ABORTED and view.row.plan is None
    assert "leakage audit" in view.row.abort_reason
    events = [e[1] for e in refused.store.audit_entries()]
    assert "plan-audit" in events and "plan-published" not in events
    audit = next(e[2] for e in refused.store.audit_entries() if e[1] == "plan-audit")
    assert audit["passed"] is False

    allowed = _coordinator(
        federation,
        tmp_path / "b",
        gram_scope="per-class",
        operator_override=True,
        override_reason="ethics board approval 2024-17",
    )
    _enrol_all(allowed, federation)
    view = allowed.machine.current()
    assert view.row.stage == Stage.PLAN_REVIEW and view.row.plan is not None
    plan = common_pb2.ReleasePlan.FromString(view.row.plan)
    assert plan.operator_override and plan.override_reason == "ethics board approval 2024-17"


def test_uploads_need_an_accepted_plan_and_the_log_holds_digests_only(
    federation: ProvisionedFederation, tmp_path: Path
) -> None:
    """[M-05] no upload before the site accepted the plan; [M-30] the audit record of an upload
    names who, which release, the digest and the size, never a value."""
    coordinator = _coordinator(federation, tmp_path / "c", gram_scope="global")
    _enrol_all(coordinator, federation)
    view = coordinator.machine.current()
    assert view.row.stage == Stage.PLAN_REVIEW
    values = np.linspace(0.125, 3.0, packed_length(D))
    data = values.astype("<f8").tobytes()
    upload = AssembledPayload(
        view.round_id, "gram[all]", pb.PAYLOAD_KIND_STATISTIC, data, hashlib.sha256(data).digest()
    )
    with pytest.raises(WrongStageError, match="accept the release plan"):
        coordinator.upload("p1", upload)
    assert coordinator.store.uploads(view.round_id) == {}
    _accept(coordinator, federation, "p1")
    receipt = coordinator.upload("p1", upload)
    assert receipt.bytes_received == len(data) and not receipt.duplicate
    record = next(e[2] for e in coordinator.store.audit_entries() if e[1] == "upload")
    assert set(record) == {"round_id", "site_id", "release", "sha256", "bytes"}
    assert record["sha256"] == upload.sha256.hex() and record["bytes"] == len(data)
    assert coordinator.store.verify_audit_chain()
