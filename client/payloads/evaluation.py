"""A site's payloads for the evaluation releases of a plan (docs/method.md §3.2-3.3): score
histograms and confusion counts of a verified, published model on the site's feature cache.

For every release of kind SCORE_HISTOGRAM or CONFUSION_COUNTS the site is a member of, the site

1. checks the release's ``EvaluationSpec`` (:func:`afl.proto.wire.read_evaluation`: 32-byte model
   digest, finite strictly increasing bins within :data:`afl.core.evaluation.scorebins.MAX_EDGES`, threshold
   in (0, 1), shape) and that it evaluates exactly the model the site verified (the digest of the
   signed ``Model`` bytes): a site never scores its data with a model it has not verified;
2. computes :func:`afl.core.evaluation.federated.evaluation_statistics` with the model's columns for the
   release's classes, over the rows of its cache, for the classes it labels (its other classes,
   and classes its cache does not hold, send zeros, as in the ``global`` scope);
3. returns the flat float64 values (integer counts, exact in float64 and in every mode's
   encoding) encoded by the round's mode, grouped per upload slot
   (:func:`afl.client.payloads.stats.encode_slots`).

The leakage audit of these releases is the site's usual policy check
(:func:`afl.client.policy.plan.check_plan`; quantities in
:func:`afl.core.evaluation.federated.evaluation_quantities`); which model and which rows a site evaluates in
a run's evaluation round is :mod:`afl.client.daemon.evaluation`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import numpy as np
from numpy.typing import NDArray

from afl.client.payloads.dp import dp_rows, noisy_values
from afl.client.payloads.stats import PayloadError, SlotPayload, encode_slots
from afl.core.data.featurecache import FeatureCache
from afl.core.evaluation.federated import (
    EvaluationError,
    EvaluationStats,
    coarsen_histograms,
    confusion_from_histograms,
    decision_edge,
    evaluation_statistics,
)
from afl.proto.v1 import common_pb2 as cpb
from afl.proto.wire import EVALUATION_KINDS, WireError, read_evaluation

__all__ = ["evaluation_slot_payloads", "evaluation_values", "is_evaluation_plan"]


def is_evaluation_plan(plan: cpb.ReleasePlan) -> bool:
    """Whether ``plan`` is an evaluation round's (it holds an evaluation release)."""
    return any(r.kind in EVALUATION_KINDS for r in plan.releases)


def evaluation_values(
    release: cpb.Release,
    *,
    cache: FeatureCache,
    labelled: NDArray[np.bool_],
    weights: NDArray[np.float64],
    model_classes: Sequence[str],
    model_sha256: str,
    memo: dict[tuple[object, ...], EvaluationStats] | None = None,
    rows: NDArray[np.int64] | None = None,
    min_mass: int = 0,
) -> NDArray[np.float64]:
    """The site's flat float64 contribution to one evaluation release (module docstring).

    ``labelled`` is over the cache's columns; ``weights`` (d, C) follows ``model_classes``;
    ``memo`` reuses statistics between releases with the same classes, bins and threshold;
    ``rows`` (DP: the unit's rows, :func:`afl.client.payloads.dp.dp_rows`) the cache rows
    evaluated (default all); ``min_mass`` > 1 (a plan without DP: the site's ``min_cohort``)
    coarsens the histograms so that every bin is 0 or holds ≥ ``min_mass`` rows
    (:func:`afl.core.evaluation.federated.coarsen_histograms`) and derives the confusion counts
    from them (docs/protocol.md §6.1)."""
    try:
        spec = read_evaluation(release)
    except WireError as exc:
        raise PayloadError(str(exc)) from exc
    if spec.model_sha256 != model_sha256:
        raise PayloadError(
            f"release {release.name} evaluates model {spec.model_sha256[:16]}…, not the model "
            f"this site verified ({model_sha256[:16]}…)"
        )
    names = list(cache.meta.classes)
    unknown = [c for c in spec.classes if c not in model_classes]
    if unknown:
        raise PayloadError(f"release {release.name}: classes {unknown} are not the model's")
    if weights.shape != (cache.meta.d, len(model_classes)):
        raise PayloadError(f"model weights {weights.shape} do not fit d = {cache.meta.d}")
    key = (spec.classes, spec.bins, spec.threshold)
    stats = None if memo is None else memo.get(key)
    if stats is None:
        held = np.array([c in names for c in spec.classes], dtype=bool)
        # A class the cache does not hold reads column 0 but is not labelled: zeros.
        cache_cols = [names.index(c) if c in names else 0 for c in spec.classes]
        model_cols = [list(model_classes).index(c) for c in spec.classes]
        take = slice(None) if rows is None else rows
        stats = evaluation_statistics(
            np.asarray(cache.features[take]),
            np.asarray(cache.labels[take][:, cache_cols]),
            weights=np.ascontiguousarray(weights[:, model_cols]),
            classes=spec.classes,
            bins=spec.bins,
            labelled=np.asarray(labelled, dtype=bool)[cache_cols] & held,
            threshold=spec.threshold,
        )
        if min_mass > 1:
            try:
                edge = decision_edge(spec.bins, spec.threshold)
            except EvaluationError as exc:
                raise PayloadError(f"release {release.name}: {exc}") from exc
            hist = coarsen_histograms(stats.histograms, min_count=min_mass, edge=edge)
            stats = replace(
                stats, histograms=hist, confusion=confusion_from_histograms(hist, edge=edge)
            )
        if memo is not None:
            memo[key] = stats
    source = (
        stats.histograms if spec.kind == cpb.STATISTIC_KIND_SCORE_HISTOGRAM else stats.confusion
    )
    return np.ascontiguousarray(source, dtype=np.float64).ravel()


def evaluation_slot_payloads(
    plan: cpb.ReleasePlan,
    *,
    site_id: str,
    cache: FeatureCache,
    labelled: NDArray[np.bool_],
    weights: NDArray[np.float64],
    model_classes: Sequence[str],
    model_sha256: str,
    encode: Callable[[cpb.Release, NDArray[np.float64]], bytes],
    min_mass: int = 0,
) -> list[SlotPayload]:
    """One encoded payload per upload slot of the plan's evaluation releases the site is in.

    Under DP (``plan.dp.enabled``, docs/protocol.md §6.1) the site evaluates the unit's rows only
    (the first m images of each patient, as in training: the sensitivity m·√C assumes it) and
    adds its discrete Gaussian share to each release (:func:`afl.client.payloads.dp.
    noisy_values`), fresh per release; without DP, ``min_mass`` (the site's ``min_cohort``)
    coarsens its histograms (:func:`evaluation_values`)."""
    memo: dict[tuple[object, ...], EvaluationStats] = {}
    rows = dp_rows(plan, n=cache.meta.n, patients=cache.patients) if plan.dp.enabled else None

    def values(release: cpb.Release) -> NDArray[np.float64]:
        exact = evaluation_values(
            release,
            cache=cache,
            labelled=labelled,
            weights=weights,
            model_classes=model_classes,
            model_sha256=model_sha256,
            memo=memo,
            rows=rows,
            min_mass=0 if plan.dp.enabled else min_mass,
        )
        return noisy_values(release, exact) if plan.dp.enabled else exact

    return encode_slots(
        (
            (r, values(r))
            for r in plan.releases
            if site_id in r.member_site_ids and r.kind in EVALUATION_KINDS
        ),
        encode=encode,
    )
