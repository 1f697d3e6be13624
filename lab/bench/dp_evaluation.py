"""`afl bench dp-evaluation`: federated macro AUC and ECE from DP score histograms against the
exact values, on a federation (default: the embedded surrogate default; docs/benchmarks.md §9).

For each ε: the round-1 ``global`` model (Missing-1); the score scale s (median over classes of
the training scores' standard deviation: what the coordinator computes from the run's released
Gram and sums); the bins (:func:`afl.core.dp.evaluation.dp_score_bins`, B equal-mass bins of
N(0, s²) and the edge 0); then over ``trials`` draws:

1. the test rows spread over the sites (row i at site i mod K, as ``afl bench calibration``); each
   site's histogram plus its discrete Gaussian share σ/√K, drawn as the sites draw it
   (:func:`afl.crypto.dgauss.discrete_gaussian`; σ of the plan's ``eval_hist`` release,
   :func:`afl.core.dp.evaluation.evaluation_noise`, t = 0: the evaluation round's ε split with
   the confusion counts), summed; macro AUC of the noisy sums
   (:func:`afl.core.evaluation.federated.histogram_auc`, unclipped) against scikit-learn's exact
   macro AUC of the unbinned test scores;
2. a Platt calibration fitted from the noisy sum of the sites' training-row histograms (negative
   noisy counts weigh 0), its macro ECE on the test set (10 probability bins) against the ECE of
   the calibration fitted from the exact histograms on the default fine grid.

Without DP (``no_dp_min_cohort``): the macro AUC of the sites' test histograms on the fine default
grid, each site's coarsened so that every bin holds 0 or ≥ k rows (k = 3, the default
``min_cohort``; :func:`afl.core.evaluation.federated.coarsen_histograms`), against the same sum
uncoarsened and the exact unbinned value.
"""

from __future__ import annotations

import argparse
import math
import time
from typing import Any

import numpy as np
from numpy.typing import NDArray
from scipy.special import expit

from afl.core.aggregation import federated_solve
from afl.core.data.assignment import missing_m_assignment
from afl.core.data.nih import FEDMLP_PARTITION_SEED
from afl.core.dp.evaluation import DP_EVALUATION_BINS, dp_score_bins, evaluation_noise
from afl.core.evaluation.calibration import fit_class, reliability_curve
from afl.core.evaluation.federated import (
    coarsen_histograms,
    decision_edge,
    evaluation_statistics,
    histogram_auc,
    sum_statistics,
)
from afl.core.evaluation.scorebins import DEFAULT_SCORE_BINS, ScoreBins
from afl.core.metrics import evaluate
from afl.core.stats import local_statistics
from afl.crypto.dgauss import discrete_gaussian
from afl.lab.bench.common import describe_machine, emit_json
from afl.lab.simulate.dataset import FederatedDataset, default_dataset

__all__ = ["add_arguments", "run", "run_dp_evaluation_bench"]

FloatArray = NDArray[np.float64]


def _site_histograms(
    features: list[NDArray[np.floating]],
    labels: list[NDArray[np.int8]],
    w: FloatArray,
    bins: ScoreBins,
) -> list[FloatArray]:
    return [
        evaluation_statistics(
            f, y, weights=w, classes=tuple(str(c) for c in range(w.shape[1])), bins=bins
        ).histograms.astype(np.float64)
        for f, y in zip(features, labels, strict=True)
    ]


def _noisy_sum(parts: list[FloatArray], sigma: float) -> FloatArray:
    """Σ_k (H_k + Z_k), Z_k ~ N_Z(0, σ²/K): the released sum of K sites' noisy shares."""
    share = sigma / math.sqrt(len(parts))
    total: FloatArray = np.sum([p + discrete_gaussian(share, p.shape) for p in parts], axis=0)
    return total


def _macro_auc(hist: FloatArray) -> float:
    return float(np.nanmean([histogram_auc(hist[c, 0], hist[c, 1]) for c in range(len(hist))]))


def _macro_ece(hist: FloatArray, bins: ScoreBins, z: FloatArray, y: NDArray[np.int8]) -> float:
    eces = []
    for c in range(hist.shape[0]):
        fit = fit_class(
            str(c),
            negatives=np.maximum(hist[c, 0], 0.0),
            positives=np.maximum(hist[c, 1], 0.0),
            bins=bins,
            method="platt",
        )
        probs = fit.probabilities(z[:, c]) if fit.fitted else expit(z[:, c])
        eces.append(reliability_curve(probs, y[:, c]).ece)
    return float(np.mean(eces))


