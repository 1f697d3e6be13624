"""Balanced label projection (paper eq. 7).

For an active class c at client k with N+ positives and N- negatives, sample i gets
``+1/N+`` if positive and ``-1/N-`` if negative; missing (inactive) classes get 0.

The zero-positive / zero-negative case is undefined in the paper (division by zero). We define
it: such a class is *unusable* at that client, its column is all zeros (the client contributes
nothing for it, exactly as if the class were missing there) and the reason is recorded so the
round report can say why (docs/method.md §1).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

ABSENT = -1


class LabelError(ValueError):
    """Labels are malformed (wrong shape, values outside {-1, 0, 1}, unlabelled rows of an active class)."""


@dataclass(frozen=True)
class BalancedTargets:
    """Eq. 7 targets and what made each class usable or not at this client."""

    targets: NDArray[np.float64]  # (N, C)
    usable: NDArray[np.bool_]  # (C,): active and has both positives and negatives
    n_pos: NDArray[np.int64]  # (C,)
    n_neg: NDArray[np.int64]  # (C,)
    skipped: tuple[str, ...]  # human-readable reasons, one per active class that was skipped


def check_labels(labels: NDArray[np.integer], *, active: NDArray[np.bool_]) -> None:
    """Validate a (N, C) label matrix against the client's active-class mask."""
    if labels.ndim != 2:
        raise LabelError(f"labels must be 2-D (N, C), got shape {labels.shape}")
    if active.shape != (labels.shape[1],):
        raise LabelError(
            f"active mask has shape {active.shape}, labels have {labels.shape[1]} classes"
        )
    if not np.isin(labels, (ABSENT, 0, 1)).all():
        raise LabelError("labels must be -1 (not labelled), 0 or 1")
    unlabelled = (labels[:, active] == ABSENT).any(axis=0)
    if unlabelled.any():
        cols = np.flatnonzero(active)[unlabelled].tolist()
        raise LabelError(
            f"active classes {cols} have unlabelled (-1) rows; an active class must be fully labelled"
        )


def class_counts(
    labels: NDArray[np.integer], *, active: NDArray[np.bool_]
) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """Positive and negative counts per class (zero for inactive classes)."""
    n_pos = np.where(active, (labels == 1).sum(axis=0), 0).astype(np.int64)
    n_neg = np.where(active, (labels == 0).sum(axis=0), 0).astype(np.int64)
    return n_pos, n_neg


def usable_classes(
    n_pos: NDArray[np.int64], n_neg: NDArray[np.int64], *, active: NDArray[np.bool_]
) -> tuple[NDArray[np.bool_], tuple[str, ...]]:
    """Active classes with at least one positive and one negative; reasons for the others."""
    usable = active & (n_pos > 0) & (n_neg > 0)
    reasons = tuple(
        f"class {c}: {int(n_pos[c])} positives, {int(n_neg[c])} negatives; "
        "balanced label undefined, class skipped at this client"
        for c in np.flatnonzero(active & ~usable)
    )
    return usable, reasons


def balanced_targets(labels: NDArray[np.integer], *, active: NDArray[np.bool_]) -> BalancedTargets:
    """Eq. 7: the (N, C) balanced label matrix Y_k of one client."""
    labels = np.asarray(labels)
    active = np.asarray(active, dtype=bool)
    check_labels(labels, active=active)
    n_pos, n_neg = class_counts(labels, active=active)
    usable, reasons = usable_classes(n_pos, n_neg, active=active)
    pos_w = np.divide(1.0, n_pos, out=np.zeros(n_pos.shape), where=usable)
    neg_w = np.divide(1.0, n_neg, out=np.zeros(n_neg.shape), where=usable)
    targets = np.where(labels == 1, pos_w, np.where(labels == 0, -neg_w, 0.0))
    targets[:, ~usable] = 0.0
    return BalancedTargets(targets.astype(np.float64), usable, n_pos, n_neg, reasons)
