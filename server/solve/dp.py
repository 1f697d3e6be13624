"""The server's solve in DP mode: normalise the noisy additive statistics, regularise Ĝ to the
noise level, solve (docs/protocol.md §7; steps 4-5 of :mod:`afl.core.dp.stats`).

Round 1: for every class group of the plan (releases ``gram``, ``s_pos``, ``t_sum``, ``counts``
over one member set, :mod:`afl.server.plan.dp`), with noisy sums Ĝ, Ŝ+ (d x C_r), T̂ (d x C_r)
and counts n̂+, N̂ (rows of the 2 x C_r ``counts``):

    b_c = Ŝ+_c / n̂+_c - (T̂_c - Ŝ+_c) / (N̂_c - n̂+_c)     (pooled balanced targets, eq. 7 pooled)
    w_c = (Ĝ + λI)_+^{-1} b_c,  λ = γ + √(2d)·σ_G          (eq. 15; _+ = eigenvalues floored at γ)

via :func:`afl.core.dp.stats.balanced_targets` (counts floored at 1),
:func:`afl.core.dp.stats.noise_ridge` (σ_G the Gram release's σ in the signed plan: the ridge is
raised to the noise level, AdaSSP-style) and :func:`afl.core.dp.stats.regularised_gram`; all are
post-processing, so they cost no privacy. A Gram release without label statistics (the
``gram[all]`` a per-class round 1 plans for round 2) is not used in round 1.

Round 2 (eq. 20-22 with the pooled normalisation): W = (Ĝ_all + λI)_+^{-1} (B_1 + α·B_pseudo),
Ĝ_all round 1's ``gram[all]``, B_1 round 1's targets as above, B_pseudo the pooled balanced
targets of round 2's ``pseudo_s_pos``, ``pseudo_t_sum`` and ``pseudo_counts``; a class whose noisy
pseudo counts fall below δ+ positives or δ- negatives gets no pseudo target (the paper's per-site
gate applied to the noisy pooled counts: post-processing, whereas a gate at each site would depend
on one patient's rows).

Difference from the paper: b is normalised over the pooled rows of the group (one unit of positive
and negative mass in total) instead of per client (one unit per site); the two agree for one site,
and W differs from the paper's by the per-class weighting of sites (docs/protocol.md §7). The
Gram's symmetric noise is already symmetrised by the sites. Classes in no group keep w_c = 0.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
from numpy.typing import NDArray

from afl.core.aggregation import AggregationError
from afl.core.dp.evaluation import dp_score_bins, score_scales
from afl.core.dp.stats import (
    SufficientStatistics,
    balanced_targets,
    noise_ridge,
    regularised_gram,
)
from afl.core.evaluation.scorebins import ScoreBins
from afl.core.refinement import RefinementParams
from afl.proto.v1 import common_pb2, coordinator_pb2
from afl.server.plan.release import GLOBAL_GRAM, PlannedRelease, releases_from_plan

__all__ = ["dp_evaluation_bins", "solve_dp_round", "solve_dp_run"]

FloatArray = NDArray[np.float64]
_LABEL_KINDS: tuple[int, ...] = (
    common_pb2.STATISTIC_KIND_POSITIVE_SUM,
    common_pb2.STATISTIC_KIND_FEATURE_SUM,
    common_pb2.STATISTIC_KIND_COUNT,
)
_PSEUDO_KINDS: tuple[int, ...] = (
    common_pb2.STATISTIC_KIND_PSEUDO_POSITIVE_SUM,
    common_pb2.STATISTIC_KIND_PSEUDO_FEATURE_SUM,
    common_pb2.STATISTIC_KIND_PSEUDO_COUNT,
)


def _label_stats(
    gram: FloatArray, by_kind: Mapping[int, PlannedRelease], sums: Mapping[str, FloatArray]
) -> tuple[tuple[str, ...], SufficientStatistics]:
    """The (pseudo-)label statistics of one group: s_pos, t_sum and counts by kind, in order."""
    s_pos, t_sum, counts = by_kind.values()
    classes = s_pos.class_names
    if t_sum.class_names != classes or counts.class_names != classes:
        raise AggregationError(f"DP plan: the statistics of {s_pos.name} disagree on classes")
    c = np.asarray(sums[counts.name], dtype=np.float64).reshape(2, len(classes))
    stats = SufficientStatistics(
        gram=gram,
        positive_sum=np.asarray(sums[s_pos.name], dtype=np.float64).T,
        positive_count=c[0],
        label_sum=np.asarray(sums[t_sum.name], dtype=np.float64).T,
        label_count=c[1],
    )
    return classes, stats


def _groups(
    releases: Sequence[PlannedRelease], sums: Mapping[str, FloatArray]
) -> list[tuple[PlannedRelease, tuple[str, ...], SufficientStatistics]]:
    """Every round-1 group with label statistics: (its Gram release, classes, statistics)."""
    out = []
    for gram in (r for r in releases if r.kind == common_pb2.STATISTIC_KIND_GRAM):
        same: dict[int, PlannedRelease] = {
            r.kind: r for r in releases if r.members == gram.members and r is not gram
        }
        if not same:
            continue  # gram[all] planned for round 2 only
        if set(same) != set(_LABEL_KINDS) or len(same) != len(_LABEL_KINDS):
            raise AggregationError(f"DP plan: {gram.name} lacks its s_pos/t_sum/counts releases")
        ordered = {k: same[k] for k in _LABEL_KINDS}
        g = np.asarray(sums[gram.name], dtype=np.float64)
        classes, stats = _label_stats(g, ordered, sums)
        out.append((gram, classes, stats))
    if not out:
        raise AggregationError("DP plan has no Gram release with label statistics")
    return out


def _cho_solve(factor: tuple[FloatArray, bool], rhs: FloatArray) -> FloatArray:
    from scipy.linalg import cho_solve

    solved: FloatArray = cho_solve(factor, rhs)
    return solved


def _factor(
    gram: FloatArray, *, gamma: float, sigma_gram: float, name: str
) -> tuple[FloatArray, bool]:
    from scipy.linalg import cho_factor  # on demand: importing the coordinator loads no scipy

    ridge = gamma + noise_ridge(sigma_gram=sigma_gram, d=gram.shape[0])
    a = regularised_gram(gram + (ridge - gamma) * np.eye(gram.shape[0]), gamma=gamma)
    try:
        factor: tuple[FloatArray, bool] = cho_factor(a, lower=False, check_finite=True)
    except np.linalg.LinAlgError as exc:  # pragma: no cover - floored eigenvalues
        raise AggregationError(f"{name}: Ĝ + λI is not positive definite") from exc
    return factor


def _round_one_targets(
    groups: Sequence[tuple[PlannedRelease, tuple[str, ...], SufficientStatistics]],
    classes: Sequence[str],
) -> FloatArray:
    """B_1 (d, C): each group's pooled balanced targets in its classes' columns."""
    d = groups[0][2].gram.shape[0]
    out = np.zeros((d, len(classes)), dtype=np.float64)
    for _, group, stats in groups:
        b = balanced_targets(stats, min_count=1.0)
        for j, cls in enumerate(group):
            out[:, list(classes).index(cls)] = b[:, j]
    return out


def solve_dp_round(
    releases: Sequence[PlannedRelease],
    sums: Mapping[str, FloatArray],
    *,
    classes: Sequence[str],
    gamma: float,
    sigmas: Mapping[str, float] | None = None,
) -> FloatArray:
    """W (d, C) from the noisy sums of a DP round 1 (module docstring); ``sigmas``: each
    release's σ from the plan (None: noise-free sums, ridge γ only)."""
    groups = _groups(releases, sums)
    weights = np.zeros((groups[0][2].gram.shape[0], len(classes)), dtype=np.float64)
    for gram, group, stats in groups:
        sigma = 0.0 if sigmas is None else sigmas[gram.name]
        factor = _factor(stats.gram, gamma=gamma, sigma_gram=sigma, name=gram.name)
        w = _cho_solve(factor, balanced_targets(stats, min_count=1.0))
        for j, cls in enumerate(group):
            weights[:, list(classes).index(cls)] = w[:, j]
    return weights


