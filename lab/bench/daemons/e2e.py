"""End-to-end rounds per aggregation mode through the real daemons (`afl bench secagg|ckks --e2e`).

Runs :func:`afl.lab.demo.federation.run_loopback` on the same K site caches (random benchmark
features, numpy RNG: data, not secrets) once per mode: ``plaintext`` (the reference), ``mask``
(pairwise masking) and/or ``ckks`` (afl-server, a dedicated decryptor site and K
``afl-client run`` processes over loopback mTLS). Reported per mode:

    round_seconds        the slowest site's round time (plan check -> verified model)
    log_witness_seconds  the slowest site's federation-log step before it accepted the plan
                         (witnessing the newest checkpoint, waiting for the quorum's
                         cosignatures, the plan's inclusion proof); log_witness_share: its part
                         of that site's round
    exchange_seconds     the slowest site's mode exchange (CKKS: context fetch and check, sealed
                         tags, encryption and streamed upload; MASK: all five stages)
    bytes_sent_per_site  payload bytes a site uploaded (CKKS: serialized ciphertexts)
    wall_seconds         the whole run, process start-up included
    decrypt_seconds      CKKS only: the decryptor's decryptions (tag check, grid rounding; its
                         jobs overlap, so this sum can exceed their share of the round)
    download_seconds     CKKS only: the decryptor fetching the homomorphic sums
    ckks_ciphertexts     CKKS only: the ciphertexts the K sites encrypted, and
    ckks_drawn_ahead     of them those made from an encryption of zero a site drew while it
                         waited for the round (afl.crypto.ckks.zeros)
    server_peak_rss_mib  afl-server's peak resident memory (the kernel's VmHWM; Linux, else null)
    site_peak_rss_mib    the largest peak resident memory of the K site daemons
    decryptor_peak_rss_mib  CKKS only: the decryptor daemon's
    server_cpu_seconds   afl-server's CPU seconds (user + system, /proc; start-up included)
    site_cpu_seconds     the mean CPU seconds of the K site daemons (start-up included)
    decryptor_cpu_seconds  CKKS only: the decryptor daemon's
    cpu_seconds          CPU seconds of every process of the run (the kernel's account of the
                         children the run waited for: exact, start-up included)
    load_average         the 1-minute load average at the start and the end of the run
    site_timings_s_median  each step of a site's round (its report's ``timings_s``: the plan
                         check, the stage waits, each stage of the exchange, the wait for the
                         model), the median over the K sites

and the ratios to plaintext (same run, same machine), plus the max relative W difference.
Pure per-site encryption time is measured in-process by ``afl bench ckks`` (no transport).

With ``repeats`` R > 1 (``--e2e-repeats``) every mode runs R rounds, each on a freshly
provisioned federation, interleaved, the modes' order rotating from one repetition to the next
(plaintext, ckks, mask; then ckks, mask, plaintext; ...) so that no mode always runs first or
last. Each mode's figures are then the medians over its R rounds (``site_timings_s_median``: per
step; ``load_average``: the first round's start and the last round's end), its rounds' own
figures are kept under ``repetitions``, and beside each ratio of medians the per-repetition
ratios of the round time are listed (``<mode>_round_seconds_ratio_per_repetition``). The W
difference is the largest over the repetitions.

`afl bench startup` (this module's ``add_arguments`` and ``run``) times the commands operators
and sites type, each as a fresh process, ``repeats`` times, against a federation provisioned in a
temporary folder (no CKKS) whose ``afl-server`` runs for ``afl admin ls``. Reported per command
(medians over the repeats):

    wall_seconds   from start to exit
    cpu_seconds    user + system CPU of the process (less sensitive to other jobs than wall time)

With ``baseline_bin`` (the ``bin`` folder of another afl install, e.g. an older checkout's
virtual environment) the same commands run from there too, interleaved with this install's so
both see the same load, with the ratios this / baseline. The load average at start and end is
recorded: on a shared machine wall times are noisy, CPU seconds much less so.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from afl.lab.bench.common import emit_json
from afl.lab.bench.daemons.scaling_e2e import CLASSES, PeakMemory, random_sites
from afl.lab.demo.federation import (
    LoopbackFederation,
    LoopbackRun,
    ckks_round_settings,
    mask_round_settings,
    prepare_loopback,
    run_loopback,
)

__all__ = [
    "COMMANDS",
    "MODES",
    "children_cpu",
    "memory_summary",
    "round_figures",
    "run_e2e_bench",
    "run_startup_bench",
]

MODES = ("plaintext", "ckks", "mask")
_KEYS = ("round_seconds", "exchange_seconds", "bytes_sent_per_site", "wall_seconds", "cpu_seconds")


def children_cpu() -> float:
    """User + system CPU seconds of every child process waited for so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def round_figures(
    run: LoopbackRun, loop: LoopbackFederation, memory: PeakMemory | None = None
) -> dict[str, Any]:
    """The figures of one run from its sites' reports and ``memory``'s peaks (module docstring)."""
    finals = [run.final_report(s) for s in loop.site_ids]
    if any(r.get("outcome") != "COMPLETED" for r in finals):
        raise RuntimeError(f"the federation failed: {[r.get('reason') for r in finals]}")
    out: dict[str, Any] = {
        "round_seconds": max(r["timings_s"]["round"] for r in finals),
        "exchange_seconds": max(r["timings_s"]["upload"] for r in finals),
        "bytes_sent_per_site": float(np.mean([r["bytes_sent"] for r in finals])),
        "wall_seconds": run.wall_s,
        "weights": np.load(finals[0]["model"]["path"]),
    }
    # The federation log: the slowest site's witnessing and quorum wait before it accepted the
    # plan (docs/protocol.md §11a), and its share of that site's round.
    witnessed = [(r["timings_s"].get("log_witness", 0.0), r["timings_s"]["round"]) for r in finals]
    slowest = max(witnessed)
    out["log_witness_seconds"] = slowest[0]
    out["log_witness_share"] = slowest[0] / slowest[1] if slowest[1] > 0 else 0.0
    out["site_timings_s_median"] = {  # each step of a site's round, median over the sites
        key: float(np.median([float(r["timings_s"].get(key, 0.0)) for r in finals]))
        for key in sorted({k for r in finals for k in r["timings_s"]})
    }
    if memory is not None:
        sites = [v for name, v in memory.peaks.items() if name not in ("server", "decryptor")]
        out["server_peak_rss_mib"] = memory.peaks.get("server")
        out["site_peak_rss_mib"] = max(sites) if sites else None
        if "decryptor" in memory.peaks:
            out["decryptor_peak_rss_mib"] = memory.peaks["decryptor"]
        site_cpu = [v for name, v in memory.cpu.items() if name not in ("server", "decryptor")]
        out["server_cpu_seconds"] = memory.cpu.get("server")
        out["site_cpu_seconds"] = float(np.mean(site_cpu)) if site_cpu else None
        if "decryptor" in memory.cpu:
            out["decryptor_cpu_seconds"] = memory.cpu["decryptor"]
    if loop.decryptor_config is not None:
        counts = [r.get("ckks", {}) for r in finals]
        out["ckks_ciphertexts"] = sum(int(c.get("ciphertexts", 0)) for c in counts)
        out["ckks_drawn_ahead"] = sum(int(c.get("drawn_ahead", 0)) for c in counts)
        jobs_file = loop.decryptor_config.parent / "state" / "ckks" / "decryptions.jsonl"
        jobs = [json.loads(x) for x in jobs_file.read_text().splitlines() if x.strip()]
        out["decrypt_seconds"] = float(sum(j["decrypt_s"] for j in jobs))
        out["download_seconds"] = float(sum(j["download_s"] for j in jobs))
        out["aggregate_bytes"] = int(sum(j["size"] for j in jobs))
        out["jobs"] = len(jobs)
    return out


