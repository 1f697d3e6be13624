"""Metrics against hand-computed values and scikit-learn's own definitions."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.metrics import balanced_accuracy_score

from afl.core.metrics import evaluate, predict_proba


def test_bacc_matches_sklearn_balanced_accuracy():
    rng = np.random.default_rng(0)
    labels = (rng.random((500, 3)) < 0.2).astype(np.int8)
    probs = np.clip(0.5 + 0.3 * (labels - 0.5) + rng.normal(scale=0.2, size=labels.shape), 0, 1)
    m = evaluate(probs, labels, classes=("a", "b", "c"))
    for c in range(3):
        assert m.bacc[c] == pytest.approx(balanced_accuracy_score(labels[:, c], probs[:, c] > 0.5))
    assert m.macro_bacc == pytest.approx(m.bacc.mean())


def test_hand_computed_auc_and_ap():
    labels = np.array([[1], [0], [1], [0]], dtype=np.int8)
    probs = np.array([[0.9], [0.8], [0.4], [0.1]])
    m = evaluate(probs, labels, classes=("x",))
    assert m.auc[0] == pytest.approx(0.75)  # pairs ranked right: (0.9>0.8, 0.9>0.1, 0.4>0.1) of 4
    assert m.ap[0] == pytest.approx((1.0 + 2 / 3) / 2)
    assert m.bacc[0] == pytest.approx(0.5 * (0.5 + 0.5))


def test_class_without_positives_is_undefined_not_averaged():
    labels = np.array([[1, 0], [0, 0]], dtype=np.int8)
    m = evaluate(np.array([[0.9, 0.2], [0.1, 0.3]]), labels, classes=("a", "b"))
    assert m.undefined == ("b",)
    assert np.isnan(m.auc[1]) and m.macro_auc == pytest.approx(1.0)
    assert m.to_json()["per_class"]["b"]["auc"] is None


def test_predict_proba_is_sigmoid_of_scores():
    h = np.array([[1.0, 0.0], [0.0, 2.0]])
    w = np.array([[0.0], [1.0]])
    np.testing.assert_allclose(predict_proba(h, w, batch_size=1)[:, 0], [0.5, 1 / (1 + np.exp(-2))])


def test_incomplete_test_labels_are_rejected():
    with pytest.raises(ValueError, match="complete"):
        evaluate(np.zeros((1, 1)), np.array([[-1]]), classes=("a",))
