"""`afl bench calibration`: calibration and federated evaluation of the round-1 model on a
federation (default: the embedded surrogate default), in process (docs/benchmarks.md §7).

For each Missing-m setting: the round-1 model (``global`` scope, eq. 13-15), then

1. every site's score histograms and confusion counts on its training rows, for the classes it
   labels (:func:`afl.core.evaluation.federated.evaluation_statistics`, the default score bins);
2. their sum through pairwise masking in process (:func:`afl.crypto.secagg.local.run_local_round`,
   fixed-point encoding with the bound = the largest site's rows): the decoded sum is compared
   with the plain integer sum and with the histograms of the pooled rows;
3. Platt and isotonic calibrations fitted from the masked sums, and from the pooled rows' histograms
   (the largest difference of the calibrated probabilities is reported);
4. on the test set: reliability curves and ECE of σ(z) (the paper's probabilities) and of both
   calibrations; the federated-evaluation metrics of the test rows spread over the sites, from the
   summed histograms, against scikit-learn's exact metrics (the bins' resolution cost);
5. round 2 with the paper's τ = 0.7 filter on σ(z) and on the Platt-calibrated probabilities
   (a documented deviation from the paper): pseudo-labels admitted, contributions (δ+, δ−), and the
   test metrics of the round-2 model.
"""

from __future__ import annotations

import argparse
import hashlib
import time
from typing import Any

import numpy as np
from scipy.special import expit

from afl.core.aggregation import class_b_sums, federated_solve
from afl.core.data.assignment import missing_m_assignment
from afl.core.data.nih import FEDMLP_PARTITION_SEED
from afl.core.evaluation.calibration import (
    METHODS,
    Calibration,
    calibration_document,
    fit_calibration,
    reliability_curve,
)
from afl.core.evaluation.federated import (
    EvaluationStats,
    evaluation_statistics,
    pooled_metrics,
    sum_statistics,
)
from afl.core.evaluation.scorebins import DEFAULT_SCORE_BINS
from afl.core.metrics import Metrics, evaluate, predict_proba
from afl.core.refinement import RefinementParams, pseudo_label_projection, solve_round2
from afl.core.stats import local_statistics
from afl.crypto.identity.signatures import generate_identity_key
from afl.crypto.secagg.config import ReleaseSpec, RoundConfig
from afl.crypto.secagg.local import run_local_round
from afl.lab.bench.common import describe_machine, emit_json
from afl.lab.simulate.dataset import FederatedDataset, default_dataset

__all__ = ["add_arguments", "masked_sum", "run", "run_calibration_bench"]


def masked_sum(parts: list[EvaluationStats], site_names: tuple[str, ...]) -> EvaluationStats:
    """Σ of the sites' statistics through the masking protocol, in process (the fixed-point
    bound: the largest site's rows), decoded."""
    bound = float(max(int(p.n_pos.max() + p.n_neg.max()) for p in parts))
    releases = [
        ReleaseSpec("hist", site_names, parts[0].histograms.size, bound),
        ReleaseSpec("conf", site_names, parts[0].confusion.size, bound),
    ]
    config = RoundConfig.create(round_id="bench-calibration", cohort=site_names, releases=releases)
    inputs = {
        s: {
            "hist": p.histograms.astype(np.float64).ravel(),
            "conf": p.confusion.astype(np.float64).ravel(),
        }
        for s, p in zip(site_names, parts, strict=True)
    }
    keys = {s: generate_identity_key() for s in site_names}
    sums = run_local_round(config=config, identity_keys=keys, inputs=inputs).result.sums
    first = parts[0]
    return EvaluationStats.from_sums(
        classes=first.classes,
        bins=first.bins,
        threshold=first.threshold,
        histograms=sums["hist"],
        confusion=sums["conf"],
    )


def _macro(metrics: Metrics) -> dict[str, float | None]:
    body = metrics.to_json()["macro"]
    return {k: body[k] for k in ("bacc", "auc", "map")}


