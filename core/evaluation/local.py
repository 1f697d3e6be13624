"""A site's evaluation of a model on its own labelled hold-out, with bootstrap confidence
intervals (docs/method.md §3.4).

For every class the site labels, on the rows labelled for it (label 0 or 1; −1 rows are left
out): BACC at the paper's decision ``p > 0.5``, ROC AUC and average precision (the definitions
of :func:`afl.core.metrics.class_metrics`, scikit-learn). The confidence interval is the
percentile bootstrap: ``n_boot`` resamples of the rows with replacement (numpy
``default_rng(SeedSequence(seed, spawn_key=(c,)))`` for class column c, so a class's interval does not
depend on which other classes are evaluated); a resample with only one label value is skipped
and counted; the interval is the (α/2, 1 − α/2) quantiles of the resampled metric with
α = 1 − ``confidence``. The point estimate is the metric on all rows.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from afl.core.metrics import THRESHOLD, class_metrics

__all__ = [
    "ClassEvaluation",
    "Interval",
    "LocalEvaluation",
    "bootstrap_evaluation",
    "bootstrap_indices",
]

METRIC_NAMES = ("bacc", "auc", "ap")


@dataclass(frozen=True)
class Interval:
    """A point estimate and its bootstrap confidence interval."""

    estimate: float
    low: float
    high: float

    def to_json(self) -> dict[str, float | None]:
        def clean(v: float) -> float | None:
            return None if math.isnan(v) else v

        return {"estimate": clean(self.estimate), "low": clean(self.low), "high": clean(self.high)}


@dataclass(frozen=True)
class ClassEvaluation:
    name: str
    n_pos: int
    n_neg: int
    bacc: Interval
    auc: Interval
    ap: Interval
    resamples_used: int
    note: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "n_pos": self.n_pos,
            "n_neg": self.n_neg,
            "bacc": self.bacc.to_json(),
            "auc": self.auc.to_json(),
            "ap": self.ap.to_json(),
            "resamples_used": self.resamples_used,
            **({"note": self.note} if self.note else {}),
        }


@dataclass(frozen=True)
class LocalEvaluation:
    classes: tuple[ClassEvaluation, ...]
    n_rows: int
    n_boot: int
    confidence: float
    seed: int
    threshold: float

    def to_json(self) -> dict[str, Any]:
        return {
            "n_rows": self.n_rows,
            "bootstrap": {
                "resamples": self.n_boot,
                "confidence": self.confidence,
                "seed": self.seed,
                "method": "percentile bootstrap over rows",
            },
            "decision_threshold": self.threshold,
            "per_class": {c.name: c.to_json() for c in self.classes},
        }


def bootstrap_indices(n: int, *, n_boot: int, seed: int, stream: int) -> NDArray[np.int64]:
    """The (n_boot, n) resample indices of class stream ``stream`` (module docstring)."""
    rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(stream,)))
    return rng.integers(0, n, size=(n_boot, n), dtype=np.int64)


def _nan_interval() -> Interval:
    return Interval(math.nan, math.nan, math.nan)


def bootstrap_evaluation(
    probabilities: NDArray[np.floating],
    labels: NDArray[np.integer],
    *,
    classes: Sequence[str],
    labelled: NDArray[np.bool_],
    threshold: float = THRESHOLD,
    n_boot: int = 1000,
    confidence: float = 0.95,
    seed: int = 0,
) -> LocalEvaluation:
    """Per-class metrics with percentile-bootstrap intervals for the ``labelled`` classes."""
    p_all = np.asarray(probabilities, dtype=np.float64)
    y_all = np.asarray(labels)
    if p_all.shape != y_all.shape or p_all.shape[1] != len(classes):
        raise ValueError(
            f"probabilities {p_all.shape}, labels {y_all.shape}, {len(classes)} classes"
        )
    if not 0 < confidence < 1 or n_boot < 1:
        raise ValueError("confidence must lie in (0, 1) and n_boot be >= 1")
    alpha = 1.0 - confidence
    out = []
    for c in (int(i) for i in np.flatnonzero(np.asarray(labelled, dtype=bool))):
        rows = y_all[:, c] >= 0
        y = y_all[rows, c] == 1
        p = p_all[rows, c]
        n_pos, n_neg = int(y.sum()), int((~y).sum())
        if n_pos == 0 or n_neg == 0:
            nan = _nan_interval()
            out.append(
                ClassEvaluation(
                    classes[c], n_pos, n_neg, nan, nan, nan, 0, "needs positives and negatives"
                )
            )
            continue
        point = class_metrics(y, p, threshold=threshold)
        draws = []
        for idx in bootstrap_indices(y.size, n_boot=n_boot, seed=seed, stream=c):
            yb = y[idx]
            if yb.all() or not yb.any():
                continue
            draws.append(class_metrics(yb, p[idx], threshold=threshold))
        values = np.asarray(draws, dtype=np.float64).reshape(-1, 3)
        intervals = []
        for m in range(3):
            if values.shape[0] == 0:
                intervals.append(Interval(point[m], math.nan, math.nan))
                continue
            low, high = np.quantile(values[:, m], [alpha / 2, 1 - alpha / 2])
            intervals.append(Interval(point[m], float(low), float(high)))
        bacc, auc, ap = intervals
        out.append(ClassEvaluation(classes[c], n_pos, n_neg, bacc, auc, ap, values.shape[0]))
    return LocalEvaluation(tuple(out), int(p_all.shape[0]), n_boot, confidence, seed, threshold)
