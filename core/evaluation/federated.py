"""Federated evaluation statistics: additive per-class releases and the pooled metrics computed
from their sums (docs/method.md §3.2).

A site evaluates a published model W on its own labelled rows without revealing a per-image score:
for every class c it labels, with scores ``z_i = h_i · w_c`` and labels ``y_ic`` (1 positive,
0 negative; −1 rows are skipped),

* the **score histograms** ``hist[c, y, j] = #{i : y_ic = y, z_i in bin j}`` over the plan's fixed
  bins (:mod:`afl.core.evaluation.scorebins`), y = 0 (negatives) and 1 (positives);
* the **confusion counts** at the paper's decision ``p_i = σ(z_i) > threshold`` (eq. 23):
  ``(TP, FN, FP, TN)`` per class.

Both are sums over rows, hence additive over sites: the release of a group of sites is the sum
of its members' statistics (masking and CKKS sum them like any release, as exact integers).
Classes a site does not label contribute zeros, as non-labellers do for ``b_c`` in the ``global``
scope (docs/protocol.md §6).

From the summed statistics (:func:`pooled_metrics`):

* BACC = (TP/(TP+FN) + TN/(TN+FP)) / 2 (eq. 23) from the confusion counts;
* AUC from the histograms (Mann–Whitney with ties counted half):
  ``AUC = Σ_j N_j (Σ_{k>j} P_k + P_j / 2) / (P · N)`` where ``P_j``, ``N_j`` are the positive and
  negative counts of bin j; it equals the exact ROC AUC of the pooled rows with every score
  replaced by its bin (:func:`histogram_auc`);
* AP from the histograms: ``AP = Σ_k (R_k − R_{k−1}) · Prec_k`` over the bins from the highest
  score down, the exact average precision of the pooled binned scores
  (:func:`histogram_average_precision`, scikit-learn's definition).

The metrics are those of the pooled rows at the bins' resolution; the bins' effect on AUC/AP is
reported in docs/benchmarks.md §7. What the releases add to the leakage audit is
:func:`evaluation_quantities`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from afl.core.evaluation.scorebins import ScoreBins
from afl.core.metrics import THRESHOLD, Metrics

#: ``format`` of :func:`federated_evaluation_document` (read by ``afl export`` and ``afl report``).
FEDERATED_EVALUATION_FORMAT = "afl-federated-evaluation"

__all__ = [
    "CONFUSION_FIELDS",
    "FEDERATED_EVALUATION_FORMAT",
    "EvaluationError",
    "EvaluationStats",
    "coarsen_histograms",
    "confusion_bacc",
    "confusion_from_histograms",
    "decision_edge",
    "evaluation_quantities",
    "evaluation_statistics",
    "federated_evaluation_document",
    "histogram_auc",
    "histogram_average_precision",
    "pooled_metrics",
    "sum_statistics",
]

#: Column order of the confusion counts.
CONFUSION_FIELDS = ("tp", "fn", "fp", "tn")


class EvaluationError(ValueError):
    """Evaluation statistics of different shapes, classes, bins or thresholds, or bad inputs."""


@dataclass(frozen=True)
class EvaluationStats:
    """One site's (or a sum of sites') evaluation statistics for a model.

    ``histograms[c, 0]`` counts the negatives and ``histograms[c, 1]`` the positives of class c
    per score bin; ``confusion[c]`` is (TP, FN, FP, TN) at ``σ(z) > threshold``.
    """

    classes: tuple[str, ...]
    bins: ScoreBins
    threshold: float
    histograms: NDArray[np.int64]  # (C, 2, B)
    confusion: NDArray[np.int64]  # (C, 4)

    def __post_init__(self) -> None:
        c, b = len(self.classes), self.bins.num_bins
        if self.histograms.shape != (c, 2, b) or self.confusion.shape != (c, 4):
            raise EvaluationError(
                f"histograms {self.histograms.shape} / confusion {self.confusion.shape} do not "
                f"fit {c} classes and {b} bins"
            )
        if (self.histograms < 0).any() or (self.confusion < 0).any():
            raise EvaluationError("counts must be non-negative")

    @property
    def n_pos(self) -> NDArray[np.int64]:
        out: NDArray[np.int64] = self.histograms[:, 1].sum(axis=1)
        return out

    @property
    def n_neg(self) -> NDArray[np.int64]:
        out: NDArray[np.int64] = self.histograms[:, 0].sum(axis=1)
        return out

    def __add__(self, other: EvaluationStats) -> EvaluationStats:
        if (self.classes, self.bins, self.threshold) != (
            other.classes,
            other.bins,
            other.threshold,
        ):
            raise EvaluationError("cannot add evaluation statistics of other classes or bins")
        return EvaluationStats(
            self.classes,
            self.bins,
            self.threshold,
            self.histograms + other.histograms,
            self.confusion + other.confusion,
        )

    @classmethod
    def from_sums(
        cls,
        *,
        classes: Sequence[str],
        bins: ScoreBins,
        threshold: float,
        histograms: NDArray[np.number[Any]],
        confusion: NDArray[np.number[Any]],
    ) -> EvaluationStats:
        """Statistics from released float64 sums (exact integers after decoding)."""
        h = np.asarray(histograms, dtype=np.float64).reshape(len(classes), 2, bins.num_bins)
        m = np.asarray(confusion, dtype=np.float64).reshape(len(classes), 4)
        for name, arr in (("histograms", h), ("confusion", m)):
            if not np.isfinite(arr).all() or (np.abs(arr - np.round(arr)) > 1e-6).any():
                raise EvaluationError(f"released {name} are not integer counts")
        return cls(
            tuple(classes),
            bins,
            float(threshold),
            np.round(h).astype(np.int64),
            np.round(m).astype(np.int64),
        )


def sum_statistics(parts: Sequence[EvaluationStats]) -> EvaluationStats:
    """Σ over sites (what a release of all of them holds)."""
    if not parts:
        raise EvaluationError("nothing to sum")
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total


def evaluation_statistics(
    features: NDArray[np.floating],
    labels: NDArray[np.integer],
    *,
    weights: NDArray[np.float64],
    classes: Sequence[str],
    bins: ScoreBins,
    labelled: NDArray[np.bool_] | None = None,
    threshold: float = THRESHOLD,
    batch_size: int = 8192,
) -> EvaluationStats:
    """A site's statistics (module docstring), streamed over row blocks of a (memory-mapped)
    feature matrix. ``labelled[c]`` False makes class c's statistics zero; rows with label −1 are
    skipped per class. Scores are float64 ``h · W`` as in :func:`afl.core.metrics.predict_proba`."""
    n, d = features.shape
    num_classes = len(classes)
    if weights.shape != (d, num_classes) or labels.shape != (n, num_classes):
        raise EvaluationError(
            f"features {features.shape}, labels {labels.shape}, W {weights.shape} and "
            f"{num_classes} classes do not fit together"
        )
    from scipy.special import expit  # on demand: importing afl.core loads no scipy

    mask = np.ones(num_classes, bool) if labelled is None else np.asarray(labelled, bool)
    hist = np.zeros((num_classes, 2, bins.num_bins), dtype=np.int64)
    conf = np.zeros((num_classes, 4), dtype=np.int64)
    for start in range(0, n, batch_size):
        h = np.asarray(features[start : start + batch_size], dtype=np.float64)
        z = h @ weights
        decide = expit(z) > threshold
        index = bins.index(z)
        y = np.asarray(labels[start : start + batch_size])
        for c in np.flatnonzero(mask):
            for value in (0, 1):
                rows = y[:, c] == value
                hist[c, value] += np.bincount(index[rows, c], minlength=bins.num_bins)
            pos, neg = y[:, c] == 1, y[:, c] == 0
            conf[c] += [
                np.count_nonzero(decide[pos, c]),
                np.count_nonzero(~decide[pos, c]),
                np.count_nonzero(decide[neg, c]),
                np.count_nonzero(~decide[neg, c]),
            ]
    return EvaluationStats(tuple(classes), bins, float(threshold), hist, conf)


def histogram_auc(negatives: NDArray[np.integer], positives: NDArray[np.integer]) -> float:
    """ROC AUC of binned scores: ``Σ_j N_j (Σ_{k>j} P_k + P_j/2) / (P·N)``; NaN without both."""
    neg = np.asarray(negatives, dtype=np.float64)
    pos = np.asarray(positives, dtype=np.float64)
    total_pos, total_neg = pos.sum(), neg.sum()
    if total_pos == 0 or total_neg == 0:
        return float("nan")
    above = total_pos - np.cumsum(pos)  # positives in higher bins
    return float((neg * (above + 0.5 * pos)).sum() / (total_pos * total_neg))


def histogram_average_precision(
    negatives: NDArray[np.integer], positives: NDArray[np.integer]
) -> float:
    """Average precision of binned scores (thresholds at each occupied bin, highest first):
    ``Σ_k (R_k − R_{k−1}) · TP_k / (TP_k + FP_k)``; NaN without positives."""
    neg = np.asarray(negatives, dtype=np.float64)[::-1]
    pos = np.asarray(positives, dtype=np.float64)[::-1]
    total_pos = pos.sum()
    if total_pos == 0 or neg.sum() == 0:
        return float("nan")
    tp, fp = np.cumsum(pos), np.cumsum(neg)
    hit = pos > 0  # a bin without positives adds no recall
    return float((pos[hit] / total_pos * tp[hit] / (tp[hit] + fp[hit])).sum())


def confusion_bacc(counts: NDArray[np.integer]) -> float:
    """BACC = (TP/(TP+FN) + TN/(TN+FP)) / 2 from (TP, FN, FP, TN); NaN without both labels."""
    tp, fn, fp, tn = (float(x) for x in np.asarray(counts).ravel())
    if tp + fn == 0 or tn + fp == 0:
        return float("nan")
    return 0.5 * (tp / (tp + fn) + tn / (tn + fp))


def pooled_metrics(stats: EvaluationStats) -> Metrics:
    """Per-class BACC (confusion counts), AUC and AP (histograms) of summed statistics."""
    num_classes = len(stats.classes)
    bacc, auc, ap = (np.full(num_classes, np.nan) for _ in range(3))
    undefined = []
    for c, name in enumerate(stats.classes):
        neg, pos = stats.histograms[c]
        if pos.sum() == 0 or neg.sum() == 0:
            undefined.append(name)
            continue
        bacc[c] = confusion_bacc(stats.confusion[c])
        auc[c] = histogram_auc(neg, pos)
        ap[c] = histogram_average_precision(neg, pos)
    return Metrics(stats.classes, bacc, auc, ap, tuple(undefined))


def evaluation_quantities(classes: Sequence[str], *, model_sha256: str) -> list[str]:
    """The linear quantities an evaluation release of ``classes`` sums, for the leakage audit
    (:func:`afl.core.leakage.audit_releases`, docs/protocol.md §6).

    Per class c two quantities: ``eval[c]@<model>``, the histograms and confusion counts of that
    model (one quantity: the confusion counts are sums of histogram bins when the threshold's
    logit is an edge, so releases of either can be differenced against the other), and
    ``labels[c]``, the class's positive and negative counts, which every evaluation release of c
    determines whatever the model (Σ_j hist = counts; TP + FN = positives): evaluations of two
    models over different member sets can be differenced through it.
    """
    out = []
    for c in classes:
        out += [f"eval[{c}]@{model_sha256}", f"labels[{c}]"]
    return out


def federated_evaluation_document(
    stats: EvaluationStats, *, model_sha256: str, members: Sequence[str] = ()
) -> dict[str, Any]:
    """The pooled metrics of summed statistics as a JSON document bound to the model, with the
    per-class counts (what the coordinator reports; no site's own figures)."""
    metrics = pooled_metrics(stats).to_json()
    for c, name in enumerate(stats.classes):
        metrics["per_class"][name].update(n_pos=int(stats.n_pos[c]), n_neg=int(stats.n_neg[c]))
    return {
        "format": FEDERATED_EVALUATION_FORMAT,
        "model_sha256": model_sha256,
        "members": list(members),
        "score_bins": stats.bins.num_bins,
        "decision_threshold": stats.threshold,
        **metrics,
    }


def decision_edge(bins: ScoreBins, threshold: float) -> int:
    """The number of bins at or below the decision (σ(z) > threshold ⟺ z > logit(threshold)):
    bins j < e hold the rows decided negative, j ≥ e the rows decided positive, when the logit is
    an edge (bin j holds (edge_{j-1}, edge_j]). EvaluationError when it is not one."""
    logit = float(np.log(threshold / (1.0 - threshold)))
    edges = bins.array
    hit = np.flatnonzero(np.abs(edges - logit) <= 1e-12 * abs(logit))
    if hit.size != 1:
        raise EvaluationError(
            f"the decision threshold {threshold:g} (logit {logit:g}) is not a bin edge: the "
            "confusion counts are not a function of the histogram"
        )
    return int(hit[0]) + 1


def coarsen_histograms(
    hist: NDArray[np.integer], *, min_count: int, edge: int
) -> NDArray[np.int64]:
    """A site's histograms [C, 2, B] with every bin 0 or ≥ ``min_count`` rows' worth of mass
    (docs/protocol.md §6.1, the rule without DP). Per class and label row, on each side of the
    decision edge ``edge`` (:func:`decision_edge`) separately, the rows are swept upwards in bin
    order into groups that close as soon as they hold ≥ k rows (a remainder of fewer than k
    joins the side's last group), and each group is released in the bin of its median row (the
    lower median: both labels' rows move towards their group's middle, so neither label's
    scores are pushed up against the other's). A side with fewer than k rows in all joins the other side's group next to
    the edge (those rows cross the decision); a row of fewer than k rows in all is released as
    zeros (the class's label at this site is left out). Every row stays within the span of its
    group, so the order of the scores is kept up to the groups."""
    h = np.asarray(hist, dtype=np.int64)
    if min_count <= 1:
        return h.copy()
    out = np.zeros_like(h)
    bins = h.shape[-1]
    for c in range(h.shape[0]):
        for y in range(h.shape[1]):
            row = h[c, y]
            total = int(row.sum())
            if total < min_count:
                continue  # released as zeros
            below, above = int(row[:edge].sum()), int(row[edge:].sum())
            if below < min_count or above < min_count:  # one side too small: one side only
                merged = np.zeros_like(row)
                if above >= below:
                    merged[edge:] = row[edge:]
                    merged[edge] += below
                else:
                    merged[:edge] = row[:edge]
                    merged[edge - 1] += above
                row = merged
            out[c, y] = _coarsen_single_sides(row, min_count, edge, bins)
    return out


def _coarsen_single_sides(
    row: NDArray[np.int64], k: int, edge: int, bins: int
) -> NDArray[np.int64]:
    """Both sides of ``row`` hold 0 or ≥ k rows: coarsen each (see :func:`coarsen_histograms`)."""
    out = np.zeros_like(row)
    for lo, hi in ((0, edge), (edge, bins)):
        groups: list[list[int]] = []  # each group's rows, as their bins in increasing order
        current: list[int] = []
        for j in range(lo, hi):
            current += [j] * int(row[j])
            if len(current) >= k:
                groups.append(current)
                current = []
        if current:
            assert groups, "a side holds 0 or at least k rows"
            groups[-1] += current
        for group in groups:
            out[group[(len(group) - 1) // 2]] += len(group)
    return out


def confusion_from_histograms(hist: NDArray[np.integer], *, edge: int) -> NDArray[np.int64]:
    """(TP, FN, FP, TN) per class from histograms [C, 2, B] whose decision edge is ``edge``."""
    h = np.asarray(hist, dtype=np.int64)
    pos, neg = h[:, 1], h[:, 0]
    out: NDArray[np.int64] = np.stack(
        [pos[:, edge:].sum(1), pos[:, :edge].sum(1), neg[:, edge:].sum(1), neg[:, :edge].sum(1)],
        axis=1,
    )
    return out
