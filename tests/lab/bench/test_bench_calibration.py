"""`afl bench calibration` on a small federation with tiny scores: the masked histogram sums
equal the plain and pooled-row sums, the federated fit equals the pooled fit, calibration lowers
the test ECE (reliability recomputed here), and the paper's τ filter on σ(z) admits nothing."""

from __future__ import annotations

import numpy as np

from afl.core.evaluation.calibration import Calibration
from afl.lab.bench.calibration import run_calibration_bench
from afl.lab.simulate.dataset import FederatedDataset


def _federation() -> FederatedDataset:
    rng = np.random.default_rng(2)
    classes = ("A", "B", "C", "D")
    direction = rng.normal(size=(4, 12))

    def block(n: int) -> tuple[np.ndarray, np.ndarray]:
        y = (rng.random((n, 4)) < [0.1, 0.2, 0.3, 0.15]).astype(np.int8)
        h = np.abs(rng.normal(size=(n, 12)) + 0.8 * (y @ direction)) + 1.0
        return h.astype(np.float32), y

    sites = [block(600 + 50 * k) for k in range(4)]
    test = block(2000)
    return FederatedDataset(
        classes=classes,
        site_names=tuple(f"site-{k + 1}" for k in range(4)),
        site_features=tuple(f for f, _ in sites),
        site_labels=tuple(y for _, y in sites),
        test_features=test[0],
        test_labels=test[1],
        provenance="test",
        surrogate=True,
    )


def test_calibration_bench_on_a_small_federation() -> None:
    fed = _federation()
    result = run_calibration_bench(fed, missing=(1,), seed=5)
    body = result["settings"]["missing-1"]
    assert body["masked_sum_equals_plain_sum"] and body["summed_histograms_equal_pooled_rows"]
    assert body["max_abs_diff_federated_vs_pooled_fit"] <= 1e-9
    platt = Calibration.from_json(body["calibrations"]["platt"])
    ece = body["test_ece"]["macro"]
    assert ece["platt"] < ece["raw sigmoid"] and ece["isotonic"] < ece["raw sigmoid"]
    reliability = body["test_ece"]["per_class"]["A"]["raw sigmoid"]
    assert len(reliability["edges"]) == 11 and sum(reliability["weight"]) == len(fed.test_labels)
    fe = body["federated_evaluation_test"]
    assert fe["max_abs_bacc_diff"] == 0.0 and fe["max_abs_auc_diff"] < 5e-3
    paper = body["round2_tau_0.7"]["raw sigmoid (paper)"]
    assert paper["pseudo_positive"] == paper["pseudo_negative"] == paper["contributions"] == 0
    assert paper["test_macro"] == body["round1_test_macro"]  # round 2 = round 1 (global scope)
    calibrated = body["round2_tau_0.7"]["platt-calibrated"]
    assert calibrated["pseudo_negative"] > 0
    assert platt.method == "platt" and all(c.fitted for c in platt.classes)
