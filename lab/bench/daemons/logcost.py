"""`afl bench log`: what the federation log and its witnessing cost a masked round
(docs/protocol.md §11a; docs/benchmarks.md §3d).

The same masked round (``aggregation = "mask"``, global Gram, K sites of ``rows`` × d random
float32 features and 8 classes; numpy's RNG: data, not secrets) runs through the real daemons on
loopback mTLS (:func:`afl.lab.demo.federation.run_loopback`: ``afl-server`` and one
``afl-client run`` process per site, or with ``hosts`` the sites hosted by that many
``afl-client run-many`` processes and the many-site client timing of ``afl bench scaling --e2e``;
the full masking graph, or the sparse one) in two variants, ``repeats`` times each, interleaved
(shipped, unlogged, unlogged, shipped, ...: both see the same machine and its drift), each on a
freshly provisioned federation:

    shipped   the product as it ships: every site witnesses the log, waits for a quorum of
              cosignatures on a checkpoint holding the plan, checks its inclusion and the log's
              history, anchors its DP ledger; the coordinator appends every statement
    unlogged  MEASUREMENT BASELINE ONLY: the same daemons with the log's methods patched to
              no-ops by the lab wrapper :mod:`afl.lab.bench.daemons.unlogged` (no product switch can
              select it)

Both variants start their daemons through that wrapper, which times the log's methods (two clock
reads per call). Reported per variant and repetition, and as medians:

    round_seconds         the slowest site's round (plan check -> verified model)
    log_witness_seconds   the slowest site's plan-check log step (report ``timings_s``)
    site_log_seconds      per site process, all its time in the log's methods (start-up
                          reconciliation, witnessing on status answers, the plan's check, the
                          ledger's anchoring; quorum waits included): the max and the median over
                          the processes (one site each without ``hosts``), and the mean per site
    coordinator_log_seconds   the coordinator's time in the log's methods (appends in their
                          transactions, checkpoints signed and served, cosignatures verified)
    cpu_seconds           CPU of every process of the run (user + system, start-up included)
    server_cpu_seconds, site_cpu_seconds   the coordinator's and the sites' mean CPU (/proc)
    wall_seconds          the whole run, process start-up included
    load_average          the 1-minute load average at the start and end of the run

and ``round_ratio`` = median shipped round / median unlogged round (also per repetition pair),
``round_overhead`` = round_ratio - 1 against the goal (≤ 5 %), the CPU ratio, and the largest
relative difference between the variants' W (the log changes no number of the model).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from afl.lab.bench.common import (
    add_standing_argument,
    describe_machine,
    emit_json,
    format_machine,
)
from afl.lab.bench.daemons.e2e import children_cpu, combine_repetitions, round_figures
from afl.lab.bench.daemons.scaling_e2e import (
    CLASSES,
    CLIENT_TIMING,
    GRAPHS,
    PeakMemory,
    masked_federation,
    random_sites,
)
from afl.lab.bench.daemons.unlogged import VARIANTS
from afl.lab.demo.federation import run_loopback

__all__ = ["GOAL", "add_arguments", "run", "run_log_bench"]

#: The goal of the log's cost: at most 5 % of the round.
GOAL = 0.05
_MEDIANS = (
    "round_seconds",
    "log_witness_seconds",
    "site_log_seconds_max",
    "site_log_seconds_median",
    "site_log_seconds_mean_per_site",
    "coordinator_log_seconds",
    "cpu_seconds",
    "server_cpu_seconds",
    "site_cpu_seconds",
    "wall_seconds",
)


def _wrapper(role: str, variant: str, timings: Path) -> list[str]:
    return [sys.executable, "-m", "afl.lab.bench.daemons.unlogged", role, variant, str(timings)]


def _timings(folder: Path, role: str, processes: int) -> list[dict[str, Any]]:
    """The timings the wrapper wrote for ``role``'s ``processes`` processes."""
    docs = [json.loads(p.read_text(encoding="utf-8")) for p in folder.glob(f"{role}-*.json")]
    if len(docs) != processes:
        raise RuntimeError(
            f"{folder}: {len(docs)} {role} timings for {processes} processes (a daemon did not "
            "exit cleanly)"
        )
    return docs


