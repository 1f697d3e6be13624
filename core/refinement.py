"""Round 2: analytic pseudo-label refinement (paper eq. 16-22).

Client k scores each *missing* class c with ``p = σ(H_k w_c⁽¹⁾)`` (eq. 16), keeps confident rows
as pseudo-positives (``p > τ``) or pseudo-negatives (``p < 1-τ``) with balanced weights
``+1/N_pp``, ``-1/N_pn`` (eq. 17), and contributes ``b_pseudo = H_kᵀ y_pseudo`` (eq. 19) only if
``N_pp ≥ δ+`` and ``N_pn ≥ δ-`` (eq. 18). Streaming as in round 1: sums and counts, normalised
at the end.

Optional deviation from the paper (docs/method.md §3.3): with a ``calibration``
(:class:`afl.core.evaluation.calibration.Calibration` of the round-1 model) the τ filter reads the calibrated
probability of each class instead of σ(h · w_c); everything else is unchanged.

The server solves with the GLOBAL Gram (eq. 20) ``A = Σ_{all k} G_k + γI`` and
``b_c = Σ_{S_c} b_{k,c} + α Σ_{P_c} b_pseudo_{k,c}`` (eq. 21), ``w_c = A⁻¹ b_c`` (eq. 22).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from afl.core.aggregation import AggregationError, factor_regularised
from afl.core.evaluation.calibration import Calibration
from afl.core.labels import LabelError


@dataclass(frozen=True)
class RefinementParams:
    """Paper Table IV defaults."""

    tau: float = 0.7
    alpha: float = 0.5
    delta_pos: int = 5
    delta_neg: int = 50

    def __post_init__(self) -> None:
        if not 0.5 <= self.tau < 1.0:
            raise ValueError(f"τ must lie in [0.5, 1), got {self.tau}")
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"α must lie in [0, 1], got {self.alpha}")
        if self.delta_pos < 1 or self.delta_neg < 1:
            raise ValueError("δ+ and δ- must be at least 1")


@dataclass(frozen=True)
class PseudoStats:
    """A client's round-2 upload: pseudo-label projections for its missing classes."""

    b: NDArray[np.float64]  # (d, C), zero where not contributing
    contributes: NDArray[np.bool_]  # (C,)
    n_pseudo_pos: NDArray[np.int64]
    n_pseudo_neg: NDArray[np.int64]


def pseudo_labels(
    h: NDArray[np.float64],
    weights: NDArray[np.float64],
    *,
    tau: float,
    calibration: Calibration | None = None,
    columns: Sequence[int] | None = None,
) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """Eq. 16-17 on rows ``h`` (n, d) for the columns of ``weights`` (d, m): p = σ(h·w), the
    pseudo-positive indicator [p > τ] and pseudo-negative indicator [p < 1 - τ], as float64.
    With ``calibration``, p is its calibrated probability of the model's class ``columns``
    (module docstring)."""
    scores = h @ weights
    if calibration is None:
        from scipy.special import expit  # on demand (scipy is not loaded by importing afl.core)

        prob = expit(scores)
    else:
        cols = list(range(weights.shape[1])) if columns is None else list(columns)
        prob = np.nan_to_num(calibration.probabilities(scores, columns=cols), nan=0.5)
    return (prob > tau).astype(np.float64), (prob < 1.0 - tau).astype(np.float64)


def pseudo_label_projection(
    features: NDArray[np.floating],
    *,
    weights: NDArray[np.float64],
    missing: NDArray[np.bool_],
    params: RefinementParams,
    calibration: Calibration | None = None,
    batch_size: int = 4096,
) -> PseudoStats:
    """Eq. 16-19 for one client, streamed over row blocks of a (memory-mapped) feature matrix;
    with ``calibration`` the filter reads calibrated probabilities (module docstring)."""
    d, num_classes = weights.shape
    missing = np.asarray(missing, dtype=bool)
    if features.ndim != 2 or features.shape[1] != d:
        raise ValueError(f"features must be (n, {d}), got {features.shape}")
    if missing.shape != (num_classes,):
        raise LabelError(f"missing mask must have shape ({num_classes},), got {missing.shape}")
    cols = np.flatnonzero(missing)
    pos_sum = np.zeros((d, cols.size))
    neg_sum = np.zeros((d, cols.size))
    n_pp = np.zeros(cols.size, dtype=np.int64)
    n_pn = np.zeros(cols.size, dtype=np.int64)
    for start in range(0, features.shape[0], batch_size):
        h = np.asarray(features[start : start + batch_size], dtype=np.float64)
        pp, pn = pseudo_labels(
            h, weights[:, cols], tau=params.tau, calibration=calibration, columns=cols.tolist()
        )
        pos_sum += h.T @ pp
        neg_sum += h.T @ pn
        n_pp += pp.sum(axis=0).astype(np.int64)
        n_pn += pn.sum(axis=0).astype(np.int64)
    ok = (n_pp >= params.delta_pos) & (n_pn >= params.delta_neg)
    inv_pp = np.divide(1.0, n_pp, out=np.zeros(cols.size), where=ok)
    inv_pn = np.divide(1.0, n_pn, out=np.zeros(cols.size), where=ok)
    b = np.zeros((d, num_classes))
    b[:, cols] = pos_sum * inv_pp - neg_sum * inv_pn
    contributes = np.zeros(num_classes, dtype=bool)
    contributes[cols] = ok
    full_pp = np.zeros(num_classes, dtype=np.int64)
    full_pn = np.zeros(num_classes, dtype=np.int64)
    full_pp[cols] = n_pp
    full_pn[cols] = n_pn
    return PseudoStats(b, contributes, full_pp, full_pn)


def solve_round2(
    *,
    gram_total: NDArray[np.float64],
    b_real: NDArray[np.float64],
    b_pseudo: NDArray[np.float64],
    alpha: float,
    gamma: float,
) -> NDArray[np.float64]:
    """Eq. 20-22: one factorisation of the global Gram, all classes as right-hand sides.

    ``b_real`` holds Σ_{S_c} b_{k,c} per class, ``b_pseudo`` holds Σ_{P_c} b_pseudo_{k,c}.
    """
    if b_real.shape != b_pseudo.shape or gram_total.shape != (b_real.shape[0],) * 2:
        raise AggregationError(
            f"shape mismatch: Gram {gram_total.shape}, b {b_real.shape}, b_pseudo {b_pseudo.shape}"
        )
    from scipy.linalg import cho_solve

    factor = factor_regularised(np.asarray(gram_total, dtype=np.float64), gamma)
    solved: NDArray[np.float64] = cho_solve(factor, b_real + alpha * b_pseudo, check_finite=True)
    return solved
