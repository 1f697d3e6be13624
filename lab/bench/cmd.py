"""`afl bench SUITE`: benchmark suites. Each writes JSON; docs/benchmarks.md records the figures."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable

from afl.core.progress import Progress

# suite name -> (module under afl.lab.bench, one-line help). Modules expose add_arguments and run.
SUITES: dict[str, tuple[str, str]] = {
    "extract": ("extract", "feature-extraction images/s: full pipeline vs pure forward pass"),
    "secagg": ("secagg", "pairwise-masking cost vs plaintext, bytes per site, growth with K"),
    "ckks": ("ckks", "CKKS encrypt/decrypt time, bytes per site, accuracy vs plaintext"),
    "privacy": ("privacy", "utility vs ε and the accuracy cost of global vs per-class"),
    "stats": ("stats", "local-statistics throughput: Gram accumulation vs raw H.T @ H"),
    "solve": ("solve", "server solve time vs the number of distinct coverage sets"),
    "scaling": ("scaling", "round-1 cost growth in K (sites) and d (dimension)"),
    "flower": (
        "flower",
        "a masked round as afl's Flower app vs afl's daemons vs Flower's SecAgg+, each vs plaintext",
    ),
    "calibration": (
        "calibration",
        "calibration from masked score histograms: ECE before/after, federated evaluation, τ",
    ),
    "dp-evaluation": (
        "dp_evaluation",
        "federated macro AUC and ECE from DP score histograms vs exact, per evaluation ε",
    ),
    "gate": (
        "gate",
        "residual influence of one in-bound site on the default; the validation gate's cost",
    ),
    "log": (
        "daemons.logcost",
        "a masked round through the daemons with the federation log and witnessing vs without",
    ),
    "fedlog": (
        "fedlog",
        "a witnessing call's Merkle work as the federation log grows: kept tree vs list",
    ),
    "startup": ("daemons.e2e", "how long afl, afl-client, afl-server and afl admin take to answer"),
}


def _missing(name: str, exc: ModuleNotFoundError) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        print(
            f"afl bench {name}: needs the Python module {exc.name!r}, which is not installed "
            "(install afl with the extras of docs/benchmarks.md, e.g. pip install 'afl[client,lab]')",
            file=sys.stderr,
        )
        return 2

    return run


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="suite", required=True, metavar="SUITE")
    for name, (module_name, help_text) in SUITES.items():
        sp = sub.add_parser(name, help=help_text, description=help_text)
        try:
            module = importlib.import_module(f"afl.lab.bench.{module_name}")
        except ModuleNotFoundError as exc:  # an image without torch still runs `afl admin`
            if (exc.name or "").startswith("afl"):
                raise
            sp.set_defaults(suite_run=_missing(name, exc))
            continue
        module.add_arguments(sp)
        sp.set_defaults(suite_run=module.run)


def run(args: argparse.Namespace) -> int:
    Progress("afl bench")(f"running the {args.suite} suite (its JSON is written at the end)")
    code: int = args.suite_run(args)
    return code
