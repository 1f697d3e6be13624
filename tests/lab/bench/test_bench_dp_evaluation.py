"""`afl bench dp-evaluation` on a small federation: the bins are the rulebook's, a huge ε leaves
only the bins' own effect on the AUC, and the noise of a small ε shows in the AUC difference.
Oracle: the exact macro AUC of the unbinned test scores (scikit-learn, in the bench)."""

from __future__ import annotations

from afl.lab.bench.dp_evaluation import run_dp_evaluation_bench
from tests.lab.bench.test_bench_calibration import _federation


def test_dp_evaluation_bench_on_a_small_federation() -> None:
    result = run_dp_evaluation_bench(_federation(), epsilons=(0.2, 1e3), trials=5, seed=5)
    assert result["bins"]["num_bins"] == 16 and result["score_scale"] > 0
    binned_gap = abs(result["binned_macro_auc_no_noise"] - result["exact_macro_auc"])
    huge, small = result["epsilons"]["1000"], result["epsilons"]["0.2"]
    assert huge["sigma"] < 0.1 < 1.0 < small["sigma"]
    # σ ≪ 1 count: only the bins' ties separate the noisy AUC from the exact one.
    assert abs(huge["auc_mean_abs_diff"] - binned_gap) < 2e-3
    assert small["auc_mean_abs_diff"] > huge["auc_mean_abs_diff"]
    assert 0 <= huge["ece_mean"] <= 1 and 0 <= small["ece_mean"] <= 1
