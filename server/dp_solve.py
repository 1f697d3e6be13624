"""The server's solve in DP mode: normalise the noisy additive statistics, keep Ĝ + γI positive
definite, solve (docs/protocol.md §7; steps 4-5 of :mod:`afl.core.dp_stats`).

For every class group of the plan (releases ``gram``, ``s_pos``, ``t_sum``, ``counts`` over one
member set, :mod:`afl.server.dp_plan`), with noisy sums Ĝ, Ŝ+ (d x C_r), T̂ (d x C_r) and
counts n̂+, N̂ (rows of the 2 x C_r ``counts``):

    b_c = Ŝ+_c / n̂+_c - (T̂_c - Ŝ+_c) / (N̂_c - n̂+_c)     (pooled balanced targets, eq. 7 pooled)
    w_c = (Ĝ + γI)_+^{-1} b_c                               (eq. 15; _+ = eigenvalues floored at γ)

via :func:`afl.core.dp_stats.balanced_targets` (counts floored at 1) and
:func:`afl.core.dp_stats.regularised_gram`; both are post-processing, so they cost no privacy.
Difference from the paper: b is normalised over the pooled rows of the group (one unit of
positive and negative mass in total) instead of per client (one unit per site); the two agree for
one site, and W differs from the paper's by the per-class weighting of sites (docs/protocol.md
§7). The Gram's symmetric noise is already symmetrised by the sites. Classes in no group keep
w_c = 0.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
from numpy.typing import NDArray
from scipy.linalg import cho_factor, cho_solve

from afl.core.aggregation import AggregationError
from afl.core.dp_stats import SufficientStatistics, balanced_targets, regularised_gram
from afl.proto.v1 import common_pb2
from afl.server.plan import PlannedRelease

__all__ = ["solve_dp_round"]

FloatArray = NDArray[np.float64]


def _group_stats(
    gram: PlannedRelease,
    releases: Sequence[PlannedRelease],
    sums: Mapping[str, FloatArray],
) -> tuple[tuple[str, ...], SufficientStatistics]:
    same = [r for r in releases if r.members == gram.members and r is not gram]
    by_kind = {r.kind: r for r in same}
    wanted = (
        common_pb2.STATISTIC_KIND_POSITIVE_SUM,
        common_pb2.STATISTIC_KIND_FEATURE_SUM,
        common_pb2.STATISTIC_KIND_COUNT,
    )
    if len(same) != len(wanted) or set(by_kind) != set(wanted):
        raise AggregationError(f"DP plan: {gram.name} lacks its s_pos/t_sum/counts releases")
    s_pos, t_sum, counts = (by_kind[k] for k in wanted)
    classes = s_pos.class_names
    if t_sum.class_names != classes or counts.class_names != classes:
        raise AggregationError(f"DP plan: the statistics of {gram.name} disagree on classes")
    c = np.asarray(sums[counts.name], dtype=np.float64).reshape(2, len(classes))
    stats = SufficientStatistics(
        gram=np.asarray(sums[gram.name], dtype=np.float64),
        positive_sum=np.asarray(sums[s_pos.name], dtype=np.float64).T,
        positive_count=c[0],
        label_sum=np.asarray(sums[t_sum.name], dtype=np.float64).T,
        label_count=c[1],
    )
    return classes, stats


def solve_dp_round(
    releases: Sequence[PlannedRelease],
    sums: Mapping[str, FloatArray],
    *,
    classes: Sequence[str],
    gamma: float,
) -> FloatArray:
    """W (d, C) from the noisy sums of a DP round (module docstring)."""
    grams = [r for r in releases if r.kind == common_pb2.STATISTIC_KIND_GRAM]
    if not grams:
        raise AggregationError("DP plan has no Gram release")
    d = grams[0].shape[0]
    weights = np.zeros((d, len(classes)), dtype=np.float64)
    for gram in grams:
        group, stats = _group_stats(gram, releases, sums)
        b = balanced_targets(stats, min_count=1.0)
        a = regularised_gram(stats.gram, gamma=gamma)
        try:
            factor = cho_factor(a, lower=False, check_finite=True)
        except np.linalg.LinAlgError as exc:  # pragma: no cover - floored eigenvalues
            raise AggregationError(f"{gram.name}: Ĝ + γI is not positive definite") from exc
        w = cho_solve(factor, b)
        for j, cls in enumerate(group):
            weights[:, list(classes).index(cls)] = w[:, j]
    return weights
