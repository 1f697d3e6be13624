"""Tests of Gaussian-mechanism accounting (docs/protocol.md §7) against the analytic Gaussian
mechanism."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import norm

from afl.core.dp.accounting import (
    AccountingError,
    GaussianRelease,
    calibrate_noise_multiplier,
    calibrate_sigma,
    delta_for_epsilon,
    effective_noise_multiplier,
    epsilon_for_releases,
    epsilon_from_mu,
    mu_from_releases,
)
from tests.helpers.probe import run_probe


def balle_wang_delta(eps: float, sigma: float, sensitivity: float) -> float:
    """Balle & Wang 2018, Theorem 8, in their parametrisation (independent oracle)."""
    a = sensitivity / (2 * sigma)
    b = eps * sigma / sensitivity
    return float(norm.cdf(a - b) - math.exp(eps) * norm.cdf(-a - b))


def balle_wang_epsilon(sigma: float, delta: float, sensitivity: float = 1.0) -> float:
    """Smallest ε with δ(ε) ≤ δ, by plain bisection (δ(ε) is decreasing in ε)."""
    lo, hi = 0.0, 1.0
    while balle_wang_delta(hi, sigma, sensitivity) > delta:
        hi *= 2
    for _ in range(200):
        mid = (lo + hi) / 2
        if balle_wang_delta(mid, sigma, sensitivity) > delta:
            lo = mid
        else:
            hi = mid
    return hi


REFERENCE = [(1.0, 4.377), (2.0, 1.993), (5.0, 0.7255)]


@pytest.mark.parametrize("backend", ["opacus", "scipy", "auto"])
@pytest.mark.parametrize(("sigma", "expected"), REFERENCE)
def test_reference_values(backend, sigma, expected) -> None:
    release = GaussianRelease("g", sensitivity=1.0, sigma=sigma)
    eps = epsilon_for_releases([release], delta=1e-5, backend=backend)
    assert eps == pytest.approx(expected, abs=1e-2)
    assert eps == pytest.approx(balle_wang_epsilon(sigma, 1e-5), rel=1e-7)


@settings(max_examples=40, deadline=None)
@given(
    multiplier=st.floats(min_value=0.3, max_value=50.0),
    sensitivity=st.floats(min_value=0.1, max_value=10.0),
    log10_delta=st.floats(min_value=-10.0, max_value=-2.0),
)
def test_matches_analytic_gaussian(multiplier, sensitivity, log10_delta) -> None:
    delta = 10.0**log10_delta
    sigma = multiplier * sensitivity
    release = GaussianRelease("g", sensitivity=sensitivity, sigma=sigma)
    oracle = balle_wang_epsilon(sigma, delta, sensitivity)
    eps = epsilon_for_releases([release], delta=delta, backend="scipy")
    assert eps == pytest.approx(oracle, rel=1e-6, abs=1e-9)


def test_composition_into_one_gaussian() -> None:
    # Two releases with σ = √2 each compose into one with σ = 1; z_eff = (Σ(Δ/σ)²)^(-1/2).
    two = [GaussianRelease("a", 1.0, math.sqrt(2)), GaussianRelease("b", 1.0, math.sqrt(2))]
    assert effective_noise_multiplier(two) == pytest.approx(1.0)
    assert epsilon_for_releases(two, delta=1e-5) == pytest.approx(4.377, abs=1e-3)
    mixed = [GaussianRelease("g", 4.0, 8.0), GaussianRelease("s", 1.0, 3.0)]
    assert mu_from_releases(mixed) == pytest.approx(math.sqrt(0.25 + 1 / 9))
    # Composition can only cost privacy.
    assert epsilon_for_releases(mixed, delta=1e-5) > epsilon_for_releases(mixed[:1], delta=1e-5)


def test_edge_cases() -> None:
    assert epsilon_for_releases([], delta=1e-5) == 0.0
    assert effective_noise_multiplier([]) == math.inf
    assert epsilon_for_releases([GaussianRelease("g", 1.0, 0.0)], delta=1e-5) == math.inf
    assert epsilon_from_mu(mu=1e-7, delta=0.5) == 0.0  # δ(0) ≤ δ already
    # Beyond opacus' ε bracket [0, 500]: still answered, and consistent with the dual.
    eps = epsilon_from_mu(mu=100.0, delta=1e-5, backend="opacus")
    assert eps > 500
    assert delta_for_epsilon(epsilon=eps, mu=100.0) == pytest.approx(1e-5, rel=1e-6)
    with pytest.raises(AccountingError):
        epsilon_from_mu(mu=1.0, delta=0.0)
    with pytest.raises(AccountingError):
        GaussianRelease("g", 1.0, -1.0)
    with pytest.raises(AccountingError):
        calibrate_noise_multiplier(epsilon=-1.0, delta=1e-5)


@pytest.mark.parametrize("epsilon", [0.5, 1.0, 2.0, 4.0, 8.0])
def test_calibration_round_trip(epsilon) -> None:
    z = calibrate_noise_multiplier(epsilon=epsilon, delta=1e-5)
    achieved = epsilon_from_mu(mu=1 / z, delta=1e-5, backend="opacus")
    assert achieved <= epsilon + 1e-9  # conservative side
    assert achieved == pytest.approx(epsilon, rel=1e-6)
    assert calibrate_sigma(epsilon=epsilon, delta=1e-5, sensitivity=3.0) == pytest.approx(3 * z)


@pytest.mark.parametrize(("sigma", "expected"), REFERENCE)
def test_calibration_recovers_reference_sigma(sigma, expected) -> None:
    eps = balle_wang_epsilon(sigma, 1e-5)
    assert calibrate_noise_multiplier(epsilon=eps, delta=1e-5) == pytest.approx(sigma, rel=1e-6)


def test_infinite_epsilon_means_no_noise() -> None:
    assert calibrate_noise_multiplier(epsilon=math.inf, delta=1e-5) == 0.0


def test_the_default_accounting_imports_no_torch() -> None:
    # The daemons account every DP plan with the default backend: it must not import opacus
    # (and with it torch, seconds of CPU in every site and coordinator process).
    probe = (
        "import sys\n"
        "from afl.core.dp.accounting import GaussianRelease, epsilon_for_releases\n"
        "eps = epsilon_for_releases([GaussianRelease('g', 1.0, 1.0)], delta=1e-5)\n"
        "assert abs(eps - 4.377) < 1e-2, eps\n"
        "print(sorted({m.partition('.')[0] for m in sys.modules} & {'opacus', 'torch'}))\n"
    )
    assert run_probe(probe) == "[]"