def _ece_table(
    z: np.ndarray,
    labels: np.ndarray,
    classes: tuple[str, ...],
    calibrations: dict[str, Calibration],
) -> dict[str, Any]:
    out: dict[str, Any] = {"per_class": {}, "macro": {}}
    probs = {"raw sigmoid": expit(z)}
    probs.update({m: c.probabilities(z) for m, c in calibrations.items()})
    for name, p in probs.items():
        eces = []
        for c, cls in enumerate(classes):
            rel = reliability_curve(p[:, c], labels[:, c])
            out["per_class"].setdefault(cls, {})[name] = rel.to_json()
            eces.append(rel.ece)
        out["macro"][name] = float(np.mean(eces))
    return out


def _setting(fed: FederatedDataset, missing: int, *, seed: int, gamma: float) -> dict[str, Any]:
    t0 = time.perf_counter()
    classes, sites = fed.classes, fed.site_names
    active = missing_m_assignment(
        num_clients=fed.num_sites, num_classes=len(classes), missing=missing, seed=seed
    )
    stats = [
        local_statistics(f, y, active=active[k])
        for k, (f, y) in enumerate(zip(fed.site_features, fed.site_labels, strict=True))
    ]
    w, plan = federated_solve(stats, gamma=gamma, gram_scope="global")
    model_id = hashlib.sha256(np.ascontiguousarray(w, dtype="<f8").tobytes()).hexdigest()
    bins = DEFAULT_SCORE_BINS
    parts = [
        evaluation_statistics(f, y, weights=w, classes=classes, bins=bins, labelled=active[k])
        for k, (f, y) in enumerate(zip(fed.site_features, fed.site_labels, strict=True))
    ]
    plain = sum_statistics(parts)
    masked = masked_sum(parts, sites)
    pooled_labels = np.concatenate(
        [np.where(active[k], y, -1) for k, y in enumerate(fed.site_labels)]
    )  # each site's rows labelled for the classes it labels, as the sites computed them
    pooled = evaluation_statistics(
        np.concatenate(fed.site_features), pooled_labels, weights=w, classes=classes, bins=bins
    )
    test_z = np.asarray(fed.test_features, dtype=np.float64) @ w
    test_y = np.asarray(fed.test_labels)
    federated: dict[str, Calibration] = {
        m: fit_calibration(masked, model_sha256=model_id, method=m) for m in METHODS
    }
    pooled_fit = {m: fit_calibration(pooled, model_sha256=model_id, method=m) for m in METHODS}
    probe = np.linspace(test_z.min(), test_z.max(), 2001)[:, None].repeat(len(classes), axis=1)
    fit_gap = max(
        float(
            np.nanmax(
                np.abs(federated[m].probabilities(probe) - pooled_fit[m].probabilities(probe))
            )
        )
        for m in METHODS
    )
    # federated evaluation of the test rows, spread over the sites as the surrogate places them
    test_site = np.arange(len(test_y)) % fed.num_sites
    test_parts = [
        evaluation_statistics(
            fed.test_features[test_site == k],
            test_y[test_site == k],
            weights=w,
            classes=classes,
            bins=bins,
        )
        for k in range(fed.num_sites)
    ]
    fed_eval = pooled_metrics(sum_statistics(test_parts))
    exact = evaluate(expit(test_z), test_y, classes=classes)
    # round 2: τ on σ(z) (the paper) and on the Platt-calibrated probabilities
    params = RefinementParams()
    round2: dict[str, Any] = {}
    b_real = class_b_sums(plan, [s.b for s in stats])
    gram_total = np.sum([s.gram for s in stats], axis=0)
    for name, calib in (("raw sigmoid (paper)", None), ("platt-calibrated", federated["platt"])):
        pseudo = [
            pseudo_label_projection(
                f, weights=w, missing=~active[k], params=params, calibration=calib
            )
            for k, f in enumerate(fed.site_features)
        ]
        w2 = solve_round2(
            gram_total=gram_total,
            b_real=b_real,
            b_pseudo=np.sum([p.b for p in pseudo], axis=0),
            alpha=params.alpha,
            gamma=gamma,
        )
        round2[name] = {
            "pseudo_positive": int(sum(p.n_pseudo_pos.sum() for p in pseudo)),
            "pseudo_negative": int(sum(p.n_pseudo_neg.sum() for p in pseudo)),
            "contributions": int(sum(p.contributes.sum() for p in pseudo)),
            "per_class_contributors": {
                cls: int(sum(p.contributes[c] for p in pseudo)) for c, cls in enumerate(classes)
            },
            "test_macro": _macro(
                evaluate(predict_proba(fed.test_features, w2), test_y, classes=classes)
            ),
        }
    return {
        "assignment_seed": seed,
        "round1_test_macro": _macro(exact),
        "masked_sum_equals_plain_sum": bool(
            np.array_equal(masked.histograms, plain.histograms)
            and np.array_equal(masked.confusion, plain.confusion)
        ),
        "summed_histograms_equal_pooled_rows": bool(
            np.array_equal(masked.histograms, pooled.histograms)
        ),
        "max_abs_diff_federated_vs_pooled_fit": fit_gap,
        "training_histogram_reliability": {
            m: calibration_document(federated[m], masked)["reliability"] for m in METHODS
        },
        "test_ece": _ece_table(test_z, test_y, classes, federated),
        "calibrations": {m: federated[m].to_json() for m in METHODS},
        "federated_evaluation_test": {
            "from_histograms": fed_eval.to_json(),
            "exact_sklearn": exact.to_json(),
            "max_abs_auc_diff": float(np.nanmax(np.abs(fed_eval.auc - exact.auc))),
            "max_abs_ap_diff": float(np.nanmax(np.abs(fed_eval.ap - exact.ap))),
            "max_abs_bacc_diff": float(np.nanmax(np.abs(fed_eval.bacc - exact.bacc))),
        },
        "round2_tau_0.7": round2,
        "seconds": time.perf_counter() - t0,
    }


