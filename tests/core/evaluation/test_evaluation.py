"""Federated evaluation statistics (afl.core.evaluation.federated, afl.core.evaluation.scorebins): site statistics
against direct counts, additivity, and the pooled metrics against scikit-learn on the pooled
binned rows (docs/method.md §3.1-3.2)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.special import expit
from sklearn.metrics import average_precision_score, balanced_accuracy_score, roc_auc_score

from afl.core.evaluation.federated import (
    EvaluationError,
    EvaluationStats,
    confusion_bacc,
    evaluation_statistics,
    histogram_auc,
    histogram_average_precision,
    pooled_metrics,
    sum_statistics,
)
from afl.core.evaluation.scorebins import (
    DEFAULT_SCORE_BINS,
    ScoreBins,
    ScoreBinsError,
    symmetric_log_bins,
)

CLASSES = ("A", "B", "C")


def _site(rng: np.random.Generator, n: int, d: int = 6) -> tuple[np.ndarray, np.ndarray]:
    feats = rng.normal(size=(n, d)).astype(np.float32)
    labels = (rng.random((n, len(CLASSES))) < 0.3).astype(np.int8)
    return feats, labels


def _weights(rng: np.random.Generator, d: int = 6) -> np.ndarray:
    return rng.normal(size=(d, len(CLASSES))) * 1e-4  # tiny scores, as balanced targets give


def test_bins_reject_bad_edges_and_index_by_definition() -> None:
    for bad in ([], [1.0, 1.0], [2.0, 1.0], [0.0, np.inf], [np.nan]):
        with pytest.raises(ScoreBinsError):
            ScoreBins.from_edges(bad)
    bins = ScoreBins.from_edges([-1.0, 0.0, 2.0])
    z = np.array([-5.0, -1.0, -0.5, 0.0, 1e-300, 2.0, 2.5])
    # bin j = (e_{j-1}, e_j]: the number of edges strictly below the score
    want = [sum(e < v for e in bins.edges) for v in z]
    assert bins.index(z).tolist() == want == [0, 0, 1, 1, 2, 2, 3]
    np.testing.assert_array_equal(bins.representatives(), [-1.0, -0.5, 1.0, 2.0])
    with pytest.raises(ScoreBinsError):
        bins.index(np.array([np.nan]))


def test_symmetric_log_bins_are_symmetric_around_zero() -> None:
    bins = symmetric_log_bins(min_abs=1e-3, max_abs=1e1, per_decade=5)
    e = bins.array
    assert e.size == 2 * (4 * 5 + 1) + 1
    np.testing.assert_allclose(e, -e[::-1], rtol=0, atol=0)
    assert 0.0 in bins.edges
    np.testing.assert_allclose(e[e > 0][[0, -1]], [1e-3, 1e1], rtol=1e-12)
    ratios = e[e > 0][1:] / e[e > 0][:-1]
    np.testing.assert_allclose(ratios, 10 ** (1 / 5), rtol=1e-9)
    assert DEFAULT_SCORE_BINS.num_bins == 1284


def test_site_statistics_match_a_direct_count() -> None:
    rng = np.random.default_rng(0)
    feats, labels = _site(rng, 120)
    labels[:7, 1] = -1  # rows not labelled for class B
    w = _weights(rng)
    bins = symmetric_log_bins(min_abs=1e-7, max_abs=1e-2, per_decade=4)
    stats = evaluation_statistics(
        feats, labels, weights=w, classes=CLASSES, bins=bins, batch_size=32
    )
    z = feats.astype(np.float64) @ w
    for c in range(len(CLASSES)):
        for y in (0, 1):
            for j in range(bins.num_bins):
                lo = -np.inf if j == 0 else bins.edges[j - 1]
                hi = np.inf if j == bins.num_bins - 1 else bins.edges[j]
                want = sum(1 for i in range(120) if labels[i, c] == y and lo < z[i, c] <= hi)
                assert stats.histograms[c, y, j] == want
        pos, neg = labels[:, c] == 1, labels[:, c] == 0
        decide = expit(z[:, c]) > 0.5
        want_conf = [
            (decide & pos).sum(),
            (~decide & pos).sum(),
            (decide & neg).sum(),
            (~decide & neg).sum(),
        ]
        assert stats.confusion[c].tolist() == want_conf
    assert stats.n_pos.tolist() == [(labels[:, c] == 1).sum() for c in range(3)]


def test_unlabelled_classes_contribute_zeros() -> None:
    rng = np.random.default_rng(1)
    feats, labels = _site(rng, 50)
    stats = evaluation_statistics(
        feats,
        labels,
        weights=_weights(rng),
        classes=CLASSES,
        bins=DEFAULT_SCORE_BINS,
        labelled=np.array([True, False, True]),
    )
    assert stats.histograms[1].sum() == 0 and stats.confusion[1].sum() == 0
    assert stats.histograms[0].sum() == 50


def test_summed_site_statistics_equal_the_pooled_rows() -> None:
    rng = np.random.default_rng(2)
    sites = [_site(rng, n) for n in (40, 75, 33)]
    w = _weights(rng)
    bins = DEFAULT_SCORE_BINS
    parts = [evaluation_statistics(f, y, weights=w, classes=CLASSES, bins=bins) for f, y in sites]
    pooled = evaluation_statistics(
        np.concatenate([f for f, _ in sites]),
        np.concatenate([y for _, y in sites]),
        weights=w,
        classes=CLASSES,
        bins=bins,
    )
    total = sum_statistics(parts)
    np.testing.assert_array_equal(total.histograms, pooled.histograms)
    np.testing.assert_array_equal(total.confusion, pooled.confusion)
    # decoded float64 sums (what a masked or CKKS release returns) round-trip exactly
    again = EvaluationStats.from_sums(
        classes=CLASSES,
        bins=bins,
        threshold=0.5,
        histograms=total.histograms.astype(np.float64).ravel(),
        confusion=total.confusion.astype(np.float64).ravel(),
    )
    np.testing.assert_array_equal(again.histograms, pooled.histograms)
    with pytest.raises(EvaluationError, match="integer"):
        EvaluationStats.from_sums(
            classes=CLASSES,
            bins=bins,
            threshold=0.5,
            histograms=total.histograms.ravel() + 0.25,
            confusion=total.confusion.ravel(),
        )
    with pytest.raises(EvaluationError):
        parts[0] + evaluation_statistics(
            *sites[0], weights=w, classes=CLASSES, bins=symmetric_log_bins(per_decade=3)
        )


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6)), min_size=2, max_size=12),
)
def test_histogram_auc_and_ap_equal_sklearn_on_binned_rows(counts: list[tuple[int, int]]) -> None:
    neg = np.array([n for n, _ in counts])
    pos = np.array([p for _, p in counts])
    if pos.sum() == 0 or neg.sum() == 0:
        assert np.isnan(histogram_auc(neg, pos))
        return
    # the pooled rows, each score replaced by its bin index
    scores = np.concatenate(
        [np.repeat(np.arange(len(counts)), neg), np.repeat(np.arange(len(counts)), pos)]
    )
    y = np.concatenate([np.zeros(neg.sum()), np.ones(pos.sum())])
    assert histogram_auc(neg, pos) == pytest.approx(roc_auc_score(y, scores), abs=1e-12)
    assert histogram_average_precision(neg, pos) == pytest.approx(
        average_precision_score(y, scores), abs=1e-12
    )


def test_pooled_metrics_equal_sklearn_on_the_pooled_binned_scores() -> None:
    rng = np.random.default_rng(3)
    sites = [_site(rng, n, d=6) for n in (300, 200, 250)]
    w = _weights(rng)
    bins = DEFAULT_SCORE_BINS
    total = sum_statistics(
        [evaluation_statistics(f, y, weights=w, classes=CLASSES, bins=bins) for f, y in sites]
    )
    metrics = pooled_metrics(total)
    feats = np.concatenate([f for f, _ in sites]).astype(np.float64)
    labels = np.concatenate([y for _, y in sites])
    z = feats @ w
    for c in range(len(CLASSES)):
        y = labels[:, c] == 1
        binned = bins.index(z[:, c])
        assert metrics.auc[c] == pytest.approx(roc_auc_score(y, binned), abs=1e-12)
        assert metrics.ap[c] == pytest.approx(average_precision_score(y, binned), abs=1e-12)
        assert metrics.bacc[c] == pytest.approx(
            balanced_accuracy_score(y, expit(z[:, c]) > 0.5), abs=1e-12
        )
        # the default grid is fine enough that binning costs little against exact scores
        assert abs(metrics.auc[c] - roc_auc_score(y, z[:, c])) < 5e-3


def test_confusion_bacc_and_undefined_classes() -> None:
    assert confusion_bacc(np.array([3, 1, 2, 6])) == pytest.approx(0.5 * (3 / 4 + 6 / 8))
    assert np.isnan(confusion_bacc(np.array([0, 0, 2, 6])))
    bins = ScoreBins.from_edges([0.0])
    stats = EvaluationStats(
        ("x",),
        bins,
        0.5,
        np.array([[[4, 5], [0, 0]]], dtype=np.int64),
        np.array([[0, 0, 5, 4]], dtype=np.int64),
    )
    m = pooled_metrics(stats)
    assert m.undefined == ("x",) and np.isnan(m.auc[0])