def solve_dp_round_two(
    first: tuple[Sequence[PlannedRelease], Mapping[str, FloatArray], Mapping[str, float]],
    releases: Sequence[PlannedRelease],
    sums: Mapping[str, FloatArray],
    *,
    classes: Sequence[str],
    gamma: float,
    refinement: RefinementParams,
) -> FloatArray:
    """W (d, C) of round 2 (module docstring); ``first``: round 1's releases, sums and σ."""
    first_releases, first_sums, first_sigmas = first
    if GLOBAL_GRAM not in first_sums:
        raise AggregationError(f"round 1 released no {GLOBAL_GRAM} for round 2")
    gram = np.asarray(first_sums[GLOBAL_GRAM], dtype=np.float64)
    b_real = _round_one_targets(_groups(first_releases, first_sums), classes)
    pseudo = {r.kind: r for r in releases if r.kind in _PSEUDO_KINDS}
    if len(pseudo) != len(_PSEUDO_KINDS):
        raise AggregationError("DP round 2 lacks its pseudo_s_pos/pseudo_t_sum/pseudo_counts")
    group, stats = _label_stats(gram, {k: pseudo[k] for k in _PSEUDO_KINDS}, sums)
    b = balanced_targets(stats, min_count=1.0)
    negatives = stats.label_count - stats.positive_count
    keep = (stats.positive_count >= refinement.delta_pos) & (negatives >= refinement.delta_neg)
    b_pseudo = np.zeros_like(b_real)
    for j, cls in enumerate(group):
        if keep[j]:
            b_pseudo[:, list(classes).index(cls)] = b[:, j]
    factor = _factor(gram, gamma=gamma, sigma_gram=first_sigmas[GLOBAL_GRAM], name=GLOBAL_GRAM)
    weights: FloatArray = _cho_solve(factor, b_real + refinement.alpha * b_pseudo)
    return weights


