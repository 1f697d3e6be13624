"""Differentially private rows of `afl simulate` (design §8; issue 6), float simulation.

Each site clips its feature rows to L and releases additive statistics (G, per-class positive
sums and counts, per-class label sums and counts; ``afl.core.dp_stats``). Noise is added once per
*release* with the total σ (equal in distribution to distributed shares N(0, σ²/n) from n honest
contributors under secure aggregation, t = 0). The server normalises the noisy sums into pooled
balanced targets and floors the eigenvalues of Ĝ + γI (post-processing), then solves.

Accounting (``afl.core.dp_accounting``): a site's data enters one Gram release per coverage set it
belongs to (1 under ``global``; several under ``per-class``) and the four label statistics once.
All are Gaussian mechanisms on the same data, so they compose into μ-GDP with
``μ² = Σ_j (Δ_j/σ_j)²``. We use one noise multiplier z for every statistic (σ_j = z·Δ_j), so a site
in g Gram releases has ``μ = √(g + 4)/z``; z is calibrated so that the worst site meets the target
(ε, δ). ε = ∞ keeps clipping and pooled normalisation but adds no noise: it isolates their cost.

Noise here comes from a seeded ``numpy.random.Generator``: this is a simulation, not a release.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
from numpy.typing import NDArray
from scipy.linalg import cho_factor, cho_solve

from afl.core import dp_stats
from afl.core.aggregation import GramScope, plan_aggregation
from afl.core.dp_accounting import calibrate_noise_multiplier, epsilon_from_mu

PDMethod = Literal["shift", "floor"]
DEFAULT_CLIP = (
    14.0  # ≈ 99th percentile of the surrogate's row norms (public constant, not data-fit)
)
N_LABEL_STATISTICS = 4


@dataclass(frozen=True)
class DPConfig:
    epsilons: tuple[float, ...]
    delta: float = 1e-5
    clip_norm: float = DEFAULT_CLIP
    rows_per_individual: int = 1
    seed: int = 0
    pd_method: PDMethod = "shift"

    def __post_init__(self) -> None:
        if not self.epsilons or any(not e > 0 for e in self.epsilons):
            raise ValueError(f"ε values must be > 0 (inf allowed), got {self.epsilons}")
        if not 0 < self.delta < 1:
            raise ValueError(f"δ must lie in (0, 1), got {self.delta}")


@dataclass(frozen=True)
class ClippedSite:
    gram: NDArray[np.float64]
    features: NDArray[np.float64]
    clipped_fraction: float


def clip_site(features: NDArray[np.floating], *, clip_norm: float) -> ClippedSite:
    h = np.asarray(features, dtype=np.float64)
    clipped = dp_stats.clip_rows(h, clip_norm=clip_norm)
    frac = float(np.mean(np.linalg.norm(h, axis=1) > clip_norm)) if len(h) else 0.0
    return ClippedSite(clipped.T @ clipped, clipped, frac)


def positive_definite(
    gram: NDArray[np.float64], *, gamma: float, sigma_gram: float, method: PDMethod
) -> NDArray[np.float64]:
    """Ĝ + γI made positive definite by post-processing (design §8).

    ``shift``: add σ_G·√(2d)·I, about the spectral norm of the symmetrised noise, so noise
    eigenvalues can no longer dominate (acts as extra ridge); eigenvalues are then floored at γ in
    the rare case the shift was not enough. ``floor``: eigenvalues of Ĝ + γI floored at γ.
    """
    d = gram.shape[0]
    shift = sigma_gram * math.sqrt(2 * d) if method == "shift" else 0.0
    return dp_stats.regularised_gram(gram + shift * np.eye(d), gamma=gamma)


def noise_multiplier_for(*, epsilon: float, delta: float, gram_releases_per_site: int) -> float:
    """z such that a site in g Gram releases plus the 4 label statistics meets (ε, δ)."""
    if math.isinf(epsilon):
        return 0.0
    z_single = calibrate_noise_multiplier(epsilon=epsilon, delta=delta)
    return z_single * math.sqrt(gram_releases_per_site + N_LABEL_STATISTICS)


def _release(
    stats: dp_stats.SufficientStatistics,
    *,
    z: float,
    config: DPConfig,
    num_classes: int,
    rng: np.random.Generator,
) -> dp_stats.SufficientStatistics:
    if z == 0.0:
        return stats
    scales = dp_stats.NoiseScales.for_noise_multiplier(
        noise_multiplier=z,
        clip_norm=config.clip_norm,
        n_classes=num_classes,
        rows_per_individual=config.rows_per_individual,
    )
    return dp_stats.add_noise(stats, scales=scales, rng=rng)


def dp_solve(
    sites: Sequence[ClippedSite],
    site_labels: Sequence[NDArray[np.int8]],
    active: NDArray[np.bool_],
    *,
    scope: GramScope,
    epsilon: float,
    gamma: float,
    config: DPConfig,
) -> tuple[NDArray[np.float64], dict[str, float]]:
    """W under DP for one assignment; returns W and the accounting actually achieved."""
    num_classes = active.shape[1]
    plan = plan_aggregation(active, gram_scope=scope)
    per_site = [sum(1 for cover in plan.gram_releases if k in cover) for k in range(len(sites))]
    worst = max(per_site)
    z = noise_multiplier_for(epsilon=epsilon, delta=config.delta, gram_releases_per_site=worst)
    rng = np.random.default_rng(config.seed)
    label_stats = [
        dp_stats.sufficient_statistics(s.features, y, label_mask=active[k])
        for k, (s, y) in enumerate(zip(sites, site_labels, strict=True))
    ]
    gram_sensitivity = config.rows_per_individual * config.clip_norm**2
    weights = np.zeros((sites[0].gram.shape[0], num_classes))
    for cover in plan.gram_releases:
        members = sorted(cover)
        classes = [c for c, g in enumerate(plan.gram_cover) if g == cover]
        summed = label_stats[members[0]]
        for k in members[1:]:
            summed = summed + label_stats[k]
        summed = dp_stats.SufficientStatistics(
            gram=np.sum([sites[k].gram for k in members], axis=0),
            positive_sum=summed.positive_sum,
            positive_count=summed.positive_count,
            label_sum=summed.label_sum,
            label_count=summed.label_count,
        )
        noisy = _release(summed, z=z, config=config, num_classes=num_classes, rng=rng)
        a = positive_definite(
            noisy.gram, gamma=gamma, sigma_gram=z * gram_sensitivity, method=config.pd_method
        )
        b = dp_stats.balanced_targets(noisy)
        weights[:, classes] = cho_solve(cho_factor(a), b[:, classes])
    mu = math.sqrt(worst + N_LABEL_STATISTICS) / z if z > 0 else math.inf
    eps = epsilon_from_mu(mu=mu, delta=config.delta) if z > 0 else math.inf
    return weights, {
        "epsilon_target": epsilon,
        "epsilon_achieved_worst_site": eps,
        "delta": config.delta,
        "noise_multiplier": z,
        "gram_releases_worst_site": float(worst),
        "clip_norm": config.clip_norm,
        "clipped_fraction": float(np.mean([s.clipped_fraction for s in sites])),
    }