def run_calibration_bench(
    fed: FederatedDataset,
    *,
    missing: tuple[int, ...] = (3,),
    seed: int = FEDMLP_PARTITION_SEED,
    gamma: float = 1.0,
) -> dict[str, Any]:
    """The JSON document of the bench (module docstring)."""
    return {
        "suite": "calibration",
        "machine": describe_machine(),
        "data": {k: v for k, v in fed.describe().items() if not k.endswith("image_ids")},
        "score_bins": {
            "kind": "symmetric log grid, 1e-12 .. 1e4, 40 per decade",
            "edges": len(DEFAULT_SCORE_BINS.edges),
        },
        "ece_bins": 10,
        "settings": {f"missing-{m}": _setting(fed, m, seed=seed, gamma=gamma) for m in missing},
    }


def _print(result: dict[str, Any]) -> None:
    for name, body in result["settings"].items():
        print(f"{name}: round-1 test macro {body['round1_test_macro']}")
        ece = body["test_ece"]
        print(
            "  test ECE (10 bins)  " + "  ".join(f"{k}: {v:.4f}" for k, v in ece["macro"].items())
        )
        for cls, per in ece["per_class"].items():
            print(f"    {cls:<14}" + "  ".join(f"{k}: {v['ece']:.4f}" for k, v in per.items()))
        fe = body["federated_evaluation_test"]
        print(
            f"  federated evaluation vs exact: max |ΔAUC| {fe['max_abs_auc_diff']:.2e}, "
            f"|ΔAP| {fe['max_abs_ap_diff']:.2e}, |ΔBACC| {fe['max_abs_bacc_diff']:.2e}"
        )
        print(
            f"  masked sum = plain sum: {body['masked_sum_equals_plain_sum']}; "
            f"federated vs pooled fit max |Δp| {body['max_abs_diff_federated_vs_pooled_fit']:.1e}"
        )
        for k, v in body["round2_tau_0.7"].items():
            print(
                f"  round 2, τ = 0.7 on {k}: {v['pseudo_positive']} pseudo-positive, "
                f"{v['pseudo_negative']} pseudo-negative rows, {v['contributions']} site-class "
                f"contributions; test macro {v['test_macro']}"
            )


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--setting", action="append", type=int, metavar="M", help="Missing-M (3)")
    p.add_argument("--sites", type=int, default=8, help="number of sites (8)")
    p.add_argument("--d", type=int, default=1024, help="surrogate feature dimension (1024)")
    p.add_argument("--out", help="JSON output (default: standard output)")


def run(args: argparse.Namespace) -> int:
    fed = default_dataset(num_sites=args.sites, d=args.d)
    result = run_calibration_bench(fed, missing=tuple(args.setting or (3,)))
    if args.out:
        emit_json(result, args.out)
        _print(result)
    else:
        emit_json(result, None)
    return 0