def memory_summary(row: dict[str, Any]) -> str:
    """One line of the peak resident memory per mode and daemon, e.g. ``peak RSS MiB: plaintext
    server 120 site 150; ckks server 160 site 200 decryptor 250``."""

    def mib(value: Any) -> str:
        return "?" if value is None else f"{value:.0f}"

    parts = []
    for mode in MODES:
        if isinstance(row.get(mode), dict):
            figures = row[mode]
            text = f"{mode} server {mib(figures.get('server_peak_rss_mib'))}"
            text += f" site {mib(figures.get('site_peak_rss_mib'))}"
            if "decryptor_peak_rss_mib" in figures:
                text += f" decryptor {mib(figures['decryptor_peak_rss_mib'])}"
            parts.append(text)
    return "peak RSS MiB: " + "; ".join(parts)


def run_e2e_bench(
    *,
    num_sites: int = 8,
    d: int = 1024,
    rows: int = 300,
    seed: int = 0,
    modes: Sequence[str] = MODES,
    timeout_s: float = 900,
    standing_s: float = 0.0,
    repeats: int = 1,
) -> dict[str, Any]:
    """``repeats`` loopback rounds per mode on the same caches, interleaved; the figures of the
    module docstring. ``standing_s`` > 0: K − 1 sites stand that long, enrolled, before the last
    one starts (:func:`afl.lab.demo.federation.run_loopback`), as a deployment's daemons do
    between runs; 0: every daemon starts at once and the round is the first thing the last one
    does."""
    if "plaintext" not in modes or len(set(modes)) < 2 or set(modes) - set(MODES):
        raise ValueError(f"modes must include plaintext and another mode, from {MODES}")
    if repeats < 1:
        raise ValueError("repeats must be at least 1")
    feats, labels = random_sites(num_sites, d=d, rows=rows, seed=seed)
    out: dict[str, Any] = {
        "num_sites": num_sites,
        "d": d,
        "rows_per_site": rows,
        "standing_s": standing_s,
        "repeats": repeats,
    }
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
    with tempfile.TemporaryDirectory(prefix="afl-bench-e2e-") as tmp:
        for repetition in range(repeats):
            turn = repetition % len(modes)
            for mode in [*modes[turn:], *modes[:turn]]:
                settings: dict[str, Any] = {"gram_scope": "global", "upload_timeout_s": 600.0}
                if mode == "mask":
                    settings.update(mask_round_settings(feats))
                if mode == "ckks":
                    settings.update(ckks_round_settings(feats))
                loop = prepare_loopback(
                    Path(tmp) / f"{mode}-{repetition}",
                    classes=CLASSES,
                    site_features=feats,
                    site_labels=labels,
                    active=np.ones((num_sites, len(CLASSES)), dtype=bool),
                    test_features=feats[0][:10],
                    test_labels=labels[0][:10],
                    round_settings=settings,
                    decryptor=mode == "ckks",
                    allow_plaintext=mode == "plaintext",  # the baseline: sites opt in
                )
                memory = PeakMemory()
                load_start, before = os.getloadavg()[0], children_cpu()
                try:
                    run = run_loopback(
                        loop, timeout_s=timeout_s, on_started=memory.watch, standing_s=standing_s
                    )
                finally:
                    memory.stop()
                figures = round_figures(run, loop, memory)
                figures["cpu_seconds"] = children_cpu() - before
                figures["load_average"] = [load_start, os.getloadavg()[0]]
                runs[mode].append(figures)
    weights = {mode: [r.pop("weights") for r in runs[mode]] for mode in modes}
    for mode in modes:
        out[mode] = combine_repetitions(runs[mode])
    for mode in modes:
        if mode == "plaintext":
            continue
        out[f"{mode}_w_relative_difference"] = max(
            float(np.linalg.norm(w - p) / np.linalg.norm(p))
            for w, p in zip(weights[mode], weights["plaintext"], strict=True)
        )
        for key in _KEYS:
            out[f"{mode}_{key}_ratio"] = out[mode][key] / out["plaintext"][key]
        if repeats > 1:
            out[f"{mode}_round_seconds_ratio_per_repetition"] = [
                r["round_seconds"] / p["round_seconds"]
                for r, p in zip(runs[mode], runs["plaintext"], strict=True)
            ]
    return out