def _one_round(
    root: Path,
    variant: str,
    *,
    feats: list[Any],
    labels: list[Any],
    graph: str,
    hosts: int,
    timeout_s: float,
    standing_s: float = 0.0,
) -> tuple[dict[str, Any], Any]:
    """One round of ``variant`` under ``root``: its figures and W."""
    loop = masked_federation(
        root,
        feats,
        labels,
        graph=graph,
        timeout_s=timeout_s,
        client_settings=CLIENT_TIMING if hosts else None,
    )
    timings = root / "log-timings"
    per_process = math.ceil(len(feats) / hosts) if hosts else 1
    wrapped = _wrapper("client", variant, timings)
    memory = PeakMemory()
    load_start, before = os.getloadavg()[0], children_cpu()
    try:
        run = run_loopback(
            loop,
            timeout_s=timeout_s,
            server_command=_wrapper("server", variant, timings),
            client_commands=None if hosts else dict.fromkeys(loop.site_ids, wrapped),
            host_command=wrapped,
            sites_per_process=per_process,
            on_started=memory.watch,
            standing_s=standing_s,
        )
    finally:
        memory.stop()
    figures = round_figures(run, loop, memory)
    figures["cpu_seconds"] = children_cpu() - before
    figures["load_average"] = [load_start, os.getloadavg()[0]]
    sites = _timings(timings, "client", math.ceil(len(feats) / per_process))
    per_process_s = [doc["seconds"] for doc in sites]
    finals = [run.final_report(s) for s in loop.site_ids]
    figures["log_witness_seconds_per_site"] = [
        float(r["timings_s"].get("log_witness", 0.0)) for r in finals
    ]
    figures["site_log_seconds_per_process"] = per_process_s
    figures["site_log_seconds_max"] = max(per_process_s)
    figures["site_log_seconds_median"] = statistics.median(per_process_s)
    figures["site_log_seconds_mean_per_site"] = sum(per_process_s) / len(feats)
    figures["site_log_calls"] = {  # summed over the sites
        name: [sum(doc["calls"][name][i] for doc in sites) for i in (0, 1)]
        for name in sites[0]["calls"]
    }
    (server,) = _timings(timings, "server", 1)
    figures["coordinator_log_seconds"] = server["seconds"]
    figures["coordinator_log_calls"] = server["calls"]
    weights = figures.pop("weights")
    figures.pop("log_witness_share", None)
    return figures, weights


