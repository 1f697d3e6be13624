"""Privacy accounting for Gaussian releases of one dataset (design §8).

A Gaussian release with L2 sensitivity Δ and noise standard deviation σ is μ-GDP with μ = Δ/σ
(Dong, Roth & Su 2019). Releases of the same dataset compose (adaptive or not) into one
μ-GDP mechanism with

    μ² = Σ_j (Δ_j / σ_j)²,   i.e. noise multiplier  z_eff = 1/μ = (Σ_j (Δ_j/σ_j)²)^(-1/2).

μ-GDP is exactly (ε, δ(ε))-DP for every ε with (Balle & Wang 2018, Thm. 8; Dong et al. Cor. 2.13)

    δ(ε) = Φ(-ε/μ + μ/2) - e^ε Φ(-ε/μ - μ/2).

ε(δ) is computed by opacus' exact dual (``opacus.accountants.analysis.gdp.eps_from_mu``, no
subsampling, hence no CLT approximation). opacus' ``GaussianAccountant`` is never used: it is a
loose CLT approximation for subsampled SGD. opacus imports torch, so it is imported lazily; when it
is not installed (server-only installs) the same formula is solved here with scipy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from scipy import optimize
from scipy.stats import norm

Backend = Literal["auto", "opacus", "scipy"]

_OPACUS_MAX_EPS = 500.0  # opacus brackets its root search in [0, 500]


class AccountingError(ValueError):
    """Invalid privacy parameters."""


@dataclass(frozen=True)
class GaussianRelease:
    """One Gaussian mechanism: L2 ``sensitivity`` Δ and noise standard deviation ``sigma`` σ."""

    name: str
    sensitivity: float
    sigma: float

    def __post_init__(self) -> None:
        if not self.sensitivity >= 0:
            raise AccountingError(f"{self.name}: sensitivity must be >= 0, got {self.sensitivity}")
        if not self.sigma >= 0:
            raise AccountingError(f"{self.name}: sigma must be >= 0, got {self.sigma}")


def _check_delta(delta: float) -> None:
    if not 0.0 < delta < 1.0:
        raise AccountingError(f"delta must lie in (0, 1), got {delta}")


def mu_from_releases(releases: Sequence[GaussianRelease]) -> float:
    """Composed GDP parameter μ = sqrt(Σ_j (Δ_j/σ_j)²) (design §8); inf if some σ_j = 0 < Δ_j."""
    total = 0.0
    for r in releases:
        if r.sensitivity == 0:
            continue
        if r.sigma == 0:
            return math.inf
        total += (r.sensitivity / r.sigma) ** 2
    return math.sqrt(total)


def effective_noise_multiplier(releases: Sequence[GaussianRelease]) -> float:
    """z_eff = (Σ_j (Δ_j/σ_j)²)^(-1/2) (design §8); inf for no (or zero-sensitivity) releases."""
    mu = mu_from_releases(releases)
    return math.inf if mu == 0 else 1.0 / mu


def delta_for_epsilon(*, epsilon: float, mu: float) -> float:
    """δ(ε) = Φ(-ε/μ + μ/2) - e^ε Φ(-ε/μ - μ/2) of μ-GDP (Balle & Wang 2018, Thm. 8)."""
    if mu <= 0:
        return 0.0
    if math.isinf(mu):
        return 1.0
    a = -epsilon / mu + mu / 2
    b = -epsilon / mu - mu / 2
    # e^ε Φ(b) evaluated in log space: e^ε overflows long before the product does.
    return max(0.0, float(norm.cdf(a) - math.exp(epsilon + float(norm.logcdf(b)))))


def _eps_scipy(mu: float, delta: float) -> float:
    hi = 1.0
    while delta_for_epsilon(epsilon=hi, mu=mu) > delta:
        hi *= 2.0
    root = optimize.brentq(
        lambda e: delta_for_epsilon(epsilon=e, mu=mu) - delta, 0.0, hi, xtol=1e-12, rtol=1e-12
    )
    return float(root)


def _eps_opacus(mu: float, delta: float) -> float:
    from opacus.accountants.analysis.gdp import eps_from_mu

    return float(eps_from_mu(mu=mu, delta=delta))


def _opacus_available() -> bool:
    try:
        import opacus.accountants.analysis.gdp  # noqa: F401
    except ImportError:
        return False
    return True


def epsilon_from_mu(*, mu: float, delta: float, backend: Backend = "auto") -> float:
    """Smallest ε such that μ-GDP is (ε, δ)-DP (exact dual, design §8).

    ``backend``: ``opacus`` (``eps_from_mu``), ``scipy`` (the same formula solved here) or
    ``auto`` (opacus when importable). Returns 0 when μ = 0 or δ(0) ≤ δ, inf when μ = inf.
    """
    _check_delta(delta)
    if not mu >= 0:
        raise AccountingError(f"mu must be >= 0, got {mu}")
    if math.isinf(mu):
        return math.inf
    if delta_for_epsilon(epsilon=0.0, mu=mu) <= delta:
        return 0.0
    if backend == "auto":
        backend = "opacus" if _opacus_available() else "scipy"
    if backend == "opacus":
        if delta_for_epsilon(epsilon=_OPACUS_MAX_EPS, mu=mu) > delta:
            return _eps_scipy(mu, delta)  # outside opacus' bracket: ε > 500, no privacy anyway
        return _eps_opacus(mu, delta)
    if backend == "scipy":
        return _eps_scipy(mu, delta)
    raise AccountingError(f"unknown backend {backend!r}")


def epsilon_for_releases(
    releases: Sequence[GaussianRelease], *, delta: float, backend: Backend = "auto"
) -> float:
    """ε at δ of the composition of ``releases`` of one dataset (design §8)."""
    return epsilon_from_mu(mu=mu_from_releases(releases), delta=delta, backend=backend)


def calibrate_noise_multiplier(*, epsilon: float, delta: float, rel_tol: float = 1e-10) -> float:
    """Noise multiplier z = σ/Δ (= 1/μ) of one Gaussian release that is exactly (ε, δ)-DP.

    Bisection on μ of δ(ε; μ) = δ, which is increasing in μ (design §8). ε = inf returns 0
    (no noise). For several releases with a common budget, use the result as z_eff.
    """
    _check_delta(delta)
    if math.isnan(epsilon) or epsilon <= 0:
        raise AccountingError(f"epsilon must be > 0, got {epsilon}")
    if math.isinf(epsilon):
        return 0.0
    lo, hi = 0.0, 1.0
    while delta_for_epsilon(epsilon=epsilon, mu=hi) < delta:
        lo, hi = hi, hi * 2.0
    while hi - lo > rel_tol * hi:
        mid = 0.5 * (lo + hi)
        if delta_for_epsilon(epsilon=epsilon, mu=mid) < delta:
            lo = mid
        else:
            hi = mid
    return 1.0 / lo if lo > 0 else math.inf


def calibrate_sigma(*, epsilon: float, delta: float, sensitivity: float) -> float:
    """σ = z·Δ of one Gaussian release that is (ε, δ)-DP at L2 sensitivity ``sensitivity``."""
    if not sensitivity > 0:
        raise AccountingError(f"sensitivity must be > 0, got {sensitivity}")
    return calibrate_noise_multiplier(epsilon=epsilon, delta=delta) * sensitivity
