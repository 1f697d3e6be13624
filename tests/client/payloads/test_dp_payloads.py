"""A site's DP-mode payloads (afl.client.payloads.dp): clipped additive statistics, the noise
share's scale and symmetry, the grid, the site's own ε recomputation (afl.client.policy.dp),
and that a DP round run through the real Coordinator in-process releases a W equal to the pooled
non-DP solve when ε is huge (the noise then is far below the tolerance derived below)."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from numpy.typing import NDArray

from afl.client.modes.base import PlaintextMode
from afl.client.payloads.dp import dp_slot_payloads, dp_statistics, noisy_values
from afl.client.policy.dp import site_epsilon
from afl.core.dp.stats import SufficientStatistics, clip_rows, sufficient_statistics
from afl.crypto.identity import signatures
from afl.crypto.identity.signed_blobs import (
    PLAN_DECISION_CONTEXT,
    blob_sha256,
    plan_decision_fields,
)
from afl.ops.provisioning import provision
from afl.proto.v1 import common_pb2 as cpb
from afl.proto.v1 import coordinator_pb2 as pb
from afl.proto.wire import AssembledPayload
from afl.server.config import load_config
from afl.server.coordinator import Coordinator
from afl.server.plan.dp import DpSettings, apply_dp, calibrate, dp_releases
from afl.server.plan.release import build_plan
from afl.server.rounds import Stage
from afl.server.store import Store
from tests.helpers.enrol import enrol_in_process

D = 5
SITES = ["a", "b", "c"]
CLASSES = ["x", "y"]


def _plan(*, epsilon: float, plaintext: bool = True, scope: str = "global") -> cpb.ReleasePlan:
    releases = dp_releases(
        classes=CLASSES,
        participants=SITES,
        coverage={"a": ["x", "y"], "b": ["x"], "c": ["y"]},
        gram_scope=scope,
        d=D,
    )
    settings = DpSettings(epsilon=epsilon, delta=1e-5, clip_norm=2.0)
    plan = build_plan(
        federation_id="f", round_id="r1", round_number=1, participants=SITES,
        gram_scope="global" if scope == "global" else "per-class", releases=releases,
    )  # fmt: skip
    apply_dp(plan, calibrate(releases, settings, participants=SITES, plaintext=plaintext))
    return plan


def _data(seed: int, n: int = 60) -> tuple[NDArray[np.float64], NDArray[np.int64]]:
    rng = np.random.default_rng(seed)
    feats = rng.normal(size=(n, D)) * 2.0
    labels = (feats[:, :2] + rng.normal(size=(n, 2)) > 1.0).astype(np.int64)  # class signal
    return feats, labels


def test_statistics_are_clipped_and_masked() -> None:
    feats, labels = _data(1)
    labels[:5, 1] = -1
    stats = dp_statistics(feats, labels, labelled=np.array([True, False]), clip_norm=1.5)
    h = clip_rows(feats, clip_norm=1.5)
    assert np.linalg.norm(h, axis=1).max() <= 1.5 + 1e-12
    mask = np.zeros(labels.shape, dtype=bool)
    mask[:, 0] = True
    ref = sufficient_statistics(h, np.where(mask, labels, 0), label_mask=mask)
    np.testing.assert_allclose(stats.gram, ref.gram, rtol=1e-14)
    np.testing.assert_allclose(stats.positive_sum, ref.positive_sum, rtol=1e-14)
    assert stats.label_count.tolist() == [60, 0]


def _release(kind: int, shape: tuple[int, ...], *, sigma: float, f: int) -> cpb.Release:
    return cpb.Release(
        name="r", member_site_ids=["a", "b"], kind=kind,  # type: ignore[arg-type]
        class_names=["x"], shape=list(shape),
        noise=cpb.DpNoise(mechanism=cpb.NOISE_MECHANISM_DISCRETE_GAUSSIAN, sigma=sigma,
                          assumed_colluders=1, frac_bits=f),
    )  # fmt: skip


def test_noise_share_scale_grid_and_symmetry(monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*_: Any, **__: Any) -> None:
        raise AssertionError("numpy's RNG must not be used for DP noise")

    monkeypatch.setattr(np.random, "default_rng", forbidden)
    monkeypatch.setattr(np.random, "normal", forbidden)
    sigma, f, d = 0.5, 10, 300
    gram = np.full((d, d), 1.0 / 3.0)
    noisy = noisy_values(_release(cpb.STATISTIC_KIND_GRAM, (d, d), sigma=sigma, f=f), gram)
    assert np.array_equal(noisy, noisy.T)
    assert np.array_equal(noisy * 2**11, np.rint(noisy * 2**11))  # on the half grid
    noise = noisy - np.rint(gram * 2**f) / 2**f
    off = noise[np.triu_indices(d, 1)]
    share = sigma  # n - t = 1: the full σ
    # Diagonal variance σ², off-diagonal σ²/2 (docs/protocol.md §7); 6 standard errors.
    assert abs(np.diag(noise).var() / share**2 - 1) <= 6 * math.sqrt(2 / d)
    assert abs(off.var() / (share**2 / 2) - 1) <= 6 * math.sqrt(2 / off.size)
    vec = noisy_values(
        _release(cpb.STATISTIC_KIND_POSITIVE_SUM, (20000, 1), sigma=sigma, f=f),
        np.zeros((20000, 1)),
    )
    assert abs(vec.var() / share**2 - 1) <= 6 * math.sqrt(2 / vec.size)
    assert np.array_equal(vec * 2**f, np.rint(vec * 2**f))


def test_values_beyond_the_grid_range_are_refused() -> None:
    from afl.client.payloads.stats import PayloadError

    release = _release(cpb.STATISTIC_KIND_POSITIVE_SUM, (1, 1), sigma=1.0, f=40)
    with pytest.raises(PayloadError, match="exact range"):
        noisy_values(release, np.array([[1e9]]))


@pytest.mark.parametrize("scope", ["global", "per-class"])
def test_site_recomputes_the_servers_epsilon(scope: str) -> None:
    plan = _plan(epsilon=2.0, scope=scope)
    for budget in plan.budgets:
        assert site_epsilon(plan, budget.site_id) == pytest.approx(budget.epsilon, rel=1e-6)
    bare = cpb.ReleasePlan()
    bare.CopyFrom(plan)
    bare.releases[0].noise.sigma = 0.0
    assert site_epsilon(bare, bare.releases[0].member_site_ids[0]) == math.inf


def test_payloads_cover_the_site_releases_only() -> None:
    plan = _plan(epsilon=1.0, scope="per-class")
    feats, labels = _data(2)
    stats = dp_statistics(feats, labels, labelled=np.array([True, False]), clip_norm=2.0)
    out = dp_slot_payloads(
        plan, site_id="b", class_names=CLASSES, stats=stats, encode=PlaintextMode().encode
    )
    mine = [r for r in plan.releases if "b" in r.member_site_ids]
    assert [p.slot for p in out] == [r.name for r in mine] and len(mine) == 4
    sizes = {r.name: 8 * (D * (D + 1) // 2 if r.kind == 1 else math.prod(r.shape)) for r in mine}
    assert all(len(p.payload) == sizes[p.slot] for p in out)


def _pooled(feats: list[NDArray[np.float64]], labels: list[NDArray[np.int64]]) -> Any:
    """Oracle: ridge on the pooled clipped rows with pooled balanced targets, a row positive in
    p > 1 classes weighing 1/√p in the positive sums and counts (label clipping k = 1), written
    out with numpy."""
    h = clip_rows(np.vstack(feats), clip_norm=2.0)
    y = np.vstack(labels)
    mask = y >= 0
    pos = np.where(mask, y, 0).astype(np.float64)
    weight = 1.0 / np.sqrt(np.maximum(pos.sum(axis=1), 1.0))
    st = sufficient_statistics(h, np.where(mask, y, 0), label_mask=mask)
    s_pos, n_pos = h.T @ (pos * weight[:, None]), (pos * weight[:, None]).sum(axis=0)
    t_sum = st.label_sum.T
    b = s_pos / n_pos - (t_sum - s_pos) / (st.label_count - n_pos)
    weighted = SufficientStatistics(st.gram, s_pos.T, n_pos, st.label_sum, st.label_count)
    return np.linalg.solve(h.T @ h + np.eye(D), b), weighted


def test_in_process_dp_round_with_huge_epsilon_equals_the_pooled_solve(tmp_path: Path) -> None:
    fed = provision(
        tmp_path / "f",
        sites=SITES,
        round_settings={"classes": CLASSES, "feature_dim": D, "min_participants": 3},
    )
    config = load_config(fed.server_dir / "server.toml")
    dp = DpSettings(epsilon=1e6, delta=1e-5, clip_norm=2.0)
    config = replace(config, state_dir=tmp_path / "s", round=replace(config.round, dp=dp))
    key = signatures.load_private_key_pem(config.identity_key.read_bytes())
    coordinator = Coordinator(
        config, Store(tmp_path / "s", federation_id=config.federation_id), key
    )
    data = {s: _data(10 + i, n=80 + 10 * i) for i, s in enumerate(SITES)}
    keys = {
        s: signatures.load_private_key_pem((fed.site_dirs[s] / "identity.key").read_bytes())
        for s in SITES
    }
    for s in SITES:
        enrol_in_process(coordinator, s, keys[s], labelled_classes=CLASSES, feature_dim=D)
    view = coordinator.machine.current()
    assert view.row.plan is not None
    plan = cpb.ReleasePlan.FromString(view.row.plan)
    digest = blob_sha256(view.row.plan)
    for s in SITES:
        fields = plan_decision_fields(round_id=view.round_id, accept=True, plan_sha256=digest)
        signed = signatures.sign_fields(keys[s], context=PLAN_DECISION_CONTEXT, fields=fields)
        coordinator.decide(s, pb.PlanDecision(round_id=view.round_id, accept=True,
                                              plan_sha256=digest, signature=signed))  # fmt: skip
    assert plan.dp.max_positive_labels == 1
    for s in SITES:
        feats, labels = data[s]
        stats = dp_statistics(
            feats, labels, labelled=np.array([True, True]), clip_norm=2.0, max_positive_labels=1
        )
        for p in dp_slot_payloads(plan, site_id=s, class_names=CLASSES, stats=stats,
                                  encode=PlaintextMode().encode):  # fmt: skip
            coordinator.upload(
                s,
                AssembledPayload(
                    round_id=view.round_id,
                    release_name=p.slot,
                    kind=pb.PAYLOAD_KIND_STATISTIC,
                    data=p.payload,
                    sha256=bytes.fromhex(p.sha256),
                ),
            )
    view = coordinator.machine.current()
    assert view.row.stage == Stage.PUBLISHED, view.row.abort_reason
    model = pb.Model.FromString(coordinator.model("a").model)
    w = np.frombuffer(model.weights.data, dtype="<f8").reshape(D, 2)
    w_ref, st = _pooled([data[s][0] for s in SITES], [data[s][1] for s in SITES])
    # Derived tolerance (first order): ‖Δw‖ <= ‖A⁻¹‖·(‖E_G‖·‖w‖ + ‖Δb‖), with the K summed
    # shares of std <= σ each (plaintext: every site adds the full σ), ‖E_G‖ <= e_g =
    # 6σ_G·2√(dK), ‖A⁻¹‖ <= 1/(λ_min(G + I) - e_g) and, per class,
    # ‖Δb_c‖ <= 6√(dK)·(σ_S + σ_T)·2/n_min + ‖b_c‖·6√K·σ_count·2/n_min (n_min: smallest n+, n-).
    sig = {r.name: r.noise.sigma for r in plan.releases}
    k = len(SITES)
    n_min = float(min(st.positive_count.min(), (st.label_count - st.positive_count).min()))
    b_norm = float(np.linalg.norm((st.gram + np.eye(D)) @ w_ref, axis=0).max())
    e_g = 6 * sig["gram[all]"] * 2 * math.sqrt(D * k)
    inv_norm = 1.0 / (float(np.linalg.eigvalsh(st.gram).min()) + 1.0 - e_g)
    db = 6 * math.sqrt(D * k) * (sig["s_pos"] + sig["t_sum"]) * 2 / n_min
    db += b_norm * 6 * math.sqrt(k) * sig["counts"] * 2 / n_min
    bound = inv_norm * (e_g * float(np.linalg.norm(w_ref, 2)) + math.sqrt(2) * db)
    err = float(np.linalg.norm(w - w_ref))
    assert 0 < err <= bound, (err, bound)
    assert bound <= 0.05 * float(np.linalg.norm(w_ref))  # the test is not vacuous
