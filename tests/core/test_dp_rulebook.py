"""The DP rulebook (afl.core.dp_accounting, docs/protocol.md §7): sensitivities' structure, the
noise share, the grid, composition, the calibration of one noise multiplier and the release
groups. Oracles: a direct numerical integration of the Gaussian privacy-loss distribution
(δ(ε) = E[(1 - e^(ε - L))+], not the closed form the code uses), the coverage sets of
:func:`afl.core.aggregation.plan_aggregation`, and arithmetic written out in the tests."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from scipy import integrate
from scipy.stats import norm

from afl.core.aggregation import plan_aggregation
from afl.core.dp_accounting import (
    GRID_INFLATION_MAX,
    MIN_SHARE_STEPS,
    STATISTIC_KINDS,
    AccountingError,
    GaussianRelease,
    StatisticRelease,
    assumed_colluders,
    calibrate_noise_multiplier,
    calibrate_releases,
    epsilon_for_releases,
    grid_frac_bits,
    grid_inflation,
    mu_from_releases,
    noise_multiplier_for_sites,
    noise_share,
    plan_releases,
    release_groups,
    statistic_sensitivity,
)

# ------------------------------------------------------------------ independent ε(μ) oracle


def pld_delta(epsilon: float, mus: list[float]) -> float:
    """δ(ε) of the composition of Gaussian mechanisms with μ_j = Δ_j/σ_j, integrated numerically.

    The privacy loss of one Gaussian mechanism at the worst-case neighbours is L_j ~ N(μ_j²/2,
    μ_j²); independent losses add, so L ~ N(Σμ_j²/2, Σμ_j²), and the tight δ is
    δ(ε) = E[max(0, 1 - e^(ε - L))] (Balle & Wang 2018, Thm. 5 / the privacy-loss definition).
    """
    var = sum(m * m for m in mus)
    mean, sd = var / 2, math.sqrt(var)

    def integrand(x: float) -> float:
        return float((1 - math.exp(epsilon - x)) * norm.pdf(x, loc=mean, scale=sd))

    hi = max(epsilon, mean) + 40 * sd
    value, _ = integrate.quad(integrand, epsilon, hi, epsabs=1e-17, epsrel=1e-12, limit=400)
    return float(value)


def pld_epsilon(mus: list[float], delta: float) -> float:
    lo, hi = 0.0, 1.0
    while pld_delta(hi, mus) > delta:
        hi *= 2
    for _ in range(80):
        mid = (lo + hi) / 2
        if pld_delta(mid, mus) > delta:
            lo = mid
        else:
            hi = mid
    return hi


@pytest.mark.parametrize(
    ("sigmas", "delta"),
    [([1.0], 1e-5), ([2.0, 2.0, 2.0, 2.0], 1e-5), ([3.0, 5.0, 8.0], 1e-6), ([0.7, 10.0], 1e-3)],
)
def test_epsilon_matches_a_numerical_privacy_loss_integral(sigmas, delta) -> None:
    releases = [GaussianRelease(f"r{j}", 1.0, s) for j, s in enumerate(sigmas)]
    oracle = pld_epsilon([1.0 / s for s in sigmas], delta)
    for backend in ("scipy", "opacus"):
        assert epsilon_for_releases(releases, delta=delta, backend=backend) == pytest.approx(
            oracle, rel=1e-6
        )


# ------------------------------------------------------------------ composition


@settings(max_examples=60, deadline=None)
@given(
    k=st.integers(1, 40),
    z=st.floats(0.2, 50.0),
    sensitivity=st.floats(0.01, 100.0),
)
def test_k_identical_releases_compose_like_one_with_z_over_root_k(k, z, sensitivity) -> None:
    many = [GaussianRelease(f"r{j}", sensitivity, z * sensitivity) for j in range(k)]
    one = [GaussianRelease("one", sensitivity, z * sensitivity / math.sqrt(k))]
    assert mu_from_releases(many) == pytest.approx(mu_from_releases(one), rel=1e-12)
    assert mu_from_releases(many) == pytest.approx(math.sqrt(k) / z, rel=1e-12)
    assert epsilon_for_releases(many, delta=1e-5, backend="scipy") == pytest.approx(
        epsilon_for_releases(one, delta=1e-5, backend="scipy"), rel=1e-9
    )


@settings(max_examples=40, deadline=None)
@given(
    releases_per_site=st.lists(st.integers(0, 30), min_size=1, max_size=10).filter(
        lambda xs: max(xs) > 0
    ),
    epsilon=st.floats(0.1, 20.0),
)
def test_one_multiplier_meets_the_worst_site(releases_per_site, epsilon) -> None:
    z = noise_multiplier_for_sites(epsilon=epsilon, delta=1e-5, releases_per_site=releases_per_site)
    z_one = calibrate_noise_multiplier(epsilon=epsilon, delta=1e-5)
    assert z == pytest.approx(z_one * math.sqrt(max(releases_per_site)), rel=1e-12)
    eps = [
        epsilon_for_releases([GaussianRelease("r", 1.0, z)] * r, delta=1e-5, backend="scipy")
        for r in releases_per_site
    ]
    assert max(eps) <= epsilon * (1 + 1e-8)
    assert max(eps) == pytest.approx(epsilon, rel=1e-6)


def test_a_plan_without_releases_cannot_be_calibrated() -> None:
    with pytest.raises(AccountingError, match="nothing"):
        noise_multiplier_for_sites(epsilon=1.0, delta=1e-5, releases_per_site=[0, 0])


# ------------------------------------------------------------------ sensitivities


def test_sensitivity_formulas() -> None:
    # m·L², m·√C_r·L, m·√C_r·L, m·√(2C_r), written out.
    expected = {"gram": 2 * 9.0, "s_pos": 2 * math.sqrt(8) * 3.0, "t_sum": 2 * math.sqrt(8) * 3.0}
    for kind in STATISTIC_KINDS:
        sens = statistic_sensitivity(kind, clip_norm=3.0, n_classes=8, rows_per_individual=2)
        assert sens == pytest.approx(expected.get(kind, 2 * 4.0))
    assert statistic_sensitivity("gram", clip_norm=3.0) == 9.0  # no classes needed
    for clip, classes, m in ((0.0, 1, 1), (1.0, 0, 1), (1.0, 1, 0), (math.inf, 1, 1)):
        with pytest.raises(AccountingError):
            statistic_sensitivity("s_pos", clip_norm=clip, n_classes=classes, rows_per_individual=m)


# ------------------------------------------------------------------ noise share


@settings(max_examples=80, deadline=None)
@given(
    n=st.integers(1, 50),
    data=st.data(),
    sigma=st.floats(1e-3, 1e6),
)
def test_any_n_minus_t_honest_shares_carry_sigma(n, data, sigma) -> None:
    t = data.draw(st.integers(0, n - 1))
    share = noise_share(sigma, members=n, colluders=t)
    assert share * math.sqrt(n - t) == pytest.approx(sigma, rel=1e-12)
    # Every set of at least n - t honest members (independent shares) has variance >= σ².
    for honest in range(n - t, n + 1):
        assert honest * share**2 >= sigma**2 * (1 - 1e-12)
    if t > 0:  # the bound is tight: one honest member fewer falls short
        assert (n - t - 1) * share**2 < sigma**2


def test_noise_share_is_validated_and_sums_empirically() -> None:
    for n, t in ((3, 3), (3, -1), (0, 0)):
        with pytest.raises(AccountingError):
            noise_share(1.0, members=n, colluders=t)
    assert noise_share(2.0, members=1, colluders=0) == 2.0
    share = noise_share(2.0, members=8, colluders=2)
    rng = np.random.default_rng(0)
    total = rng.normal(scale=share, size=(200_000, 6)).sum(axis=1)  # 6 honest shares
    assert total.var() == pytest.approx(4.0, rel=0.02)


def test_assumed_colluders() -> None:
    assert assumed_colluders(members=5, tolerated=2, local=False) == 2
    assert assumed_colluders(members=2, tolerated=7, local=False) == 1
    assert assumed_colluders(members=5, tolerated=0, local=True) == 4
    assert assumed_colluders(members=1, tolerated=0, local=True) == 0


# ------------------------------------------------------------------ grid


@settings(max_examples=80, deadline=None)
@given(
    sensitivity=st.floats(1e-3, 1e4),
    coordinates=st.integers(0, 10**7),
    share=st.floats(1e-6, 1e6),
)
def test_grid_is_the_coarsest_meeting_both_conditions(sensitivity, coordinates, share) -> None:
    f = grid_frac_bits(sensitivity=sensitivity, coordinates=coordinates, share_sigma=share)

    def ok(bits: int) -> bool:
        inflation = grid_inflation(coordinates=coordinates, frac_bits=bits)
        fine = inflation <= GRID_INFLATION_MAX * sensitivity
        return bool(fine and share * 2.0**bits >= MIN_SHARE_STEPS)

    assert f >= 0 and ok(f)
    assert f == 0 or not ok(f - 1)


def test_grid_inflation() -> None:
    assert grid_inflation(coordinates=16, frac_bits=3) == pytest.approx(4 / 8)
    assert grid_inflation(coordinates=0, frac_bits=0) == 0.0


# ------------------------------------------------------------------ release groups


@settings(max_examples=60, deadline=None)
@given(active=hnp.arrays(np.bool_, st.tuples(st.integers(1, 6), st.integers(1, 6))))
def test_release_groups_are_the_coverage_sets(active) -> None:
    sites = [f"s{k}" for k in range(active.shape[0])]
    classes = [f"c{c}" for c in range(active.shape[1])]
    coverage = {
        s: [c for c, on in zip(classes, row, strict=True) if on]
        for s, row in zip(sites, active, strict=True)
    }
    plan = plan_aggregation(active, gram_scope="per-class")
    groups = release_groups(
        classes=classes, participants=sites, coverage=coverage, gram_scope="per-class"
    )
    # Oracle: the distinct non-empty coverage sets of the non-DP plan, in first-use order.
    assert [frozenset(g.members) for g in groups] == [
        frozenset(sites[k] for k in cover) for cover in plan.gram_releases
    ]
    for g, cover in zip(groups, plan.gram_releases, strict=True):
        assert list(g.classes) == [
            classes[c] for c in range(len(classes)) if plan.class_cover[c] == cover
        ]
    (whole,) = release_groups(
        classes=classes, participants=sites, coverage=coverage, gram_scope="global"
    )
    assert whole.members == tuple(sorted(sites)) and whole.classes == tuple(classes)
    releases = plan_releases(groups, d=3)
    assert [r.kind for r in releases] == list(STATISTIC_KINDS) * len(groups)
    assert len({r.name for r in releases}) == len(releases)


def test_plan_releases_shapes() -> None:
    (group,) = release_groups(
        classes=["a", "b", "c"], participants=["y", "x"], coverage={}, gram_scope="global"
    )
    shapes = {r.kind: r.shape for r in plan_releases([group], d=5)}
    assert shapes == {"gram": (5, 5), "s_pos": (5, 3), "t_sum": (5, 3), "counts": (2, 3)}
    with pytest.raises(AccountingError):
        release_groups(classes=["a"], participants=["x"], coverage={}, gram_scope="local")


# ------------------------------------------------------------------ calibration


@settings(max_examples=25, deadline=None)
@given(
    active=hnp.arrays(np.bool_, (5, 4)),
    scope=st.sampled_from(["global", "per-class"]),
    epsilon=st.floats(0.2, 30.0),
    clip=st.floats(0.1, 20.0),
    m=st.integers(1, 3),
    tolerated=st.integers(0, 5),
    local=st.booleans(),
)
def test_calibration_of_a_plan(active, scope, epsilon, clip, m, tolerated, local) -> None:
    sites = [f"s{k}" for k in range(5)]
    classes = [f"c{c}" for c in range(4)]
    coverage = {
        s: [c for c, on in zip(classes, row, strict=True) if on]
        for s, row in zip(sites, active, strict=True)
    }
    groups = release_groups(
        classes=classes, participants=sites, coverage=coverage, gram_scope=scope
    )
    releases = plan_releases(groups, d=7)
    if not releases:
        return
    cal = calibrate_releases(
        releases, epsilon=epsilon, delta=1e-6, clip_norm=clip, rows_per_individual=m,
        tolerated=tolerated, local=local, participants=sites,
    )  # fmt: skip
    z = cal.noise_multiplier
    per_site = {s: sum(1 for r in releases if s in r.members) for s in sites}
    assert z == pytest.approx(
        calibrate_noise_multiplier(epsilon=epsilon, delta=1e-6) * math.sqrt(max(per_site.values()))
    )
    for r in releases:
        noise = cal.noise[r.name]
        base = statistic_sensitivity(
            r.kind, clip_norm=clip, n_classes=r.n_classes, rows_per_individual=m
        )
        assert base <= noise.sensitivity <= base * (1 + GRID_INFLATION_MAX)
        assert noise.sigma == pytest.approx(z * noise.sensitivity, rel=1e-12)
        n = len(r.members)
        assert noise.assumed_colluders == (n - 1 if local else min(tolerated, n - 1))
        share = noise_share(noise.sigma, members=n, colluders=noise.assumed_colluders)
        assert share * 2.0**noise.frac_bits >= MIN_SHARE_STEPS
        if r.kind == "counts":
            assert noise.sensitivity == base  # integers: no grid rounding
    for s in sites:
        k = per_site[s]
        if k == 0:
            assert cal.site_epsilon[s] == 0.0
            continue
        # μ_k = √R_k / z whatever the sensitivities (σ_r = z·Δ'_r).
        expected = epsilon_for_releases([GaussianRelease("r", 1.0, z)] * k, delta=1e-6)
        assert cal.site_epsilon[s] == pytest.approx(expected, rel=1e-9)
        assert cal.site_epsilon[s] <= epsilon * (1 + 1e-8)
    assert max(cal.site_epsilon.values()) == pytest.approx(epsilon, rel=1e-6)


def test_calibration_refuses_bad_input() -> None:
    release = StatisticRelease("g", "gram", ("a", "b"), 0, (2, 2))
    for eps in (math.inf, 0.0, math.nan):
        with pytest.raises(AccountingError):
            calibrate_releases([release], epsilon=eps, delta=1e-5, clip_norm=1.0)
    cal = calibrate_releases([release], epsilon=1.0, delta=1e-5, clip_norm=1.0)
    assert set(cal.site_epsilon) == {"a", "b"}
