"""Command-line front end of `afl simulate` (argument parsing, output files)."""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from afl.core.data.assignment import load_coverage_spec
from afl.core.data.nih import CLASS_SETS, FEDMLP_PARTITION_SEED
from afl.core.refinement import RefinementParams
from afl.lab.report import tables
from afl.lab.simulate.baselines import BASELINES, BaselineConfig
from afl.lab.simulate.dataset import FederatedDataset, default_dataset, load_dataset, save_dataset
from afl.lab.simulate.dp import DEFAULT_CLIP, MECHANISMS, DPConfig
from afl.lab.simulate.grid import (
    Setting,
    SimulationConfig,
    coverage_setting,
    missing_settings,
    simulate,
)

SETTING_RE = re.compile(r"^missing-(\d+)$")


def add_arguments(p: argparse.ArgumentParser) -> None:
    data = p.add_argument_group("data (default: the embedded surrogate federation)")
    data.add_argument(
        "--features", metavar="DIR", help="feature caches: DIR/<site>/ per site and DIR/test/"
    )
    data.add_argument("--class-set", choices=sorted(CLASS_SETS), default="paper")
    data.add_argument(
        "--split",
        choices=("image", "patient"),
        default="image",
        help="7:3 split: image-wise as FedMLP, or patient-wise",
    )
    data.add_argument("--sites", type=int, default=8, help="number of IID sites (default 8)")
    data.add_argument("--surrogate-seed", type=int, default=0)
    data.add_argument(
        "--metadata",
        metavar="CSV",
        help="NIH Data_Entry_2017_v2020.csv.gz (default: the copy torchxrayvision ships)",
    )
    real = p.add_argument_group(
        "real images (NIH ChestX-ray14 folder; features extracted once, resumable)"
    )
    real.add_argument("--images", metavar="DIR", help="NIH folder: Data_Entry_2017*.csv + images/")
    real.add_argument("--weights", metavar="FILE", help="local backbone weights (never downloaded)")
    real.add_argument(
        "--backbone", default="xrv-densenet121-all", help="see `afl-client backbones`"
    )
    real.add_argument("--sha256", help="pinned SHA-256 of the weights file")
    real.add_argument(
        "--random-init", action="store_true", help="random weights (tests only; stamped)"
    )
    real.add_argument("--cache-dir", default="afl-cache", help="where extracted features are kept")
    real.add_argument("--batch-size", type=int, default=32)
    real.add_argument("--workers", type=int, default=2)
    real.add_argument("--device", default="auto")
    grid = p.add_argument_group("experiment grid")
    grid.add_argument(
        "--setting",
        action="append",
        metavar="missing-M",
        help="repeatable; default missing-1/3/5/7",
    )
    grid.add_argument(
        "--coverage",
        metavar="FILE",
        help="a coverage spec (JSON/TOML) instead of Missing-m settings",
    )
    grid.add_argument("--assignment-seed", type=int, default=FEDMLP_PARTITION_SEED)
    grid.add_argument(
        "--gram-scope",
        action="append",
        choices=("per-class", "global"),
        help="repeatable; default both",
    )
    grid.add_argument("--rounds", default="1,2", help="comma list from {1,2} (default 1,2)")
    grid.add_argument(
        "--baselines",
        default="",
        metavar="LIST",
        help=f"comma list of gradient baselines on the same features: {','.join(BASELINES)}",
    )
    grid.add_argument("--baseline-rounds", type=int, default=50)
    grid.add_argument(
        "--no-oracle", action="store_true", help="skip the Theorem-1 pooled-ridge oracle rows"
    )
    grid.add_argument(
        "--no-centralised", action="store_true", help="skip the centralised all-labels row"
    )
    hyper = p.add_argument_group("hyper-parameters (paper Table IV defaults)")
    hyper.add_argument("--gamma", type=float, default=1.0)
    hyper.add_argument("--tau", type=float, default=0.7)
    hyper.add_argument("--alpha", type=float, default=0.5)
    hyper.add_argument("--delta-pos", type=int, default=5)
    hyper.add_argument("--delta-neg", type=int, default=50)
    dp = p.add_argument_group("differential privacy (docs/protocol.md §7; adds DP rows, 1 round)")
    dp.add_argument(
        "--dp-epsilon",
        action="append",
        type=float,
        metavar="EPS",
        help="repeatable; 'inf' = clipping and pooled normalisation without noise",
    )
    dp.add_argument("--dp-delta", type=float, default=1e-5)
    dp.add_argument("--dp-clip", type=float, default=DEFAULT_CLIP, help="row clip norm L")
    dp.add_argument(
        "--dp-unit",
        choices=("patient", "image"),
        default="patient",
        help="unit of privacy (patient: the first m images of each patient, the daemons' default)",
    )
    dp.add_argument(
        "--dp-images-per-patient",
        type=int,
        default=1,
        metavar="M",
        help="m, images kept per patient at a site (unit patient; sensitivities times m)",
    )
    dp.add_argument(
        "--dp-mechanism",
        choices=MECHANISMS,
        default="default",
        help="default: the daemons' (measured budget split, joint calibration, label clipping "
        "k = 1, ridge at the noise level); previous: equal split, per-release calibration, no "
        "label clipping, eigenvalue floor; the others undo one choice of default",
    )
    dp.add_argument("--dp-seed", type=int, default=0, help="seed of the simulated noise")
    out = p.add_argument_group("output")
    out.add_argument("--out", metavar="FILE", help="write the results as JSON")
    out.add_argument(
        "--save-dir",
        metavar="DIR",
        help="save per-site caches, assignments and every solved W (.npy)",
    )
    out.add_argument(
        "--quiet",
        action="store_true",
        help="no progress output (default: a bar on a terminal, else one line per phase on stderr)",
    )


