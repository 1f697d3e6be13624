"""A site's local evaluation with bootstrap intervals (afl.core.evaluation.local): point
estimates and intervals recomputed with scikit-learn on the same rows and resamples."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.metrics import average_precision_score, balanced_accuracy_score, roc_auc_score

from afl.core.evaluation.local import bootstrap_evaluation, bootstrap_indices

CLASSES = ("A", "B", "C", "D")


def _data(n: int = 300) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(5)
    labels = (rng.random((n, 4)) < [0.2, 0.4, 0.3, 0.1]).astype(np.int8)
    probs = np.clip(0.5 + 0.1 * (labels - 0.5) + rng.normal(scale=0.08, size=(n, 4)), 0, 1)
    labels[:20, 1] = -1  # not labelled for B in the hold-out
    labels[:, 3] = 0  # D: no positives
    return probs, labels


def _sklearn(y: np.ndarray, p: np.ndarray) -> tuple[float, float, float]:
    return (
        balanced_accuracy_score(y, p > 0.5),
        roc_auc_score(y, p),
        average_precision_score(y, p),
    )


def test_estimates_and_intervals_equal_sklearn_on_the_same_rows() -> None:
    probs, labels = _data()
    labelled = np.array([True, True, False, True])
    result = bootstrap_evaluation(
        probs, labels, classes=CLASSES, labelled=labelled, n_boot=200, seed=3
    )
    assert [c.name for c in result.classes] == ["A", "B", "D"]  # C is not labelled here
    for ev in result.classes[:2]:
        c = CLASSES.index(ev.name)
        rows = labels[:, c] >= 0
        y, p = labels[rows, c] == 1, probs[rows, c]
        assert (ev.n_pos, ev.n_neg) == (int(y.sum()), int((~y).sum()))
        want = _sklearn(y, p)
        got = (ev.bacc.estimate, ev.auc.estimate, ev.ap.estimate)
        np.testing.assert_allclose(got, want, atol=1e-12)
        draws = [
            _sklearn(y[i], p[i])
            for i in bootstrap_indices(y.size, n_boot=200, seed=3, stream=c)
            if 0 < y[i].sum() < y.size
        ]
        lows, highs = np.quantile(np.array(draws), [0.025, 0.975], axis=0)
        for m, interval in enumerate((ev.bacc, ev.auc, ev.ap)):
            assert interval.low == pytest.approx(lows[m], abs=1e-12)
            assert interval.high == pytest.approx(highs[m], abs=1e-12)
            assert interval.low <= interval.estimate <= interval.high
        assert ev.resamples_used == len(draws)
    d = result.classes[2]
    assert d.note and np.isnan(d.auc.estimate) and d.resamples_used == 0
    doc = result.to_json()
    assert doc["per_class"]["D"]["auc"]["estimate"] is None
    assert doc["bootstrap"]["resamples"] == 200


def test_a_class_interval_does_not_depend_on_the_other_classes() -> None:
    probs, labels = _data()
    one = bootstrap_evaluation(
        probs, labels, classes=CLASSES, labelled=np.array([False, True, False, False]), n_boot=50
    )
    two = bootstrap_evaluation(
        probs, labels, classes=CLASSES, labelled=np.array([True, True, False, False]), n_boot=50
    )
    assert one.classes[0] == two.classes[1]


def test_bad_arguments_are_refused() -> None:
    probs, labels = _data()
    with pytest.raises(ValueError):
        bootstrap_evaluation(probs[:, :3], labels, classes=CLASSES, labelled=np.ones(4, bool))
    with pytest.raises(ValueError):
        bootstrap_evaluation(
            probs, labels, classes=CLASSES, labelled=np.ones(4, bool), confidence=1.5
        )
