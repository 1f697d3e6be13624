"""`afl bench privacy`: utility vs ε (PNG + JSON) and the accuracy cost of `global` vs `per-class`.

Runs `afl simulate`'s DP rows (docs/protocol.md §7: the daemons' releases and calibration) on a
federation (default: the embedded surrogate) for each Missing-m setting, both Gram scopes and
every ε, plus the non-private rows as references.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
from pathlib import Path
from typing import Any

from afl.core.nih import FEDMLP_PARTITION_SEED
from afl.lab.dataset import FederatedDataset, default_dataset
from afl.lab.simulate import (
    SimulationConfig,
    dp_method_name,
    method_name,
    missing_settings,
    simulate,
)
from afl.lab.simulate_dp import DEFAULT_CLIP, DPConfig

DEFAULT_EPSILONS = (0.5, 1.0, 2.0, 4.0, 8.0, math.inf)


def run_privacy_bench(
    fed: FederatedDataset,
    *,
    missing: tuple[int, ...] = (1, 7),
    epsilons: tuple[float, ...] = DEFAULT_EPSILONS,
    delta: float = 1e-5,
    clip_norm: float = DEFAULT_CLIP,
    seed: int = FEDMLP_PARTITION_SEED,
    progress: bool = False,
) -> dict[str, Any]:
    settings = missing_settings(
        missing, num_sites=fed.num_sites, num_classes=len(fed.classes), seed=seed
    )
    config = SimulationConfig(
        settings=settings,
        rounds=(1,),
        oracle=False,
        centralised=False,
        dp=DPConfig(epsilons=epsilons, delta=delta, clip_norm=clip_norm),
    )
    results = simulate(fed, config, progress=progress)
    curves: dict[str, dict[str, Any]] = {}
    for name, body in results["settings"].items():
        rows = {r["method"]: r["macro"] for r in body["rows"]}
        for scope in ("per-class", "global"):
            curves[f"{name} ({scope})"] = {
                "no_dp": rows[method_name(1, scope)],
                "epsilon": [e if math.isfinite(e) else "inf" for e in epsilons],
                "auc": [rows[dp_method_name(e, scope)]["auc"] for e in epsilons],
                "bacc": [rows[dp_method_name(e, scope)]["bacc"] for e in epsilons],
            }
    scope_cost = {
        name: {
            metric: rows_by[method_name(1, "global")][metric]
            - rows_by[method_name(1, "per-class")][metric]
            for metric in ("bacc", "auc", "map")
        }
        for name, rows_by in (
            (n, {r["method"]: r["macro"] for r in b["rows"]})
            for n, b in results["settings"].items()
        )
    }
    return {
        "suite": "privacy",
        "machine": f"{platform.machine()} {platform.processor() or ''} {platform.system()}".strip(),
        "data": results["data"]["provenance"],
        "delta": delta,
        "clip_norm": clip_norm,
        "curves": curves,
        "global_minus_per_class": scope_cost,
        "timings": results["timings"],
    }


def plot(bench: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for metric, ax in zip(("auc", "bacc"), axes, strict=True):
        for label, curve in bench["curves"].items():
            finite = [
                (e, v) for e, v in zip(curve["epsilon"], curve[metric], strict=True) if e != "inf"
            ]
            (line,) = ax.plot(
                [e for e, _ in finite], [v for _, v in finite], marker="o", label=label
            )
            ax.axhline(curve["no_dp"][metric], color=line.get_color(), linestyle=":", linewidth=1)
        ax.set_xscale("log")
        ticks = [e for e in next(iter(bench["curves"].values()))["epsilon"] if e != "inf"]
        ax.set_xticks(ticks, [f"{e:g}" for e in ticks])
        ax.minorticks_off()
        ax.set_xlabel(f"ε (δ = {bench['delta']:g})")
        ax.set_ylabel(f"macro {metric.upper()}")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"Utility vs ε — {bench['data']} (dotted: no DP)", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--setting", type=int, action="append", metavar="M", help="Missing-M (default 1 and 7)"
    )
    p.add_argument(
        "--epsilon", type=float, action="append", help="repeatable (default 0.5 1 2 4 8 inf)"
    )
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--clip", type=float, default=DEFAULT_CLIP)
    p.add_argument("--out-dir", default="bench-results/privacy")


def run(args: argparse.Namespace) -> int:
    fed = default_dataset()
    bench = run_privacy_bench(
        fed,
        missing=tuple(args.setting or (1, 7)),
        epsilons=tuple(args.epsilon or DEFAULT_EPSILONS),
        delta=args.delta,
        clip_norm=args.clip,
        progress=True,
    )
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "privacy.json").write_text(json.dumps(bench, indent=2), encoding="utf-8")
    plot(bench, out / "utility_vs_epsilon.png")
    print(json.dumps(bench["global_minus_per_class"], indent=2))
    print(f"written: {out / 'privacy.json'}, {out / 'utility_vs_epsilon.png'}")
    return 0
