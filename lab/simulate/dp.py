"""Differentially private rows of `afl simulate` (docs/protocol.md §7), float simulation.

The simulation releases exactly what the daemons release (:mod:`afl.server.plan.dp`), with the
same calibration, both taken from the rulebook :mod:`afl.core.dp.accounting`:

* the privacy unit: ``patient`` keeps the first m images of each patient at each site
  (:func:`afl.core.dp.stats.patient_rows`; the dataset's patient ids), ``image`` every row;
* release groups (:func:`~afl.core.dp.accounting.release_groups`): one over all sites in
  ``global`` scope, one per distinct coverage set S_c in ``per-class`` scope; each group releases
  ``gram``, ``s_pos``, ``t_sum`` and ``counts`` over its members' clipped rows (sites send zeros
  for classes they do not label), with label clipping at k positives;
* the noise of :func:`~afl.core.dp.accounting.calibrate_releases` for the chosen
  :class:`~afl.core.dp.accounting.Mechanism` (:data:`MECHANISMS`: ``default``, the daemons'
  measured split, joint calibration, label clipping at k = 1 and ridge at the noise level;
  ``previous``, equal split, per-release calibration, no label clipping, eigenvalue floor only;
  ``no-label-clip``, ``equal-split`` and ``floor``: ``default`` with one choice undone), as the
  ``mask`` daemons calibrate it with t = 0, including their noise-grid rounding allowance;
* optionally (``projection`` d′, measured in docs/benchmarks.md §2, not in the daemons) the
  features projected on a fixed random d′-dimensional subspace (:func:`projection_matrix`, a
  public seed) before the unit's rows are clipped; W is mapped back to the original features.

Noise is added once per release with the total σ_r (equal in distribution to the shares
N(0, σ_r²/n_r) of n_r honest members under secure aggregation, t = 0), as continuous Gaussian
noise (the daemons' discrete shares on the grid are not simulated). The server's post-processing
follows: pooled balanced targets from the noisy sums and counts, Ĝ + λI with the ridge raised to
the noise level (``shift``: λ = γ + √(2d)·σ_G, as the daemons; ``floor``: λ = γ), eigenvalues
floored at γ, one solve per group. Classes no site labels keep w_c = 0, as in the non-private rows.
ε = ∞ keeps the unit, clipping and pooled normalisation but adds no noise: it isolates their cost.

Noise here comes from a seeded ``numpy.random.Generator``: this is a simulation, not a release.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

import numpy as np
from numpy.typing import NDArray
from scipy.linalg import cho_factor, cho_solve

from afl.core.aggregation import GramScope
from afl.core.dp import stats as dp_stats
from afl.core.dp.accounting import (
    EQUAL_SPLIT,
    Mechanism,
    NoiseCalibration,
    ReleaseGroup,
    StatisticRelease,
    calibrate_releases,
    plan_releases,
    previous_mechanism,
    release_groups,
)

PDMethod = Literal["shift", "floor"]
MechanismName = Literal["default", "previous", "no-label-clip", "equal-split", "floor"]
#: The mechanism variants (docs/benchmarks.md §2): the daemons' ``default``, the ``previous``
#: one, and ``default`` with one choice undone (for the ablation).
MECHANISMS: tuple[MechanismName, ...] = (
    "default",
    "previous",
    "no-label-clip",
    "equal-split",
    "floor",
)
Unit = Literal["patient", "image"]
DEFAULT_CLIP = (
    14.0  # ≈ 99th percentile of the surrogate's row norms (public constant, not data-fit)
)


@dataclass(frozen=True)
class DPConfig:
    """The DP rows' settings: ``rows_per_individual`` is m (images kept per patient when
    ``unit = "patient"``; 1 for ``image``)."""

    epsilons: tuple[float, ...]
    delta: float = 1e-5
    clip_norm: float = DEFAULT_CLIP
    unit: Unit = "patient"
    rows_per_individual: int = 1
    mechanism: MechanismName = "default"
    seed: int = 0
    pd_method: PDMethod | None = None  # None: the mechanism's (floor for previous and floor)
    projection: int = 0  # d' > 0: project the features on a fixed random d'-dim subspace

    def __post_init__(self) -> None:
        if not self.epsilons or any(not e > 0 for e in self.epsilons):
            raise ValueError(f"ε values must be > 0 (inf allowed), got {self.epsilons}")
        if not 0 < self.delta < 1:
            raise ValueError(f"δ must lie in (0, 1), got {self.delta}")
        if self.rows_per_individual < 1 or (self.unit == "image" and self.rows_per_individual > 1):
            raise ValueError("rows_per_individual must be >= 1, and 1 for unit 'image'")
        if self.projection < 0:
            raise ValueError(f"projection must be >= 0, got {self.projection}")

    @property
    def rulebook(self) -> Mechanism:
        """The rulebook's mechanism of these settings."""
        m = self.rows_per_individual
        if self.mechanism == "previous":
            return previous_mechanism(self.clip_norm, rows_per_individual=m)
        if self.mechanism == "no-label-clip":
            return Mechanism(self.clip_norm, rows_per_individual=m, max_positive_labels=0)
        if self.mechanism == "equal-split":
            return Mechanism(self.clip_norm, rows_per_individual=m, split=EQUAL_SPLIT)
        return Mechanism(self.clip_norm, rows_per_individual=m)

    @property
    def ridge(self) -> PDMethod:
        """How Ĝ + λI is made positive definite: ``shift`` (the daemons' noise ridge) unless
        set, or ``floor`` for the previous mechanism (the daemons' solve before)."""
        if self.pd_method is not None:
            return self.pd_method
        return "floor" if self.mechanism in ("previous", "floor") else "shift"


