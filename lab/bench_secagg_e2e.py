"""`afl bench secagg --e2e`: masked vs plaintext rounds through the real daemons (issue 5).

Runs :func:`afl.lab.demo_federation.run_loopback` twice on the same K site caches (random
benchmark features, numpy RNG: data, not secrets), once with ``aggregation = "plaintext"`` and
once with ``"mask"`` (afl-server plus K ``afl-client run`` processes over loopback mTLS), and
reports per mode:

    round_seconds        the slowest site's round time (plan check -> verified model)
    exchange_seconds     the slowest site's mode exchange (uploads; MASK: all five stages)
    bytes_sent_per_site  payload bytes a site sent (MASK: masked vectors + keys, shares, sigs)
    wall_seconds         the whole run, process start-up included

and the masked/plaintext ratios (goal: round time ≤ 1.3×), plus the relative difference of the
two published W (the masked W must equal the plaintext W).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from afl.lab.demo_federation import (
    LoopbackRun,
    mask_round_settings,
    prepare_loopback,
    run_loopback,
)

__all__ = ["run_e2e_bench"]

CLASSES = ("A", "B", "C", "D", "E", "F", "G", "H")


def _mode_figures(run: LoopbackRun, sites: tuple[str, ...]) -> dict[str, Any]:
    finals = [run.final_report(s) for s in sites]
    if any(r.get("outcome") != "COMPLETED" for r in finals):
        raise RuntimeError(f"the federation failed: {[r.get('reason') for r in finals]}")
    return {
        "round_seconds": max(r["timings_s"]["round"] for r in finals),
        "exchange_seconds": max(r["timings_s"]["upload"] for r in finals),
        "bytes_sent_per_site": float(np.mean([r["bytes_sent"] for r in finals])),
        "wall_seconds": run.wall_s,
        "weights": np.load(finals[0]["model"]["path"]),
    }


def run_e2e_bench(
    *, num_sites: int = 8, d: int = 1024, rows: int = 300, seed: int = 0, timeout_s: float = 900
) -> dict[str, Any]:
    """One plaintext and one masked loopback round on the same caches; the figures above."""
    rng = np.random.default_rng(seed)
    feats = [rng.normal(size=(rows, d)).astype(np.float32) for _ in range(num_sites)]
    labels = [(rng.random((rows, len(CLASSES))) < 0.3).astype(np.int8) for _ in range(num_sites)]
    out: dict[str, Any] = {"num_sites": num_sites, "d": d, "rows_per_site": rows}
    with tempfile.TemporaryDirectory(prefix="afl-bench-e2e-") as tmp:
        for mode in ("plaintext", "mask"):
            settings: dict[str, Any] = {"gram_scope": "global", "upload_timeout_s": 300.0}
            if mode == "mask":
                settings.update(mask_round_settings(feats))
            loop = prepare_loopback(
                Path(tmp) / mode,
                classes=CLASSES,
                site_features=feats,
                site_labels=labels,
                active=np.ones((num_sites, len(CLASSES)), dtype=bool),
                test_features=feats[0][:10],
                test_labels=labels[0][:10],
                round_settings=settings,
            )
            out[mode] = _mode_figures(run_loopback(loop, timeout_s=timeout_s), loop.site_ids)
    w_plain, w_mask = out["plaintext"].pop("weights"), out["mask"].pop("weights")
    out["w_relative_difference"] = float(np.linalg.norm(w_mask - w_plain) / np.linalg.norm(w_plain))
    for key in ("round_seconds", "exchange_seconds", "bytes_sent_per_site", "wall_seconds"):
        out[f"{key}_ratio"] = out["mask"][key] / out["plaintext"][key]
    return out
