"""The DP rulebook (afl.core.dp.accounting, docs/protocol.md §7): sensitivities' structure, the
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
from afl.core.dp.accounting import (
    DEFAULT_SPLIT,
    EQUAL_SPLIT,
    GRID_INFLATION_MAX,
    MIN_SHARE_STEPS,
    PSEUDO_KINDS,
    STATISTIC_KINDS,
    AccountingError,
    BudgetSplit,
    GaussianRelease,
    Mechanism,
    StatisticKind,
    StatisticRelease,
    assumed_colluders,
    calibrate_noise_multiplier,
    calibrate_releases,
    compose_mu,
    epsilon_for_releases,
    epsilon_from_mu,
    grid_frac_bits,
    grid_inflation,
    mu_from_releases,
    noise_multiplier_for_sites,
    noise_share,
    plan_releases,
    previous_mechanism,
    protecting_sigma,
    pseudo_releases,
    release_groups,
    site_view_releases,
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
    # m·L², m·√C_r·L, m·√C_r·L, m·√(2C_r), written out (no label clipping).
    expected = {"gram": 2 * 9.0, "s_pos": 2 * math.sqrt(8) * 3.0, "t_sum": 2 * math.sqrt(8) * 3.0}
    for kind in (*STATISTIC_KINDS, *PSEUDO_KINDS):
        sens = statistic_sensitivity(kind, clip_norm=3.0, n_classes=8, rows_per_individual=2)
        assert sens == pytest.approx(expected.get(kind.removeprefix("pseudo_"), 2 * 4.0))
    # Label clipping at k = 1: positive sums m·L, counts m·√(1 + C_r); k >= C_r changes nothing.
    clipped: dict[StatisticKind, float] = {
        "s_pos": 2 * 3.0,
        "t_sum": 2 * math.sqrt(8) * 3.0,
        "counts": 2 * 3.0,
    }
    for kind, value in clipped.items():
        assert statistic_sensitivity(
            kind, clip_norm=3.0, n_classes=8, rows_per_individual=2, max_positive_labels=1
        ) == pytest.approx(value)
    assert statistic_sensitivity(
        "counts", clip_norm=3.0, n_classes=2, max_positive_labels=5
    ) == pytest.approx(2.0)
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


def _coverage_plan(active, scope):
    sites = [f"s{k}" for k in range(active.shape[0])]
    classes = [f"c{c}" for c in range(active.shape[1])]
    coverage = {
        s: [c for c, on in zip(classes, row, strict=True) if on]
        for s, row in zip(sites, active, strict=True)
    }
    groups = release_groups(
        classes=classes, participants=sites, coverage=coverage, gram_scope=scope
    )
    return sites, classes, plan_releases(groups, d=7)


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
def test_the_previous_mechanism_gives_every_release_one_multiplier(
    active, scope, epsilon, clip, m, tolerated, local
) -> None:
    sites, _, releases = _coverage_plan(active, scope)
    if not releases:
        return
    mech = previous_mechanism(clip, rows_per_individual=m)
    cal = calibrate_releases(
        releases, epsilon=epsilon, delta=1e-6, mechanism=mech,
        tolerated=tolerated, local=local, participants=sites,
    )  # fmt: skip
    # Equal split a = 1/4 and per-release Δ̂ = Δ: σ_r = 2z·Δ'_r; the worst site has R_max
    # releases: (2z)² = 4·z*²·R_max/4, i.e. σ_r = z*·√R_max·Δ'_r as before the split.
    per_site = {s: sum(1 for r in releases if s in r.members) for s in sites}
    z_one = calibrate_noise_multiplier(epsilon=epsilon, delta=1e-6) * math.sqrt(
        max(per_site.values())
    )
    for r in releases:
        noise = cal.noise[r.name]
        base = statistic_sensitivity(
            r.kind, clip_norm=clip, n_classes=r.n_classes, rows_per_individual=m
        )
        assert base <= noise.sensitivity <= base * (1 + GRID_INFLATION_MAX)
        assert noise.sigma == pytest.approx(z_one * noise.sensitivity, rel=1e-9)
        n = len(r.members)
        assert noise.assumed_colluders == (n - 1 if local else min(tolerated, n - 1))
        share = noise_share(noise.sigma, members=n, colluders=noise.assumed_colluders)
        assert share * 2.0**noise.frac_bits >= MIN_SHARE_STEPS
        if r.kind == "counts":
            assert noise.sensitivity == base  # integers: no grid rounding
    for s in sites:
        k = per_site[s]
        expected = (
            0.0
            if k == 0
            else epsilon_for_releases([GaussianRelease("r", 1.0, z_one)] * k, delta=1e-6)
        )
        assert cal.site_epsilon[s] == pytest.approx(expected, rel=1e-9, abs=1e-12)
    assert max(cal.site_epsilon.values()) == pytest.approx(epsilon, rel=1e-6)


@settings(max_examples=25, deadline=None)
@given(
    active=hnp.arrays(np.bool_, (5, 4)),
    scope=st.sampled_from(["global", "per-class"]),
    epsilon=st.floats(0.2, 30.0),
    k=st.integers(0, 3),
    split=st.sampled_from([DEFAULT_SPLIT, EQUAL_SPLIT, BudgetSplit(0.1, 0.1, 0.1, 0.7)]),
    joint=st.booleans(),
)
def test_every_mechanism_meets_the_target_and_the_split(
    active, scope, epsilon, k, split, joint
) -> None:
    sites, _, releases = _coverage_plan(active, scope)
    if not releases:
        return
    mech = Mechanism(2.0, rows_per_individual=2, max_positive_labels=k, split=split, joint=joint)
    cal = calibrate_releases(
        releases, epsilon=epsilon, delta=1e-6, mechanism=mech, participants=sites
    )
    z = cal.noise_multiplier
    for s in sites:
        mine = [r for r in releases if s in r.members]
        # Oracle: the composition written out from the plan's (Δ, σ), at the scipy backend.
        oracle = epsilon_for_releases(
            [GaussianRelease(r.name, cal.noise[r.name].sensitivity, cal.noise[r.name].sigma)
             for r in mine],
            delta=1e-6, backend="scipy",
        )  # fmt: skip
        assert cal.site_epsilon[s] == pytest.approx(oracle, rel=1e-6, abs=1e-12)
        assert cal.site_epsilon[s] <= epsilon * (1 + 1e-8)
        for kind in STATISTIC_KINDS:  # joint: each kind costs at most its share a_κ/z² of μ²
            costs = [
                (cal.noise[r.name].sensitivity / cal.noise[r.name].sigma) ** 2
                for r in mine
                if r.kind == kind
            ]
            shares = 1 if joint else len(costs)  # per release: a_κ/z² each
            assert sum(costs) <= shares * split.share(kind) / z**2 * (1 + 1e-9)
    assert max(cal.site_epsilon.values()) == pytest.approx(epsilon, rel=1e-6)


def test_joint_calibration_costs_one_share_across_groups() -> None:
    # s0 labels c0..c2 alone with one other site each (3 groups); c3 is labelled by s1, s2, s3.
    # Per-release calibration sizes every release for s0's 3 groups (z = z*·√3); joint
    # calibration sizes each release for its own members: the c3 group only for s1's 2 groups.
    active = np.array([[1, 1, 1, 0], [1, 0, 0, 1], [0, 1, 0, 1], [0, 0, 1, 1]], dtype=bool)
    _, _, releases = _coverage_plan(active, "per-class")
    joint = Mechanism(1.0, max_positive_labels=0, split=EQUAL_SPLIT, joint=True)
    alone = Mechanism(1.0, max_positive_labels=0, split=EQUAL_SPLIT, joint=False)
    z_one = calibrate_noise_multiplier(epsilon=2.0, delta=1e-5)
    cal_j = calibrate_releases(releases, epsilon=2.0, delta=1e-5, mechanism=joint)
    cal_a = calibrate_releases(releases, epsilon=2.0, delta=1e-5, mechanism=alone)
    assert cal_a.noise_multiplier == pytest.approx(z_one * math.sqrt(3 * 4 / 4))
    assert cal_j.noise_multiplier == pytest.approx(z_one)
    for r in releases:
        ratio = cal_j.noise[r.name].sigma / cal_a.noise[r.name].sigma
        expected = math.sqrt(2 / 3) if "s0" not in r.members else 1.0
        assert ratio == pytest.approx(expected, rel=1e-3), r.name
    for cal in (cal_j, cal_a):
        assert max(cal.site_epsilon.values()) == pytest.approx(2.0, rel=1e-6)


def test_round_two_is_reserved_and_composes() -> None:
    sites = ["a", "b", "c"]
    (group,) = release_groups(
        classes=["x", "y"], participants=sites, coverage={}, gram_scope="global"
    )
    first = plan_releases([group], d=4)
    second = pseudo_releases(sites, classes=["x", "y"], d=4)
    assert [r.kind for r in second] == list(PSEUDO_KINDS)
    mech = Mechanism(1.5, rows_per_individual=2)
    cal1 = calibrate_releases(first, epsilon=3.0, delta=1e-5, mechanism=mech, reserved=second)
    assert max(cal1.site_epsilon.values()) < 3.0  # round 2's share is kept back
    cal2 = calibrate_releases(
        second,
        epsilon=3.0,
        delta=1e-5,
        mechanism=mech,
        noise_multiplier=cal1.noise_multiplier,
        earlier=[(r, cal1.noise[r.name]) for r in first],
    )
    # The run composed: exactly the target (the worst site is every site here).
    both = [
        GaussianRelease(r.name, n.sensitivity, n.sigma)
        for cal, rs in ((cal1, first), (cal2, second))
        for r in rs
        for n in [cal.noise[r.name]]
    ]
    oracle = epsilon_for_releases(both, delta=1e-5, backend="scipy")
    for s in sites:
        assert cal2.site_epsilon[s] == pytest.approx(oracle, rel=1e-6)
    assert oracle == pytest.approx(3.0, rel=1e-6)


def test_the_adversary_that_sees_the_upload() -> None:
    # Plaintext (local): only the site's own share σ/√(n - t) protects it; with t = 0 among 4
    # members that is σ/2, i.e. μ doubles. Mask/ckks: the n - t honest shares give σ back.
    share = noise_share(2.0, members=4, colluders=0)
    assert protecting_sigma(share, members=4, colluders=0, local=True) == pytest.approx(1.0)
    assert protecting_sigma(share, members=4, colluders=0, local=False) == pytest.approx(2.0)
    stated = [("g", 1.0, 2.0, 4, 0), ("s", 3.0, 6.0, 4, 0)]
    plain = mu_from_releases(site_view_releases(stated, local=True))
    masked = mu_from_releases(site_view_releases(stated, local=False))
    assert plain == pytest.approx(2 * masked) and masked == pytest.approx(math.sqrt(0.5))
    honest = [("g", 1.0, 2.0, 4, 3)]  # t = n - 1: the honest local-DP plan
    assert mu_from_releases(site_view_releases(honest, local=True)) == pytest.approx(0.5)
    with pytest.raises(AccountingError):
        protecting_sigma(1.0, members=2, colluders=2, local=False)


def test_compose_mu_is_gdp_composition() -> None:
    assert compose_mu([0.3, 0.4]) == pytest.approx(0.5)
    assert compose_mu([]) == 0.0 and compose_mu([1.0, math.inf]) == math.inf
    # μ-GDP composition agrees with composing the Gaussian releases themselves.
    releases = [GaussianRelease("a", 1.0, 2.0), GaussianRelease("b", 2.0, 1.0)]
    mu = compose_mu([0.5, 2.0])
    assert epsilon_from_mu(mu=mu, delta=1e-5) == pytest.approx(
        epsilon_for_releases(releases, delta=1e-5), rel=1e-12
    )
    with pytest.raises(AccountingError):
        compose_mu([-1.0])


def test_calibration_refuses_bad_input() -> None:
    release = StatisticRelease("g", "gram", ("a", "b"), 0, (2, 2))
    mech = Mechanism(1.0)
    for eps in (math.inf, 0.0, math.nan):
        with pytest.raises(AccountingError):
            calibrate_releases([release], epsilon=eps, delta=1e-5, mechanism=mech)
    cal = calibrate_releases([release], epsilon=1.0, delta=1e-5, mechanism=mech)
    assert set(cal.site_epsilon) == {"a", "b"}
    with pytest.raises(AccountingError):
        BudgetSplit(0.5, 0.5, 0.5, 0.5)
