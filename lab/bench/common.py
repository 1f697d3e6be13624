"""Helpers shared by the `afl bench` suites: timing, output files and the machine a figure ran on.

Timings are the best (minimum) wall time of ``repeats`` runs of ``time.perf_counter``: the least
disturbed run estimates the cost, the others measure the machine's noise.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "add_blas_threads_argument",
    "add_standing_argument",
    "best_seconds",
    "blas_threads",
    "describe_machine",
    "format_machine",
    "line_plot",
    "write_json",
]


@contextmanager
def blas_threads(limit: int | None) -> Iterator[None]:
    """Cap the BLAS thread pools (numpy's and scipy's OpenBLAS) for the block; None: no cap.

    On a small or busy machine multi-threaded OpenBLAS can be many times slower than one thread
    (threads spin waiting for cores), so the suites can measure both.
    """
    if limit is None:
        yield
        return
    if limit < 1:
        raise ValueError(f"BLAS threads must be >= 1, got {limit}")
    from threadpoolctl import threadpool_limits  # type: ignore[import-untyped]

    with threadpool_limits(limits=limit, user_api="blas"):
        yield


def add_blas_threads_argument(p: argparse.ArgumentParser) -> None:
    """The --blas-threads option shared by the stats, solve and scaling suites."""
    p.add_argument(
        "--blas-threads",
        type=int,
        default=None,
        metavar="N",
        help="cap numpy/scipy BLAS threads at N during the run (default: the library's own)",
    )


def best_seconds(fn: Callable[[], object], *, repeats: int) -> float:
    """min over ``repeats`` calls of fn's wall time, in seconds."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def write_json(data: dict[str, Any], path: Path) -> Path:
    """Write ``data`` as indented JSON, creating the parent folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    return path


def emit_json(data: dict[str, Any], out: str | None) -> None:
    """Write a bench result to ``out`` (JSON file) or, when ``out`` is None, to standard output."""
    if out:
        write_json(data, Path(out))
    else:
        print(json.dumps(data, indent=2))


def line_plot(
    path: Path,
    *,
    x: Sequence[float],
    series: dict[str, Sequence[float]],
    xlabel: str,
    ylabel: str,
    title: str,
    log: bool = True,
) -> Path:
    """One PNG with a marked line per series (matplotlib Agg; log-log axes by default)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, ys in series.items():
        ax.plot(list(x), list(ys), marker="o", label=label)
    if log:
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
    ax.set_xticks(list(x), [f"{v:g}" for v in x])
    ax.minorticks_off()
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# The machine a benchmark ran on: platform, CPU count and the BLAS libraries numpy/scipy use.
# Benchmark figures are meaningless without it (docs/benchmarks.md records it with every number);
# the BLAS list comes from ``threadpoolctl`` when it is installed.
def _blas_libraries() -> list[dict[str, Any]] | str:
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return "unknown (threadpoolctl not installed)"
    import scipy.linalg  # noqa: F401  (loads scipy's BLAS so that it is listed too)

    keys = ("internal_api", "version", "num_threads", "threading_layer", "architecture", "prefix")
    return [
        {key: lib.get(key) for key in keys}
        for lib in threadpool_info()
        if lib["user_api"] == "blas"
    ]


def describe_machine() -> dict[str, Any]:
    """Platform, processor, CPU counts (total and usable by this process), numpy and BLAS."""
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        usable = os.cpu_count() or 0
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": usable,
        "numpy": np.__version__,
        "blas": _blas_libraries(),
    }


def format_machine(info: dict[str, Any]) -> str:
    """One line per fact, for the start of a benchmark's console output."""
    blas = info["blas"]
    if isinstance(blas, list):
        blas_text = "; ".join(
            f"{b['internal_api']} {b['version']} ({b['num_threads']} threads, "
            f"{b['architecture']}, {b['prefix']})"
            for b in blas
        )
    else:
        blas_text = str(blas)
    return (
        f"machine: {info['platform']} ({info['processor']}), {info['cpu_count']} CPUs "
        f"({info['cpus_usable']} usable), Python {info['python']}, numpy {info['numpy']}\n"
        f"BLAS: {blas_text}"
    )


def add_standing_argument(parser: argparse._ActionsContainer) -> None:
    """``--standing-s`` of the ``--e2e`` benches (:func:`afl.lab.bench.daemons.e2e.run_e2e_bench`)."""
    parser.add_argument(
        "--standing-s",
        type=float,
        default=0.0,
        metavar="S",
        help="the site daemons stand S seconds, enrolled, before the last client process "
        "starts and its enrolment starts the round (a deployment's daemons stand between runs; "
        "CKKS sites draw encryptions of zero meanwhile); default 0: every daemon starts at once",
    )


def add_e2e_repeats_argument(parser: argparse._ActionsContainer) -> None:
    """``--e2e-repeats`` of ``afl bench secagg|ckks --e2e``
    (:func:`afl.lab.bench.daemons.e2e.run_e2e_bench`)."""
    parser.add_argument(
        "--e2e-repeats",
        type=int,
        default=1,
        metavar="R",
        help="with --e2e: R rounds per mode, each on a fresh federation, interleaved with the "
        "modes' order rotating; the figures are the medians, each round's are kept, and the "
        "per-round ratios listed (default 1)",
    )


def repetition_ratios(row: Mapping[str, Any], mode: str) -> str:
    """ ", per round x1.02 x0.97 ..." for a ``--e2e-repeats`` row ("" for one round)."""
    ratios = row.get(f"{mode}_round_seconds_ratio_per_repetition")
    return (" (per round " + " ".join(f"x{r:.2f}" for r in ratios) + ")") if ratios else ""