def _numbers(values: Sequence[Any]) -> bool:
    """Whether every mapping among ``values`` maps to numbers only."""
    return all(
        isinstance(x, (int, float)) and not isinstance(x, bool)
        for v in values
        if isinstance(v, dict)
        for x in v.values()
    )


def combine_repetitions(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One mode's figures over its repetitions (module docstring): the median of each number
    (None where one of them is None), of each step of ``site_timings_s_median`` (of each entry of
    any mapping of numbers), the first round's start and the last round's end of
    ``load_average``; anything else as the first round has it. With more than one, the rounds'
    own figures under ``repetitions``."""
    if len(runs) == 1:
        return dict(runs[0])
    out: dict[str, Any] = {}
    for key, first in runs[0].items():
        values = [r.get(key) for r in runs]
        if key == "load_average":
            out[key] = [runs[0][key][0], runs[-1][key][-1]]
        elif isinstance(first, dict) and _numbers(values):
            steps = sorted({k for v in values if isinstance(v, dict) for k in v})
            out[key] = {
                k: float(np.median([float(v.get(k, 0.0)) for v in values if isinstance(v, dict)]))
                for k in steps
            }
        elif isinstance(first, bool) or not isinstance(first, (int, float)):
            out[key] = first
        elif any(v is None for v in values):
            out[key] = None
        else:
            out[key] = float(np.median([float(v) for v in values if v is not None]))
    out["repetitions"] = [dict(r) for r in runs]
    return out


# `afl bench startup` (module docstring).

#: (name, argv); ``{admin}`` is the admin kit's admin.toml.
COMMANDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("afl --version", ("afl", "--version")),
    ("afl-client --help", ("afl-client", "--help")),
    ("afl-server --help", ("afl-server", "--help")),
    ("afl admin ls", ("afl", "admin", "--config", "{admin}", "ls")),
)


def _timed(argv: Sequence[str]) -> tuple[float, float]:
    """(wall, CPU) seconds of one run of ``argv``; RuntimeError naming it if it fails."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {proc.returncode}: {proc.stderr.strip()}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def _serve(root: Path) -> tuple[subprocess.Popen[str], Path]:
    """A provisioned federation under ``root`` with its afl-server running; the admin kit."""
    from afl.lab.demo.federation import LISTENING, free_port
    from afl.ops.provisioning import provision

    federation = provision(
        root / "federation",
        sites=["site-a", "site-b", "site-c"],
        port=free_port(),
        round_settings={
            "classes": ["A", "B"],
            "feature_dim": 8,
            "backbone": "xrv-densenet121-all",
            "backbone_sha256": "0" * 64,
            "allow_random_init": True,
        },
    )
    server = subprocess.Popen(
        [sys.executable, "-m", "afl.server.daemon.main", "--config", "server.toml"],
        cwd=federation.server_dir,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert server.stderr is not None
    for line in server.stderr:
        if LISTENING in line:
            return server, federation.root / "admins" / "operator" / "admin.toml"
    raise RuntimeError(f"afl-server exited with {server.wait()} before listening")


def run_startup_bench(*, repeats: int = 3, baseline_bin: Path | None = None) -> dict[str, Any]:
    """The figures of the module docstring for :data:`COMMANDS`."""
    if repeats < 1:
        raise ValueError("repeats must be at least 1")
    installs = {"this": Path(sys.executable).parent}
    if baseline_bin is not None:
        installs["baseline"] = Path(baseline_bin)
    for name, folder in installs.items():
        missing = [c for c in ("afl", "afl-client", "afl-server") if not (folder / c).is_file()]
        if missing:
            raise ValueError(f"{folder} ({name}) has no {', '.join(missing)}")
    out: dict[str, Any] = {"repeats": repeats, "load_average_start": os.getloadavg()}
    times: dict[tuple[str, str], list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="afl-bench-startup-") as tmp:
        server, admin = _serve(Path(tmp))
        try:
            for _ in range(repeats):
                for name, argv in COMMANDS:
                    for install, folder in installs.items():
                        args = [str(folder / argv[0])]
                        args += [a.format(admin=admin) for a in argv[1:]]
                        times.setdefault((name, install), []).append(_timed(args))
        finally:
            server.send_signal(signal.SIGTERM)
            server.communicate(timeout=120)
    out["load_average_end"] = os.getloadavg()
    rows = []
    for name, _ in COMMANDS:
        row: dict[str, Any] = {"command": name}
        for install in installs:
            runs = times[(name, install)]
            row[install] = {
                "wall_seconds": statistics.median(w for w, _ in runs),
                "cpu_seconds": statistics.median(c for _, c in runs),
                "wall_seconds_all": [w for w, _ in runs],
            }
        if "baseline" in installs:
            for key in ("wall_seconds", "cpu_seconds"):
                row[f"{key}_ratio"] = row["this"][key] / row["baseline"][key]
        rows.append(row)
    out["commands"] = rows
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repeats", type=int, default=3, help="runs per command (median)")
    parser.add_argument(
        "--baseline-bin",
        type=Path,
        default=None,
        help="the bin folder of another afl install to compare with (interleaved runs)",
    )
    parser.add_argument("--out", metavar="FILE", help="write JSON here (default: stdout)")


def run(args: argparse.Namespace) -> int:
    try:
        result = run_startup_bench(repeats=args.repeats, baseline_bin=args.baseline_bin)
    except (ValueError, RuntimeError) as exc:
        print(f"afl bench startup: {exc}", file=sys.stderr)
        return 2
    for row in result["commands"]:
        text = f"{row['command']:<20} {row['this']['wall_seconds']:6.2f} s wall"
        text += f" {row['this']['cpu_seconds']:6.2f} s CPU"
        if "baseline" in row:
            text += (
                f"  (baseline {row['baseline']['wall_seconds']:.2f} s wall "
                f"{row['baseline']['cpu_seconds']:.2f} s CPU)"
            )
        print(text, file=sys.stderr)
    emit_json({"benchmark": "startup", "results": [result]}, args.out)
    return 0