def run_dp_evaluation_bench(
    fed: FederatedDataset,
    *,
    epsilons: tuple[float, ...] = (0.5, 1.0, 2.0, 4.0),
    delta: float = 1e-5,
    num_bins: int = DP_EVALUATION_BINS,
    trials: int = 50,
    seed: int = FEDMLP_PARTITION_SEED,
    gamma: float = 1.0,
) -> dict[str, Any]:
    """The JSON document of the bench (module docstring)."""
    t0 = time.perf_counter()
    classes = fed.classes
    active = missing_m_assignment(
        num_clients=fed.num_sites, num_classes=len(classes), missing=1, seed=seed
    )
    stats = [
        local_statistics(f, y, active=active[k])
        for k, (f, y) in enumerate(zip(fed.site_features, fed.site_labels, strict=True))
    ]
    w, _ = federated_solve(stats, gamma=gamma, gram_scope="global")
    train_z = np.concatenate([np.asarray(f, dtype=np.float64) @ w for f in fed.site_features])
    scale = float(np.median(train_z.std(axis=0)))
    bins = dp_score_bins(scale=scale, num_bins=num_bins)
    test_z = np.asarray(fed.test_features, dtype=np.float64) @ w
    test_y = np.asarray(fed.test_labels)
    exact_auc = float(np.nanmean(evaluate(expit(test_z), test_y, classes=classes).auc))
    site_of = np.arange(len(test_y)) % fed.num_sites
    test_parts = _site_histograms(
        [fed.test_features[site_of == k] for k in range(fed.num_sites)],
        [test_y[site_of == k] for k in range(fed.num_sites)],
        w,
        bins,
    )
    train_labels = [np.where(active[k], y, -1) for k, y in enumerate(fed.site_labels)]
    train_parts = _site_histograms(list(fed.site_features), train_labels, w, bins)
    fine = sum_statistics(
        [
            evaluation_statistics(
                f, y, weights=w, classes=classes, bins=DEFAULT_SCORE_BINS, labelled=active[k]
            )
            for k, (f, y) in enumerate(zip(fed.site_features, fed.site_labels, strict=True))
        ]
    ).histograms.astype(np.float64)
    exact_ece = _macro_ece(fine, DEFAULT_SCORE_BINS, test_z, test_y)
    binned_auc = _macro_auc(np.sum(test_parts, axis=0))
    fine_parts = _site_histograms(
        [fed.test_features[site_of == k] for k in range(fed.num_sites)],
        [test_y[site_of == k] for k in range(fed.num_sites)],
        w,
        DEFAULT_SCORE_BINS,
    )
    edge = decision_edge(DEFAULT_SCORE_BINS, 0.5)
    no_dp = {"min_cohort": 3, "exact_macro_auc": exact_auc}
    no_dp["fine_grid_macro_auc"] = _macro_auc(np.sum(fine_parts, axis=0))
    no_dp["coarsened_macro_auc"] = _macro_auc(
        np.sum(
            [coarsen_histograms(p.astype(np.int64), min_count=3, edge=edge) for p in fine_parts],
            axis=0,
        ).astype(np.float64)
    )
    binned_ece = _macro_ece(np.sum(train_parts, axis=0), bins, test_z, test_y)
    rows: dict[str, Any] = {}
    for epsilon in epsilons:
        sigma = evaluation_noise(
            kind="hist",
            epsilon=epsilon,
            delta=delta,
            n_classes=len(classes),
            members=fed.num_sites,
            tolerated=0,
            local=False,
        ).sigma
        auc = np.array([_macro_auc(_noisy_sum(test_parts, sigma)) for _ in range(trials)])
        ece = np.array(
            [
                _macro_ece(_noisy_sum(train_parts, sigma), bins, test_z, test_y)
                for _ in range(trials)
            ]
        )
        rows[f"{epsilon:g}"] = {
            "sigma": sigma,
            "auc_mean_abs_diff": float(np.mean(np.abs(auc - exact_auc))),
            "auc_rms_diff": float(np.sqrt(np.mean((auc - exact_auc) ** 2))),
            "auc_p95_abs_diff": float(np.percentile(np.abs(auc - exact_auc), 95)),
            "ece_mean": float(np.mean(ece)),
            "ece_mean_abs_diff": float(np.mean(np.abs(ece - exact_ece))),
        }
    return {
        "suite": "dp-evaluation",
        "machine": describe_machine(),
        "data": {k: v for k, v in fed.describe().items() if not k.endswith("image_ids")},
        "setting": "missing-1",
        "delta": delta,
        "trials": trials,
        "score_scale": scale,
        "bins": {"kind": "equal-mass bins of N(0, s^2) and 0", "num_bins": bins.num_bins},
        "exact_macro_auc": exact_auc,
        "binned_macro_auc_no_noise": binned_auc,
        "exact_macro_ece_fine_grid": exact_ece,
        "binned_macro_ece_no_noise": binned_ece,
        "epsilons": rows,
        "no_dp_min_cohort": no_dp,
        "seconds": time.perf_counter() - t0,
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--epsilon", action="append", type=float, help="evaluation ε (0.5 1 2 4)")
    p.add_argument("--bins", type=int, default=DP_EVALUATION_BINS, help="equal-mass bins (16)")
    p.add_argument("--trials", type=int, default=50, help="noise draws per ε (50)")
    p.add_argument("--sites", type=int, default=8, help="number of sites (8)")
    p.add_argument("--d", type=int, default=1024, help="surrogate feature dimension (1024)")
    p.add_argument("--out", help="JSON output (default: standard output)")


def run(args: argparse.Namespace) -> int:
    fed = default_dataset(num_sites=args.sites, d=args.d)
    result = run_dp_evaluation_bench(
        fed,
        epsilons=tuple(args.epsilon or (0.5, 1.0, 2.0, 4.0)),
        num_bins=args.bins,
        trials=args.trials,
    )
    emit_json(result, args.out)
    return 0
