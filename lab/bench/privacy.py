"""`afl bench privacy`: utility vs ε (PNG + JSON) per DP mechanism, and the accuracy cost of
`global` vs `per-class`.

Runs `afl simulate`'s DP rows (docs/protocol.md §7: the daemons' releases and calibration) on a
federation (default: the embedded surrogate) for each Missing-m setting, both Gram scopes, every
ε and every mechanism variant, plus the non-private rows as references. A variant is
``MECHANISM:UNIT:M`` (:class:`afl.lab.simulate.dp.DPConfig`): a mechanism of
:data:`afl.lab.simulate.dp.MECHANISMS` (``default``: the daemons' measured budget split, joint
calibration, label clipping k = 1, ridge at the noise level; ``previous``: equal split,
per-release calibration, no label clipping, eigenvalue floor; the others undo one choice of
``default``), ``patient`` (the first M images of each patient per site) or ``image``, and
optionally D′: the features projected on a fixed random D′-dimensional subspace (public seed,
:func:`afl.lab.simulate.dp.projection_matrix`) with the clip norm scaled by √(D′/d).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
from pathlib import Path
from typing import Any

from afl.core.data.nih import FEDMLP_PARTITION_SEED
from afl.lab.simulate.dataset import FederatedDataset, default_dataset
from afl.lab.simulate.dp import DEFAULT_CLIP, MECHANISMS, DPConfig
from afl.lab.simulate.grid import (
    SimulationConfig,
    dp_method_name,
    method_name,
    missing_settings,
    simulate,
)

DEFAULT_EPSILONS = (1.0, 2.0, 4.0, 8.0, math.inf)
#: The chosen mechanism at the daemons' default unit, and the previous one (image-level, as it
#: was before the patient unit, and at the patient unit).
DEFAULT_VARIANTS = ("default:patient:1", "previous:patient:1", "previous:image:1")


def parse_variant(text: str) -> tuple[str, str, int, int]:
    """``MECHANISM:UNIT:M[:D]`` -> (mechanism, unit, m, projection d′ or 0); ValueError names
    what is wrong."""
    parts = text.split(":")
    shape = f"variant must be {'|'.join(MECHANISMS)}:patient|image:M[:D'], got {text!r}"
    if len(parts) not in (3, 4) or parts[0] not in MECHANISMS:
        raise ValueError(shape)
    numbers = parts[2:]
    if parts[1] not in ("patient", "image") or not all(
        p.isdigit() and int(p) >= 1 for p in numbers
    ):
        raise ValueError(shape)
    return parts[0], parts[1], int(parts[2]), int(parts[3]) if len(parts) == 4 else 0


def run_privacy_bench(
    fed: FederatedDataset,
    *,
    missing: tuple[int, ...] = (1, 7),
    epsilons: tuple[float, ...] = DEFAULT_EPSILONS,
    delta: float = 1e-5,
    clip_norm: float = DEFAULT_CLIP,
    variants: tuple[str, ...] = DEFAULT_VARIANTS,
    seed: int = FEDMLP_PARTITION_SEED,
    progress: bool = False,
) -> dict[str, Any]:
    settings = missing_settings(
        missing, num_sites=fed.num_sites, num_classes=len(fed.classes), seed=seed
    )
    curves: dict[str, dict[str, Any]] = {}
    scope_cost: dict[str, dict[str, float]] = {}
    timings: dict[str, dict[str, float]] = {}
    kept: dict[str, float] = {}
    for variant in variants:
        mechanism, unit, m, projection = parse_variant(variant)
        # A random projection to d′ shrinks a row's norm by about √(d′/d): the clip follows.
        clip = clip_norm * math.sqrt(projection / fed.d) if projection else clip_norm
        config = SimulationConfig(
            settings=settings,
            rounds=(1,),
            oracle=False,
            centralised=False,
            dp=DPConfig(
                epsilons=epsilons,
                delta=delta,
                clip_norm=clip,
                unit=unit,  # type: ignore[arg-type]
                rows_per_individual=m,
                mechanism=mechanism,  # type: ignore[arg-type]
                projection=projection,
            ),
        )
        results = simulate(fed, config, progress=progress)
        timings[variant] = results["timings"]
        for name, body in results["settings"].items():
            rows = {r["method"]: r for r in body["rows"]}
            for scope in ("per-class", "global"):
                dp_rows = [rows[dp_method_name(e, scope)] for e in epsilons]
                kept[variant] = float(dp_rows[0]["dp"]["kept_fraction"])
                curves[f"{variant} {name} ({scope})"] = {
                    "variant": variant,
                    "setting": name,
                    "scope": scope,
                    "no_dp": rows[method_name(1, scope)]["macro"],
                    "epsilon": [e if math.isfinite(e) else "inf" for e in epsilons],
                    "auc": [r["macro"]["auc"] for r in dp_rows],
                    "bacc": [r["macro"]["bacc"] for r in dp_rows],
                }
            scope_cost[name] = {
                metric: rows[method_name(1, "global")]["macro"][metric]
                - rows[method_name(1, "per-class")]["macro"][metric]
                for metric in ("bacc", "auc", "map")
            }
    return {
        "suite": "privacy",
        "machine": f"{platform.machine()} {platform.processor() or ''} {platform.system()}".strip(),
        "data": fed.provenance,
        "delta": delta,
        "clip_norm": clip_norm,
        "variants": list(variants),
        "kept_fraction": kept,
        "curves": curves,
        "global_minus_per_class": scope_cost,
        "timings": timings,
    }


def table(bench: dict[str, Any]) -> str:
    """The utility-vs-ε table of docs/benchmarks.md §2 (macro AUC) as Markdown."""
    eps = next(iter(bench["curves"].values()))["epsilon"]
    head = " | ".join(f"ε = {e}" if e != "inf" else "∞ (no noise)" for e in eps)
    lines = [
        f"| mechanism, unit, setting (scope) | {head} | no DP |",
        "|---" * (len(eps) + 2) + "|",
    ]
    for label, curve in bench["curves"].items():
        cells = " | ".join(f"{v:.3f}" for v in curve["auc"])
        lines.append(f"| {label} | {cells} | {curve['no_dp']['auc']:.3f} |")
    return "\n".join(lines)


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
    axes[0].legend(fontsize=6)
    fig.suptitle(f"Utility vs ε — {bench['data']} (dotted: no DP)", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--setting", type=int, action="append", metavar="M", help="Missing-M (default 1 and 7)"
    )
    p.add_argument(
        "--epsilon", type=float, action="append", help="repeatable (default 1 2 4 8 inf)"
    )
    p.add_argument(
        "--variant",
        action="append",
        metavar="MECHANISM:UNIT:M",
        help=f"repeatable (default {' '.join(DEFAULT_VARIANTS)}); module docstring",
    )
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--clip", type=float, default=DEFAULT_CLIP)
    p.add_argument("--out-dir", default="bench-results/privacy")


def run(args: argparse.Namespace) -> int:
    variants = tuple(args.variant or DEFAULT_VARIANTS)
    for v in variants:
        try:
            parse_variant(v)
        except ValueError as exc:
            raise SystemExit(f"afl bench privacy: {exc}") from exc
    fed = default_dataset()
    bench = run_privacy_bench(
        fed,
        missing=tuple(args.setting or (1, 7)),
        epsilons=tuple(args.epsilon or DEFAULT_EPSILONS),
        delta=args.delta,
        clip_norm=args.clip,
        variants=variants,
        progress=True,
    )
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "privacy.json").write_text(json.dumps(bench, indent=2), encoding="utf-8")
    plot(bench, out / "utility_vs_epsilon.png")
    print(table(bench))
    print(json.dumps({"kept_fraction": bench["kept_fraction"]}, indent=2))
    print(f"written: {out / 'privacy.json'}, {out / 'utility_vs_epsilon.png'}")
    return 0
