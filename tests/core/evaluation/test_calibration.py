"""Calibration from score histograms (afl.core.evaluation.calibration; docs/method.md §3.3): the federated
fit from masked sums equals the pooled fit on the same bins, Platt and isotonic agree with
scikit-learn on the expanded binned rows, reliability/ECE against scikit-learn's
calibration_curve, and the calibrated τ filter of round 2."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.special import expit
from sklearn.calibration import calibration_curve
from sklearn.isotonic import IsotonicRegression
from sklearn.linear_model import LogisticRegression

from afl.core.evaluation.calibration import (
    Calibration,
    CalibrationError,
    ClassCalibration,
    calibration_document,
    fit_calibration,
    fit_class,
    histogram_reliability,
    reliability_curve,
)
from afl.core.evaluation.federated import EvaluationStats, evaluation_statistics
from afl.core.evaluation.scorebins import DEFAULT_SCORE_BINS, symmetric_log_bins
from afl.core.refinement import RefinementParams, pseudo_label_projection
from afl.lab.bench.calibration import masked_sum

CLASSES = ("A", "B")
MODEL = "ab" * 32


def _data(seed: int, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Features whose scores are tiny (as balanced targets give) but informative."""
    rng = np.random.default_rng(seed)
    labels = (rng.random((n, 2)) < [0.1, 0.3]).astype(np.int8)
    feats = rng.normal(size=(n, 5)) + labels @ np.array([[1.5, 0, 0, 0, 0], [0, 1.0, 0, 0, 0]])
    w = np.zeros((5, 2))
    w[0, 0], w[1, 1] = 2e-4, 3e-4
    return feats, labels, w


def _sites(n_sites: int = 4) -> tuple[list[EvaluationStats], EvaluationStats]:
    w = _data(0, 1)[2]
    parts, rows = [], []
    for k in range(n_sites):
        feats, labels, _ = _data(100 + k, 400 + 50 * k)
        rows.append((feats, labels))
        parts.append(
            evaluation_statistics(
                feats, labels, weights=w, classes=CLASSES, bins=DEFAULT_SCORE_BINS
            )
        )
    pooled = evaluation_statistics(
        np.concatenate([f for f, _ in rows]),
        np.concatenate([y for _, y in rows]),
        weights=w,
        classes=CLASSES,
        bins=DEFAULT_SCORE_BINS,
    )
    return parts, pooled


def test_federated_fit_from_masked_sums_equals_the_pooled_fit() -> None:
    parts, pooled = _sites()
    sites = tuple(f"site-{k}" for k in range(len(parts)))
    federated = masked_sum(parts, sites)  # pairwise masking in process, decoded
    np.testing.assert_array_equal(federated.histograms, pooled.histograms)
    z = np.linspace(-1e-3, 1e-3, 101)[:, None].repeat(2, axis=1)
    for method in ("platt", "isotonic"):
        fed = fit_calibration(federated, model_sha256=MODEL, method=method)
        pool = fit_calibration(pooled, model_sha256=MODEL, method=method)
        np.testing.assert_allclose(fed.probabilities(z), pool.probabilities(z), rtol=0, atol=1e-9)
        for a, b in zip(fed.classes, pool.classes, strict=True):
            if method == "platt":
                assert a.slope == pytest.approx(b.slope, rel=1e-9)
                assert a.intercept == pytest.approx(b.intercept, rel=1e-9, abs=1e-12)


def test_platt_matches_sklearn_logistic_regression_on_the_binned_rows() -> None:
    _, pooled = _sites(2)
    reps = DEFAULT_SCORE_BINS.representatives()
    for c in range(2):
        neg, pos = pooled.histograms[c]
        ours = fit_class("x", negatives=neg, positives=pos, bins=DEFAULT_SCORE_BINS)
        keep = (neg + pos) > 0
        x = np.concatenate([reps[keep], reps[keep]])
        y = np.concatenate([np.ones(keep.sum()), np.zeros(keep.sum())])
        weight = np.concatenate([pos[keep], neg[keep]]).astype(np.float64)
        scale = x.std()
        oracle = LogisticRegression(C=np.inf, tol=1e-12, max_iter=10_000)
        oracle.fit((x / scale)[:, None], y, sample_weight=weight)
        assert ours.slope == pytest.approx(oracle.coef_[0, 0] / scale, rel=1e-5)
        assert ours.intercept == pytest.approx(oracle.intercept_[0], rel=1e-5, abs=1e-7)


def test_isotonic_matches_sklearn_on_the_binned_rows() -> None:
    _, pooled = _sites(2)
    reps = DEFAULT_SCORE_BINS.representatives()
    neg, pos = pooled.histograms[1]
    ours = fit_class("x", negatives=neg, positives=pos, bins=DEFAULT_SCORE_BINS, method="isotonic")
    keep = (neg + pos) > 0
    x = np.concatenate([np.repeat(reps[keep], pos[keep]), np.repeat(reps[keep], neg[keep])])
    y = np.concatenate([np.ones(pos.sum()), np.zeros(neg.sum())])
    oracle = IsotonicRegression(y_min=0, y_max=1, out_of_bounds="clip").fit(x, y)
    probe = np.linspace(-2e-3, 2e-3, 301)
    np.testing.assert_allclose(ours.probabilities(probe), oracle.predict(probe), atol=1e-12)


