"""An independent oracle for federated evaluations: scikit-learn on the pooled rows.

Each class is measured on the rows labelled for it (label 0 or 1; -1 rows are left out). The
scores ``z = h · w_c`` are replaced by their bin (the number of the plan's edges strictly below z,
docs/method.md §3.1), so ROC AUC and average precision are scikit-learn's on tied scores, which is
what summed histograms determine; BACC is scikit-learn's balanced accuracy at σ(z) > 0.5.
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


def pooled_metrics_oracle(
    features: NDArray[np.float64],
    labels: NDArray[np.int8],
    *,
    weights: NDArray[np.float64],
    classes: Sequence[str],
    edges: NDArray[np.float64],
) -> dict[str, dict[str, float]]:
    """Per class: bacc, auc, ap, n_pos, n_neg of the pooled rows (module docstring)."""
    z = features @ weights
    out = {}
    for c, name in enumerate(classes):
        rows = labels[:, c] >= 0
        y = labels[rows, c].astype(int)
        binned = np.searchsorted(edges, z[rows, c], side="left")
        decided = 1.0 / (1.0 + np.exp(-z[rows, c])) > 0.5
        out[name] = {
            "bacc": float(balanced_accuracy_score(y, decided)),
            "auc": float(roc_auc_score(y, binned)),
            "ap": float(average_precision_score(y, binned)),
            "n_pos": int(y.sum()),
            "n_neg": int((y == 0).sum()),
        }
    return out
