"""Bounded influence: what a dataset of a declared size could produce (docs/protocol.md §2, §6.2).

A site that declares N rows of feature-row norm at most L (:class:`afl.core.row_bounds.RowBounds`,
both rounded up to powers of two) can only produce statistics inside these sets, whatever its
labels (docs/method.md §1.2-1.3):

* a balanced class vector ``b_c = S⁺_c/N⁺ − S⁻_c/N⁻`` (eq. 12) is a difference of two means of
  rows of norm ≤ L, so ``‖b_c‖₂ ≤ 2L`` for every class c (a column of zeros for a class the site
  does not use);
* the Gram ``G = Σ_i h_i h_iᵀ`` is positive semi-definite with ``trace(G) = Σ_i ‖h_i‖² ≤ N·L²``,
  so its diagonal is ≥ 0, its trace ≤ N·L², and ``|G_ij| ≤ sqrt(G_ii·G_jj)`` (Cauchy-Schwarz);
* a count (e.g. pseudo-positive counts of round 2) lies in [0, N].

A sum over m members with bounds (N_k, L_k) lies in the Minkowski sum of the sets: ``‖Σ b_c‖ ≤
Σ 2L_k``, ``trace(Σ G) ≤ Σ N_k·L_k²``, the counts in [0, Σ N_k] (what a CKKS decryptor, who sees
only sums, can check).

The per-entry bound of ``mask`` (|entry| ≤ 2L for a class vector, N·L² for a Gram) lets one site
send a class vector √d times longer than any dataset of its size could produce (for d = 1024:
32×) and a Gram of trace d·N·L²: these checks close that gap where the statistics are visible.

A relative tolerance of 1e-9 (plus 1e-12 absolute) absorbs float64 round-off of honest sums.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

__all__ = [
    "InfluenceBound",
    "class_vector_problem",
    "count_problem",
    "gram_problem",
]

_RTOL = 1e-9
_ATOL = 1e-12


@dataclass(frozen=True)
class InfluenceBound:
    """The statistics bound of a dataset (or a sum of datasets): ``vector_norm`` bounds each
    class vector's L2 norm (2L, or Σ 2L_k), ``gram_trace`` the Gram's trace (N·L², or Σ N_k·L_k²),
    ``count`` each count (N, or Σ N_k)."""

    vector_norm: float
    gram_trace: float
    count: float

    @classmethod
    def of_dataset(cls, *, rows: int, max_row_norm: float) -> InfluenceBound:
        """The bound of one dataset of ``rows`` rows of norm at most ``max_row_norm``."""
        if rows < 0 or not (math.isfinite(max_row_norm) and max_row_norm >= 0):
            raise ValueError(
                f"a dataset needs rows >= 0 and a finite L >= 0, got {rows}, {max_row_norm}"
            )
        return cls(2.0 * max_row_norm, rows * max_row_norm**2, float(rows))

    def __add__(self, other: InfluenceBound) -> InfluenceBound:
        return InfluenceBound(
            self.vector_norm + other.vector_norm,
            self.gram_trace + other.gram_trace,
            self.count + other.count,
        )


def _over(value: float, bound: float) -> bool:
    return not value <= bound * (1.0 + _RTOL) + _ATOL


def class_vector_problem(
    b: NDArray[np.float64], *, bound: InfluenceBound, classes: tuple[str, ...] = ()
) -> str:
    """Why the class vectors ``b`` ([d, C] or [d]) cannot come from a dataset within ``bound``
    ("" if they can): the classes whose ‖b_c‖₂ exceeds ``bound.vector_norm``."""
    matrix = np.asarray(b, dtype=np.float64)
    if matrix.ndim == 1:
        matrix = matrix[:, None]
    norms = np.linalg.norm(matrix, axis=0)
    names = classes or tuple(str(c) for c in range(matrix.shape[1]))
    over = [
        f"{n} ({v:.6g})" for n, v in zip(names, norms, strict=True) if _over(v, bound.vector_norm)
    ]
    if not over:
        return ""
    return (
        f"class vector norm above 2L = {bound.vector_norm:.6g}, the most a dataset of the "
        f"declared size can produce: {', '.join(over)}"
    )


def gram_problem(gram: NDArray[np.float64], *, bound: InfluenceBound) -> str:
    """Why ``gram`` ([d, d]) cannot be the Gram of a dataset within ``bound`` ("" if it can):
    a negative diagonal entry, a trace above N·L², or an entry above sqrt(G_ii·G_jj)."""
    g = np.asarray(gram, dtype=np.float64)
    diag = np.diag(g)
    if (diag < -_ATOL).any():
        return "Gram with a negative diagonal entry (no dataset has one)"
    trace = float(diag.sum())
    if _over(trace, bound.gram_trace):
        return (
            f"Gram trace {trace:.6g} above N·L² = {bound.gram_trace:.6g}, the most a dataset of "
            "the declared size can produce"
        )
    scale = np.sqrt(np.clip(diag, 0.0, None))
    if (np.abs(g) > np.outer(scale, scale) * (1.0 + _RTOL) + _ATOL * max(1.0, trace)).any():
        return "Gram entry above sqrt(G_ii·G_jj) (no positive semi-definite matrix has one)"
    return ""


def count_problem(counts: NDArray[np.float64], *, bound: InfluenceBound) -> str:
    """Why ``counts`` cannot be counts of a dataset within ``bound`` ("" if they can): a value
    outside [0, N] or not an integer."""
    c = np.asarray(counts, dtype=np.float64)
    if c.size == 0:
        return ""
    if (c < 0).any() or (np.abs(c - np.round(c)) > 1e-9).any():
        return "a count that is negative or not an integer"
    if _over(float(c.max()), bound.count):
        return f"a count of {float(c.max()):.6g} above the declared N = {bound.count:.6g} rows"
    return ""
