"""`afl bench scaling`: how round-1 cost grows with the number of sites K and the dimension d.

A fixed pool of ``total_rows`` synthetic float32 rows (a dataset of fixed size, as NIH's) is split
evenly over K simulated sites with a Missing-m assignment. Per point, measured once:

    stats_seconds_mean / _max / _total   each site's :func:`afl.core.stats.local_statistics`
                                         (eq. 11-12); sites run in parallel in a federation,
                                         so a round waits for ``_max``
    server_sum_seconds                   the server adding each arriving d×d Gram into every
                                         release (coverage set) it belongs to (eq. 13-14)
    solve_seconds                        :func:`afl.core.aggregation.solve_from_sums` (eq. 15)
    distinct_sets                        Cholesky factorisations the solve needed

Growth in K at d = ``d_for_sites`` and growth in d at K = ``sites_for_dims``. Grams are added as
they arrive and dropped (memory O(sets · d²), not O(K · d²)). Data from numpy's RNG.

With ``--e2e``: masked rounds through the real daemons, full vs sparse masking graph, with time,
bytes and memory per site and their growth exponents (:mod:`afl.lab.bench.daemons.scaling_e2e`).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from afl.core.aggregation import Cover, GramScope, plan_aggregation, solve_from_sums
from afl.core.data.assignment import missing_m_assignment
from afl.core.stats import local_statistics
from afl.lab.bench.common import (
    add_blas_threads_argument,
    add_standing_argument,
    blas_threads,
    describe_machine,
    format_machine,
    line_plot,
    write_json,
)

__all__ = ["add_arguments", "run", "run_scaling_bench", "scaling_point"]


def scaling_point(
    h: NDArray[np.float32],
    labels: NDArray[np.int8],
    *,
    num_sites: int,
    missing: int,
    scope: GramScope,
    gamma: float = 1.0,
    seed: int = 0,
) -> dict[str, Any]:
    """One round 1 over ``num_sites`` even slices of (h, labels); timings as in the docstring."""
    n, d = h.shape
    classes = labels.shape[1]
    if num_sites > n:
        raise ValueError(f"{num_sites} sites need at least as many rows, got {n}")
    active = missing_m_assignment(
        num_clients=num_sites, num_classes=classes, missing=missing, seed=seed
    )
    slices = np.array_split(np.arange(n), num_sites)
    has_both = np.stack(
        [(labels[s] == 1).any(axis=0) & (labels[s] == 0).any(axis=0) for s in slices]
    )
    plan = plan_aggregation(active & has_both, gram_scope=scope)
    releases = plan.gram_releases
    sums: dict[Cover, NDArray[np.float64]] = {c: np.zeros((d, d)) for c in releases}
    b_sums = np.zeros((d, classes))
    stats_times = []
    sum_s = 0.0
    for k, rows in enumerate(slices):
        start = time.perf_counter()
        stats = local_statistics(h[rows[0] : rows[-1] + 1], labels[rows], active=active[k])
        stats_times.append(time.perf_counter() - start)
        start = time.perf_counter()
        for cover in releases:
            if k in cover:
                sums[cover] += stats.gram
        b_sums[:, stats.contributes] += stats.b[:, stats.contributes]
        sum_s += time.perf_counter() - start
    start = time.perf_counter()
    weights = solve_from_sums(plan, gram_sums=sums, b_sums=b_sums, gamma=gamma)
    solve_s = time.perf_counter() - start
    if not np.isfinite(weights).all():
        raise ArithmeticError("the solve returned non-finite weights")
    return {
        "num_sites": num_sites,
        "d": d,
        "rows_per_site": n / num_sites,
        "distinct_sets": len(releases),
        "stats_seconds_mean": float(np.mean(stats_times)),
        "stats_seconds_max": float(np.max(stats_times)),
        "stats_seconds_total": float(np.sum(stats_times)),
        "server_sum_seconds": sum_s,
        "solve_seconds": solve_s,
    }


def _data(
    rows: int, d: int, classes: int, seed: int
) -> tuple[NDArray[np.float32], NDArray[np.int8]]:
    rng = np.random.default_rng(seed)
    h = rng.standard_normal((rows, d), dtype=np.float32)
    labels = (rng.random((rows, classes)) < 0.2).astype(np.int8)
    return h, labels


def run_scaling_bench(
    *,
    sites: Sequence[int] = (8, 16, 32, 64, 128, 256),
    dims: Sequence[int] = (256, 512, 1024, 2048),
    d_for_sites: int = 1024,
    sites_for_dims: int = 8,
    total_rows: int = 16384,
    classes: int = 8,
    missing: int = 3,
    scope: GramScope = "per-class",
    gamma: float = 1.0,
    seed: int = 0,
) -> dict[str, Any]:
    """Growth in K (at ``d_for_sites``) and in d (at ``sites_for_dims``) of round-1 costs."""
    if not sites or not dims or total_rows < max(sites) or classes < 1:
        raise ValueError("need K and d values, total_rows >= max K and classes >= 1")
    warm_h, warm_labels = _data(64, 16, classes, seed)  # load BLAS/LAPACK paths before timing
    scaling_point(warm_h, warm_labels, num_sites=2, missing=0, scope=scope, gamma=gamma)
    h, labels = _data(total_rows, d_for_sites, classes, seed)
    by_sites = [
        scaling_point(h, labels, num_sites=k, missing=missing, scope=scope, gamma=gamma, seed=seed)
        for k in sites
    ]
    by_dims = []
    for d in dims:
        h, labels = _data(total_rows, d, classes, seed)
        by_dims.append(
            scaling_point(
                h,
                labels,
                num_sites=sites_for_dims,
                missing=missing,
                scope=scope,
                gamma=gamma,
                seed=seed,
            )
        )
    return {
        "suite": "scaling",
        "machine": describe_machine(),
        "total_rows": total_rows,
        "classes": classes,
        "missing": missing,
        "gram_scope": scope,
        "gamma": gamma,
        "seed": seed,
        "d_for_sites": d_for_sites,
        "sites_for_dims": sites_for_dims,
        "by_sites": by_sites,
        "by_dims": by_dims,
    }


SERIES = {
    "stats per site (mean)": "stats_seconds_mean",
    "stats, all sites": "stats_seconds_total",
    "server sum": "server_sum_seconds",
    "solve": "solve_seconds",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of `afl bench scaling`."""
    p.add_argument(
        "--sites", type=int, nargs="+", default=[8, 16, 32, 64, 128, 256], help="K values"
    )
    p.add_argument("--dims", type=int, nargs="+", default=[256, 512, 1024, 2048], help="d values")
    p.add_argument("--d-for-sites", type=int, default=1024, help="d of the K sweep")
    p.add_argument("--sites-for-dims", type=int, default=8, help="K of the d sweep")
    p.add_argument("--total-rows", type=int, default=16384, help="rows split over the sites")
    p.add_argument("--classes", type=int, default=8)
    p.add_argument("--missing", type=int, default=3, help="Missing-m assignment (default 3)")
    p.add_argument("--gram-scope", choices=("per-class", "global"), default="per-class")
    p.add_argument("--seed", type=int, default=0)
    add_blas_threads_argument(p)
    p.add_argument("--out-dir", default="bench-results/scaling")
    e2e = p.add_argument_group("--e2e: masked rounds through the daemons (--sites, --seed)")
    e2e.add_argument(
        "--e2e",
        action="store_true",
        help="afl-server + K sites in afl-client run-many hosts over loopback mTLS, per graph",
    )
    e2e.add_argument("--graphs", nargs="+", choices=("full", "sparse"), default=["full", "sparse"])
    e2e.add_argument("--dim", type=int, default=1024, help="d of the e2e sweep")
    e2e.add_argument("--rows", type=int, default=300, help="rows per site in the e2e sweep")
    e2e.add_argument("--hosts", type=int, default=4, help="afl-client run-many processes")
    add_standing_argument(e2e)
    e2e.add_argument(
        "--full-max-sites", type=int, default=256, help="largest K run with the full graph"
    )
    e2e.add_argument("--timeout-s", type=float, default=1800.0, help="per round and stage")
    e2e.add_argument("--work-dir", default=None, help="folder for the kits, caches and state")
    e2e.add_argument(
        "--keep-work", action="store_true", help="keep the federations (logs, reports, state)"
    )