def _plan_sigmas(plan_bytes: bytes) -> dict[str, float]:
    plan = common_pb2.ReleasePlan.FromString(plan_bytes)
    return {r.name: float(r.noise.sigma) for r in plan.releases}


def solve_dp_run(
    plan_bytes: bytes,
    sums: Mapping[str, FloatArray],
    *,
    parent: tuple[bytes, Mapping[str, FloatArray]] | None,
    classes: Sequence[str],
    gamma: float,
    refinement: RefinementParams,
) -> FloatArray:
    """W of a DP round from its signed plan and released sums; round 2 passes round 1's signed
    plan and sums as ``parent``."""
    releases = releases_from_plan(plan_bytes)
    if parent is None:
        return solve_dp_round(
            releases, sums, classes=classes, gamma=gamma, sigmas=_plan_sigmas(plan_bytes)
        )
    first_plan, first_sums = parent
    first = (releases_from_plan(first_plan), first_sums, _plan_sigmas(first_plan))
    return solve_dp_round_two(
        first, releases, sums, classes=classes, gamma=gamma, refinement=refinement
    )


def dp_evaluation_bins(
    model: bytes, *, plan_bytes: bytes, sums: Mapping[str, FloatArray], num_bins: int
) -> ScoreBins:
    """The score bins of a DP evaluation of ``model`` (its ``Model`` bytes): equal-mass bins of
    N(0, s²) and the edge 0 (:func:`afl.core.dp.evaluation.dp_score_bins`), s the median over
    classes of the score scale each round-1 group's released noisy Gram, feature sums and
    counts give W (:func:`afl.core.dp.evaluation.score_scales`; ``plan_bytes`` and ``sums``
    those of the run's round 1): post-processing of released statistics, no budget spent.
    AggregationError when they give no scale."""
    message = coordinator_pb2.Model.FromString(model)
    shape = tuple(int(x) for x in message.weights.shape)
    weights = np.frombuffer(message.weights.data, dtype="<f8").astype(np.float64).reshape(shape)
    classes = list(message.class_names)
    scales: list[float] = []
    for _, group, stats in _groups(releases_from_plan(plan_bytes), sums):
        cols = [classes.index(c) for c in group]
        s = score_scales(
            weights=weights[:, cols],
            gram=stats.gram,
            label_sum=stats.label_sum.T,
            label_count=stats.label_count,
        )
        scales += [float(x) for x in s if np.isfinite(x)]
    if not scales:
        raise AggregationError("the run's released statistics give no score scale for its bins")
    return dp_score_bins(scale=float(np.median(scales)), num_bins=num_bins)
