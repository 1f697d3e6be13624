"""`afl bench solve`: the server's round-1 solve against the number of distinct coverage sets.

Per-class aggregation (paper eq. 13-15) needs one Gram sum ``Σ_{k∈S_c} G_k`` and one Cholesky
factorisation of ``Σ G + γI`` per *distinct* coverage set S_c (classes sharing a set share the
factor, :func:`afl.core.aggregation.solve_from_sums`); the ``global`` scope always needs one. So
the server's cost grows with the number of distinct sets, from 1 (every site labels every class)
to C (every class has its own set). For K sites and m sets, set j is every site but those in the
binary digits of j (set 0 = all sites) and class c uses set ``c mod m``.

Reported per m: ``sum_seconds`` (plaintext Gram sums of every release), ``solve_seconds``
(factorisations and solves), their total, the time per set, and the max relative difference of W
from ``numpy.linalg.solve`` on the same sums (sanity check). Synthetic Grams ``XᵀX`` from numpy's
RNG (benchmark data, not secrets).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from afl.core.aggregation import (
    GramScope,
    class_b_sums,
    plaintext_gram_sums,
    plan_aggregation,
    solve_from_sums,
)
from afl.lab.bench.common import (
    add_blas_threads_argument,
    best_seconds,
    blas_threads,
    describe_machine,
    format_machine,
    line_plot,
    write_json,
)

__all__ = ["add_arguments", "coverage_with_sets", "run", "run_solve_bench"]


def coverage_with_sets(*, num_sites: int, num_classes: int, sets: int) -> NDArray[np.bool_]:
    """A (K, C) contributes mask with exactly ``sets`` distinct non-empty coverage sets."""
    if not 1 <= sets <= min(num_classes, 2**num_sites - 1):
        raise ValueError(
            f"sets must be in [1, min(C={num_classes}, 2^K - 1={2**num_sites - 1})], got {sets}"
        )
    full = 2**num_sites - 1
    mask = np.zeros((num_sites, num_classes), dtype=bool)
    for c in range(num_classes):
        members = full - (c % sets)  # set j: all sites but the binary digits of j
        mask[:, c] = [(members >> k) & 1 == 1 for k in range(num_sites)]
    return mask


def _one_point(
    contributes: NDArray[np.bool_],
    grams: Sequence[NDArray[np.float64]],
    bs: Sequence[NDArray[np.float64]],
    *,
    scope: GramScope,
    gamma: float,
    repeats: int,
) -> dict[str, Any]:
    plan = plan_aggregation(contributes, gram_scope=scope)
    sum_s = best_seconds(lambda: plaintext_gram_sums(plan, grams), repeats=repeats)
    gram_sums = plaintext_gram_sums(plan, grams)
    b_sums = class_b_sums(plan, bs)
    solve_s = best_seconds(
        lambda: solve_from_sums(plan, gram_sums=gram_sums, b_sums=b_sums, gamma=gamma),
        repeats=repeats,
    )
    weights = solve_from_sums(plan, gram_sums=gram_sums, b_sums=b_sums, gamma=gamma)
    d = weights.shape[0]
    err = 0.0
    for c, cover in enumerate(plan.gram_cover):
        direct = np.linalg.solve(gram_sums[cover] + gamma * np.eye(d), b_sums[:, c])
        err = max(err, float(np.linalg.norm(weights[:, c] - direct) / np.linalg.norm(direct)))
    releases = len(plan.gram_releases)
    return {
        "gram_scope": scope,
        "distinct_sets": releases,
        "sum_seconds": sum_s,
        "solve_seconds": solve_s,
        "total_seconds": sum_s + solve_s,
        "solve_seconds_per_set": solve_s / releases,
        "max_rel_diff_vs_numpy": err,
    }


def run_solve_bench(
    *,
    d: int = 1024,
    num_sites: int = 8,
    classes: int = 14,
    set_counts: Sequence[int] = (1, 2, 4, 8, 14),
    rows_per_site: int = 1024,
    gamma: float = 1.0,
    repeats: int = 3,
    seed: int = 0,
) -> dict[str, Any]:
    """Server sum + solve time for K sites and each number of distinct coverage sets."""
    if d < 1 or num_sites < 1 or rows_per_site < 1 or repeats < 1 or not set_counts:
        raise ValueError("need d, num_sites, rows_per_site, repeats >= 1 and some set counts")
    rng = np.random.default_rng(seed)
    grams = []
    for _ in range(num_sites):
        x = rng.standard_normal((rows_per_site, d))
        grams.append(x.T @ x)
    bs = [rng.standard_normal((d, classes)) for _ in range(num_sites)]
    warm = coverage_with_sets(num_sites=num_sites, num_classes=classes, sets=1)
    _one_point(warm, grams, bs, scope="global", gamma=gamma, repeats=1)  # warm-up, not reported
    per_class = [
        _one_point(
            coverage_with_sets(num_sites=num_sites, num_classes=classes, sets=m),
            grams,
            bs,
            scope="per-class",
            gamma=gamma,
            repeats=repeats,
        )
        for m in set_counts
    ]
    worst = coverage_with_sets(num_sites=num_sites, num_classes=classes, sets=max(set_counts))
    global_point = _one_point(worst, grams, bs, scope="global", gamma=gamma, repeats=repeats)
    return {
        "suite": "solve",
        "machine": describe_machine(),
        "d": d,
        "num_sites": num_sites,
        "classes": classes,
        "rows_per_site": rows_per_site,
        "gamma": gamma,
        "repeats": repeats,
        "seed": seed,
        "per_class": per_class,
        "global": global_point,
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of `afl bench solve`."""
    p.add_argument("--dim", type=int, default=1024, help="feature dimension d (default 1024)")
    p.add_argument("--sites", type=int, default=8, help="K (default 8)")
    p.add_argument("--classes", type=int, default=14, help="C (default 14)")
    p.add_argument(
        "--sets",
        type=int,
        nargs="+",
        default=[1, 2, 4, 8, 14],
        help="numbers of distinct coverage sets (default 1 2 4 8 14; each <= C)",
    )
    p.add_argument("--rows-per-site", type=int, default=1024, help="rows behind each Gram")
    p.add_argument("--gamma", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=5, help="runs per timing (best is kept)")
    p.add_argument("--seed", type=int, default=0)
    add_blas_threads_argument(p)
    p.add_argument("--out-dir", default="bench-results/solve")