def run(args: argparse.Namespace) -> int:
    """Run the suite; write scaling.json, scaling_sites.png and scaling_dims.png (with --e2e:
    scaling_e2e.json and scaling_e2e.png)."""
    if args.e2e:
        return _run_e2e(args)
    with blas_threads(args.blas_threads):
        bench = run_scaling_bench(
            sites=args.sites,
            dims=args.dims,
            d_for_sites=args.d_for_sites,
            sites_for_dims=args.sites_for_dims,
            total_rows=args.total_rows,
            classes=args.classes,
            missing=args.missing,
            scope=args.gram_scope,
            seed=args.seed,
        )
    bench["blas_threads"] = args.blas_threads
    print(format_machine(bench["machine"]), file=sys.stderr)
    for row in [*bench["by_sites"], *bench["by_dims"]]:
        print(
            f"K={row['num_sites']:4d} d={row['d']:5d}: stats/site {row['stats_seconds_mean']:.4f}s"
            f" (all {row['stats_seconds_total']:.3f}s), sum {row['server_sum_seconds']:.3f}s, "
            f"solve {row['solve_seconds']:.3f}s ({row['distinct_sets']} sets)",
            file=sys.stderr,
        )
    out = Path(args.out_dir)
    paths = [write_json(bench, out / "scaling.json")]
    for key, xkey, name, fixed in (
        ("by_sites", "num_sites", "K (sites)", f"d = {bench['d_for_sites']}"),
        ("by_dims", "d", "d (feature dimension)", f"K = {bench['sites_for_dims']}"),
    ):
        rows = bench[key]
        paths.append(
            line_plot(
                out / f"scaling_{key.removeprefix('by_')}.png",
                x=[r[xkey] for r in rows],
                series={label: [r[field] for r in rows] for label, field in SERIES.items()},
                xlabel=name,
                ylabel="seconds",
                title=f"Round-1 cost vs {name}, {fixed}, {bench['total_rows']} rows in all",
            )
        )
    print("written: " + ", ".join(str(p) for p in paths))
    return 0


