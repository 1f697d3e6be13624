"""A submitted run is audited with the federation's released history before it is queued
(docs/protocol.md M-124, at ``afl admin submit``): its first plan, predicted over every member it
names, must not difference with an earlier release to one site's statistics. A refused run is not
stored; its "run-submit-refused" record is, and the Admin service answers FAILED_PRECONDITION
with the one-line reason."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest

from afl.crypto.identity import signatures
from afl.proto.v1 import admin_pb2 as apb
from afl.server import toml_text
from afl.server.admin import AdminRequests
from afl.server.config import load_config
from afl.server.coordinator import Coordinator
from afl.server.errors import RefusedError
from afl.server.plan.dp import DpSettings
from afl.server.servicer import status_for
from afl.server.store import Store
from tests.helpers.federation import FederationSpec
from tests.helpers.inprocess import complete_round, enrol

SIX = [f"site-{i}" for i in range(1, 7)]
FIVE = SIX[:5]
FEDERATION = FederationSpec(
    sites=SIX,
    round_settings={
        "classes": ["a", "b"],
        "feature_dim": 2,
        "min_participants": 3,
        "participants": FIVE,
    },
)


def _published_over_five(federation: Any, state: Path) -> AdminRequests:
    """A coordinator whose run-1 published a model over site-1..site-5."""
    config = replace(load_config(federation.server_dir / "server.toml"), state_dir=state)
    key = signatures.load_private_key_pem((federation.server_dir / "identity.key").read_bytes())
    coordinator = Coordinator(config, Store(state, federation_id=config.federation_id), key)
    for site in FIVE:
        enrol(coordinator, federation, site)
    complete_round(coordinator, federation)
    admin = AdminRequests(coordinator)
    assert admin.get("operator", "run-1").state == "published"
    return admin


def _submit(admin: AdminRequests, sites: list[str], **keys: Any) -> apb.RunInfo:
    text = toml_text.dumps({"round": {"participants": sites, **keys}})
    return admin.submit("operator", apb.SubmitRunRequest(name="next", settings_toml=text))


def _refusals(admin: AdminRequests) -> list[dict[str, Any]]:
    return [
        json.loads(detail)
        for _, _, event, detail, *_ in admin.coordinator.store.audit_records(
            after_seq=0, limit=10_000
        )
        if event == "run-submit-refused"
    ]


def test_a_run_without_a_site_of_a_published_run_is_refused_at_submission(
    federation: Any, tmp_path: Path
) -> None:
    admin = _published_over_five(federation, tmp_path / "state")
    with pytest.raises(RefusedError) as refused:
        _submit(admin, FIVE[:4])
    reason = str(refused.value)
    assert "\n" not in reason
    assert "run 'next' is refused" in reason and "statistics of site-5" in reason
    assert "/gram[all]" in reason and "M-124" in reason
    assert "keep those sites in the run" in reason and "[round.dp]" in reason
    # Nothing is stored as a run; the refusal is recorded with the exposed site and the admin.
    assert [r.run_id for r in admin.coordinator.store.runs()] == ["run-1"]
    [record] = _refusals(admin)
    assert record["exposed"] == ["site-5"] and record["by"] == "operator"
    assert record["members"] == FIVE[:4] and record["name"] == "next"
    # The one place errors become statuses answers FAILED_PRECONDITION with the line.
    assert status_for(refused.value) == (grpc.StatusCode.FAILED_PRECONDITION, reason)

    # The same five sites again: nothing new is determined; the run is queued as run-2.
    assert _submit(admin, FIVE).run_id == "run-2"
    # DP covers the difference: the four-site run is accepted, its plans noised.
    dp = dataclasses.asdict(DpSettings(epsilon=2.0, delta=1e-5, clip_norm=1.0))
    assert _submit(admin, FIVE[:4], dp=dp).run_id == "run-3"
    assert len(_refusals(admin)) == 1


@pytest.mark.parametrize(
    ("sites", "exposed"),
    [
        # site-6 replaces site-5: the two runs determine only G5 - G6, no one site's statistics.
        ([*FIVE[:4], "site-6"], []),
        # site-6 joins the five alone: the difference of the two runs is site-6's.
        (SIX, ["site-6"]),
    ],
)
def test_a_new_site_is_audited_as_the_history_determines(
    federation: Any, tmp_path: Path, sites: list[str], exposed: list[str]
) -> None:
    admin = _published_over_five(federation, tmp_path / "state")
    enrol(admin.coordinator, federation, "site-6")
    if not exposed:
        assert _submit(admin, sites).run_id == "run-2"
        assert _refusals(admin) == []
        return
    with pytest.raises(RefusedError, match="statistics of site-6"):
        _submit(admin, sites)
    assert [r["exposed"] for r in _refusals(admin)] == [exposed]


def test_a_per_class_run_with_undeclared_coverage_is_left_to_plan_time(
    federation: Any, tmp_path: Path
) -> None:
    admin = _published_over_five(federation, tmp_path / "state")
    for site in FIVE[:4]:
        enrol(admin.coordinator, federation, site, labelled=["a", "b"])
    # Over site-1..4 alone the per-class plan differences to site-5: refused.
    with pytest.raises(RefusedError, match="statistics of site-5"):
        _submit(admin, FIVE[:4], gram_scope="per-class")
    # site-6 never enrolled: which classes it labels, hence the plan's coverage sets, are
    # unknown; the submission passes and the plan-time audit decides once it has enrolled.
    assert _submit(admin, [*FIVE[:4], "site-6"], gram_scope="per-class").run_id == "run-2"
    assert len(_refusals(admin)) == 1
