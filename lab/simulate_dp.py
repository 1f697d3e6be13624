"""Differentially private rows of `afl simulate` (docs/protocol.md §7), float simulation.

The simulation releases exactly what the daemons release (:mod:`afl.server.dp_plan`), with the
same calibration, both taken from the rulebook :mod:`afl.core.dp_accounting`:

* release groups (:func:`~afl.core.dp_accounting.release_groups`): one over all sites in
  ``global`` scope, one per distinct coverage set S_c in ``per-class`` scope; each group releases
  ``gram`` (Δ = m·L²), ``s_pos`` and ``t_sum`` (d x C_r, Δ = m·√C_r·L) and ``counts`` (n+ and N,
  2 x C_r, Δ = m·√(2C_r)) over its members' clipped rows (sites send zeros for classes they do
  not label);
* one noise multiplier z, σ_r = z·Δ'_r with Δ'_r the daemons' accounted sensitivity (including
  their noise-grid rounding allowance, ≤ 1e-4·Δ_r), z = z*(ε, δ)·√max_k R_k so that the worst
  site (the one in the most releases R_k = 4·groups) meets (ε, δ)
  (:func:`~afl.core.dp_accounting.calibrate_releases` as the ``mask`` daemons call it, t = 0).

Noise is added once per release with the total σ_r (equal in distribution to the shares
N(0, σ_r²/n_r) of n_r honest members under secure aggregation, t = 0), as continuous Gaussian
noise (the daemons' discrete shares on the grid are not simulated). The server's post-processing
follows: pooled balanced targets from the noisy sums and counts, Ĝ + γI made positive definite,
one solve per group. Classes no site labels keep w_c = 0, as in the non-private rows. ε = ∞ keeps
clipping and pooled normalisation but adds no noise: it isolates their cost.

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
from afl.core.aggregation import GramScope
from afl.core.dp_accounting import (
    NoiseCalibration,
    ReleaseGroup,
    StatisticRelease,
    calibrate_releases,
    plan_releases,
    release_groups,
)

PDMethod = Literal["shift", "floor"]
DEFAULT_CLIP = (
    14.0  # ≈ 99th percentile of the surrogate's row norms (public constant, not data-fit)
)


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
    """Ĝ + γI made positive definite by post-processing (docs/protocol.md §7).

    ``shift``: add σ_G·√(2d)·I, about the spectral norm of the symmetrised noise, so noise
    eigenvalues can no longer dominate (acts as extra ridge); eigenvalues are then floored at γ in
    the rare case the shift was not enough. ``floor``: eigenvalues of Ĝ + γI floored at γ.
    """
    d = gram.shape[0]
    shift = sigma_gram * math.sqrt(2 * d) if method == "shift" else 0.0
    return dp_stats.regularised_gram(gram + shift * np.eye(d), gamma=gamma)


def site_names(num_sites: int) -> list[str]:
    """The names the simulation gives sites 0..K-1 in its release plan."""
    return [f"site{k}" for k in range(num_sites)]


def class_names(num_classes: int) -> list[str]:
    """The names the simulation gives classes 0..C-1 in its release plan."""
    return [f"class{c}" for c in range(num_classes)]


def dp_release_groups(active: NDArray[np.bool_], *, scope: GramScope) -> tuple[ReleaseGroup, ...]:
    """The daemons' release groups for the (K, C) coverage ``active`` (site k labels class c)."""
    sites, classes = site_names(active.shape[0]), class_names(active.shape[1])
    coverage = {
        s: [c for c, on in zip(classes, row, strict=True) if on]
        for s, row in zip(sites, active, strict=True)
    }
    return release_groups(classes=classes, participants=sites, coverage=coverage, gram_scope=scope)


def calibrate_dp(
    active: NDArray[np.bool_], *, scope: GramScope, d: int, epsilon: float, config: DPConfig
) -> tuple[list[StatisticRelease], NoiseCalibration | None]:
    """The releases and their calibration (None for ε = ∞: no noise), as the ``mask`` daemons
    calibrate them with t = 0 (module docstring)."""
    releases = plan_releases(dp_release_groups(active, scope=scope), d=d)
    if math.isinf(epsilon):
        return releases, None
    calibration = calibrate_releases(
        releases,
        epsilon=epsilon,
        delta=config.delta,
        clip_norm=config.clip_norm,
        rows_per_individual=config.rows_per_individual,
        tolerated=0,
        local=False,
        participants=site_names(active.shape[0]),
    )
    return releases, calibration


def _group_scales(
    group: ReleaseGroup, calibration: NoiseCalibration | None, *, d: int
) -> dp_stats.NoiseScales:
    if calibration is None:
        return dp_stats.NoiseScales(0.0, 0.0, 0.0, 0.0, 0.0)
    sigma = {r.kind: calibration.noise[r.name].sigma for r in plan_releases([group], d=d)}
    return dp_stats.NoiseScales(
        gram=sigma["gram"],
        positive_sum=sigma["s_pos"],
        positive_count=sigma["counts"],
        label_sum=sigma["t_sum"],
        label_count=sigma["counts"],
    )


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
    num_sites, num_classes = active.shape
    d = sites[0].gram.shape[0]
    groups = dp_release_groups(active, scope=scope)
    releases, calibration = calibrate_dp(active, scope=scope, d=d, epsilon=epsilon, config=config)
    site_index = {s: k for k, s in enumerate(site_names(num_sites))}
    class_index = {c: j for j, c in enumerate(class_names(num_classes))}
    covered = [bool(np.any(active[:, c])) for c in range(num_classes)]
    rng = np.random.default_rng(config.seed)
    label_stats = [
        dp_stats.sufficient_statistics(s.features, y, label_mask=active[k])
        for k, (s, y) in enumerate(zip(sites, site_labels, strict=True))
    ]
    weights = np.zeros((d, num_classes))
    for group in groups:
        members = [site_index[s] for s in group.members]
        cols = [class_index[c] for c in group.classes]
        summed = label_stats[members[0]]
        for k in members[1:]:
            summed = summed + label_stats[k]
        stats = dp_stats.SufficientStatistics(
            gram=np.sum([sites[k].gram for k in members], axis=0),
            positive_sum=summed.positive_sum[cols],
            positive_count=summed.positive_count[cols],
            label_sum=summed.label_sum[cols],
            label_count=summed.label_count[cols],
        )
        scales = _group_scales(group, calibration, d=d)
        noisy = stats if calibration is None else dp_stats.add_noise(stats, scales=scales, rng=rng)
        a = positive_definite(
            noisy.gram, gamma=gamma, sigma_gram=scales.gram, method=config.pd_method
        )
        w = cho_solve(cho_factor(a), dp_stats.balanced_targets(noisy))
        for j, c in enumerate(cols):
            if covered[c]:
                weights[:, c] = w[:, j]
    per_site = {s: sum(1 for r in releases if s in r.members) for s in site_index}
    groups_per_site = {s: sum(1 for g in groups if s in g.members) for s in site_index}
    return weights, {
        "epsilon_target": epsilon,
        "epsilon_achieved_worst_site": (
            math.inf if calibration is None else max(calibration.site_epsilon.values())
        ),
        "delta": config.delta,
        "noise_multiplier": 0.0 if calibration is None else calibration.noise_multiplier,
        "gram_releases_worst_site": float(max(groups_per_site.values(), default=0)),
        "releases_worst_site": float(max(per_site.values(), default=0)),
        "clip_norm": config.clip_norm,
        "clipped_fraction": float(np.mean([s.clipped_fraction for s in sites])),
    }
