"""What a site sends for a plan it accepted: the one choice among the payload builders, made for
the daemon (:mod:`afl.client.daemon.loop`) and the Flower site (:mod:`afl.flower.site`) alike
(docs/architecture.md §3, a round at a site).

:func:`round_payloads` picks by the plan: an evaluation round's score histograms and confusion
counts (:mod:`afl.client.payloads.evaluation`), a DP round's clipped, noised statistics
(:mod:`afl.client.payloads.dp`), else the exact statistics in the round's class view with, in
round 2, the pseudo-label projections (:mod:`afl.client.payloads.stats`). What comes from outside
the site's data (round 1's model, the model an evaluation scores) the caller has fetched and
verified; nothing here reads the network.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from numpy.typing import NDArray

from afl.client.payloads.dp import dp_round_payloads
from afl.client.payloads.evaluation import evaluation_slot_payloads, is_evaluation_plan
from afl.client.payloads.stats import (
    PayloadError,
    RoundClasses,
    RoundOne,
    SlotPayload,
    load_or_compute_pseudo,
    slot_payloads,
)
from afl.core.data.featurecache import FeatureCache
from afl.proto.v1 import common_pb2 as cpb

__all__ = ["ROUND_TWO_KINDS", "Scoring", "needs_parent_model", "round_payloads"]

#: Release kinds computed from round 1's model (a round-2 plan).
ROUND_TWO_KINDS = (cpb.STATISTIC_KIND_PSEUDO_CLASS_VECTOR, cpb.STATISTIC_KIND_PSEUDO_POSITIVE_SUM)


def needs_parent_model(plan: cpb.ReleasePlan) -> bool:
    """Whether the plan's payloads need round 1's verified model (pseudo-label releases)."""
    return any(r.kind in ROUND_TWO_KINDS for r in plan.releases)


@dataclass(frozen=True, kw_only=True)
class Scoring:
    """What an evaluation round scores: a model the site verified and the rows it scores."""

    weights: NDArray[np.float64]
    classes: Sequence[str]
    model_sha256: str
    cache: FeatureCache
    labelled: NDArray[np.bool_]
    #: Without DP: every released bin 0 or ≥ this many rows (the site's min_cohort, §6.1).
    min_mass: int = 0


def round_payloads(
    plan: cpb.ReleasePlan,
    *,
    site_id: str,
    cache: FeatureCache,
    view: RoundClasses,
    class_names: Sequence[str],
    encode: Callable[[cpb.Release, NDArray[np.float64]], bytes],
    state_dir: Path,
    round_one: RoundOne | None = None,
    scoring: Scoring | None = None,
) -> list[SlotPayload]:
    """This site's payloads for an accepted ``plan``, each encoded by the round's mode
    (``encode``; module docstring). ``view`` is the site's statistics in the round's class order
    ``class_names``; ``round_one`` what a round-2 plan needs; ``scoring`` the model and rows of
    an evaluation plan; ``state_dir`` keeps the pseudo-label projections."""
    if is_evaluation_plan(plan):
        if scoring is None:
            raise PayloadError("an evaluation plan needs the verified model it scores")
        return evaluation_slot_payloads(
            plan,
            site_id=site_id,
            cache=scoring.cache,
            labelled=scoring.labelled,
            weights=scoring.weights,
            model_classes=scoring.classes,
            model_sha256=scoring.model_sha256,
            encode=encode,
            min_mass=scoring.min_mass,
        )
    if round_one is None and needs_parent_model(plan):
        raise PayloadError("a round-2 plan needs the verified round-1 model")
    if plan.dp.enabled:  # docs/protocol.md §7: the unit's rows, clipped, with the noise share
        return dp_round_payloads(
            plan,
            site_id=site_id,
            cache=cache,
            class_names=class_names,
            labels=view.labels(cache.labels),
            labelled=view.labelled,
            encode=encode,
            round_one=round_one,
        )
    pseudo = None
    if round_one is not None and needs_parent_model(plan):
        missing: NDArray[np.bool_] = ~view.labelled
        pseudo, _ = load_or_compute_pseudo(
            cache,
            weights=round_one.weights,
            missing=missing,
            params=round_one.refinement,
            state_dir=state_dir,
        )
    return slot_payloads(
        plan,
        site_id=site_id,
        class_names=class_names,
        stats=view.stats,
        pseudo=pseudo,
        encode=encode,
    )
