"""An independent oracle for federated evaluations: scikit-learn on the pooled rows.

Each class is measured on the rows labelled for it (label 0 or 1; -1 rows are left out). The
scores ``z = h · w_c`` are replaced by their bin (the number of the plan's edges strictly below z,
docs/method.md §3.1), so ROC AUC and average precision are scikit-learn's on tied scores, which is
what summed histograms determine; BACC is scikit-learn's balanced accuracy at σ(z) > 0.5.

Sites coarsen their histograms without DP (docs/protocol.md §6.1, every bin 0 or ≥ k =
``min_cohort`` of the site's rows): with ``sites`` (each pooled row's site) and ``min_cohort``,
each row's bin is first moved as the rule says, written here row by row
(:func:`coarsened_bins`), and the metrics are scikit-learn's on the moved bins.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray
from sklearn.metrics import average_precision_score, balanced_accuracy_score, roc_auc_score


def pooled_rows(
    blocks: Sequence[tuple[NDArray[Any], NDArray[Any]]],
) -> tuple[NDArray[np.float64], NDArray[np.int8]]:
    """(features, labels) of every site's evaluated rows, stacked."""
    feats = np.concatenate([np.asarray(f, dtype=np.float64) for f, _ in blocks])
    labels = np.concatenate([np.asarray(y, dtype=np.int8) for _, y in blocks])
    return feats, labels


def coarsened_bins(bins: NDArray[np.int64], *, k: int, edge: int) -> NDArray[np.int64]:
    """The bin each of one site's rows (one class, one label) is released in, -1 for none: with
    fewer than k rows none is released; a side of the decision edge with fewer than k rows moves
    next to the edge on the other side (upwards on a tie); then on each side the rows, a bin at a
    time in bin order, fill groups that close once they hold k rows (the rows left over join the
    side's last group), each released in the bin of its lower-median row."""
    out = np.asarray(bins, dtype=np.int64).copy()
    if k <= 1:
        return out
    if len(out) < k:
        return np.full(len(out), -1, dtype=np.int64)
    below = out < edge
    if below.sum() < k or (~below).sum() < k:
        if (~below).sum() >= below.sum():
            out[below] = edge
        else:
            out[~below] = edge - 1
    result = out.copy()
    for side in (out < edge, out >= edge):
        rows = np.flatnonzero(side)
        groups: list[list[int]] = []
        pending: list[int] = []
        for b in sorted(set(out[rows].tolist())):  # a bin's rows stay together
            pending += [int(i) for i in rows[out[rows] == b]]
            if len(pending) >= k:
                groups.append(pending)
                pending = []
        if pending:
            groups[-1] += pending
        for group in groups:
            ordered = sorted(group, key=lambda i: int(out[i]))
            result[group] = out[ordered[(len(ordered) - 1) // 2]]
    return result


def pooled_metrics_oracle(
    features: NDArray[np.float64],
    labels: NDArray[np.int8],
    *,
    weights: NDArray[np.float64],
    classes: Sequence[str],
    edges: NDArray[np.float64],
    sites: NDArray[np.int64] | None = None,
    min_cohort: int = 1,
) -> dict[str, dict[str, float]]:
    """Per class: bacc, auc, ap, n_pos, n_neg of the pooled rows (module docstring)."""
    z = features @ weights
    edge = int(np.searchsorted(edges, 0.0, side="left")) + 1  # bins >= edge: σ(z) > 0.5
    out = {}
    for c, name in enumerate(classes):
        rows = labels[:, c] >= 0
        binned = np.searchsorted(edges, z[:, c], side="left")
        decided_all = 1.0 / (1.0 + np.exp(-z[:, c])) > 0.5
        if sites is not None and min_cohort > 1:
            for site in np.unique(sites):
                for label in (0, 1):
                    pick = np.flatnonzero((sites == site) & (labels[:, c] == label))
                    binned[pick] = coarsened_bins(binned[pick], k=min_cohort, edge=edge)
            rows &= binned >= 0
            decided_all = binned >= edge
        y = labels[rows, c].astype(int)
        binned = binned[rows]
        decided = decided_all[rows]
        out[name] = {
            "bacc": float(balanced_accuracy_score(y, decided)),
            "auc": float(roc_auc_score(y, binned)),
            "ap": float(average_precision_score(y, binned)),
            "n_pos": int(y.sum()),
            "n_neg": int((y == 0).sum()),
        }
    return out
