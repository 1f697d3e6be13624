"""`afl simulate --dp-epsilon` releases and calibrates exactly as the daemons do: at the same
(ε, δ, L, m, C, coverage) the simulation's σ per statistic and per-site ε equal the server's DP
plan (:mod:`afl.server.plan.dp`, the reference), for global and per-class scope; the noise the
simulation actually draws has those σ; noise-free, its W equals the server's DP solve."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from numpy.typing import NDArray

from afl.core.dp import stats as dp_stats
from afl.lab.simulate.dp import (
    DPConfig,
    calibrate_dp,
    class_names,
    clip_site,
    clip_sites,
    dp_solve,
    projection_matrix,
    site_names,
)
from afl.proto.v1 import common_pb2 as cpb
from afl.server.plan.dp import DpCalibration, DpSettings, calibrate, dp_releases
from afl.server.plan.release import PlannedRelease
from afl.server.solve.dp import solve_dp_round
from tests.lab.synthetic import small_federation

# Missing-style coverage of 5 sites x 4 classes: two distinct coverage sets share classes, site 4
# labels nothing, class 3 is labelled by nobody.
COVERAGES = {
    "overlapping": np.array(
        [
            [1, 1, 0, 0],
            [1, 1, 1, 0],
            [0, 1, 1, 0],
            [1, 0, 1, 0],
            [0, 0, 0, 0],
        ],
        dtype=bool,
    ),
    "full": np.ones((5, 4), dtype=bool),
    "missing-3-of-4": ~np.eye(5, 4, dtype=bool),
}
GRAM, S_POS, T_SUM, COUNTS = (
    cpb.STATISTIC_KIND_GRAM,
    cpb.STATISTIC_KIND_POSITIVE_SUM,
    cpb.STATISTIC_KIND_FEATURE_SUM,
    cpb.STATISTIC_KIND_COUNT,
)
KIND_NAMES: dict[int, str] = {GRAM: "gram", S_POS: "s_pos", T_SUM: "t_sum", COUNTS: "counts"}


def _daemon(
    active: NDArray[np.bool_], *, scope: str, d: int, settings: DpSettings, plaintext: bool
) -> tuple[list[PlannedRelease], DpCalibration]:
    sites, classes = site_names(active.shape[0]), class_names(active.shape[1])
    coverage = {
        s: [c for c, on in zip(classes, row, strict=True) if on]
        for s, row in zip(sites, active, strict=True)
    }
    releases = dp_releases(
        classes=classes, participants=sites, coverage=coverage, gram_scope=scope, d=d
    )
    return releases, calibrate(releases, settings, participants=sites, plaintext=plaintext)


def _key(kind: str, members: tuple[str, ...]) -> tuple[str, frozenset[str]]:
    return kind, frozenset(members)


@pytest.mark.parametrize("coverage", sorted(COVERAGES))
@pytest.mark.parametrize("scope", ["global", "per-class"])
@pytest.mark.parametrize(
    ("epsilon", "delta", "clip", "m"),
    [(1.0, 1e-5, 14.0, 1), (4.0, 1e-6, 2.5, 3), (0.3, 1e-5, 1.0, 2)],
)
def test_simulate_and_the_daemons_give_the_same_noise_and_epsilon(
    coverage: str, scope: Any, epsilon: float, delta: float, clip: float, m: int
) -> None:
    active, d = COVERAGES[coverage], 12
    config = DPConfig(epsilons=(epsilon,), delta=delta, clip_norm=clip, rows_per_individual=m)
    sim_releases, sim = calibrate_dp(active, scope=scope, d=d, epsilon=epsilon, config=config)
    assert sim is not None
    settings = DpSettings(epsilon=epsilon, delta=delta, clip_norm=clip, images_per_patient=m)
    # The simulation is secure aggregation with t = 0: the mask daemons' calibration, exactly.
    releases, daemon = _daemon(active, scope=scope, d=d, settings=settings, plaintext=False)
    sim_sigma = {_key(r.kind, r.members): sim.noise[r.name] for r in sim_releases}
    daemon_sigma = {_key(KIND_NAMES[r.kind], r.members): daemon.noise[r.name] for r in releases}
    assert sim_sigma.keys() == daemon_sigma.keys()
    for key, noise in daemon_sigma.items():
        assert sim_sigma[key].sigma == pytest.approx(noise.sigma, rel=1e-12), key
        assert sim_sigma[key].sensitivity == pytest.approx(noise.sensitivity, rel=1e-12), key
    assert sim.noise_multiplier == pytest.approx(daemon.noise_multiplier, rel=1e-12)
    assert sim.site_epsilon.keys() == daemon.site_epsilon.keys()
    for site, eps in daemon.site_epsilon.items():
        assert sim.site_epsilon[site] == pytest.approx(eps, rel=1e-12)
    assert max(sim.site_epsilon.values()) == pytest.approx(epsilon, rel=1e-6)
    # Plaintext daemons (local DP) differ only by the noise grid's rounding allowance (≤ 1e-4·Δ).
    _, local = _daemon(active, scope=scope, d=d, settings=settings, plaintext=True)
    for r in releases:
        key = _key(KIND_NAMES[r.kind], r.members)
        assert sim_sigma[key].sigma == pytest.approx(local.noise[r.name].sigma, rel=1e-4)
    for site, eps in local.site_epsilon.items():
        assert sim.site_epsilon[site] == pytest.approx(eps, rel=1e-12)


@pytest.mark.parametrize("scope", ["global", "per-class"])
def test_the_simulated_noise_has_the_daemons_sigma(
    scope: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    fed = small_federation(3, sites=5, d=8)
    active = COVERAGES["overlapping"]
    config = DPConfig(epsilons=(2.0,), clip_norm=20.0, rows_per_individual=2)
    drawn: list[tuple[dp_stats.SufficientStatistics, dp_stats.NoiseScales]] = []
    real = dp_stats.add_noise

    def spy(stats: Any, *, scales: Any, rng: Any) -> Any:
        drawn.append((stats, scales))
        return real(stats, scales=scales, rng=rng)

    monkeypatch.setattr(dp_stats, "add_noise", spy)  # simulate_dp calls dp_stats.add_noise
    sites = [
        clip_site(h, y, clip_norm=config.clip_norm)
        for h, y in zip(fed.site_features, fed.site_labels, strict=True)
    ]
    _, info = dp_solve(sites, active, scope=scope, epsilon=2.0, gamma=1.0, config=config)
    settings = DpSettings(epsilon=2.0, delta=config.delta, clip_norm=20.0, images_per_patient=2)
    releases, daemon = _daemon(active, scope=scope, d=8, settings=settings, plaintext=False)
    grams = [r for r in releases if r.kind == GRAM]
    assert len(drawn) == len(grams)  # one noised release group per Gram
    for (stats, scales), gram in zip(drawn, grams, strict=True):
        group = {
            KIND_NAMES[r.kind]: daemon.noise[r.name].sigma
            for r in releases
            if r.members == gram.members
        }
        assert stats.positive_sum.shape[0] == len(
            next(r for r in releases if r.members == gram.members and r.kind == S_POS).class_names
        )
        assert scales.gram == group["gram"]
        assert scales.positive_sum == group["s_pos"]
        assert scales.label_sum == group["t_sum"]
        assert scales.positive_count == scales.label_count == group["counts"]
    assert info["noise_multiplier"] == daemon.noise_multiplier
    assert info["epsilon_achieved_worst_site"] == max(daemon.site_epsilon.values())
    per_site = [sum(1 for r in releases if s in r.members) for s in site_names(5)]
    assert info["releases_worst_site"] == max(per_site)


@pytest.mark.parametrize("scope", ["global", "per-class"])
def test_noise_free_simulation_equals_the_servers_dp_solve(scope: Any) -> None:
    fed = small_federation(4, sites=5, d=8)
    active = COVERAGES["overlapping"]
    config = DPConfig(epsilons=(math.inf,), clip_norm=20.0, pd_method="floor")
    sites = [
        clip_site(h, y, clip_norm=config.clip_norm)
        for h, y in zip(fed.site_features, fed.site_labels, strict=True)
    ]
    w_sim, info = dp_solve(sites, active, scope=scope, epsilon=math.inf, gamma=0.5, config=config)
    assert info["noise_multiplier"] == 0.0 and info["epsilon_achieved_worst_site"] == math.inf
    names, classes = site_names(5), class_names(4)
    coverage = {
        s: [c for c, on in zip(classes, row, strict=True) if on]
        for s, row in zip(names, active, strict=True)
    }
    releases = dp_releases(
        classes=classes, participants=names, coverage=coverage, gram_scope=scope, d=8
    )
    stats = {
        s: dp_stats.sufficient_statistics(
            site.features, y, label_mask=active[k], max_positive_labels=1
        )
        for k, (s, site, y) in enumerate(zip(names, sites, fed.site_labels, strict=True))
    }
    sums: dict[str, NDArray[np.float64]] = {}
    for r in releases:
        total = sum((stats[s] for s in r.members[1:]), stats[r.members[0]])
        cols = [classes.index(c) for c in r.class_names]
        by_kind: dict[int, NDArray[np.float64]] = {
            GRAM: total.gram,
            S_POS: total.positive_sum[cols].T,
            T_SUM: total.label_sum[cols].T,
            COUNTS: np.stack([total.positive_count[cols], total.label_count[cols]]),
        }
        sums[r.name] = by_kind[r.kind]
    w_server = solve_dp_round(releases, sums, classes=classes, gamma=0.5)
    np.testing.assert_allclose(w_sim, w_server, rtol=1e-9, atol=1e-12)


def test_patient_level_sites_keep_m_images_per_patient() -> None:
    fed = small_federation(4, sites=2, d=6)
    n = [len(h) for h in fed.site_features]
    patients = [np.arange(k) // 3 for k in n]  # three images per patient, in row order
    config = DPConfig(epsilons=(1.0,), clip_norm=5.0, unit="patient", rows_per_individual=2)
    sites = clip_sites(fed.site_features, fed.site_labels, patients, config)
    for site, h, y, k in zip(sites, fed.site_features, fed.site_labels, n, strict=True):
        keep = np.flatnonzero(np.arange(k) % 3 < 2)  # oracle: the first two of every three rows
        np.testing.assert_allclose(site.features, clip_rows_oracle(h[keep], 5.0), rtol=1e-12)
        assert np.array_equal(site.labels, y[keep])
        assert site.kept_fraction == pytest.approx(len(keep) / k)
    with pytest.raises(ValueError, match="patient ids"):
        clip_sites(fed.site_features, fed.site_labels, None, config)
    image = DPConfig(epsilons=(1.0,), clip_norm=5.0, unit="image", mechanism="previous")
    assert image.rulebook.max_positive_labels == 0 and not image.rulebook.joint
    assert [
        s.kept_fraction for s in clip_sites(fed.site_features, fed.site_labels, None, image)
    ] == [
        1.0,
        1.0,
    ]


def clip_rows_oracle(h: NDArray[np.floating], clip: float) -> NDArray[np.float64]:
    rows = np.asarray(h, dtype=np.float64)
    norms = np.linalg.norm(rows, axis=1, keepdims=True)
    out: NDArray[np.float64] = rows * np.minimum(1.0, clip / np.maximum(norms, 1e-300))
    return out


def test_a_fixed_projection_solves_in_d_prime_and_maps_w_back() -> None:
    fed = small_federation(4, sites=3, d=8)
    active = np.ones((3, len(fed.classes)), dtype=bool)
    config = DPConfig(epsilons=(math.inf,), clip_norm=50.0, unit="image", projection=3)
    q = projection_matrix(8, 3)
    np.testing.assert_allclose(q.T @ q, np.eye(3), atol=1e-12)  # orthonormal columns
    np.testing.assert_array_equal(q, projection_matrix(8, 3))  # fixed: a public seed
    sites = clip_sites(fed.site_features, fed.site_labels, None, config)
    assert sites[0].features.shape[1] == 3 and sites[0].input_dim == 8
    w, _ = dp_solve(sites, active, scope="global", epsilon=math.inf, gamma=1.0, config=config)
    # Oracle: the solve on the projected rows (numpy), mapped back with Q.
    h = np.vstack([np.asarray(f, dtype=np.float64) @ q for f in fed.site_features])
    y = np.vstack(fed.site_labels).astype(np.float64)
    weight = 1.0 / np.sqrt(np.maximum(y.sum(axis=1, keepdims=True), 1.0))
    s_pos, n_pos = h.T @ (y * weight), (y * weight).sum(axis=0)
    b = s_pos / n_pos - (h.sum(axis=0)[:, None] - s_pos) / (len(h) - n_pos)
    np.testing.assert_allclose(w, q @ np.linalg.solve(h.T @ h + np.eye(3), b), rtol=1e-9)
