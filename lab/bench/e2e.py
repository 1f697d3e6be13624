"""End-to-end rounds per aggregation mode through the real daemons (`afl bench secagg|ckks --e2e`).

Runs :func:`afl.lab.demo.federation.run_loopback` on the same K site caches (random benchmark
features, numpy RNG: data, not secrets) once per mode: ``plaintext`` (the reference), ``mask``
(pairwise masking) and/or ``ckks`` (afl-server, a dedicated decryptor site and K
``afl-client run`` processes over loopback mTLS). Reported per mode:

    round_seconds        the slowest site's round time (plan check -> verified model)
    exchange_seconds     the slowest site's mode exchange (CKKS: context fetch and check, sealed
                         tags, encryption and streamed upload; MASK: all five stages)
    bytes_sent_per_site  payload bytes a site uploaded (CKKS: serialized ciphertexts)
    wall_seconds         the whole run, process start-up included
    decrypt_seconds      CKKS only: the decryptor's decryptions (tag check, grid rounding)
    download_seconds     CKKS only: the decryptor fetching the homomorphic sums
    server_peak_rss_mib  afl-server's peak resident memory (the kernel's VmHWM; Linux, else null)
    site_peak_rss_mib    the largest peak resident memory of the K site daemons
    decryptor_peak_rss_mib  CKKS only: the decryptor daemon's

and the ratios to plaintext (same run, same machine), plus the max relative W difference.
Pure per-site encryption time is measured in-process by ``afl bench ckks`` (no transport).
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from afl.lab.bench.scaling_e2e import PeakMemory
from afl.lab.demo.federation import (
    LoopbackFederation,
    LoopbackRun,
    ckks_round_settings,
    mask_round_settings,
    prepare_loopback,
    run_loopback,
)

__all__ = ["MODES", "memory_summary", "round_figures", "run_e2e_bench"]

CLASSES = ("A", "B", "C", "D", "E", "F", "G", "H")
MODES = ("plaintext", "ckks", "mask")
_KEYS = ("round_seconds", "exchange_seconds", "bytes_sent_per_site", "wall_seconds")


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
    if memory is not None:
        sites = [v for name, v in memory.peaks.items() if name not in ("server", "decryptor")]
        out["server_peak_rss_mib"] = memory.peaks.get("server")
        out["site_peak_rss_mib"] = max(sites) if sites else None
        if "decryptor" in memory.peaks:
            out["decryptor_peak_rss_mib"] = memory.peaks["decryptor"]
    if loop.decryptor_config is not None:
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
) -> dict[str, Any]:
    """One loopback round per mode on the same caches; the figures of the module docstring."""
    if "plaintext" not in modes or len(set(modes)) < 2 or set(modes) - set(MODES):
        raise ValueError(f"modes must include plaintext and another mode, from {MODES}")
    rng = np.random.default_rng(seed)
    feats = [rng.normal(size=(rows, d)).astype(np.float32) for _ in range(num_sites)]
    labels = [(rng.random((rows, len(CLASSES))) < 0.3).astype(np.int8) for _ in range(num_sites)]
    out: dict[str, Any] = {"num_sites": num_sites, "d": d, "rows_per_site": rows}
    with tempfile.TemporaryDirectory(prefix="afl-bench-e2e-") as tmp:
        for mode in modes:
            settings: dict[str, Any] = {"gram_scope": "global", "upload_timeout_s": 600.0}
            if mode == "mask":
                settings.update(mask_round_settings(feats))
            if mode == "ckks":
                settings.update(ckks_round_settings(feats))
            loop = prepare_loopback(
                Path(tmp) / mode,
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
            try:
                run = run_loopback(loop, timeout_s=timeout_s, on_started=memory.watch)
            finally:
                memory.stop()
            out[mode] = round_figures(run, loop, memory)
    w_plain = out["plaintext"].pop("weights")
    for mode in modes:
        if mode == "plaintext":
            continue
        w = out[mode].pop("weights")
        out[f"{mode}_w_relative_difference"] = float(
            np.linalg.norm(w - w_plain) / np.linalg.norm(w_plain)
        )
        for key in _KEYS:
            out[f"{mode}_{key}_ratio"] = out[mode][key] / out["plaintext"][key]
    return out