@dataclass(frozen=True)
class ClippedSite:
    """One site's rows for the DP rows: the unit's rows, clipped, with their labels."""

    gram: NDArray[np.float64]
    features: NDArray[np.float64]
    labels: NDArray[np.int8]
    clipped_fraction: float
    kept_fraction: float = 1.0
    input_dim: int = 0  # d before a fixed projection (0: not projected)


#: Seed of the fixed projection: public, chosen before any data is seen.
PROJECTION_SEED = 20240601


def projection_matrix(d: int, d_out: int) -> NDArray[np.float64]:
    """Q (d, d_out) with orthonormal columns, from :data:`PROJECTION_SEED` only (data
    independent, so announcing it costs no privacy): features h ↦ Qᵀh, and a W′ solved on the
    projected features is W = Q·W′ on the original ones."""
    if not 1 <= d_out <= d:
        raise ValueError(f"projection dimension must lie in 1..{d}, got {d_out}")
    q, _ = np.linalg.qr(np.random.default_rng(PROJECTION_SEED).standard_normal((d, d_out)))
    out: NDArray[np.float64] = q
    return out


def clip_site(
    features: NDArray[np.floating],
    labels: NDArray[np.int8],
    *,
    clip_norm: float,
    patients: NDArray[np.generic] | None = None,
    cap: int = 1,
) -> ClippedSite:
    """The unit's rows of one site (every row, or with ``patients`` the first ``cap`` of each
    patient), clipped to ‖h‖ ≤ L."""
    rows = (
        np.arange(len(features)) if patients is None else dp_stats.patient_rows(patients, cap=cap)
    )
    h = np.asarray(features[rows], dtype=np.float64)
    clipped = dp_stats.clip_rows(h, clip_norm=clip_norm)
    frac = float(np.mean(np.linalg.norm(h, axis=1) > clip_norm)) if len(h) else 0.0
    kept = len(rows) / max(1, len(features))
    return ClippedSite(clipped.T @ clipped, clipped, np.asarray(labels)[rows], frac, kept)


def clip_sites(
    site_features: Sequence[NDArray[np.floating]],
    site_labels: Sequence[NDArray[np.int8]],
    site_patients: Sequence[NDArray[np.generic]] | None,
    config: DPConfig,
) -> list[ClippedSite]:
    """:func:`clip_site` for every site under ``config``'s unit (patient level needs the
    dataset's patient ids)."""
    if config.unit == "patient" and site_patients is None:
        raise ValueError(
            "patient-level DP rows need the sites' patient ids (the embedded default has them; "
            "feature caches need a patients.txt); or use unit 'image'"
        )
    d_in = int(site_features[0].shape[1])
    q = projection_matrix(d_in, config.projection) if config.projection else None
    sites = [
        clip_site(
            h if q is None else np.asarray(h, dtype=np.float64) @ q,
            y,
            clip_norm=config.clip_norm,
            patients=None if config.unit == "image" or site_patients is None else site_patients[k],
            cap=config.rows_per_individual,
        )
        for k, (h, y) in enumerate(zip(site_features, site_labels, strict=True))
    ]
    return [replace(s, input_dim=d_in) for s in sites] if q is not None else sites


def positive_definite(
    gram: NDArray[np.float64], *, gamma: float, sigma_gram: float, method: PDMethod
) -> NDArray[np.float64]:
    """Ĝ + λI made positive definite by post-processing (docs/protocol.md §7).

    ``shift``: λ = γ + √(2d)·σ_G (:func:`afl.core.dp.stats.noise_ridge`, the daemons' solve), so
    noise eigenvalues can no longer dominate; eigenvalues are then floored at γ in the rare case
    the shift was not enough. ``floor``: eigenvalues of Ĝ + γI floored at γ.
    """
    d = gram.shape[0]
    shift = dp_stats.noise_ridge(sigma_gram=sigma_gram, d=d) if method == "shift" else 0.0
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
        mechanism=config.rulebook,
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
    active: NDArray[np.bool_],
    *,
    scope: GramScope,
    epsilon: float,
    gamma: float,
    config: DPConfig,
) -> tuple[NDArray[np.float64], dict[str, float]]:
    """W under DP for one assignment; returns W (mapped back to the original features when
    ``config.projection``) and the accounting actually achieved."""
    num_sites, num_classes = active.shape
    d = sites[0].gram.shape[0]
    groups = dp_release_groups(active, scope=scope)
    releases, calibration = calibrate_dp(active, scope=scope, d=d, epsilon=epsilon, config=config)
    site_index = {s: k for k, s in enumerate(site_names(num_sites))}
    class_index = {c: j for j, c in enumerate(class_names(num_classes))}
    covered = [bool(np.any(active[:, c])) for c in range(num_classes)]
    rng = np.random.default_rng(config.seed)
    k_pos = config.rulebook.max_positive_labels
    label_stats = [
        dp_stats.sufficient_statistics(
            s.features, s.labels, label_mask=active[k], max_positive_labels=k_pos
        )
        for k, s in enumerate(sites)
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
        a = positive_definite(noisy.gram, gamma=gamma, sigma_gram=scales.gram, method=config.ridge)
        w = cho_solve(cho_factor(a), dp_stats.balanced_targets(noisy))
        for j, c in enumerate(cols):
            if covered[c]:
                weights[:, c] = w[:, j]
    if sites[0].input_dim:
        weights = projection_matrix(sites[0].input_dim, d) @ weights
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
        "kept_fraction": float(np.mean([s.kept_fraction for s in sites])),
        "images_per_patient": float(config.rows_per_individual),
    }
