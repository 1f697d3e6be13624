"""The leakage audit covers the evaluation releases (afl.core.evaluation.federated.evaluation_quantities,
afl.core.leakage; docs/protocol.md §6): a plan whose evaluation releases let the coordinator
recover a site's own statistics (and so its local metrics) by differencing is flagged, and the
audit's certificate reconstructs exactly that site's histograms and metrics from the released
sums; plans over all participants expose nothing."""

from __future__ import annotations

import numpy as np

from afl.core.evaluation.federated import (
    EvaluationStats,
    evaluation_quantities,
    evaluation_statistics,
    pooled_metrics,
    sum_statistics,
)
from afl.core.evaluation.scorebins import DEFAULT_SCORE_BINS
from afl.core.leakage import Release, audit_releases

CLASSES = ("A", "B")
SITES = tuple(f"s{k}" for k in range(5))
MODEL_A, MODEL_B = "aa" * 32, "bb" * 32


def _rows(name: str, members: frozenset[str], model: str) -> list[Release]:
    return [
        Release(f"{name}#{q}", members, q)
        for q in evaluation_quantities(CLASSES, model_sha256=model)
    ]


def _site_stats(seed: int, w: np.ndarray) -> EvaluationStats:
    rng = np.random.default_rng(seed)
    feats = rng.normal(size=(80, 4))
    labels = (rng.random((80, 2)) < 0.4).astype(np.int8)
    return evaluation_statistics(feats, labels, weights=w, classes=CLASSES, bins=DEFAULT_SCORE_BINS)


def test_evaluation_over_all_participants_exposes_nothing() -> None:
    everyone = frozenset(SITES)
    report = audit_releases(_rows("eval", everyone, MODEL_A), SITES, min_cohort=3)
    assert report.passed
    # the same for two models evaluated over the same cohort
    both = _rows("eval-a", everyone, MODEL_A) + _rows("eval-b", everyone, MODEL_B)
    assert audit_releases(both, SITES, min_cohort=3).passed


def test_differencing_two_evaluations_is_flagged_and_the_certificate_recovers_the_site() -> None:
    """The row-space test covers the metrics: when a site's histograms are determined, the
    certificate reproduces them (and so its local AUC/BACC) exactly from the released sums."""
    w = np.random.default_rng(9).normal(size=(4, 2)) * 1e-3
    stats = {s: _site_stats(k, w) for k, s in enumerate(SITES)}
    all_five = frozenset(SITES)
    without_s4 = frozenset(SITES[:4])  # e.g. a replacement evaluation after s4 dropped out
    releases = _rows("eval-1", all_five, MODEL_A) + _rows("eval-2", without_s4, MODEL_A)
    report = audit_releases(releases, SITES, min_cohort=3)
    assert not report.passed
    assert report.exposed_site_ids() == {"s4"}
    released = {
        "eval-1": sum_statistics([stats[s] for s in all_five]),
        "eval-2": sum_statistics([stats[s] for s in sorted(without_s4)]),
    }
    for exposure in report.exposed_sites:
        assert exposure.sites == {"s4"}
        # Σ coefficient · released sum, over the releases the certificate names
        hist = sum(
            float(coef) * released[name.split("#")[0]].histograms
            for name, coef in exposure.certificate
        )
        np.testing.assert_array_equal(hist, stats["s4"].histograms)
    recovered = EvaluationStats.from_sums(
        classes=CLASSES,
        bins=DEFAULT_SCORE_BINS,
        threshold=0.5,
        histograms=released["eval-1"].histograms - released["eval-2"].histograms,
        confusion=released["eval-1"].confusion - released["eval-2"].confusion,
    )
    np.testing.assert_array_equal(pooled_metrics(recovered).auc, pooled_metrics(stats["s4"]).auc)


def test_label_counts_link_evaluations_of_different_models() -> None:
    """Evaluations of two different models share the label counts: differencing them over
    different cohorts exposes a site's positive and negative counts, and the audit says so."""
    releases = _rows("eval-a", frozenset(SITES), MODEL_A) + _rows(
        "eval-b", frozenset(SITES[1:]), MODEL_B
    )
    report = audit_releases(releases, SITES, min_cohort=3)
    exposed = {(e.quantity, tuple(sorted(e.sites))) for e in report.exposed_sites}
    assert exposed == {("labels[A]", ("s0",)), ("labels[B]", ("s0",))}
    w_a = np.random.default_rng(1).normal(size=(4, 2)) * 1e-3
    w_b = np.random.default_rng(2).normal(size=(4, 2)) * 1e-3
    a = sum_statistics([_site_stats(k, w_a) for k in range(5)])
    b = sum_statistics([_site_stats(k, w_b) for k in range(1, 5)])
    np.testing.assert_array_equal(a.n_pos - b.n_pos, _site_stats(0, w_a).n_pos)


def test_per_coverage_evaluation_of_a_missing_one_coverage_exposes_sites() -> None:
    """Evaluating each class only over its labellers (S_c) in a Missing-1 style coverage
    determines single sites, exactly as the per-class Gram releases do (docs/protocol.md §6);
    the global form (every class over every participant, non-labellers send zeros) does not."""
    coverage = {
        c: frozenset(s for s in SITES if s != skip)
        for c, skip in zip(CLASSES, SITES[:2], strict=True)
    }
    per_cov = [
        Release(f"hist[{c}]#{q}", members, q)
        for c, members in coverage.items()
        for q in evaluation_quantities((c,), model_sha256=MODEL_A)
    ]
    # one class each: no exposure yet; add a global label-count release and s0/s1 are determined
    glob = [
        Release(f"all#{q}", frozenset(SITES), q)
        for q in evaluation_quantities(CLASSES, model_sha256=MODEL_B)
    ]
    report = audit_releases(per_cov + glob, SITES, min_cohort=3)
    assert {e.quantity for e in report.exposed_sites} == {"labels[A]", "labels[B]"}
    assert report.exposed_site_ids() == {"s0", "s1"}