def run_log_bench(
    *,
    num_sites: int = 8,
    d: int = 1024,
    rows: int = 300,
    repeats: int = 3,
    graph: str = "full",
    hosts: int = 0,
    seed: int = 0,
    timeout_s: float = 900.0,
    standing_s: float = 0.0,
) -> dict[str, Any]:
    """The with/without comparison of the module docstring; a JSON-ready dict. ``standing_s``:
    as in :func:`afl.lab.bench.daemons.e2e.run_e2e_bench` (K − 1 sites stand, enrolled, that
    long before the last one starts)."""
    if num_sites < 3 or d < 1 or rows < 1 or repeats < 1 or hosts < 0:
        raise ValueError("need sites >= 3, dim >= 1, rows >= 1, repeats >= 1 and hosts >= 0")
    if graph not in GRAPHS:
        raise ValueError(f"the masking graph is one of {GRAPHS}, not {graph!r}")
    feats, labels = random_sites(num_sites, d=d, rows=rows, seed=seed)
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    weights: dict[str, list[Any]] = {v: [] for v in VARIANTS}
    load_start = list(os.getloadavg())
    with tempfile.TemporaryDirectory(prefix="afl-bench-log-") as tmp:
        for rep in range(repeats):
            order = VARIANTS if rep % 2 == 0 else tuple(reversed(VARIANTS))
            for variant in order:
                figures, w = _one_round(
                    Path(tmp) / f"{variant}-{rep}",
                    variant,
                    feats=feats,
                    labels=labels,
                    graph=graph,
                    hosts=hosts,
                    timeout_s=timeout_s,
                    standing_s=standing_s,
                )
                figures["repetition"] = rep
                runs[variant].append(figures)
                weights[variant].append(w)
    out: dict[str, Any] = {
        "num_sites": num_sites,
        "d": d,
        "rows_per_site": rows,
        "classes": len(CLASSES),
        "repeats": repeats,
        "graph": graph,
        "hosts": hosts,
        "seed": seed,
        "standing_s": standing_s,
        "machine": describe_machine(),
        "load_average_start": load_start,
        "load_average_end": list(os.getloadavg()),
    }
    for variant in VARIANTS:
        combined = combine_repetitions(runs[variant])  # None where /proc could not be read
        out[variant] = {"median": {k: combined[k] for k in _MEDIANS}, "runs": runs[variant]}
    shipped, unlogged = out["shipped"]["median"], out["unlogged"]["median"]
    out["round_ratio"] = shipped["round_seconds"] / unlogged["round_seconds"]
    out["round_ratio_per_repetition"] = [
        a["round_seconds"] / b["round_seconds"]
        for a, b in zip(runs["shipped"], runs["unlogged"], strict=True)
    ]
    out["round_overhead"] = out["round_ratio"] - 1.0
    out["goal"] = GOAL
    out["meets_goal"] = out["round_overhead"] <= GOAL
    out["cpu_ratio"] = shipped["cpu_seconds"] / unlogged["cpu_seconds"]
    out["log_witness_share"] = shipped["log_witness_seconds"] / shipped["round_seconds"]
    reference = weights["shipped"][0]
    out["w_relative_difference"] = max(
        float(np.linalg.norm(w - reference) / np.linalg.norm(reference))
        for w in (*weights["shipped"], *weights["unlogged"])
    )
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `afl bench log`."""
    parser.add_argument("--sites", type=int, default=8, help="K (default 8)")
    parser.add_argument("--dim", type=int, default=1024, help="feature dimension d (default 1024)")
    parser.add_argument("--rows", type=int, default=300, help="rows per site (default 300)")
    parser.add_argument(
        "--repeats", type=int, default=3, help="rounds per variant, interleaved (default 3)"
    )
    parser.add_argument("--graph", choices=GRAPHS, default="full", help="the masking graph")
    parser.add_argument(
        "--hosts",
        type=int,
        default=0,
        help="afl-client run-many processes hosting the sites (default 0: a process per site)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout-s", type=float, default=900.0, help="per round and stage")
    parser.add_argument("--out", metavar="FILE", help="write JSON here (default: stdout)")
    add_standing_argument(parser)


def run(args: argparse.Namespace) -> int:
    """Run the comparison and write its JSON."""
    machine = describe_machine()
    print(format_machine(machine), file=sys.stderr)
    try:
        row = run_log_bench(
            num_sites=args.sites,
            d=args.dim,
            rows=args.rows,
            repeats=args.repeats,
            graph=args.graph,
            hosts=args.hosts,
            seed=args.seed,
            timeout_s=args.timeout_s,
            standing_s=args.standing_s,
        )
    except (ValueError, RuntimeError) as exc:
        print(f"afl bench log: {exc}", file=sys.stderr)
        return 2
    shipped, unlogged = row["shipped"]["median"], row["unlogged"]["median"]
    print(
        f"log K={row['num_sites']} d={row['d']} {row['graph']} x{row['repeats']}: round "
        f"{shipped['round_seconds']:.2f} s shipped vs {unlogged['round_seconds']:.2f} s unlogged "
        f"(x{row['round_ratio']:.3f}, {100 * row['round_overhead']:+.1f} %, goal <= "
        f"{100 * GOAL:.0f} %: {'met' if row['meets_goal'] else 'NOT met'}); plan log step "
        f"{shipped['log_witness_seconds']:.2f} s; coordinator log "
        f"{shipped['coordinator_log_seconds']:.3f} s; CPU x{row['cpu_ratio']:.3f}; load "
        f"{row['load_average_start'][0]:.1f} -> {row['load_average_end'][0]:.1f}",
        file=sys.stderr,
    )
    emit_json({"benchmark": "log", "results": [row]}, args.out)
    return 0
