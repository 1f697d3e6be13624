"""`afl bench gate`: what one site can still do to the model, and what the validation gate costs
(docs/benchmarks.md §10, docs/protocol.md §6.2).

**Residual influence** (in process, on the embedded default: 8 sites, d = 1024, ``global``
scope, γ = 1). For each site k in turn the honest round-1 model W (eq. 13-15) is solved again
with site k's statistics replaced by an attack, and the change is reported as ‖W' − W‖_F / ‖W‖_F
and the test macro ROC AUC of W' (the per-class minimum too: the gate's "no class below chance"
on hold-out rows flags a class whose AUC falls below 0.5). The attacks, every one inside the
bound of :mod:`afl.core.influence` for the site's declared N_k and L_k (powers of two) unless
marked:

* ``flip-sum``: b_{k,c} = −2L_k · s_c/‖s_c‖, s_c = Σ_{j≠k} b_{j,c} (against the others' vectors);
* ``flip-model``: b_{k,c} = −2L_k · B_c/‖B_c‖, B_c the honest total (against the solved direction);
* ``smallest-eigen``: b_{k,c} = ±2L_k · v_min (the direction A = ΣG + γI amplifies most; sign
  against w_c);
* ``gram-along-w``: G_k = N_k·L_k² · u uᵀ with u the leading left singular vector of W (the whole
  trace budget spent shrinking W along its main direction), the site's b honest;
* ``flip-model+gram``: both;
* ``mask-per-entry`` (NOT in the bound; the reference): b_{k,c} = −sign(b_{k,c}) · 0.99 · 2L_k per
  entry, what the per-entry fixed-point bound of ``mask`` admits today.

The worst in-bound case over sites and attacks (largest ‖ΔW‖, lowest macro AUC) is the residual;
``worst_below_default_floor`` is the largest step α ∈ [0, 1] from the worst site's honest vectors
towards its ``flip-model`` attack (a convex combination: still in the bound) that leaves every
class at or above chance on the test rows, i.e. what the gate's default floor lets through.

**Gate cost** (``--e2e``, through the daemons): the same ``mask`` run over loopback mTLS with and
without ``[round.gate]`` (K sites, random benchmark features with a class signal, each site with a
hold-out cache): wall time of the run, the slowest site's time from the training round's plan to
its final outcome, and each site's bytes sent and received (its reports), with the ratios.
"""

from __future__ import annotations

import argparse
import tempfile
import time
import tomllib
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from afl.core.aggregation import (
    class_b_sums,
    plaintext_gram_sums,
    plan_aggregation,
    solve_from_sums,
)
from afl.core.data.featurecache import CacheMeta, write_cache
from afl.core.metrics import evaluate, predict_proba
from afl.core.row_bounds import measure
from afl.core.stats import LocalStats, local_statistics
from afl.lab.bench.common import describe_machine, emit_json
from afl.lab.demo.federation import mask_round_settings, prepare_loopback, run_loopback
from afl.lab.simulate.dataset import default_dataset
from afl.server import toml_text

__all__ = ["add_arguments", "residual_influence", "run", "run_gate_cost"]

GAMMA = 1.0
IN_BOUND = ("flip-sum", "flip-model", "smallest-eigen", "gram-along-w", "flip-model+gram")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sites", type=int, default=8, help="sites of the embedded default (8)")
    p.add_argument("--d", type=int, default=1024, help="feature dimension (1024)")
    p.add_argument("--e2e", action="store_true", help="also measure the gate's cost end to end")
    p.add_argument("--no-residual", action="store_true", help="skip the residual-influence part")
    p.add_argument("--e2e-sites", type=int, default=4, help="sites of the --e2e federation")
    p.add_argument("--e2e-d", type=int, default=64, help="d of the --e2e federation")
    p.add_argument("--e2e-rows", type=int, default=300, help="rows per site (--e2e)")
    p.add_argument("--out", default=None, help="write JSON here (default: stdout)")


def _solve(grams: list[NDArray[np.float64]], bs: list[NDArray[np.float64]]) -> NDArray[np.float64]:
    a = np.sum(grams, axis=0) + GAMMA * np.eye(grams[0].shape[0])
    w: NDArray[np.float64] = np.linalg.solve(a, np.sum(bs, axis=0))
    return w