def _run_e2e(args: argparse.Namespace) -> int:
    from afl.lab.bench.daemons.scaling_e2e import run_scaling_e2e

    with blas_threads(args.blas_threads):
        bench = run_scaling_e2e(
            sites=args.sites,
            graphs=args.graphs,
            d=args.dim,
            rows=args.rows,
            hosts=args.hosts,
            full_max_sites=args.full_max_sites,
            seed=args.seed,
            timeout_s=args.timeout_s,
            work_dir=args.work_dir,
            keep=args.keep_work,
            standing_s=args.standing_s,
        )
    bench["blas_threads"] = args.blas_threads
    print(format_machine(bench["machine"]), file=sys.stderr)
    for row in bench["points"]:
        print(
            f"{row['graph']:6s} K={row['num_sites']:4d} k={row['degree']:3d}: round "
            f"{row['round_seconds']:.2f}s (wall {row['wall_seconds']:.1f}s), "
            f"{row['bytes_sent_per_site'] / 1e6:.3f} MB/site, server {row['server_peak_rss_mib']} "
            f"MiB, sites {row['site_rss_mib_per_site']} MiB/site, "
            f"|W - W_plain|/|W_plain| = {row['w_relative_error']:.1e}",
            file=sys.stderr,
        )
    for graph, fits in bench["growth_exponents"].items():
        text = ", ".join(f"{f} K^{b:.2f}" for f, b in fits.items() if b is not None)
        print(f"{graph}: {text}", file=sys.stderr)
    out = Path(args.out_dir)
    paths = [write_json(bench, out / "scaling_e2e.json")]
    graphs = sorted({r["graph"] for r in bench["points"]})
    ks = sorted({r["num_sites"] for r in bench["points"]})
    seconds = {(r["graph"], r["num_sites"]): float(r["round_seconds"]) for r in bench["points"]}
    series: dict[str, Sequence[float]] = {
        f"{g} graph": [seconds.get((g, k), float("nan")) for k in ks] for g in graphs
    }
    paths.append(
        line_plot(
            out / "scaling_e2e.png",
            x=ks,
            series=series,
            xlabel="K (sites)",
            ylabel="round seconds (slowest site)",
            title=f"Masked round through the daemons, d = {bench['d']}, {bench['rows_per_site']} rows/site",
        )
    )
    print("written: " + ", ".join(str(p) for p in paths))
    if not bench["w_matches_plaintext"]:
        print("error: a masked W differs from the plaintext W by more than 1e-9", file=sys.stderr)
        return 1
    return 0