def _settings(args: argparse.Namespace, fed: FederatedDataset) -> SimulationConfig:
    if args.coverage and args.setting:
        raise SystemExit("afl simulate: give --setting or --coverage, not both")
    settings: tuple[Setting, ...]
    if args.coverage:
        settings = (
            coverage_setting(load_coverage_spec(args.coverage), fed, Path(args.coverage).stem),
        )
    else:
        ms = []
        for name in args.setting or ["missing-1", "missing-3", "missing-5", "missing-7"]:
            match = SETTING_RE.match(name)
            if not match:
                raise SystemExit(f"afl simulate: setting must look like missing-M, got {name!r}")
            ms.append(int(match.group(1)))
        settings = missing_settings(
            ms, num_sites=fed.num_sites, num_classes=len(fed.classes), seed=args.assignment_seed
        )
    try:
        rounds = tuple(sorted({int(r) for r in args.rounds.split(",")}))
    except ValueError as exc:
        raise SystemExit(f"afl simulate: --rounds must be a comma list of 1 and 2 ({exc})") from exc
    baselines = tuple(b for b in args.baselines.split(",") if b)
    unknown = set(baselines) - set(BASELINES)
    if unknown:
        raise SystemExit(
            f"afl simulate: unknown baselines {sorted(unknown)}; choose from {BASELINES}"
        )
    return SimulationConfig(
        settings=settings,
        gram_scopes=tuple(args.gram_scope or ("per-class", "global")),
        rounds=rounds,
        gamma=args.gamma,
        refinement=RefinementParams(
            tau=args.tau, alpha=args.alpha, delta_pos=args.delta_pos, delta_neg=args.delta_neg
        ),
        baselines=baselines,
        baseline_config=BaselineConfig(rounds=args.baseline_rounds),
        oracle=not args.no_oracle,
        centralised=not args.no_centralised,
        dp=None
        if not args.dp_epsilon
        else DPConfig(
            epsilons=tuple(args.dp_epsilon),
            delta=args.dp_delta,
            clip_norm=args.dp_clip,
            unit=args.dp_unit,
            rows_per_individual=args.dp_images_per_patient,
            mechanism=args.dp_mechanism,
            seed=args.dp_seed,
        ),
    )


def load_data(args: argparse.Namespace) -> FederatedDataset:
    if args.images and args.features:
        raise SystemExit("afl simulate: give --images or --features, not both")
    if args.images:
        if not args.weights and not args.random_init:
            raise SystemExit(
                "afl simulate: --images needs --weights FILE (local backbone weights; "
                "`afl-client backbones` lists the expected files and where to get them)"
            )
        from afl.lab.simulate.images import image_federation

        return image_federation(
            images=args.images,
            cache_dir=args.cache_dir,
            backbone=args.backbone,
            weights=args.weights,
            sha256=args.sha256,
            random_init=args.random_init,
            class_set=args.class_set,
            split=args.split,
            num_sites=args.sites,
            batch_size=args.batch_size,
            workers=args.workers,
            device=args.device,
            progress=not args.quiet,
        )
    if args.features:
        root = Path(args.features)
        sites = sorted(
            p
            for p in root.iterdir()
            if p.is_dir() and p.name != "test" and (p / "meta.json").exists()
        )
        if not sites or not (root / "test" / "meta.json").exists():
            raise SystemExit(f"afl simulate: {root} must hold one cache per site and a test/ cache")
        return load_dataset(sites, root / "test")
    return default_dataset(
        class_set=args.class_set,
        split=args.split,
        num_sites=args.sites,
        surrogate_seed=args.surrogate_seed,
        metadata_path=args.metadata,
    )


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def _say(message: str) -> None:
    print(f"afl simulate: {message}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    progress = not args.quiet and sys.stderr.isatty()
    log = None if args.quiet or progress else _say
    if not args.quiet:
        _say("loading the data (the embedded default builds surrogate features: a minute or two)")
    start = time.perf_counter()
    fed = load_data(args)
    if not args.quiet:
        _say(
            f"data ready in {time.perf_counter() - start:.0f} s: {fed.provenance}, {fed.num_sites} sites, d = {fed.d}"
        )
    config = _settings(args, fed)
    if config.dp is not None and config.dp.unit == "patient" and fed.site_patients is None:
        raise SystemExit(
            "afl simulate: --dp-unit patient needs the sites' patient ids (feature caches with "
            "patients.txt, written by afl-client extract from a manifest 'patient' column); "
            "use --dp-unit image for caches without them"
        )
    save_dir = Path(args.save_dir) if args.save_dir else None
    saved: dict[str, str] = {}

    def keep(setting: str, method: str, weights: NDArray[np.float64]) -> None:
        if save_dir is None:
            return
        path = save_dir / "weights" / f"{_slug(setting)}__{_slug(method)}.npy"
        path.parent.mkdir(parents=True, exist_ok=True)
        np.save(path, weights)
        saved[f"{setting}/{method}"] = str(path)

    results: dict[str, Any] = simulate(fed, config, progress=progress, on_weights=keep, log=log)
    if save_dir is not None:
        save_dataset(fed, save_dir / "data")
        results["saved"] = {"data": str(save_dir / "data"), "weights": saved}
        (save_dir / "results.json").write_text(json.dumps(results, indent=2), encoding="utf-8")
    print(tables.assignments(results))
    print()
    print(tables.table_ii(results))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2), encoding="utf-8")
        print(f"\nresults written to {args.out}")
    return 0
