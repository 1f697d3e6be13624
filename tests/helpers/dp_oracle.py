"""An independent analytic-Gaussian accountant for the DP tests (docs/protocol.md §7).

Written from Balle & Wang 2018 (Theorem 8) with the standard library only, so that it shares no
code with :mod:`afl.core.dp.accounting` (opacus or scipy): Gaussian releases (Δ_j, σ_j) of one
data set compose into one Gaussian mechanism with μ² = Σ (Δ_j/σ_j)², which is (ε, δ)-DP for

    δ(ε) = Φ(μ/2 - ε/μ) - e^ε·Φ(-μ/2 - ε/μ),

and ε(δ) is found by bisection (δ(ε) decreases in ε).
"""

from __future__ import annotations

import math
from collections.abc import Iterable


def _phi(x: float) -> float:
    return 0.5 * math.erfc(-x / math.sqrt(2.0))


def _log_phi(x: float) -> float:
    if x > -30:
        return math.log(_phi(x))
    # Asymptotic expansion of log Φ(x) for very negative x (Mills ratio).
    return -x * x / 2 - math.log(-x) - 0.5 * math.log(2 * math.pi) + math.log1p(-1 / (x * x))


def delta(epsilon: float, mu: float) -> float:
    """δ(ε) of μ-GDP (module docstring)."""
    a = mu / 2 - epsilon / mu
    b = -mu / 2 - epsilon / mu
    return _phi(a) - math.exp(epsilon + _log_phi(b))


def composed_mu(releases: Iterable[tuple[float, float]]) -> float:
    """μ of Gaussian releases given as (sensitivity, sigma) pairs."""
    return math.sqrt(sum((s / sig) ** 2 for s, sig in releases))


def epsilon(mu: float, target_delta: float) -> float:
    """The smallest ε with δ(ε) ≤ ``target_delta`` (bisection to 1e-12 relative)."""
    if mu == 0 or delta(0.0, mu) <= target_delta:
        return 0.0
    lo, hi = 0.0, 1.0
    while delta(hi, mu) > target_delta:
        lo, hi = hi, 2 * hi
    for _ in range(200):
        mid = (lo + hi) / 2
        if delta(mid, mu) > target_delta:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-12 * hi:
            break
    return hi
