"""The machine a benchmark ran on: platform, CPU count and the BLAS libraries numpy/scipy use.

Benchmark figures are meaningless without it (docs/benchmarks.md records it with every number);
the BLAS list comes from ``threadpoolctl`` when it is installed.
"""

from __future__ import annotations

import os
import platform
from typing import Any

import numpy as np

__all__ = ["describe_machine", "format_machine"]


def _blas_libraries() -> list[dict[str, Any]] | str:
    try:
        from threadpoolctl import threadpool_info  # type: ignore[import-untyped]
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