def test_calibration_lowers_the_ece_of_tiny_scores_on_new_rows() -> None:
    _, pooled = _sites()
    calib = fit_calibration(pooled, model_sha256=MODEL)
    doc = calibration_document(calib, pooled)
    assert Calibration.from_json(doc) == calib  # the file's extra section is ignored on load
    for name in CLASSES:
        in_sample = doc["reliability"]["per_class"][name]
        assert in_sample["platt"]["ece"] < in_sample["raw sigmoid"]["ece"]
        assert sum(in_sample["platt"]["weight"]) == pooled.histograms[CLASSES.index(name)].sum()
    feats, labels, w = _data(7, 3000)
    z = feats @ w
    for c in range(2):
        raw = reliability_curve(expit(z[:, c]), labels[:, c])
        cal = reliability_curve(calib.probabilities(z)[:, c], labels[:, c])
        assert raw.ece > 0.15  # σ(z) ≈ 0.5 for every row
        assert cal.ece < 0.03


def test_reliability_curve_matches_sklearn_and_the_ece_formula() -> None:
    rng = np.random.default_rng(4)
    p = rng.random(500)
    y = (rng.random(500) < p**2).astype(int)
    rel = reliability_curve(p, y, n_bins=10)
    prob_true, prob_pred = calibration_curve(y, p, n_bins=10, strategy="uniform")
    used = np.array(rel.weight) > 0
    np.testing.assert_allclose(np.array(rel.observed)[used], prob_true, atol=1e-12)
    np.testing.assert_allclose(np.array(rel.mean_predicted)[used], prob_pred, atol=1e-12)
    which = np.minimum((p * 10).astype(int), 9)
    ece = sum(
        (which == b).mean() * abs(y[which == b].mean() - p[which == b].mean())
        for b in range(10)
        if (which == b).any()
    )
    assert rel.ece == pytest.approx(ece, abs=1e-12)
    # weighted histogram points give the same curve as the expanded rows
    bins_p = np.array([0.05, 0.45, 0.95])
    neg, pos = np.array([3, 4, 1]), np.array([1, 2, 5])
    hist = histogram_reliability(bins_p, negatives=neg, positives=pos)
    rows = reliability_curve(
        np.repeat(np.tile(bins_p, 2), np.concatenate([pos, neg])),
        np.repeat([1] * 3 + [0] * 3, np.concatenate([pos, neg])),
    )
    assert hist.ece == pytest.approx(rows.ece, abs=1e-12)


def test_file_round_trip_binding_and_unfitted_classes(tmp_path) -> None:
    _, pooled = _sites(2)
    hist = pooled.histograms.copy()
    hist[1, 1] = 0  # class B: no positives
    stats = EvaluationStats(pooled.classes, pooled.bins, 0.5, hist, pooled.confusion)
    for method in ("platt", "isotonic"):
        calib = fit_calibration(stats, model_sha256=MODEL, method=method)
        assert calib.classes[0].fitted and not calib.classes[1].fitted
        again = Calibration.load(calib.save(tmp_path / f"{method}.json"))
        z = np.array([[1e-4, 2e-4], [-1e-4, 0.0]])
        np.testing.assert_array_equal(again.probabilities(z), calib.probabilities(z))
        assert np.isnan(again.probabilities(z)[:, 1]).all()
        again.check_model(MODEL, CLASSES)
        with pytest.raises(CalibrationError, match="fitted for model"):
            again.check_model("cd" * 32, CLASSES)
        with pytest.raises(CalibrationError, match="classes"):
            again.check_model(MODEL, ("B", "A"))
    (tmp_path / "bad.json").write_text('{"format": "other"}')
    with pytest.raises(CalibrationError, match="not an afl calibration"):
        Calibration.load(tmp_path / "bad.json")


def test_calibrated_tau_filter_admits_pseudo_labels_the_raw_filter_cannot() -> None:
    _, pooled = _sites()
    calib = fit_calibration(pooled, model_sha256=MODEL)
    feats, _, w = _data(11, 2000)
    params = RefinementParams(tau=0.7, alpha=0.5, delta_pos=5, delta_neg=50)
    missing = np.array([True, True])
    raw = pseudo_label_projection(feats, weights=w, missing=missing, params=params)
    cal = pseudo_label_projection(
        feats, weights=w, missing=missing, params=params, calibration=calib
    )
    assert raw.n_pseudo_pos.sum() == raw.n_pseudo_neg.sum() == 0
    z = feats @ w
    p = calib.probabilities(z)
    np.testing.assert_array_equal(cal.n_pseudo_pos, (p > 0.7).sum(axis=0))
    np.testing.assert_array_equal(cal.n_pseudo_neg, (p < 0.3).sum(axis=0))
    assert cal.contributes.any()
    # an identity Platt map (a = 1, b = 0) reproduces the paper's filter exactly
    identity = Calibration(
        "platt",
        MODEL,
        symmetric_log_bins(),
        tuple(ClassCalibration(c, "platt", True, 1, 1, 1.0, 0.0) for c in CLASSES),
    )
    scaled = feats * 1e4  # scores large enough to pass τ
    a = pseudo_label_projection(scaled, weights=w, missing=missing, params=params)
    b = pseudo_label_projection(
        scaled, weights=w, missing=missing, params=params, calibration=identity
    )
    np.testing.assert_array_equal(a.b, b.b)
    np.testing.assert_array_equal(a.n_pseudo_pos, b.n_pseudo_pos)
    assert a.n_pseudo_pos.sum() > 0