def residual_influence(*, sites: int = 8, d: int = 1024) -> dict[str, Any]:
    """The residual-influence figures of the module docstring."""
    fed = default_dataset(num_sites=sites, d=d)
    stats: list[LocalStats] = []
    bounds = []
    for f, y in zip(fed.site_features, fed.site_labels, strict=True):
        h = np.asarray(f, dtype=np.float64)
        stats.append(local_statistics(h, y, active=np.all(y >= 0, axis=0)))
        bounds.append(measure(h).declared())
    plan = plan_aggregation(np.stack([s.contributes for s in stats]), gram_scope="global")
    w = solve_from_sums(
        plan,
        gram_sums=plaintext_gram_sums(plan, [s.gram for s in stats]),
        b_sums=class_b_sums(plan, [s.b for s in stats]),
        gamma=GAMMA,
    )
    grams = [s.gram for s in stats]
    bs = [s.b for s in stats]
    assert np.allclose(w, _solve(grams, bs), rtol=1e-8, atol=1e-10)
    test_h, test_y = fed.test_features, fed.test_labels

    def score(weights: NDArray[np.float64]) -> dict[str, Any]:
        m = evaluate(predict_proba(test_h, weights), test_y, classes=fed.classes)
        return {
            "relative_w_change": float(np.linalg.norm(weights - w) / np.linalg.norm(w)),
            "macro_auc": m.macro_auc,
            "min_class_auc": float(np.nanmin(m.auc)),
            "classes_below_chance": [c for c, a in zip(fed.classes, m.auc, strict=True) if a < 0.5],
        }

    honest = score(w)
    a = np.sum(grams, axis=0) + GAMMA * np.eye(d)
    _, eigvecs = np.linalg.eigh(a)
    v_min = eigvecs[:, 0]
    u = np.linalg.svd(w, full_matrices=False)[0][:, 0]
    total_b = np.sum(bs, axis=0)
    results: dict[str, list[dict[str, Any]]] = {}
    for k in range(sites):
        two_l = bounds[k].vector_bound
        rest = total_b - bs[k]
        attacks: dict[str, tuple[NDArray[np.float64], NDArray[np.float64]]] = {
            "flip-sum": (grams[k], -two_l * rest / np.linalg.norm(rest, axis=0)),
            "flip-model": (grams[k], -two_l * total_b / np.linalg.norm(total_b, axis=0)),
            "smallest-eigen": (
                grams[k],
                -two_l * np.outer(v_min, np.sign(v_min @ w + (v_min @ w == 0))),
            ),
            "gram-along-w": (bounds[k].gram_bound * np.outer(u, u), bs[k]),
            "flip-model+gram": (
                bounds[k].gram_bound * np.outer(u, u),
                -two_l * total_b / np.linalg.norm(total_b, axis=0),
            ),
            "mask-per-entry": (grams[k], -np.sign(bs[k]) * 0.99 * two_l),
        }
        for name, (g_k, b_k) in attacks.items():
            w_attack = _solve([*grams[:k], g_k, *grams[k + 1 :]], [*bs[:k], b_k, *bs[k + 1 :]])
            figures = score(w_attack)
            figures.update(
                site=fed.site_names[k],
                in_bound=name in IN_BOUND,
                b_norm_over_2l=float(np.linalg.norm(b_k, axis=0).max() / two_l),
                gram_trace_over_nl2=float(np.trace(g_k) / bounds[k].gram_bound),
            )
            results.setdefault(name, []).append(figures)
    in_bound = [r for name in IN_BOUND for r in results[name]]
    worst_w = max(in_bound, key=lambda r: r["relative_w_change"])
    worst_auc = min(in_bound, key=lambda r: r["macro_auc"])
    # Below the gate's default floor: the largest fraction α of the flip-model attack (worst site)
    # whose every class stays at or above chance on the test rows (bisection, 12 steps).
    k = next(i for i, r in enumerate(results["flip-model"]) if r is min(
        results["flip-model"], key=lambda r: r["macro_auc"]))  # fmt: skip
    direction = -bounds[k].vector_bound * total_b / np.linalg.norm(total_b, axis=0)
    lo, hi, undetected = 0.0, 1.0, score(w)
    for _ in range(12):
        alpha = 0.5 * (lo + hi)
        b_k = (1 - alpha) * bs[k] + alpha * direction  # in the bound: a convex combination
        figures = score(_solve(grams, [*bs[:k], b_k, *bs[k + 1 :]]))
        if figures["min_class_auc"] >= 0.5:
            lo, undetected = alpha, {**figures, "alpha": alpha}
        else:
            hi = alpha
    return {
        "dataset": fed.provenance,
        "sites": sites,
        "d": d,
        "gamma": GAMMA,
        "declared": [{"rows": b.rows, "max_row_norm": b.max_row_norm} for b in bounds],
        "honest": honest,
        "attacks": results,
        "worst_in_bound_by_w_change": {**worst_w, "attack": _name(results, worst_w)},
        "worst_in_bound_by_macro_auc": {**worst_auc, "attack": _name(results, worst_auc)},
        "mask_per_entry_worst": min(results["mask-per-entry"], key=lambda r: r["macro_auc"]),
        "worst_below_default_floor": {**undetected, "site": fed.site_names[k]},
    }


