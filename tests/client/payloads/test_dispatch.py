"""The one choice of a site's payloads (afl.client.payloads.dispatch): a round-1 plan sends the
exact statistics, a round-2 plan the pseudo-label projections of round 1's model, and a plan
whose inputs the caller did not supply (round 1's model, the model an evaluation scores) is
refused by name. Oracles: afl.core.stats.local_statistics and
afl.core.refinement.pseudo_label_projection on the cache, not the builders."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from afl.client.modes.base import PlaintextMode
from afl.client.payloads.dispatch import needs_parent_model, round_payloads
from afl.client.payloads.stats import (
    PayloadError,
    RoundClasses,
    RoundOne,
    labelled_mask,
    load_or_compute_stats,
    round_classes,
)
from afl.core.data.featurecache import FeatureCache
from afl.core.packing import unpack_upper
from afl.core.refinement import RefinementParams, pseudo_label_projection
from afl.core.stats import local_statistics
from afl.proto.v1 import common_pb2 as cpb
from tests.client.payloads.test_daemon_stats import CLASSES, D, _cache, _release


def _site(root: Path) -> tuple[FeatureCache, RoundClasses]:
    """The cache of test_daemon_stats (the site labels A and B, not C) and its round view."""
    cache = _cache(root / "cache")
    mask, _ = labelled_mask(cache, ())
    stats, _ = load_or_compute_stats(cache, active=mask, state_dir=root / "state")
    view = round_classes(stats, cache_classes=CLASSES, labelled=mask, round_classes=CLASSES)
    return cache, view


def _payloads(
    root: Path, plan: cpb.ReleasePlan, round_one: RoundOne | None = None
) -> dict[str, np.ndarray]:
    cache, view = _site(root)
    out = round_payloads(
        plan,
        site_id="me",
        cache=cache,
        view=view,
        class_names=CLASSES,
        encode=PlaintextMode().encode,
        state_dir=root / "state",
        round_one=round_one,
    )
    return {p.slot: np.frombuffer(p.payload, dtype="<f8") for p in out}


def test_a_round_one_plan_sends_the_exact_statistics(tmp_path: Path) -> None:
    plan = cpb.ReleasePlan(
        releases=[
            _release("gram[all]", cpb.STATISTIC_KIND_GRAM, [], [D, D], cpb.PACKING_UPPER_TRIANGLE),
            _release("b[A]", cpb.STATISTIC_KIND_CLASS_VECTOR, ["A"], [D, 1], cpb.PACKING_DENSE),
        ]
    )
    assert not needs_parent_model(plan)
    sent = _payloads(tmp_path, plan)
    cache, _ = _site(tmp_path / "oracle")
    mask = np.array([True, True, False])
    oracle = local_statistics(np.asarray(cache.features), np.asarray(cache.labels), active=mask)
    np.testing.assert_allclose(unpack_upper(sent["gram[all]"]), oracle.gram, rtol=0, atol=1e-12)
    np.testing.assert_allclose(sent["b[A]"], oracle.b[:, 0], rtol=0, atol=1e-12)


def test_a_round_two_plan_sends_round_one_s_pseudo_labels_and_needs_its_model(
    tmp_path: Path,
) -> None:
    plan = cpb.ReleasePlan(
        releases=[
            _release(
                "p[C]", cpb.STATISTIC_KIND_PSEUDO_CLASS_VECTOR, ["C"], [D, 1], cpb.PACKING_DENSE
            )
        ]
    )
    assert needs_parent_model(plan)
    with pytest.raises(PayloadError, match="needs the verified round-1 model"):
        _payloads(tmp_path / "none", plan)
    w = np.random.default_rng(5).normal(size=(D, 3))
    params = RefinementParams(tau=0.6, alpha=0.5, delta_pos=1, delta_neg=1)
    sent = _payloads(tmp_path / "one", plan, RoundOne(weights=w, refinement=params))
    cache, _ = _site(tmp_path / "oracle")
    oracle = pseudo_label_projection(
        np.asarray(cache.features), weights=w, missing=np.array([False, False, True]), params=params
    )
    np.testing.assert_allclose(sent["p[C]"], oracle.b[:, 2], rtol=0, atol=1e-12)


def test_an_evaluation_plan_without_the_model_it_scores_is_refused(tmp_path: Path) -> None:
    spec = cpb.EvaluationSpec(model_sha256=b"\x01" * 32, score_bin_edges=[0.5])
    release = _release(
        "eval_hist[all]", cpb.STATISTIC_KIND_SCORE_HISTOGRAM, ["A"], [1, 2, 2], cpb.PACKING_DENSE
    )
    release.evaluation.CopyFrom(spec)
    with pytest.raises(PayloadError, match="evaluation plan needs the verified model"):
        _payloads(tmp_path, cpb.ReleasePlan(releases=[release]))
