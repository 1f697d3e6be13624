"""The coordinator's evaluation round (docs/protocol.md §6.1, docs/operations.md §6.1), driven in
process: a run with ``evaluate = true`` plans, after its model, score histograms and confusion
counts of exactly that model over the model's contributors, decodes the sums into a signed
evaluation stored beside the state (its SHA-256 in the audit log) that sites and admins retrieve;
an evaluation that the federation's earlier evaluations would expose by differencing is not
opened; DP runs evaluate only with eval_epsilon; the masked and CKKS encodings bound the counts by N."""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from sklearn.metrics import roc_auc_score

from afl.client.daemon.verify import verify_evaluation
from afl.core.evaluation.scorebins import DEFAULT_SCORE_BINS
from afl.core.row_bounds import RowBounds
from afl.crypto.ckks import params as cp
from afl.crypto.identity import signatures
from afl.proto.v1 import admin_pb2 as apb
from afl.proto.v1 import common_pb2 as cpb
from afl.proto.v1 import coordinator_pb2 as pb
from afl.server.admin import AdminRequests
from afl.server.config import MaskSettings, load_config, run_settings, settings_table
from afl.server.coordinator import Coordinator
from afl.server.errors import ConfigError, RefusedError, WrongStageError
from afl.server.modes.ckks import CkksMode
from afl.server.modes.mask import MaskMode
from afl.server.plan.release import RoundView
from afl.server.solve.evaluation import CONFUSION, HISTOGRAMS, evaluation_releases
from afl.server.store import Store
from tests.helpers.federation import FederationSpec
from tests.helpers.inprocess import complete_round, enrol

SITES = ["p1", "p2", "p3"]
CLASSES = ["a", "b"]
FEDERATION = FederationSpec(
    sites=SITES,
    round_settings={
        "classes": CLASSES,
        "feature_dim": 2,
        "min_participants": 2,
        "evaluate": True,
        "eval_calibration": "isotonic",
    },
)
BINS = DEFAULT_SCORE_BINS.num_bins


def _trained(federation: Any, state: Path) -> tuple[Coordinator, AdminRequests, RoundView]:
    """A coordinator whose sites enrolled and completed run-1's round 1; its evaluation round."""
    config = replace(load_config(federation.server_dir / "server.toml"), state_dir=state)
    key = signatures.load_private_key_pem((federation.server_dir / "identity.key").read_bytes())
    coordinator = Coordinator(config, Store(state, federation_id=config.federation_id), key)
    for site in SITES:
        enrol(coordinator, federation, site)
    return coordinator, AdminRequests(coordinator), _train(coordinator, federation)


def _train(coordinator: Coordinator, federation: Any) -> RoundView:
    """Round 1 with every member's statistics zero (W = 0); the evaluation round it opens."""
    complete_round(coordinator, federation)
    return coordinator.find("")


def _evaluate(coordinator: Coordinator, federation: Any, sent: dict[str, Any]) -> None:
    """Every site sends its (histograms, confusion counts) to the open evaluation round."""
    complete_round(
        coordinator,
        federation,
        lambda site, release: sent[site][0 if release.name == HISTOGRAMS else 1].ravel(),
    )