def _name(results: dict[str, list[dict[str, Any]]], row: dict[str, Any]) -> str:
    return next(name for name, rows in results.items() if any(r is row for r in rows))


def _holdout(
    root: Path, site: str, h: NDArray[np.float32], y: NDArray[np.int8], classes: tuple[str, ...]
) -> Path:
    folder = root / "holdout" / site
    write_cache(
        folder,
        meta=CacheMeta(n=len(y), d=h.shape[1], classes=classes, source="surrogate"),
        ids=[f"{site}-h{i}" for i in range(len(y))],
        labels=y,
        features=h,
    )
    return folder


def run_gate_cost(*, sites: int = 4, d: int = 64, rows: int = 300, seed: int = 0) -> dict[str, Any]:
    """The same mask run with and without the gate through the daemons (module docstring)."""
    classes = ("A", "B", "C", "D")
    rng = np.random.default_rng(seed)
    directions = rng.normal(size=(len(classes), d))
    blocks = []
    for _ in range(2 * sites):
        y = (rng.random((rows, len(classes))) < 0.3).astype(np.int8)
        h = (rng.normal(size=(rows, d)) + 0.5 * (y @ directions)).astype(np.float32)
        blocks.append((h, y))
    feats = [b[0] for b in blocks[:sites]]
    labels = [b[1] for b in blocks[:sites]]
    out: dict[str, Any] = {"sites": sites, "d": d, "rows_per_site": rows, "holdout_rows": rows}
    with tempfile.TemporaryDirectory(prefix="afl-bench-gate-") as tmp:
        for gated in (False, True):
            root = Path(tmp) / ("gate" if gated else "plain")
            loop = prepare_loopback(
                root,
                classes=classes,
                site_features=feats,
                site_labels=labels,
                active=np.ones((sites, len(classes)), dtype=bool),
                test_features=feats[0][:10],
                test_labels=labels[0][:10],
                round_settings={**mask_round_settings(feats), "upload_timeout_s": 600.0},
            )
            doc = tomllib.loads(loop.server_config.read_text(encoding="utf-8"))
            if gated:
                doc["round"]["gate"] = {"min_auc": 0.5}
            loop.server_config.write_text(toml_text.dumps(doc), encoding="utf-8")
            for k, site in enumerate(loop.site_ids):
                h, y = blocks[sites + k]
                config = loop.client_configs[site]
                client = tomllib.loads(config.read_text(encoding="utf-8"))
                client["data"]["holdout"] = str(_holdout(root, site, h, y, classes))
                config.write_text(toml_text.dumps(client), encoding="utf-8")
            start = time.perf_counter()
            run = run_loopback(loop, timeout_s=900)
            wall = time.perf_counter() - start
            reports = [list(run.reports[s].values()) for s in loop.site_ids]
            if any(rc != 0 for rc in run.client_rcs.values()):
                raise RuntimeError(f"the run failed: {run.client_rcs}")
            out["gate" if gated else "no_gate"] = {
                "wall_seconds": wall,
                "site_seconds": max(
                    sum(r["timings_s"].get("round", 0.0) for r in rs) for rs in reports
                ),
                "bytes_sent_per_site": float(
                    np.mean([sum(r["bytes_sent"] for r in rs) for rs in reports])
                ),
                "bytes_received_per_site": float(
                    np.mean([sum(r["bytes_received"] for r in rs) for rs in reports])
                ),
                "rounds_per_site": len(reports[0]),
            }
    for key in ("wall_seconds", "site_seconds", "bytes_sent_per_site", "bytes_received_per_site"):
        out[f"{key}_ratio"] = out["gate"][key] / out["no_gate"][key]
    return out


def run(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    data: dict[str, Any] = {
        "suite": "gate",
        "machine": describe_machine(),
    }
    if not args.no_residual:
        data["residual"] = residual_influence(sites=args.sites, d=args.d)
    if args.e2e:
        data["gate_cost"] = run_gate_cost(sites=args.e2e_sites, d=args.e2e_d, rows=args.e2e_rows)
    data["seconds"] = time.perf_counter() - start
    emit_json(data, args.out)
    return 0
