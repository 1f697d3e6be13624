"""Inference and evaluation (paper eq. 23-25; docs/method.md §1).

Scores are ``σ(H W)``; a class is predicted positive when ``p > 0.5`` (the paper's threshold).
With balanced targets the raw scores are tiny, so ``p`` sits near 0.5 and the threshold acts as
``H w_c > 0``: reported as observed, never tuned here.

Per class on the full test set with all true labels: BACC = (TP/P + TN/N)/2, AUC = area under
the ROC curve, AP = scikit-learn average precision; macro means over classes. A class with no
positives or no negatives in the test set has undefined AUC/AP/BACC: it is reported as NaN and
left out of the macro mean (and named in ``undefined``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

THRESHOLD = 0.5


def predict_proba(
    features: NDArray[np.floating], weights: NDArray[np.float64], *, batch_size: int = 8192
) -> NDArray[np.float64]:
    """σ(H W) for a (memory-mapped) feature matrix, in row blocks."""
    from scipy.special import expit  # on demand: importing afl.core loads neither scipy nor sklearn

    out = np.empty((features.shape[0], weights.shape[1]), dtype=np.float64)
    for start in range(0, features.shape[0], batch_size):
        block = np.asarray(features[start : start + batch_size], dtype=np.float64)
        out[start : start + batch_size] = expit(block @ weights)
    return out


@dataclass(frozen=True)
class Metrics:
    """Per-class and macro BACC / AUC / AP."""

    classes: tuple[str, ...]
    bacc: NDArray[np.float64]
    auc: NDArray[np.float64]
    ap: NDArray[np.float64]
    undefined: tuple[str, ...]

    @property
    def macro_bacc(self) -> float:
        return float(np.nanmean(self.bacc)) if np.isfinite(self.bacc).any() else float("nan")

    @property
    def macro_auc(self) -> float:
        return float(np.nanmean(self.auc)) if np.isfinite(self.auc).any() else float("nan")

    @property
    def macro_ap(self) -> float:
        return float(np.nanmean(self.ap)) if np.isfinite(self.ap).any() else float("nan")

    def to_json(self) -> dict[str, Any]:
        def clean(x: float) -> float | None:
            return None if np.isnan(x) else float(x)

        return {
            "macro": {
                "bacc": clean(self.macro_bacc),
                "auc": clean(self.macro_auc),
                "map": clean(self.macro_ap),
            },
            "per_class": {
                name: {"bacc": clean(b), "auc": clean(a), "ap": clean(p)}
                for name, b, a, p in zip(self.classes, self.bacc, self.auc, self.ap, strict=True)
            },
            "undefined_classes": list(self.undefined),
        }


def evaluate(
    probabilities: NDArray[np.float64],
    labels: NDArray[np.integer],
    *,
    classes: Sequence[str],
    threshold: float = THRESHOLD,
) -> Metrics:
    """Per-class BACC at ``p > threshold``, ROC AUC and average precision."""
    if probabilities.shape != labels.shape or labels.shape[1] != len(classes):
        raise ValueError(
            f"probabilities {probabilities.shape}, labels {labels.shape}, {len(classes)} classes"
        )
    if not np.isin(labels, (0, 1)).all():
        raise ValueError("test labels must be complete 0/1 (no missing entries)")
    num_classes = len(classes)
    bacc = np.full(num_classes, np.nan)
    auc = np.full(num_classes, np.nan)
    ap = np.full(num_classes, np.nan)
    undefined = []
    for c in range(num_classes):
        y = labels[:, c] == 1
        if y.all() or not y.any():
            undefined.append(classes[c])
            continue
        bacc[c], auc[c], ap[c] = class_metrics(y, probabilities[:, c], threshold=threshold)
    return Metrics(tuple(classes), bacc, auc, ap, tuple(undefined))


def class_metrics(
    positive: NDArray[np.bool_], probabilities: NDArray[np.float64], *, threshold: float = THRESHOLD
) -> tuple[float, float, float]:
    """(BACC at ``p > threshold``, ROC AUC, AP) of one class; needs both labels present."""
    from sklearn.metrics import average_precision_score, roc_auc_score

    pred = probabilities > threshold
    bacc = 0.5 * (pred[positive].mean() + (~pred[~positive]).mean())
    auc = roc_auc_score(positive, probabilities)
    ap = average_precision_score(positive, probabilities)
    return float(bacc), float(auc), float(ap)
