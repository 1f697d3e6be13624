"""`afl bench stats`: local-statistics throughput against the machine's raw ``HᵀH``.

A site's round-1 cost is one pass of :class:`afl.core.stats.StatsAccumulator` over its features
(paper eq. 11-12: ``G_k = H_kᵀ H_k`` by BLAS ``dsyrk`` plus ``S^±_c`` sums for ``b_{k,c}``),
fed float32 rows in batches and returning float64 statistics. The yardstick is the machine's raw
float64 ``H.T @ H`` (``dgemm``) on the same rows, already converted to float64.

Reported: seconds and rows/s of each, ``time_ratio_vs_raw`` = accumulator / raw (> 1: slower
than the bare product; the accumulator also converts float32 → float64, checks the input, builds
b and symmetrises the Gram, but ``dsyrk`` does half the flops of ``dgemm``), GFLOP/s of the raw
product (2 n d² flops) and the max relative difference of the two Grams (a sanity check).
Input data come from numpy's RNG (benchmark data, not secrets).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from afl.core.stats import LocalStats, StatsAccumulator
from afl.lab.bench.common import (
    add_blas_threads_argument,
    best_seconds,
    blas_threads,
    describe_machine,
    format_machine,
    write_json,
)

__all__ = ["add_arguments", "run", "run_stats_bench"]


def _accumulate(h: NDArray[np.float32], labels: NDArray[np.int8], *, batch_size: int) -> LocalStats:
    acc = StatsAccumulator(d=h.shape[1], num_classes=labels.shape[1])
    for start in range(0, h.shape[0], batch_size):
        acc.update(h[start : start + batch_size], labels[start : start + batch_size])
    return acc.finalize(active=np.ones(labels.shape[1], dtype=bool))


def _raw_product(h32: NDArray[np.float32], *, repeats: int) -> tuple[float, NDArray[np.float64]]:
    """Best time of the bare float64 ``H.T @ H`` (conversion not timed) and its result."""
    h64 = h32.astype(np.float64)
    seconds = best_seconds(lambda: h64.T @ h64, repeats=repeats)
    gram: NDArray[np.float64] = h64.T @ h64
    return seconds, gram


def run_stats_bench(
    *,
    d: int = 1024,
    rows: int = 16384,
    batch_sizes: Sequence[int] = (1024, 4096, 16384),
    classes: int = 8,
    repeats: int = 3,
    seed: int = 0,
) -> dict[str, Any]:
    """Time the accumulator per batch size and the raw float64 ``H.T @ H`` on the same rows."""
    if d < 1 or rows < 1 or classes < 1 or repeats < 1 or not batch_sizes:
        raise ValueError("need d, rows, classes, repeats >= 1 and at least one batch size")
    if min(batch_sizes) < 1:
        raise ValueError(f"batch sizes must be >= 1, got {list(batch_sizes)}")
    rng = np.random.default_rng(seed)
    h32 = rng.standard_normal((rows, d), dtype=np.float32)
    labels = (rng.random((rows, classes)) < 0.2).astype(np.int8)
    labels[0], labels[1] = 1, 0  # every class has a positive and a negative row
    convert_s = best_seconds(lambda: h32.astype(np.float64), repeats=repeats)
    raw_s, raw_gram = _raw_product(h32, repeats=repeats)
    scale = float(np.max(np.abs(raw_gram)))
    accumulator = []
    for batch in batch_sizes:
        seconds = best_seconds(partial(_accumulate, h32, labels, batch_size=batch), repeats=repeats)
        stats = _accumulate(h32, labels, batch_size=batch)
        accumulator.append(
            {
                "batch_size": int(batch),
                "seconds": seconds,
                "rows_per_s": rows / seconds,
                "time_ratio_vs_raw": seconds / raw_s,
                "max_rel_diff_vs_raw": float(np.max(np.abs(stats.gram - raw_gram)) / scale),
            }
        )
    return {
        "suite": "stats",
        "machine": describe_machine(),
        "d": d,
        "rows": rows,
        "classes": classes,
        "repeats": repeats,
        "seed": seed,
        "raw": {
            "what": "float64 H.T @ H (dgemm) on rows already in float64",
            "seconds": raw_s,
            "rows_per_s": rows / raw_s,
            "gflops": 2.0 * rows * d * d / raw_s / 1e9,
            "float32_to_float64_seconds": convert_s,
        },
        "accumulator": accumulator,
    }


def plot(bench: dict[str, Any], path: Path) -> Path:
    """Bar chart: rows/s of the raw product and of the accumulator at each batch size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = ["raw H.T @ H\n(float64)"] + [
        f"accumulator\nbatch {a['batch_size']}" for a in bench["accumulator"]
    ]
    values = [bench["raw"]["rows_per_s"]] + [a["rows_per_s"] for a in bench["accumulator"]]
    fig, ax = plt.subplots(figsize=(6, 4))
    bars = ax.bar(labels, values, color=["#888"] + ["#3a7"] * len(bench["accumulator"]))
    for bar, acc in zip(bars[1:], bench["accumulator"], strict=True):
        ax.annotate(
            f"×{acc['time_ratio_vs_raw']:.2f} time",
            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax.set_ylabel("rows / s")
    ax.set_title(f"Local statistics, d = {bench['d']}, {bench['rows']} rows", fontsize=9)
    ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of `afl bench stats`."""
    p.add_argument("--dim", type=int, default=1024, help="feature dimension d (default 1024)")
    p.add_argument("--rows", type=int, default=16384, help="rows per pass (default 16384)")
    p.add_argument(
        "--batch-size",
        type=int,
        nargs="+",
        default=[1024, 4096, 16384],
        help="accumulator batch sizes (default 1024 4096 16384)",
    )
    p.add_argument("--classes", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3, help="runs per timing (best is kept)")
    p.add_argument("--seed", type=int, default=0)
    add_blas_threads_argument(p)
    p.add_argument("--out-dir", default="bench-results/stats")


def run(args: argparse.Namespace) -> int:
    """Run the suite; write stats.json and stats_throughput.png under --out-dir."""
    with blas_threads(args.blas_threads):
        bench = run_stats_bench(
            d=args.dim,
            rows=args.rows,
            batch_sizes=args.batch_size,
            classes=args.classes,
            repeats=args.repeats,
            seed=args.seed,
        )
    bench["blas_threads"] = args.blas_threads
    print(format_machine(bench["machine"]), file=sys.stderr)
    raw = bench["raw"]
    print(
        f"raw float64 H.T @ H: {raw['seconds']:.3f}s, {raw['rows_per_s']:,.0f} rows/s, "
        f"{raw['gflops']:.1f} GFLOP/s",
        file=sys.stderr,
    )
    for a in bench["accumulator"]:
        print(
            f"accumulator batch {a['batch_size']:6d}: {a['seconds']:.3f}s, "
            f"{a['rows_per_s']:,.0f} rows/s, x{a['time_ratio_vs_raw']:.2f} the raw time",
            file=sys.stderr,
        )
    out = Path(args.out_dir)
    json_path = write_json(bench, out / "stats.json")
    png_path = plot(bench, out / "stats_throughput.png")
    print(f"written: {json_path}, {png_path}")
    return 0