def run(args: argparse.Namespace) -> int:
    """Run the suite; write solve.json and solve_vs_sets.png under --out-dir."""
    with blas_threads(args.blas_threads):
        bench = run_solve_bench(
            d=args.dim,
            num_sites=args.sites,
            classes=args.classes,
            set_counts=args.sets,
            rows_per_site=args.rows_per_site,
            gamma=args.gamma,
            repeats=args.repeats,
            seed=args.seed,
        )
    bench["blas_threads"] = args.blas_threads
    print(format_machine(bench["machine"]), file=sys.stderr)
    for row in [*bench["per_class"], bench["global"]]:
        print(
            f"{row['gram_scope']:9s} sets={row['distinct_sets']:3d}: sum {row['sum_seconds']:.3f}s"
            f", solve {row['solve_seconds']:.3f}s ({row['solve_seconds_per_set']:.3f}s per set)",
            file=sys.stderr,
        )
    out = Path(args.out_dir)
    json_path = write_json(bench, out / "solve.json")
    x = [r["distinct_sets"] for r in bench["per_class"]]
    png_path = line_plot(
        out / "solve_vs_sets.png",
        x=x,
        series={
            "solve (per-class)": [r["solve_seconds"] for r in bench["per_class"]],
            "Gram sums (per-class)": [r["sum_seconds"] for r in bench["per_class"]],
            "solve (global)": [bench["global"]["solve_seconds"]] * len(x),
        },
        xlabel="distinct coverage sets",
        ylabel="seconds",
        title=f"Server round-1 cost, K = {bench['num_sites']}, d = {bench['d']}, "
        f"C = {bench['classes']}",
        log=False,
    )
    print(f"written: {json_path}, {png_path}")
    return 0
