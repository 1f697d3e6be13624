"""DP mode on the server (docs/protocol.md §6, §7): the DP release plan, its leakage audit, noise
calibration and per-site budgets, the refusal of a failing per-class plan unless DP covers it,
and the server-side normalisation/solve. Oracles: a hand-derived exposure list checked against an
independent numpy rank test, :mod:`afl.core.dp.accounting` compositions computed from scratch,
and sklearn's Ridge on pooled balanced targets."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from numpy.typing import NDArray
from sklearn.linear_model import Ridge

from afl.client.config import LocalPolicy
from afl.client.policy.dp import DpContext
from afl.client.policy.plan import check_plan
from afl.core.dp.accounting import GaussianRelease, epsilon_for_releases
from afl.crypto.identity import signatures
from afl.ops.provisioning import ProvisionedFederation
from afl.proto.v1 import common_pb2
from afl.server.config import load_config
from afl.server.coordinator import Coordinator
from afl.server.errors import ConfigError
from afl.server.plan.dp import (
    DpSettings,
    audit_dp_plan,
    calibrate,
    dp_releases,
    dp_settings_from_table,
)
from afl.server.plan.release import audit_plan, round1_releases
from afl.server.rounds import Stage
from afl.server.solve.dp import solve_dp_round
from afl.server.store import Store
from tests.helpers.enrol import enrol_in_process
from tests.helpers.federation import FederationSpec

ALL = ("plaintext", "mask", "ckks")  # the sites here opt in to plaintext

K = 8
SITES = [f"s{i + 1}" for i in range(K)]
CLASSES = [f"c{j}" for j in range(K)]
# FedMLP-style Missing 1 (each site labels 7 of 8 classes). The class each site misses:
# s1..s5 miss c0..c4 (one site each), s6, s7, s8 all miss c5; c6, c7 are labelled by everyone.
MISSING_1 = {s: [c for c in CLASSES if c != CLASSES[min(i, 5)]] for i, s in enumerate(SITES)}
# Hand derivation: gram[all] - gram(all \ {s_i}) = G_{s_i} for i = 1..5; s6+s7+s8 is only
# determined as a group of 3 (= min cohort): exactly s1..s5 are exposed.
MISSING_1_EXPOSED = {"s1", "s2", "s3", "s4", "s5"}
MISSING_7 = {s: [CLASSES[i]] for i, s in enumerate(SITES)}  # site i labels class i only
D = 6


def _rank_exposed(releases: list[Any], sites: list[str]) -> set[str]:
    """Independent oracle: site k is exposed iff appending e_k to the Gram incidence matrix
    does not raise its rank (e_k in the row space)."""
    rows = np.array(
        [[1.0 if s in r.members else 0.0 for s in sites] for r in releases if r.name[:4] == "gram"]
    )
    rank = np.linalg.matrix_rank(rows)
    out = set()
    for k, s in enumerate(sites):
        e = np.zeros((1, len(sites)))
        e[0, k] = 1.0
        if np.linalg.matrix_rank(np.vstack([rows, e])) == rank:
            out.add(s)
    return out


def test_missing_1_per_class_plan_exposes_exactly_the_row_space_sites() -> None:
    plain = round1_releases(classes=CLASSES, participants=SITES, coverage=MISSING_1,
                            gram_scope="per-class", d=D, need_global_gram=False)  # fmt: skip
    dp = dp_releases(
        classes=CLASSES, participants=SITES, coverage=MISSING_1, gram_scope="per-class", d=D
    )
    for releases, report in ((plain, audit_plan(plain, SITES)), (dp, audit_dp_plan(dp, SITES))):
        exposed = {s for e in report.exposed_sites if e.quantity == "gram" for s in e.sites}
        assert exposed == MISSING_1_EXPOSED == _rank_exposed(list(releases), SITES)
        assert not report.passed


@pytest.mark.parametrize("coverage", [MISSING_1, MISSING_7])
def test_global_plans_expose_nobody(coverage: dict[str, list[str]]) -> None:
    releases = dp_releases(
        classes=CLASSES, participants=SITES, coverage=coverage, gram_scope="global", d=D
    )
    report = audit_dp_plan(releases, SITES)
    assert report.passed and not report.exposed_sites and _rank_exposed(releases, SITES) == set()
    assert [r.name for r in releases] == ["gram[all]", "s_pos", "t_sum", "counts"]


@pytest.mark.parametrize("plaintext", [True, False])
@pytest.mark.parametrize("scope", ["global", "per-class"])
def test_calibration_meets_the_target_for_every_site(plaintext: bool, scope: str) -> None:
    settings = DpSettings(epsilon=1.5, delta=1e-6, clip_norm=2.0, tolerated=1)
    releases = dp_releases(
        classes=CLASSES, participants=SITES, coverage=MISSING_1, gram_scope=scope, d=D
    )
    cal = calibrate(releases, settings, participants=SITES, plaintext=plaintext)
    for site in SITES:
        mine = [
            GaussianRelease(r.name, cal.noise[r.name].sensitivity, cal.noise[r.name].sigma)
            for r in releases
            if site in r.members
        ]
        oracle = epsilon_for_releases(mine, delta=1e-6, backend="scipy")
        assert cal.site_epsilon[site] == pytest.approx(oracle, rel=1e-6)
        assert cal.site_epsilon[site] <= 1.5 + 1e-6
    assert max(cal.site_epsilon.values()) == pytest.approx(1.5, rel=1e-6)
    for r in releases:
        noise = cal.noise[r.name]
        n = len(r.members)
        assert noise.assumed_colluders == (n - 1 if plaintext else min(1, n - 1))
        # Written out for L = 2, one image per patient, label clipping k = 1 (C_r classes):
        # gram L², s_pos √min(1, C_r)·L, t_sum √C_r·L, counts √(1 + C_r).
        c_r = len(r.class_names)
        base = {1: 4.0, 4: 2.0, 6: 2.0 * math.sqrt(c_r)}.get(r.kind, math.sqrt(1 + c_r))
        assert base <= noise.sensitivity <= base * (1 + 1e-4)  # grid rounding inflation
        share_steps = noise.sigma / math.sqrt(n - noise.assumed_colluders) * 2**noise.frac_bits
        assert share_steps >= 64


def test_dp_settings_are_validated() -> None:
    assert dp_settings_from_table({"epsilon": 2, "clip_norm": 1.0}).delta == 1e-5
    for bad, word in [
        ({"clip_norm": 1.0}, "epsilon"),
        ({"epsilon": 1.0, "clip_norm": 1.0, "sigma": 3}, "unknown"),
        ({"epsilon": True, "clip_norm": 1.0}, "epsilon"),
        ({"epsilon": 1.0, "clip_norm": -1.0}, "clip_norm"),
        ({"epsilon": 1.0, "clip_norm": 1.0, "delta": 2.0}, "delta"),
        ({"epsilon": 1.0, "clip_norm": 1.0, "tolerated": 1.5}, "tolerated"),
    ]:
        with pytest.raises(ValueError, match=word):
            dp_settings_from_table(bad)


def _pooled_oracle(
    feats: list[NDArray[np.float64]], labels: list[NDArray[np.int64]], gamma: float
) -> NDArray[np.float64]:
    """Ridge on the pooled rows with pooled balanced targets (+1/n+, -1/n-, 0 if unlabelled)."""
    h = np.vstack(feats)
    y = np.vstack(labels)
    targets = np.zeros(y.shape)
    for c in range(y.shape[1]):
        pos, neg = y[:, c] == 1, y[:, c] == 0
        targets[pos, c], targets[neg, c] = 1 / pos.sum(), -1 / neg.sum()
    ridge = Ridge(alpha=gamma, fit_intercept=False, solver="cholesky").fit(h, targets)
    out: NDArray[np.float64] = ridge.coef_.T
    return out


def test_noise_free_dp_solve_equals_pooled_ridge() -> None:
    rng = np.random.default_rng(3)
    sites, classes = ["a", "b", "c"], ["x", "y"]
    feats = [rng.normal(size=(40 + 5 * k, D)) for k in range(3)]
    labels = [(rng.random((f.shape[0], 2)) < 0.4).astype(np.int64) for f in feats]
    labels[2][:, 1] = -1  # site c does not label y (its rows count for x only)
    releases = dp_releases(
        classes=classes, participants=sites, coverage={}, gram_scope="global", d=D
    )
    h_all = np.vstack(feats)
    y_all = np.vstack(labels)
    mask = y_all >= 0
    sums = {
        "gram[all]": h_all.T @ h_all,
        "s_pos": h_all.T @ np.where(mask, y_all, 0),
        "t_sum": h_all.T @ mask,
        "counts": np.stack([np.where(mask, y_all, 0).sum(0), mask.sum(0)]).astype(float),
    }
    w = solve_dp_round(releases, sums, classes=classes, gamma=0.5)
    # Global scope: every row is in the Gram; unlabelled rows get target 0 (docs/protocol.md §6).
    np.testing.assert_allclose(w, _pooled_oracle(feats, labels, 0.5), rtol=1e-8, atol=1e-13)


FEDERATION = FederationSpec(
    sites=SITES, round_settings={"classes": CLASSES, "feature_dim": D, "min_participants": 3}
)


def _coordinator(fed: ProvisionedFederation, state: Path, **round_settings: Any) -> Coordinator:
    config = load_config(fed.server_dir / "server.toml")
    config = replace(config, state_dir=state, round=replace(config.round, **round_settings))
    key = signatures.load_private_key_pem(config.identity_key.read_bytes())
    coordinator = Coordinator(config, Store(state, federation_id=config.federation_id), key)
    for site in SITES:
        site_key = signatures.load_private_key_pem(
            (fed.site_dirs[site] / "identity.key").read_bytes()
        )
        enrol_in_process(
            coordinator, site, site_key, labelled_classes=MISSING_7[site], feature_dim=D
        )
    return coordinator


def test_missing_7_per_class_is_refused_unless_dp_covers_it(
    federation: ProvisionedFederation, tmp_path: Path
) -> None:
    refused = _coordinator(federation, tmp_path / "a", gram_scope="per-class")
    view = refused.machine.current()
    assert view.row.stage == Stage.ABORTED and "leakage audit" in view.row.abort_reason

    dp = DpSettings(epsilon=4.0, delta=1e-5, clip_norm=1.0)
    allowed = _coordinator(federation, tmp_path / "b", gram_scope="per-class", dp=dp)
    view = allowed.machine.current()
    assert view.row.stage == Stage.PLAN_REVIEW and view.row.plan is not None
    plan = common_pb2.ReleasePlan.FromString(view.row.plan)
    assert plan.dp.enabled and not plan.operator_override
    assert {b.site_id for b in plan.budgets} == set(SITES)
    assert all(b.epsilon <= 4.0 + 1e-6 and b.delta == 1e-5 for b in plan.budgets)
    assert all(r.noise.mechanism == common_pb2.NOISE_MECHANISM_DISCRETE_GAUSSIAN
               and r.noise.sigma > 0 and len(r.member_site_ids) == 1 for r in plan.releases)  # fmt: skip
    entries: dict[str, Any] = {e[1]: e[2] for e in allowed.store.audit_entries()}
    assert entries["plan-audit"]["passed"] is False and "dp-covers-audit" in entries
    assert entries["dp-budget"]["sites"]["s1"]["epsilon"] == pytest.approx(4.0, rel=1e-6)
    config = allowed.round_config("s1")
    assert config.dp.enabled and config.dp.epsilon == 4.0

    # The sites' own policy (min cohort 3): DP within budget is accepted, beyond it refused.
    assert plan.dp.unit == common_pb2.PRIVACY_UNIT_PATIENT and plan.dp.images_per_patient == 1
    ctx = DpContext(has_patient_ids=True)
    ok = check_plan(
        plan,
        site_id="s1",
        policy=LocalPolicy(min_cohort=3, max_epsilon=4.5, allowed_aggregation=ALL),
        dp_context=ctx,
    )
    assert ok.accept and ok.audit["covered_by_dp"] is True
    tight = check_plan(
        plan,
        site_id="s1",
        policy=LocalPolicy(min_cohort=3, max_epsilon=2.0, allowed_aggregation=ALL),
        dp_context=ctx,
    )
    assert not tight.accept and "min cohort 3" in tight.reason  # DP does not cover it
    global_dp = _coordinator(federation, tmp_path / "c", gram_scope="global", dp=dp)
    gplan = common_pb2.ReleasePlan.FromString(global_dp.machine.current().row.plan or b"")
    tight = check_plan(
        gplan,
        site_id="s1",
        policy=LocalPolicy(min_cohort=3, max_epsilon=2.0, allowed_aggregation=ALL),
        dp_context=ctx,
    )
    assert not tight.accept and "> policy max_epsilon 2" in tight.reason
    no_ids = check_plan(
        gplan,
        site_id="s1",
        policy=LocalPolicy(min_cohort=3, max_epsilon=5.0, allowed_aggregation=ALL),
    )
    assert not no_ids.accept and "no patient ids" in no_ids.reason
    plain = common_pb2.ReleasePlan()
    plain.CopyFrom(plan)
    plain.dp.enabled = False
    refusal = check_plan(
        plain, site_id="s1", policy=LocalPolicy(min_cohort=3, allowed_aggregation=ALL)
    )
    assert not refusal.accept and "min cohort 3" in refusal.reason


def test_dp_table_in_server_toml(federation: ProvisionedFederation, tmp_path: Path) -> None:
    text = (federation.server_dir / "server.toml").read_text()
    path = federation.server_dir / "dp.toml"
    path.write_text(text + "\n[round.dp]\nepsilon = 2.0\nclip_norm = 3.0\ntolerated = 1\n")
    config = load_config(path)
    assert config.round.dp == DpSettings(epsilon=2.0, delta=1e-5, clip_norm=3.0, tolerated=1)
    path.write_text(text + "\n[round.dp]\nepsilon = 2.0\n")
    with pytest.raises(ConfigError, match="clip_norm is required"):
        load_config(path)
    # Two rounds are accounted together; ckks needs N to bound the encrypted statistics.
    dp_table = "\n[round.dp]\nepsilon = 2.0\nclip_norm = 3.0\nunit = 'image'\n"
    path.write_text(text.replace("rounds = 1", "rounds = 2") + dp_table)
    two = load_config(path)
    assert two.round.rounds == 2 and two.round.dp is not None and two.round.dp.unit == "image"
    ckks = text.replace('aggregation = "plaintext"', 'aggregation = "ckks"')
    decryptor = f'\n[sites.dec]\nidentity_public_key = "{"11" * 32}"\nrole = "decryptor"\n'
    path.write_text(ckks + decryptor + dp_table)
    with pytest.raises(ConfigError, match="max_samples"):
        load_config(path)


def test_a_per_class_two_round_plan_adds_the_global_gram() -> None:
    releases = dp_releases(classes=CLASSES, participants=SITES, coverage=MISSING_7,
                           gram_scope="per-class", d=D, need_global_gram=True)  # fmt: skip
    assert releases[0].name == "gram[all]" and releases[0].members == tuple(SITES)
    assert sum(1 for r in releases if r.kind == common_pb2.STATISTIC_KIND_GRAM) == K + 1
    second = dp_releases(classes=CLASSES, participants=SITES, coverage=MISSING_7,
                         gram_scope="per-class", d=D, round_number=2)  # fmt: skip
    assert [r.name for r in second] == ["pseudo_s_pos", "pseudo_t_sum", "pseudo_counts"]
    assert all(r.members == tuple(SITES) and r.class_names == tuple(CLASSES) for r in second)
