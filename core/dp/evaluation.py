"""The evaluation part of the DP rulebook (docs/protocol.md §6.1, §7): the sensitivity and noise
of score histograms under DP, the score bins they need, and the pooled AUC of noisy histograms.

**Sensitivity.** A site's score histogram ``hist[c, y, j]`` (docs/method.md §3.2) counts each of
its rows once per class c it labels, in one bin of one label row. Removing one row therefore
changes at most C coordinates by 1 each: L2 sensitivity √C; a patient of at most m kept rows
(the run's unit, :func:`afl.core.dp.stats.patient_rows`) changes them by at most m·√C (triangle
inequality). The same holds for the confusion counts (one cell of (TP, FN, FP, TN) per class).
When the decision threshold's logit is a bin edge (σ(z) > 0.5 ⟺ z > 0, and 0 is an edge of
every grid here) the confusion counts are a function of the histogram, so a DP evaluation
releases the histogram alone and derives them (post-processing, no budget).

**Noise.** A histogram alone is one Gaussian release with σ = z*(ε, δ)·m·√C
(:func:`evaluation_sigma`; z* the multiplier of one release at (ε, δ),
:func:`afl.core.dp.accounting.calibrate_noise_multiplier`), μ = Δ/σ = 1/z*. An evaluation round
releasing both the histogram and the confusion counts splits μ² between them
(:data:`EVALUATION_SPLIT`, a_hist + a_conf = 1: σ_r = z*·Δ/√a_r, :func:`evaluation_noise`), so
every member is exactly (ε, δ)-DP over the round; the shares, t_r and the grid are the training
releases' (:func:`afl.core.dp.accounting.noise_share`, :func:`~afl.core.dp.accounting.
assumed_colluders`, :func:`~afl.core.dp.accounting.grid_frac_bits` with no rounded coordinates:
counts are integers), and the round composes with the run's training releases and the site's
lifetime ledger like any other (μ² adds).

**Bins.** Noise is added to every bin, empty or not, so the AUC's error grows with the number of
bins (each bin's noise moves it by about σ·|F_N(j) - AUC|/P for P positives) while too few bins
bias it (ties counted half). The measured choice (docs/benchmarks.md §9): B equal-mass bins of a
Gaussian of the scores' scale s, edges s·Φ⁻¹(i/B) plus 0 (:func:`dp_score_bins`, B = 16), and the AUC
of the noisy counts as they are (:func:`afl.core.evaluation.federated.histogram_auc`, unclipped:
clipping negative counts to 0 biases every empty bin upwards, -0.23 AUC at ε = 1 on the fine
default grid). Under DP the
coordinator knows s without spending budget: the run's noisy Gram and sums give
s_c² = w_cᵀ(Ĝ/N̂)w_c - (w_cᵀT̂/N̂)² (post-processing of released statistics).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from afl.core.dp.accounting import (
    AccountingError,
    ReleaseNoise,
    assumed_colluders,
    calibrate_noise_multiplier,
    grid_frac_bits,
    noise_share,
)
from afl.core.evaluation.federated import EvaluationStats, histogram_auc
from afl.core.evaluation.scorebins import ScoreBins

__all__ = [
    "DP_EVALUATION_BINS",
    "EVALUATION_SPLIT",
    "NoisyEvaluation",
    "dp_score_bins",
    "evaluation_noise",
    "evaluation_sensitivity",
    "evaluation_sigma",
    "noisy_evaluation",
    "score_scales",
]

#: Equal-mass bins of a DP evaluation (docs/benchmarks.md §9, ε = 1 on the embedded default:
#: 8 bins bias the AUC by -0.010 and the Platt ECE by +0.03; 16 give a mean |ΔAUC| of 0.013 and
#: |ΔECE| of 0.011, 24 give 0.018 and 0.006: more bins, more noise in the AUC).
DP_EVALUATION_BINS = 16


#: The evaluation round's share of μ² per release: the AUC (from the histogram) is the figure the
#: noise hurts most; BACC's four counts per class are large (P ≥ 172 on the default).
EVALUATION_SPLIT = {"hist": 0.9, "confusion": 0.1}


def evaluation_sensitivity(*, n_classes: int, rows_per_individual: int = 1) -> float:
    """Δ = m·√C: one unit's L2 change of a score histogram or confusion counts (module
    docstring)."""
    if n_classes < 1 or rows_per_individual < 1:
        raise AccountingError(
            f"need n_classes >= 1 and rows_per_individual >= 1 (got {n_classes}, "
            f"{rows_per_individual})"
        )
    return rows_per_individual * math.sqrt(n_classes)


def evaluation_sigma(
    *, epsilon: float, delta: float, n_classes: int, rows_per_individual: int = 1
) -> float:
    """σ of the noisy pooled histogram that makes it (ε, δ)-DP for the unit: z*(ε, δ)·Δ."""
    delta_l2 = evaluation_sensitivity(n_classes=n_classes, rows_per_individual=rows_per_individual)
    return calibrate_noise_multiplier(epsilon=epsilon, delta=delta) * delta_l2


def dp_score_bins(*, scale: float, num_bins: int = DP_EVALUATION_BINS) -> ScoreBins:
    """Edges s·Φ⁻¹(i/B), i = 1 … B-1, and 0 (the decision edge): B (or B + 1) equal-mass bins of
    N(0, s²) (module docstring)."""
    if not (scale > 0 and math.isfinite(scale)) or num_bins < 2:
        raise AccountingError(f"need scale > 0 and num_bins >= 2 (got {scale}, {num_bins})")
    # Φ⁻¹ is scipy.special.ndtri (what scipy.stats.norm.ppf calls), imported on demand: importing
    # afl.core (as `afl ca` and the coordinator do) loads no scipy.
    from scipy.special import ndtri

    edges = ndtri(np.arange(1, num_bins) / num_bins) * scale
    return ScoreBins.from_edges(np.unique(np.concatenate([edges, [0.0]])))


def evaluation_noise(
    *,
    kind: str,
    epsilon: float,
    delta: float,
    n_classes: int,
    members: int,
    tolerated: int,
    local: bool,
    rows_per_individual: int = 1,
) -> ReleaseNoise:
    """The noise of one evaluation release (``kind`` "hist" or "confusion") of a round that
    releases both (module docstring): σ_r = z*(ε, δ)·Δ/√a_r, t_r, and the grid f_r at which the
    share σ_r/√(n_r - t_r) spans ≥ 64 steps."""
    if kind not in EVALUATION_SPLIT:
        raise AccountingError(f"unknown evaluation release kind {kind!r}")
    sens = evaluation_sensitivity(n_classes=n_classes, rows_per_individual=rows_per_individual)
    z = calibrate_noise_multiplier(epsilon=epsilon, delta=delta)
    sigma = z * sens / math.sqrt(EVALUATION_SPLIT[kind])
    t = assumed_colluders(members=members, tolerated=tolerated, local=local)
    share = noise_share(sigma, members=members, colluders=t)
    return ReleaseNoise(
        sigma, sens, grid_frac_bits(sensitivity=sens, coordinates=0, share_sigma=share), t
    )


def score_scales(
    *,
    weights: NDArray[np.float64],
    gram: NDArray[np.float64],
    label_sum: NDArray[np.float64],
    label_count: NDArray[np.float64],
) -> NDArray[np.float64]:
    """Each class's score scale s_c from a run's released (noisy) statistics of its training
    rows (post-processing, no budget): for W (d, C), Ĝ (d, d), T̂ (d, C) and N̂ (C,) the
    released Gram, per-class feature sums and label counts,

        s_c² = w_cᵀ(Ĝ/N̂)w_c − (w_cᵀT̂_c/N̂_c)²,   N̂ = max_c N̂_c (the rows of Ĝ);

    NaN for a class whose N̂_c < 1 or whose s_c² is not positive. The DP bins take the median
    of the finite ones (:func:`dp_score_bins`)."""
    w = np.asarray(weights, dtype=np.float64)
    t = np.asarray(label_sum, dtype=np.float64)
    n = np.asarray(label_count, dtype=np.float64).ravel()
    if gram.shape != (w.shape[0], w.shape[0]) or t.shape != w.shape or n.shape != (w.shape[1],):
        raise AccountingError(
            f"W {w.shape}, Gram {gram.shape}, sums {t.shape} and counts {n.shape} do not fit"
        )
    rows = float(n.max()) if n.size else 0.0
    out = np.full(w.shape[1], np.nan)
    for c in range(w.shape[1]):
        if not (n[c] >= 1.0 and rows >= 1.0):
            continue
        var = float(w[:, c] @ gram @ w[:, c]) / rows - (float(w[:, c] @ t[:, c]) / n[c]) ** 2
        if var > 0 and math.isfinite(var):
            out[c] = math.sqrt(var)
    return out


@dataclass(frozen=True)
class NoisyEvaluation:
    """What the coordinator makes of a DP evaluation's noisy sums (post-processing): ``stats``,
    the counts rounded to integers and clipped at 0 (BACC, AP, the calibration fit, the counts
    it reports), and ``auc``, each class's AUC of the noisy histograms as they are (unclipped,
    module docstring; NaN when a noisy label total is not positive)."""

    stats: EvaluationStats
    auc: NDArray[np.float64]

    @property
    def macro_auc(self) -> float:
        finite = self.auc[np.isfinite(self.auc)]
        return float(finite.mean()) if finite.size else float("nan")


def noisy_evaluation(
    *,
    classes: Sequence[str],
    bins: ScoreBins,
    threshold: float,
    histograms: NDArray[np.float64],
    confusion: NDArray[np.float64],
) -> NoisyEvaluation:
    """:class:`NoisyEvaluation` of released noisy sums (flat or shaped [C, 2, B] and [C, 4])."""
    h = np.asarray(histograms, dtype=np.float64).reshape(len(classes), 2, bins.num_bins)
    m = np.asarray(confusion, dtype=np.float64).reshape(len(classes), 4)
    if not (np.isfinite(h).all() and np.isfinite(m).all()):
        raise AccountingError("the released evaluation sums are not finite")
    auc = np.full(len(classes), np.nan)
    for c in range(len(classes)):
        neg, pos = h[c]
        if neg.sum() > 0 and pos.sum() > 0:
            auc[c] = histogram_auc(neg, pos)
    stats = EvaluationStats(
        tuple(classes),
        bins,
        float(threshold),
        np.maximum(np.rint(h), 0).astype(np.int64),
        np.maximum(np.rint(m), 0).astype(np.int64),
    )
    return NoisyEvaluation(stats, auc)
