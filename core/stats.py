"""Local sufficient statistics of one client, accumulated batch by batch (paper eq. 11-12).

The client sends the raw Gram ``G_k = H_kᵀ H_k`` (not ``A_k = G_k + γI``: the server adds γ once,
so the paper's ``-(|S_c|-1)γI`` correction of eq. 13 disappears, docs/method.md §1) and, per active
class, ``b_{k,c} = H_kᵀ y_{k,c}`` with the balanced labels of eq. 7.

Streaming: eq. 7 normalises by the class counts, which are known only at the end. Because
``b_{k,c} = S⁺_c / N⁺ - S⁻_c / N⁻`` with ``S^±_c`` the sums of positive / negative feature rows,
we accumulate ``S^±`` and the counts and normalise in ``finalize``: exact, one pass, float64.
The Gram is accumulated as ``h.T @ h``, which numpy computes with BLAS ``dsyrk`` (one triangle,
then mirrored: half the flops of a general product) without importing scipy (a site daemon that
only computes statistics saves scipy's start-up).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from numpy.typing import NDArray

from afl.core.labels import ABSENT, LabelError, usable_classes


@dataclass(frozen=True)
class LocalStats:
    """What one client computes for round 1. ``b[:, c]`` is zero where ``contributes[c]`` is False."""

    n: int
    gram: NDArray[np.float64]  # (d, d), symmetric, raw HᵀH
    b: NDArray[np.float64]  # (d, C), eq. 12 per class
    contributes: NDArray[np.bool_]  # (C,): active and usable (both positives and negatives)
    n_pos: NDArray[np.int64]
    n_neg: NDArray[np.int64]
    skipped: tuple[str, ...] = field(default=())

    @property
    def d(self) -> int:
        return int(self.gram.shape[0])

    def restricted_to(self, active: NDArray[np.bool_]) -> LocalStats:
        """The statistics this client would send if it labelled only ``active`` classes.

        Exact: b_{k,c} (eq. 12) depends on class c's labels alone, so statistics computed with
        every class labelled can be restricted afterwards (simulations reuse one pass over H).
        """
        active = np.asarray(active, dtype=bool)
        if active.shape != self.contributes.shape:
            raise LabelError(
                f"active mask must have shape {self.contributes.shape}, got {active.shape}"
            )
        keep = self.contributes & active
        return LocalStats(
            n=self.n,
            gram=self.gram,
            b=np.where(keep, self.b, 0.0),
            contributes=keep,
            n_pos=np.where(active, self.n_pos, 0),
            n_neg=np.where(active, self.n_neg, 0),
            skipped=tuple(
                r
                for r in self.skipped
                if any(r.startswith(f"class {c}:") for c in np.flatnonzero(active))
            ),
        )


class StatsAccumulator:
    """One-pass accumulator of G_k, S⁺, S⁻ and counts over feature batches."""

    def __init__(self, *, d: int, num_classes: int) -> None:
        if d < 1 or num_classes < 1:
            raise ValueError(f"need d >= 1 and num_classes >= 1, got d={d}, C={num_classes}")
        self.d = d
        self.num_classes = num_classes
        self.n = 0
        self._gram = np.zeros((d, d), dtype=np.float64)
        self._pos_sum = np.zeros((d, num_classes), dtype=np.float64)
        self._neg_sum = np.zeros((d, num_classes), dtype=np.float64)
        self._n_pos = np.zeros(num_classes, dtype=np.int64)
        self._n_neg = np.zeros(num_classes, dtype=np.int64)

    def update(self, features: NDArray[np.floating], labels: NDArray[np.integer]) -> None:
        """Add a batch: features (n, d), labels (n, C) in {-1, 0, 1}."""
        h = np.asarray(features, dtype=np.float64)
        y = np.asarray(labels)
        if h.ndim != 2 or h.shape[1] != self.d:
            raise ValueError(f"features must be (n, {self.d}), got {h.shape}")
        if y.shape != (h.shape[0], self.num_classes):
            raise LabelError(f"labels must be ({h.shape[0]}, {self.num_classes}), got {y.shape}")
        if not np.isfinite(h).all():
            raise ValueError("features contain NaN or inf")
        if not np.isin(y, (ABSENT, 0, 1)).all():
            raise LabelError("labels must be -1 (not labelled), 0 or 1")
        if h.shape[0] == 0:
            return
        # h.T and h share one buffer: numpy's matmul recognises AᵀA and calls BLAS dsyrk.
        self._gram += h.T @ h
        pos = (y == 1).astype(np.float64)
        neg = (y == 0).astype(np.float64)
        self._pos_sum += h.T @ pos
        self._neg_sum += h.T @ neg
        self._n_pos += pos.sum(axis=0).astype(np.int64)
        self._n_neg += neg.sum(axis=0).astype(np.int64)
        self.n += h.shape[0]

    def gram(self) -> NDArray[np.float64]:
        """The symmetric Gram matrix HᵀH accumulated so far."""
        upper = np.triu(self._gram)  # exactly symmetric, whatever the BLAS did below it
        return np.ascontiguousarray(upper + np.triu(upper, 1).T)

    def finalize(self, *, active: NDArray[np.bool_]) -> LocalStats:
        """Eq. 7 + eq. 12: normalise the class sums into balanced projections b_{k,c}."""
        active = np.asarray(active, dtype=bool)
        if active.shape != (self.num_classes,):
            raise LabelError(
                f"active mask must have shape ({self.num_classes},), got {active.shape}"
            )
        n_pos = np.where(active, self._n_pos, 0)
        n_neg = np.where(active, self._n_neg, 0)
        unlabelled = active & (self._n_pos + self._n_neg != self.n)
        if unlabelled.any():
            raise LabelError(
                f"active classes {np.flatnonzero(unlabelled).tolist()} have unlabelled rows"
            )
        usable, reasons = usable_classes(n_pos, n_neg, active=active)
        inv_pos = np.divide(1.0, n_pos, out=np.zeros(self.num_classes), where=usable)
        inv_neg = np.divide(1.0, n_neg, out=np.zeros(self.num_classes), where=usable)
        b = self._pos_sum * inv_pos - self._neg_sum * inv_neg
        return LocalStats(
            n=self.n,
            gram=self.gram(),
            b=b,
            contributes=usable,
            n_pos=n_pos,
            n_neg=n_neg,
            skipped=reasons,
        )


def local_statistics(
    features: NDArray[np.floating],
    labels: NDArray[np.integer],
    *,
    active: NDArray[np.bool_],
    batch_size: int = 4096,
) -> LocalStats:
    """Convenience: stream a whole (memory-mapped) feature matrix through the accumulator."""
    acc = StatsAccumulator(d=features.shape[1], num_classes=labels.shape[1])
    for start in range(0, features.shape[0], batch_size):
        acc.update(features[start : start + batch_size], labels[start : start + batch_size])
    return acc.finalize(active=active)