def _counts(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A site's histograms (C, 2, B) and confusion counts (C, 4): a few rows per class."""
    rng = np.random.default_rng(seed)
    hist = np.zeros((len(CLASSES), 2, BINS))
    for c in range(len(CLASSES)):
        for y in (0, 1):
            np.add.at(hist[c, y], rng.integers(600 + 40 * y, 700 + 40 * y, size=25), 1.0)
    confusion = rng.integers(0, 9, size=(len(CLASSES), 4)).astype(float)
    return hist, confusion


def test_the_run_evaluates_its_model_and_publishes_a_signed_evaluation(
    federation: Any, tmp_path: Path
) -> None:
    coordinator, admin, view = _trained(federation, tmp_path / "state")
    model_round, model, _ = coordinator.store.model() or ("", b"", b"")
    assert view.round_id.startswith("e2-") and view.row.parent_round_id == model_round
    assert view.stage == pb.ROUND_STAGE_PLAN_REVIEW and view.row.participants == tuple(SITES)
    assert admin.get("operator", "run-1").state == "active"  # until the evaluation is published
    plan = cpb.ReleasePlan.FromString(view.row.plan or b"")
    assert [(r.name, r.kind) for r in plan.releases] == [
        (HISTOGRAMS, cpb.STATISTIC_KIND_SCORE_HISTOGRAM),
        (CONFUSION, cpb.STATISTIC_KIND_CONFUSION_COUNTS),
    ]
    for release in plan.releases:
        assert list(release.member_site_ids) == SITES and list(release.class_names) == CLASSES
        assert release.evaluation.model_sha256 == hashlib.sha256(model).digest()
        assert tuple(release.evaluation.score_bin_edges) == DEFAULT_SCORE_BINS.edges
        assert release.evaluation.decision_threshold == 0.5
    sent = {s: _counts(k) for k, s in enumerate(SITES)}
    _evaluate(coordinator, federation, sent)
    assert coordinator.find(view.round_id).stage == pb.ROUND_STAGE_PUBLISHED
    # stored beside the state before the stage, anchored in the audit log, served to both
    signed = coordinator.evaluation("p1", view.round_id)
    path = tmp_path / "state" / "evaluations" / f"{view.round_id}.signed-evaluation.pb"
    assert path.read_bytes() == signed.SerializeToString()
    assert admin.evaluation("operator", "run-1") == signed
    info = admin.get("operator", "run-1")
    assert info.state == "published" and info.evaluation_round_id == view.round_id
    assert info.evaluation_sha256 == hashlib.sha256(signed.evaluation).digest()
    assert admin.model("operator", "run-1").model == model  # the run's model is round 1's
    (record,) = [
        d
        for _, event, d, _, _ in coordinator.store.audit_entries()
        if event == "stage" and d["round_id"] == view.round_id
        and d["stage"] == "ROUND_STAGE_PUBLISHED"
    ]  # fmt: skip
    assert record["evaluation_sha256"] == hashlib.sha256(signed.evaluation).hexdigest()
    assert record["evaluated_model_sha256"] == hashlib.sha256(model).hexdigest()
    evaluation = verify_evaluation(
        signed,
        server_key=signatures.load_public_key_raw(coordinator.config.identity_public_key),
        federation_id=coordinator.config.federation_id,
        round_id=view.round_id,
        model_sha256=hashlib.sha256(model).hexdigest(),
    )
    document = json.loads(evaluation.evaluation_json)
    assert json.loads(evaluation.calibration_json)["method"] == "isotonic"
    total_hist = np.sum([h for h, _ in sent.values()], axis=0)
    for c, name in enumerate(CLASSES):
        neg, pos = total_hist[c]
        assert document["per_class"][name]["n_pos"] == pos.sum()
        bins = np.arange(BINS)  # the oracle: scikit-learn on one row per count
        y = np.r_[np.zeros(int(neg.sum())), np.ones(int(pos.sum()))]
        scores = np.r_[np.repeat(bins, neg.astype(int)), np.repeat(bins, pos.astype(int))]
        assert abs(document["per_class"][name]["auc"] - roc_auc_score(y, scores)) <= 1e-12


def test_an_evaluation_the_earlier_ones_would_expose_is_not_opened(
    federation: Any, tmp_path: Path
) -> None:
    coordinator, admin, _ = _trained(federation, tmp_path / "state")
    _evaluate(coordinator, federation, dict.fromkeys(SITES, _counts(7)))
    assert admin.get("operator", "run-1").evaluation_round_id
    # A run over p1, p2 only: its label counts minus run-1's would be p3's, and before that its
    # training sums minus run-1's would be p3's statistics: refused at submission (M-124).
    request = apb.SubmitRunRequest(settings_toml='participants = ["p1", "p2"]')
    with pytest.raises(RefusedError, match="statistics of p3"):
        admin.submit("operator", request)
    assert [r.run_id for r in coordinator.store.runs()] == ["run-1"]
    # run-2 names all three, but p3 now declares another d and is left out of it: its round 1
    # opens over p1, p2 and is refused at its first plan, so neither its training nor its
    # evaluation is ever opened.
    enrol(coordinator, federation, "p3", feature_dim=3)
    assert admin.submit("operator", apb.SubmitRunRequest()).run_id == "run-2"
    coordinator.advance()
    info = admin.get("operator", "run-2")
    assert info.state == "aborted" and not info.model_round_id and not info.evaluation_round_id
    assert "M-124" in info.reason and "p3" in info.reason, info.reason
    (audit,) = [
        d
        for _, event, d, _, _ in coordinator.store.audit_entries()
        if event == "plan-audit-history" and d["round_id"] == info.round_history[-1].round_id
    ]
    exposed: list[dict[str, Any]] = audit["exposed_sites"]  # type: ignore[assignment]
    assert {s for e in exposed for s in e["sites"]} == {"p3"}
    assert coordinator.store.uploads(info.round_history[-1].round_id) == {}
    with pytest.raises(WrongStageError, match="published no evaluation"):
        admin.evaluation("operator", "run-2")


def test_dp_runs_evaluate_only_under_dp_and_the_settings_are_checked(federation: Any) -> None:
    config = load_config(federation.server_dir / "server.toml")
    table = settings_table(config.round)
    dp = {"epsilon": 1.0, "delta": 1e-5, "clip_norm": 1.0}
    with pytest.raises(ConfigError, match=r"evaluate: .*only under DP: set \[round.dp\] eval_eps"):
        run_settings({**table, "dp": dp}, source="t", sites=config.sites)
    assert run_settings({**table, "dp": dp, "evaluate": False}, source="t", sites=config.sites)
    evaluating = run_settings(
        {**table, "dp": {**dp, "eval_epsilon": 1.0}}, source="t", sites=config.sites
    )
    assert evaluating.evaluate and evaluating.dp is not None and evaluating.dp.eval_epsilon == 1.0
    with pytest.raises(ConfigError, match="eval_calibration: must be one of"):
        run_settings({**table, "eval_calibration": "beta"}, source="t", sites=config.sites)
    with pytest.raises(ConfigError, match="eval_max_rows: must be >= 0"):
        run_settings({**table, "eval_max_rows": -1}, source="t", sites=config.sites)


def test_encodings_bound_each_sites_counts_by_n(federation: Any) -> None:
    config = load_config(federation.server_dir / "server.toml")
    releases = evaluation_releases(classes=CLASSES, participants=SITES, model_sha256=b"\x01" * 32)
    declared = {s: RowBounds(2**k * 64, 1.0) for k, s in enumerate(SITES)}  # 64, 128, 256 rows
    keys = {s: e.identity_public_key for s, e in config.sites.items()}
    mask = MaskMode(MaskSettings(gram_bound=1.0, vector_bound=1.0), identities=keys)
    for release in releases:
        encoding = mask.encoding(release, declared=declared)
        assert encoding.fixed_point.bound == 256.0  # the largest member's declared rows
        assert 3 * 256.0 * 2.0**encoding.fixed_point.frac_bits < 2.0**63
    settings = replace(config.round, eval_max_rows=1000, aggregation="mask")
    configured = MaskMode(MaskSettings(max_samples=500), identities=keys, settings=settings)
    assert configured.encoding(releases[0], declared={}).fixed_point.bound == 1000.0
    samples = MaskMode(MaskSettings(max_samples=500), identities=keys)
    assert samples.encoding(releases[0], declared={}).fixed_point.bound == 500.0
    with pytest.raises(
        ValueError, match=r"\['p1', 'p2', 'p3'\] declared none: set \[round\] eval_max_rows"
    ):
        mask.encoding(releases[0], declared={})
    ckks = CkksMode()
    counts = ckks.count_encoding(releases[0], declared=declared)
    assert counts.grid_step == 1.0  # the decryptor returns integer counts
    assert counts.prescale == cp.choose_prescale(bound=256.0, num_summands=3)
    assert 2 * cp.min_grid(prescale=counts.prescale, num_summands=3) <= 1.0
