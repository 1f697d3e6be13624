"""Differentially private release of the analytic sufficient statistics (docs/protocol.md §7),
float version. The sensitivities, noise split and calibration are the rulebook's
(:mod:`afl.core.dp.accounting`); this module holds the data pipeline.

0. The privacy unit: at most m rows per patient (:func:`patient_rows`: the first m rows of each
   patient in row order), so removing a patient removes at most m rows.
1. Row clipping ``h <- h·min(1, L/‖h‖)``, so every feature row has ‖h‖ ≤ L.
2. Additive statistics over the rows (summable across sites, hence compatible with secure
   aggregation): ``G = Σ h hᵀ``; per class c, over the rows that carry a label for c, the positive
   sum ``S+_c = Σ_{y=1} ω h``, positive count ``n+_c = Σ_{y=1} ω``, label total ``T_c = Σ h`` and
   label count ``N_c``. ω = 1, or with label clipping at k positives ω_i = min(1, √(k/p_i))
   (:func:`label_weights`, p_i the row's positive labels), so one row moves the positive sums by
   at most √k·L. A site that labels every class has ``T_c = T = Σ h`` and ``N_c = N`` for all
   c; keeping them per class lets sites that do not label c send zeros (global gram_scope,
   docs/protocol.md §6).
3. Gaussian noise, one σ per statistic (:class:`NoiseScales`; released as ``gram``, ``s_pos``,
   ``t_sum`` and ``counts`` = (n+, N) with the sensitivities of
   :func:`afl.core.dp.accounting.statistic_sensitivity`).
   Noise on G: ``Ĝ = G + σ_G·(Z + Zᵀ)/2`` with Z a full iid N(0,1) d x d matrix. The mechanism is
   ``G + σ_G·Z`` (Frobenius sensitivity m·L², noise multiplier σ_G/(m·L²)); the symmetrisation is
   free post-processing. Resulting noise variance: σ_G² on the diagonal, σ_G²/2 off the diagonal.
4. Server-side normalisation into balanced targets (paper eq. 7, pooled):
   ``b_c = S+_c/n+_c - (T_c - S+_c)/(N_c - n+_c)``, counts floored at ``min_count`` (noise can
   make them small or negative; post-processing). Difference from the paper: the paper normalises
   per client (``b_c = Σ_k [S+_{k,c}/n+_{k,c} - S-_{k,c}/n-_{k,c}]``), which would need each
   site's counts (not DP without noise per site). The pooled b weights every labelled row
   equally across sites and its scale is about 1/|S_c| of the paper's (one unit of positive and
   negative mass in total instead of one per site); both coincide for a single site.
5. Positive definiteness of ``Ĝ + γI`` (post-processing): the ridge is raised to the noise level,
   γ + √(2d)·σ_G (:func:`noise_ridge`: about the spectral norm of the symmetrised d x d noise,
   AdaSSP-style, Wang 2018), and the eigenvalues are floored at γ.

Noise comes from a ``numpy.random.Generator`` passed in: this module is for simulation
(``afl simulate``) only. The daemons draw discretised noise from a CSPRNG (afl.crypto).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

FloatArray = NDArray[np.float64]


class DPStatsError(ValueError):
    """Invalid input to the DP statistics pipeline."""


def clip_rows(features: FloatArray, *, clip_norm: float) -> FloatArray:
    """Step 1: ``h <- h·min(1, L/‖h‖)`` for every row of ``features`` (n, d)."""
    if not clip_norm > 0:
        raise DPStatsError(f"clip_norm must be > 0, got {clip_norm}")
    h = np.asarray(features, dtype=np.float64)
    if h.ndim != 2:
        raise DPStatsError(f"features must be 2-D (n, d), got shape {h.shape}")
    norms = np.linalg.norm(h, axis=1, keepdims=True)
    big = norms > clip_norm
    scale = np.ones_like(norms)
    np.divide(clip_norm, norms, out=scale, where=big)
    out: FloatArray = h * scale
    return out


@dataclass(frozen=True)
class SufficientStatistics:
    """Additive statistics (step 2): G (d,d), S+ (C,d), n+ (C,), T (C,d), N (C,)."""

    gram: FloatArray
    positive_sum: FloatArray
    positive_count: FloatArray
    label_sum: FloatArray
    label_count: FloatArray

    def __add__(self, other: SufficientStatistics) -> SufficientStatistics:
        return SufficientStatistics(
            gram=self.gram + other.gram,
            positive_sum=self.positive_sum + other.positive_sum,
            positive_count=self.positive_count + other.positive_count,
            label_sum=self.label_sum + other.label_sum,
            label_count=self.label_count + other.label_count,
        )


def patient_rows(patients: NDArray[np.generic], *, cap: int) -> NDArray[np.int64]:
    """Step 0: indices (increasing) of the rows kept when each patient keeps its first ``cap``
    rows in row order. Removing one patient then removes at most ``cap`` kept rows, and no other
    patient's rows change: the sensitivities of :mod:`afl.core.dp.accounting` with m = ``cap``
    hold for the patient."""
    if cap < 1:
        raise DPStatsError(f"cap must be >= 1, got {cap}")
    ids = np.asarray(patients)
    if ids.ndim != 1:
        raise DPStatsError(f"patient ids must be 1-D, got shape {ids.shape}")
    _, inverse = np.unique(ids, return_inverse=True)
    order = np.argsort(inverse, kind="stable")  # rows grouped by patient, row order within
    starts = np.searchsorted(inverse[order], inverse[order], side="left")
    rank = np.empty(ids.size, dtype=np.int64)
    rank[order] = np.arange(ids.size) - starts
    out: NDArray[np.int64] = np.flatnonzero(rank < cap).astype(np.int64)
    return out


def label_weights(positives: NDArray[np.generic], *, max_positive_labels: int) -> FloatArray:
    """ω_i = min(1, √(k/p_i)) per row of the 0/1 matrix ``positives`` (n, C), p_i its positives
    (ω = 1 when p_i ≤ k, and for k = 0: no label clipping). ‖ω_i·y_i‖ ≤ √k."""
    if max_positive_labels < 0:
        raise DPStatsError(f"max_positive_labels must be >= 0, got {max_positive_labels}")
    p = np.asarray(positives, dtype=np.float64).sum(axis=1)
    if max_positive_labels == 0:
        return np.ones_like(p)
    out: FloatArray = np.minimum(1.0, np.sqrt(max_positive_labels / np.maximum(p, 1.0)))
    return out


def sufficient_statistics(
    features: FloatArray,
    labels: NDArray[np.generic],
    *,
    label_mask: NDArray[np.bool_] | None = None,
    max_positive_labels: int = 0,
) -> SufficientStatistics:
    """Step 2 on one site's (already clipped) rows.

    ``labels`` (n, C) holds 1 for positive, 0 for negative; ``label_mask`` (n, C) or (C,) says
    which labels exist (default: all). Missing labels are ignored whatever their value. With
    ``max_positive_labels`` k > 0 the positive sums and counts weigh row i by
    :func:`label_weights` (over its present positive labels).
    """
    h = np.asarray(features, dtype=np.float64)
    y = np.asarray(labels, dtype=np.float64)
    if h.ndim != 2 or y.ndim != 2 or y.shape[0] != h.shape[0]:
        raise DPStatsError(f"need features (n, d) and labels (n, C); got {h.shape}, {y.shape}")
    mask = (
        np.ones(y.shape, dtype=bool)
        if label_mask is None
        else np.broadcast_to(np.asarray(label_mask, dtype=bool), y.shape)
    )
    present = y[mask]
    if not np.all((present == 0) | (present == 1)):
        raise DPStatsError("labels must be 0 or 1 where label_mask is set")
    pos = np.where(mask, y, 0.0)
    pos = pos * label_weights(pos, max_positive_labels=max_positive_labels)[:, None]
    lab = mask.astype(np.float64)
    return SufficientStatistics(
        gram=h.T @ h,
        positive_sum=pos.T @ h,
        positive_count=pos.sum(axis=0),
        label_sum=lab.T @ h,
        label_count=lab.sum(axis=0),
    )


@dataclass(frozen=True)
class NoiseScales:
    """Noise standard deviation σ per statistic (0 = not noised). In a DP round n+ and N are one
    release (``counts``) and share its σ."""

    gram: float
    positive_sum: float
    positive_count: float
    label_sum: float
    label_count: float


def add_noise(
    stats: SufficientStatistics, *, scales: NoiseScales, rng: np.random.Generator
) -> SufficientStatistics:
    """Step 3: Gaussian noise per statistic; G gets σ_G·(Z + Zᵀ)/2 (symmetric)."""
    for name in ("gram", "positive_sum", "positive_count", "label_sum", "label_count"):
        if not getattr(scales, name) >= 0:
            raise DPStatsError(f"noise scale {name} must be >= 0")
    d = stats.gram.shape[0]
    z = rng.standard_normal((d, d))
    gram_noise = scales.gram * (z + z.T) / 2.0

    def noisy(x: FloatArray, sigma: float) -> FloatArray:
        out: FloatArray = x + sigma * rng.standard_normal(x.shape)
        return out

    return SufficientStatistics(
        gram=stats.gram + gram_noise,
        positive_sum=noisy(stats.positive_sum, scales.positive_sum),
        positive_count=noisy(stats.positive_count, scales.positive_count),
        label_sum=noisy(stats.label_sum, scales.label_sum),
        label_count=noisy(stats.label_count, scales.label_count),
    )


def balanced_targets(stats: SufficientStatistics, *, min_count: float = 1.0) -> FloatArray:
    """Step 4: b_c = S+_c/n+_c - (T_c - S+_c)/(N_c - n+_c), returned as (d, C).

    Counts below ``min_count`` are floored to it (post-processing of noisy counts). A class with
    no positives or no negatives (noise-free count 0) thus gets only the other term.
    """
    if not min_count > 0:
        raise DPStatsError(f"min_count must be > 0, got {min_count}")
    n_pos = np.maximum(stats.positive_count, min_count)
    n_neg = np.maximum(stats.label_count - stats.positive_count, min_count)
    neg_sum = stats.label_sum - stats.positive_sum
    b = stats.positive_sum / n_pos[:, None] - neg_sum / n_neg[:, None]
    out: FloatArray = np.ascontiguousarray(b.T)
    return out


def floor_eigenvalues(matrix: FloatArray, *, floor: float) -> FloatArray:
    """Step 5: V·diag(max(λ, floor))·Vᵀ of the symmetric part of ``matrix``."""
    a = np.asarray(matrix, dtype=np.float64)
    if a.ndim != 2 or a.shape[0] != a.shape[1]:
        raise DPStatsError(f"need a square matrix, got shape {a.shape}")
    sym = (a + a.T) / 2.0
    eigvals, eigvecs = np.linalg.eigh(sym)
    if eigvals[0] >= floor:
        return sym
    fixed = (eigvecs * np.maximum(eigvals, floor)) @ eigvecs.T
    out: FloatArray = (fixed + fixed.T) / 2.0
    return out


def noise_ridge(*, sigma_gram: float, d: int) -> float:
    """√(2d)·σ_G: about the spectral norm of the symmetrised noise σ_G·(Z + Zᵀ)/2 of a d x d
    Gram (its eigenvalues spread over ±σ_G·√(2d), the semicircle law), added to the ridge so
    that no noise eigenvalue dominates (step 5; AdaSSP, Wang 2018, sets the ridge the same way)."""
    if not (sigma_gram >= 0 and d >= 1):
        raise DPStatsError(f"need sigma_gram >= 0 and d >= 1, got {sigma_gram}, {d}")
    return sigma_gram * float(np.sqrt(2.0 * d))


def regularised_gram(gram: FloatArray, *, gamma: float, floor: float | None = None) -> FloatArray:
    """``Ĝ + γI`` with eigenvalues floored at ``floor`` (default γ, the noise-free minimum)."""
    if not gamma >= 0:
        raise DPStatsError(f"gamma must be >= 0, got {gamma}")
    a = np.asarray(gram, dtype=np.float64) + gamma * np.eye(gram.shape[0])
    return floor_eigenvalues(a, floor=gamma if floor is None else floor)
