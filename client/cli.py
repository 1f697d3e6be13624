"""``afl-client``: the hospital-side command line (make the site's keys and import the operator's
bundle, extract features, merge shards, list backbones, run the daemon).

Subcommands are listed in :data:`SUBCOMMANDS` as ``(name, help, add_arguments, run)``.
``main`` returns the process exit code:
0 success, 1 a reported error (bad input, missing weights, unreadable file with --on-error fail),
2 usage errors (argparse).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from afl.client.features.shards import SHARD_MODES, ShardError, parse_shard
from afl.client.features.sitedata import (
    NIH_PAPER_CLASSES,
    SiteDataError,
    SiteSource,
    UnreadableImageError,
    missing_files,
)
from afl.core.about import afl_version

if TYPE_CHECKING:
    from afl.client.config import ClientConfig

Handler = Callable[[argparse.Namespace], int]
_DESCRIPTION = (
    "The hospital side of afl: make the site's keys and import the operator's public bundle, "
    "extract features from chest X-rays, merge shard caches, list the backbones, check the "
    "site's setup (doctor), run the site daemon that takes part in the federation's rounds, "
    "show its state (status), evaluate a published model on the site's own hold-out, and "
    "predict with an exported model."
)


def _version() -> str:
    return f"afl-client {afl_version()}"


def default_workers() -> int:
    """DataLoader workers: up to 4, never more than the CPUs this process may use (torch warns
    above that; a 2-core machine gets 2)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(0, min(4, cpus or 1))


def _classes(text: str | None) -> tuple[str, ...] | None:
    return None if text is None else tuple(c.strip() for c in text.split(",") if c.strip())


def add_extract_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--images", help="NIH ChestX-ray14 folder (Data_Entry_2017*.csv + images)")
    src.add_argument("--manifest", help="CSV with a path column and one column per class")
    p.add_argument("--backbone", required=True, help="registry name (see `afl-client backbones`)")
    w = p.add_mutually_exclusive_group(required=True)
    w.add_argument("--weights", help="weights file, or a directory holding the expected file")
    w.add_argument(
        "--random-init", action="store_true", help="random weights (tests/benchmarks only)"
    )
    p.add_argument("--sha256", help="pin the weights file's SHA-256 (64 hex digits)")
    p.add_argument("--out", required=True, help="feature cache directory to write")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument(
        "--workers",
        type=int,
        default=default_workers(),
        help=f"DataLoader worker processes (default {default_workers()}: up to 4, at most the CPUs)",
    )
    p.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda, cuda:1")
    p.add_argument("--bf16", action="store_true", help="bfloat16 autocast (stamped in the cache)")
    p.add_argument("--channels-last", action="store_true", help="channels_last memory format")
    p.add_argument("--shard", default="0/1", help="i/n: extract shard i of n (default 0/1)")
    p.add_argument("--shard-mode", choices=SHARD_MODES, default="contiguous")
    p.add_argument("--on-error", choices=("skip", "fail"), default="skip")
    p.add_argument(
        "--classes",
        help=f"comma-separated class list (NIH default: {','.join(NIH_PAPER_CLASSES)}; "
        "manifest default: every column except the path/id columns)",
    )
    p.add_argument("--views", help="NIH only: comma-separated View Position filter, e.g. PA")
    p.add_argument(
        "--only-present",
        action="store_true",
        help="NIH only: extract the listed images that are on disk (a partial download); without "
        "it a folder missing listed images is refused before any work starts",
    )
    p.add_argument(
        "--uncertain-as",
        choices=("unlabelled", "positive", "negative"),
        default="unlabelled",
        help="manifest: what -1 means. afl's convention: not labelled (default); a CheXpert-style "
        "file's -1 means uncertain: map it to positive or negative",
    )
    p.add_argument(
        "--warn-unreadable",
        type=float,
        default=0.05,
        metavar="FRACTION",
        help="warn loudly when more than this fraction of the images is unreadable (default 0.05)",
    )
    p.add_argument("--path-column", default="path", help="manifest: image path column")
    p.add_argument("--id-column", help="manifest: image id column (default: the path)")
    p.add_argument(
        "--patient-column",
        default="patient",
        help="manifest: patient id column, the DP privacy unit (default: patient, when present)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _preflight(source: SiteSource, args: argparse.Namespace) -> SiteSource:
    """Refuse before any work what cannot be a usable run: a partial NIH folder (unless
    --only-present), a list whose files are all missing; print the source's warnings."""
    for warning in source.warnings:
        print(f"WARNING: {warning}", file=sys.stderr)
    missing = missing_files(source)
    total = len(source.records)
    if not total:
        raise SiteDataError(f"{source.description}: the list holds no images")
    if missing and args.images and not args.only_present:
        raise SiteDataError(
            f"{args.images}: only {total - len(missing):,} of the {total:,} images listed in its "
            f"Data_Entry_2017 CSV are on disk (first missing: {missing[0].path}); complete the "
            "folder, or pass --only-present to extract the images that are there"
        )
    if missing and args.images:
        keep = {r.path for r in missing}
        kept = tuple(r for r in source.records if r.path not in keep)
        print(
            f"--only-present: extracting {len(kept):,} of {total:,} listed images", file=sys.stderr
        )
        return replace(source, records=kept)
    if len(missing) == total:
        raise SiteDataError(
            f"{source.description}: none of the {total:,} listed image files exists (first: "
            f"{missing[0].path}); paths are relative to the manifest's folder"
        )
    if missing:
        print(
            f"WARNING: {len(missing):,} of {total:,} listed image files do not exist (first: "
            f"{missing[0].path}); they will be reported as unreadable",
            file=sys.stderr,
        )
    return source


def run_extract(args: argparse.Namespace) -> int:
    from afl.client.features.backbones import load_backbone
    from afl.client.features.extract import extract_features
    from afl.client.features.sitedata import manifest_source, nih_source

    classes = _classes(args.classes)
    if args.images:
        views = _classes(args.views)
        source = nih_source(args.images, classes=classes or NIH_PAPER_CLASSES, views=views)
    else:
        source = manifest_source(
            args.manifest,
            classes=classes,
            path_column=args.path_column,
            id_column=args.id_column,
            uncertain_as=args.uncertain_as,
            patient_column=args.patient_column,
        )
    source = _preflight(source, args)
    backbone = load_backbone(
        args.backbone, weights=args.weights, sha256=args.sha256, random_init=args.random_init
    )
    if backbone.random_init:
        print("WARNING: random-init backbone: features are for tests only", file=sys.stderr)
    result = extract_features(
        source,
        backbone,
        args.out,
        batch_size=args.batch_size,
        workers=args.workers,
        device=args.device,
        bf16=args.bf16,
        channels_last=args.channels_last,
        shard=parse_shard(args.shard),
        shard_mode=args.shard_mode,
        on_error=args.on_error,
        progress=not args.no_progress,
    )
    meta = result.cache.meta
    bad = len(result.unreadable)
    print(
        f"{args.out}: {meta.n} images x {meta.d} features from {meta.provenance}; "
        f"{bad} unreadable (listed in {args.out}/unreadable.csv); "
        f"{result.images_per_s:.1f} images/s"
    )
    if meta.n == 0:
        first = f" (first: {result.unreadable[0].error})" if result.unreadable else ""
        raise SiteDataError(f"no image could be read: {bad} unreadable{first}")
    if bad and bad > args.warn_unreadable * (meta.n + bad):
        print(
            f"WARNING: {bad} of {meta.n + bad} images ({bad / (meta.n + bad):.0%}) were "
            f"UNREADABLE and are left out of {args.out} (more than --warn-unreadable "
            f"{args.warn_unreadable:g}); first: {result.unreadable[0].error}; all are listed in "
            f"{args.out}/unreadable.csv",
            file=sys.stderr,
        )
    return 0


def add_merge_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("shards", nargs="+", help="shard cache directories (all i/n of one run)")
    p.add_argument("--out", required=True, help="merged feature cache directory")


def run_merge(args: argparse.Namespace) -> int:
    from afl.client.features.merge import merge_shards

    cache = merge_shards(args.shards, args.out)
    print(f"{args.out}: {cache.meta.n} images merged from {len(args.shards)} shards")
    return 0


def run_backbones(args: argparse.Namespace) -> int:
    from afl.client.features.backbones import BACKBONES

    for spec in BACKBONES.values():
        print(f"{spec.name:26s} d={spec.dim:<5d} {spec.weights_filename}  {spec.weights_url}")
    return 0


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="client.toml from the site's startup kit")
    p.add_argument(
        "--insecure",
        action="store_true",
        help="DEVELOPMENT ONLY: connect without TLS (prints a warning)",
    )
    p.add_argument(
        "--rounds", type=int, default=None, help="exit after this many rounds (default: linger)"
    )
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING (default INFO)")


def _daemon_errors() -> tuple[type[Exception], ...]:
    """What a daemon run can fail with that a user can cause (one line, exit 1)."""
    from afl.client.config import ConfigError
    from afl.client.daemon.transport import DaemonError
    from afl.client.daemon.verify import VerificationError
    from afl.client.payloads.stats import PayloadError
    from afl.core.data.featurecache import FeatureCacheError

    return (ConfigError, DaemonError, PayloadError, VerificationError, FeatureCacheError)


def _daemon_config(path: str, *, insecure: bool, log_level: str, first: bool) -> ClientConfig:
    import logging

    from afl.client.config import load_client_config

    if first:
        logging.basicConfig(
            level=log_level.upper(),
            format="%(asctime)s %(levelname)s %(name)s %(threadName)s %(message)s",
            stream=sys.stderr,
        )
        if insecure:
            print("WARNING: --insecure: no TLS, development only", file=sys.stderr)
    config = load_client_config(path)
    for warning in config.warnings:
        logging.getLogger("afl.client").warning("%s", warning)
    return config


def run_daemon(args: argparse.Namespace) -> int:
    from afl.client.daemon.loop import ClientDaemon

    try:
        config = _daemon_config(
            args.config, insecure=args.insecure, log_level=args.log_level, first=True
        )
        if config.role == "decryptor":  # the CKKS decryptor site (docs/protocol.md §4.3)
            from afl.client.daemon.decryptor import DecryptorDaemon

            return DecryptorDaemon(config, insecure=args.insecure).run()
        return ClientDaemon(config, insecure=args.insecure, max_rounds=args.rounds).run()
    except _daemon_errors() as exc:
        print(f"afl-client run: error: {exc}", file=sys.stderr)
        return 1


def add_run_many_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Run several participant sites in this one process, each with its own client.toml, kit, "
        "state folder and mutual-TLS channel, in its own thread (tests and benchmarks with many "
        "sites on one machine; a hospital runs `afl-client run`). Exit status: 0 when every site "
        "completed, else the largest site exit code."
    )
    p.add_argument(
        "--config", action="append", required=True, help="a site's client.toml (repeat per site)"
    )
    p.add_argument(
        "--insecure",
        action="store_true",
        help="DEVELOPMENT ONLY: connect without TLS (prints a warning)",
    )
    p.add_argument(
        "--rounds", type=int, default=None, help="each site exits after this many rounds"
    )
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING (default INFO)")
    p.add_argument("--summary", default=None, help="write {site: exit code} as JSON to this file")


def run_many(args: argparse.Namespace) -> int:
    from pathlib import Path

    from afl.client.daemon.host import run_sites, worst_exit_code

    refusals: tuple[type[Exception], ...] = (*_daemon_errors(), ValueError, OSError)
    try:
        configs = [
            _daemon_config(path, insecure=args.insecure, log_level=args.log_level, first=i == 0)
            for i, path in enumerate(args.config)
        ]
        hosted = [c for c in configs if c.role == "decryptor"]
        if hosted:
            raise ValueError(f"{hosted[0].path}: a decryptor site runs alone (afl-client run)")
        codes = run_sites(
            configs,
            insecure=args.insecure,
            max_rounds=args.rounds,
            summary=Path(args.summary) if args.summary else None,
            known_errors=_daemon_errors(),
        )
    except refusals as exc:
        print(f"afl-client run-many: error: {exc}", file=sys.stderr)
        return 1
    for site, code in sorted(codes.items()):
        print(f"afl-client run-many: {site}: exit {code}", file=sys.stderr)
    return worst_exit_code(codes)


def add_init_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Production provisioning at the site (docs/operations.md §2). First "
        "`afl-client init --kit DIR --site-id ID`: generates the site's TLS key and Ed25519 "
        "identity key IN the kit folder (they never leave it) and writes the public request "
        "<ID>.request.json for the operator; read its fingerprint to the operator. Then, with "
        "the operator's folder for this site: `afl-client init --kit DIR --import FOLDER "
        "--roster-fingerprint '...'`: checks the certificate, the roster and the client.toml "
        "template against this kit's keys and installs them."
    )
    p.add_argument("--kit", required=True, help="the site's kit folder (created 0700)")
    step = p.add_mutually_exclusive_group(required=True)
    step.add_argument("--site-id", help="step 1: make the keys and the request of this site")
    step.add_argument(
        "--import",
        dest="bundle",
        metavar="FOLDER",
        help="step 2: install the "
        "operator's folder for this site (ca.pem, site.pem, roster.json, client.toml)",
    )
    p.add_argument(
        "--role",
        choices=("participant", "decryptor"),
        default="participant",
        help="step 1: the role this site asks for (decryptor: the CKKS secret-key holder)",
    )
    p.add_argument(
        "--roster-fingerprint",
        metavar="HEX",
        help="step 2: the roster fingerprint the operator published out of band; the import is "
        "refused if the roster differs, or if none is given (the roster names every peer's "
        "identity key: a roster nobody checked can give a peer's place to the operator)",
    )
    p.add_argument(
        "--unverified-roster",
        action="store_true",
        help="step 2, development only: import without comparing the roster fingerprint",
    )


def run_init(args: argparse.Namespace) -> int:
    from afl.client.kit import KitError, import_bundle, init_site_kit

    try:
        if args.site_id is not None:
            path, request = init_site_kit(args.kit, site_id=args.site_id, role=args.role)
            print(f"site {request.name}: keys written to {args.kit} (site.key, identity.key; 0600)")
            print(f"  request for the operator: {path}")
            print(f"  fingerprint (read it to the operator): {request.fingerprint}")
            return 0
        if args.roster_fingerprint is None and not args.unverified_roster:
            raise KitError(
                "--roster-fingerprint is required: give the roster fingerprint the operator "
                "published out of band (docs/operations.md §2); --unverified-roster skips the "
                "check (development only)"
            )
        imported = import_bundle(args.kit, args.bundle, roster_fingerprint=args.roster_fingerprint)
    except KitError as exc:
        print(f"afl-client init: error: {exc}", file=sys.stderr)
        return 1
    roster = imported.roster
    print(
        f"site {imported.request.name}: federation {roster.federation_id} installed in {args.kit}"
    )
    print(f"  coordinator: {roster.server_address}")
    print(f"  sites: {', '.join(f'{s} ({e.role})' for s, e in sorted(roster.sites.items()))}")
    checked = (
        "matches" if args.roster_fingerprint else "NOT CHECKED: compare it with the operator's"
    )
    print(f"  roster fingerprint: {roster.fingerprint}  ({checked})")
    if imported.config_is_new:
        print(
            f"  {imported.config.name}: the operator's template (client.toml kept; merge by hand)"
        )
    else:
        print(
            "  client.toml: [policy] written with the production defaults (DP required, "
            "lifetime ε 10; docs/operations.md §3.4)"
        )
    print("  next: set [data] in client.toml and review [policy] (docs/operations.md §3)")
    return 0


def add_status_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="client.toml from the site's startup kit")
    p.add_argument("--insecure", action="store_true", help="the server runs --insecure (dev)")


def add_doctor_arguments(p: argparse.ArgumentParser) -> None:
    add_status_arguments(p)
    p.add_argument("--no-connect", action="store_true", help="skip the coordinator checks")


def _site_config(args: argparse.Namespace) -> ClientConfig | None:
    """client.toml, or None after printing why it cannot be loaded."""
    from afl.client.config import ConfigError, load_client_config

    try:
        return load_client_config(args.config)
    except ConfigError as exc:
        print(f"afl-client {args.command}: error: {exc}", file=sys.stderr)
        return None


def run_doctor(args: argparse.Namespace) -> int:
    from afl.client.doctor import doctor
    from afl.crypto.identity.kit_check import PROBLEM, report_lines

    config = _site_config(args)
    if config is None:
        return 2
    findings = doctor(config, insecure=args.insecure, connect=not args.no_connect)
    print(f"afl-client doctor {config.path}")
    print("\n".join(report_lines(findings)))
    problems = sum(f.level == PROBLEM for f in findings)
    print(f"{problems} problem(s) found" if problems else "ready: `afl-client run --config ...`")
    return 1 if problems else 0


def run_status(args: argparse.Namespace) -> int:
    from afl.client.doctor import status_lines

    config = _site_config(args)
    if config is None:
        return 2
    print("\n".join(status_lines(config, insecure=args.insecure)))
    return 0


def add_predict_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="an `afl export` folder (or its model.ts)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--images", help="folder of PNG/JPEG/DICOM files (searched recursively)")
    src.add_argument("--manifest", help="CSV with a path column (other columns are ignored)")
    p.add_argument(
        "--calibration",
        help="calibration JSON fitted for this model: adds calibrated probabilities (the "
        "decisions stay the paper's σ(z) > 0.5)",
    )
    p.add_argument("--out", required=True, help="output file (.csv or .json)")
    p.add_argument("--format", choices=("csv", "json"), help="default: from --out's suffix")
    p.add_argument("--path-column", default="path", help="manifest: image path column")
    p.add_argument("--id-column", help="manifest: image id column (default: the path)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_model_proof_arguments(p)


def add_model_proof_arguments(p: argparse.ArgumentParser, *, config: bool = True) -> None:
    """--config (unless the command has its own) and --unverified-model."""
    if config:
        p.add_argument(
            "--config",
            help="the site's client.toml: the export's signature and log proof are verified "
            "with its kit (coordinator key, roster, witness_quorum)",
        )
    p.add_argument(
        "--unverified-model",
        action="store_true",
        help="score a model whose signature or federation-log proof does not verify (not the "
        "federation's published model: testing only; a warning is printed)",
    )


def _unverified_warning(command: str, model: str, *, unchecked: str) -> None:
    print(
        f"WARNING: afl-client {command}: --unverified-model: {model} was NOT verified as this "
        f"federation's published model ({unchecked} not checked); its scores are for testing "
        "only",
        file=sys.stderr,
    )


def run_predict(args: argparse.Namespace) -> int:
    from afl.client.config import load_client_config
    from afl.client.model.export import load_exported
    from afl.client.model.predict import image_records, predict_images, summary, write_predictions
    from afl.client.model.proof import ModelProofError, check_head, verify_export
    from afl.core.evaluation.calibration import Calibration

    model = load_exported(args.model)
    if args.unverified_model:
        _unverified_warning("predict", args.model, unchecked="its signature and log proof")
    elif args.config is None:
        raise ModelProofError(
            "--config is required: the export is verified with the site's kit before scoring "
            "(--unverified-model skips that, testing only)"
        )
    else:
        published, witnesses = verify_export(args.model, load_client_config(args.config))
        check_head(model.module, published)
        if model.model_sha256 != published.model_sha256:
            raise ModelProofError(
                f"the export's card names model {model.model_sha256[:16]}…, its signed model is "
                f"{published.model_sha256[:16]}…: the export was altered"
            )
        print(
            f"model {published.model_sha256[:16]}… (round {published.model.round_id}) verified: "
            f"signed by the coordinator, in the federation log under a checkpoint cosigned by "
            f"{', '.join(sorted(witnesses))}"
        )
    calibration = Calibration.load(args.calibration) if args.calibration else None
    records = image_records(
        images=args.images,
        manifest=args.manifest,
        path_column=args.path_column,
        id_column=args.id_column,
    )
    if not records:
        print(
            f"afl-client predict: error: no images in {args.images or args.manifest}",
            file=sys.stderr,
        )
        return 1
    run = predict_images(model, records, calibration=calibration, progress=not args.no_progress)
    as_json = (args.format or ("json" if args.out.lower().endswith(".json") else "csv")) == "json"
    written = write_predictions(run, args.out, fmt="json" if as_json else "csv")
    print(summary(run))
    print("written: " + ", ".join(str(p) for p in written))
    return 0 if run.rows else 1


def add_evaluate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="the site's client.toml")
    p.add_argument(
        "--model",
        help="an `afl export` folder (its signed model and log proof are verified), or a "
        "signed model file this site's daemon kept (default: the newest in state_dir/models)",
    )
    data = p.add_mutually_exclusive_group()
    data.add_argument("--cache", help="feature cache of the labelled hold-out")
    data.add_argument("--manifest", help="CSV of hold-out images with one column per class")
    p.add_argument("--weights", help="--manifest: the backbone's local weights file")
    p.add_argument("--sha256", help="--manifest: pin the weights file's SHA-256")
    p.add_argument("--backbone", help="--manifest: backbone (default: the model's)")
    p.add_argument("--bootstrap", type=int, default=1000, help="bootstrap resamples (1000)")
    p.add_argument("--confidence", type=float, default=0.95, help="interval level (0.95)")
    p.add_argument("--seed", type=int, default=0, help="bootstrap seed (0)")
    add_model_proof_arguments(p, config=False)


def run_evaluate(args: argparse.Namespace) -> int:
    from afl.client.config import load_client_config
    from afl.client.model.evaluate import evaluate_model, write_local_evaluation

    config = load_client_config(args.config)
    run = evaluate_model(
        config,
        model_path=args.model,
        cache=args.cache,
        manifest=args.manifest,
        backbone=args.backbone,
        weights=args.weights,
        sha256=args.sha256,
        n_boot=args.bootstrap,
        confidence=args.confidence,
        seed=args.seed,
        unverified=args.unverified_model,
    )
    if args.unverified_model:
        _unverified_warning("evaluate", str(run.model.path), unchecked="its log proof")
    elif run.witnesses:
        print(
            f"model {run.model.model_sha256[:16]}… verified: in the federation log under a "
            f"checkpoint cosigned by {', '.join(sorted(run.witnesses))}"
        )
    if run.in_sample:
        print(
            "WARNING: no --cache/--manifest: evaluated on the training cache (in-sample, "
            "optimistic)",
            file=sys.stderr,
        )
    pct = round(100 * run.result.confidence)
    print(f"model {run.model.model_sha256[:16]}… on {run.data}: {run.result.n_rows} rows")
    print(f"  {'class':<18} {'n+':>6} {'n-':>6}  BACC [{pct}% CI]      AUC [{pct}% CI]       AP")
    for ev in run.result.classes:
        cells = [f"{i.estimate:.3f} [{i.low:.3f}, {i.high:.3f}]" for i in (ev.bacc, ev.auc, ev.ap)]
        print(f"  {ev.name:<18} {ev.n_pos:>6} {ev.n_neg:>6}  " + "  ".join(cells))
    path = write_local_evaluation(config.state_dir, run)
    print(f"written into the site's report {path} (local_evaluation)")
    return 0


def add_budget_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="client.toml of the site")
    p.add_argument("--json", action="store_true", help="print the ledger and totals as JSON")
    p.add_argument(
        "--rebuild-from-log",
        action="store_true",
        help="rebuild a missing or cut ledger from this site's signed dp-release statements in "
        "the federation log (a checkpoint cosigned by [policy] witness_quorum sites)",
    )
    p.add_argument("--insecure", action="store_true", help="the server runs --insecure (dev)")


def _rebuild_ledger(config: ClientConfig, *, insecure: bool) -> int:
    """``budget --rebuild-from-log`` (docs/operations.md "Rebuild a DP ledger", M-197)."""
    from afl.client.connectivity import connect
    from afl.client.daemon.anchor import rebuild_ledger
    from afl.client.daemon.rpc import CoordinatorClient
    from afl.client.daemon.transparency import LogWitness
    from afl.client.daemon.transport import INSECURE_SITE_HEADER, retry_policy
    from afl.client.policy.ledger import DpLedger
    from afl.crypto.identity.signatures import load_private_key_pem
    from afl.proto.v1 import coordinator_pb2_grpc as pb_grpc

    key = load_private_key_pem(config.identity_key_path.read_bytes())
    witness = LogWitness.for_site(config, key)
    with connect(config, insecure=insecure) as channel:
        rpc = CoordinatorClient(
            pb_grpc.CoordinatorStub(channel),
            site_id=config.site_id,
            timing=config.timing,
            retry=retry_policy(config.timing),
            metadata=((INSECURE_SITE_HEADER, config.site_id),) if insecure else (),
        )
        entries = rebuild_ledger(
            rpc.call,
            witness,
            DpLedger(config.state_dir / "dp-ledger"),
            quorum_wait_s=float(config.timing.upload_timeout_s),
        )
    print(
        f"DP ledger of site {config.site_id} rebuilt from the federation log: {len(entries)} "
        f"entr{'y' if len(entries) == 1 else 'ies'} (checkpoint size "
        f"{witness.last.checkpoint.size if witness.last else 0}, quorum {witness.quorum})"
    )
    return 0


def run_budget(args: argparse.Namespace) -> int:
    """The site's lifetime DP ledger (docs/operations.md): every release it took part in, and
    the composition against its policy's lifetime budget."""
    import json
    import math

    from afl.client.config import ConfigError, load_client_config
    from afl.client.daemon.transport import DaemonError
    from afl.client.policy.ledger import DpLedger
    from afl.crypto.errors import CryptoError

    try:
        config = load_client_config(args.config)
        if args.rebuild_from_log and _rebuild_ledger(config, insecure=args.insecure):
            return 1
        ledger = DpLedger(config.state_dir / "dp-ledger")
        entries = ledger.entries()
        policy = config.policy
        spent = ledger.spent(unit=policy.privacy_unit)
    except (ConfigError, CryptoError, DaemonError, OSError) as exc:  # LedgerError: DaemonError
        print(f"afl-client budget: error: {exc}", file=sys.stderr)
        return 1
    lifetime = spent.epsilon(policy.lifetime_delta)
    if args.json:
        doc = {
            "site_id": config.site_id,
            "unit": policy.privacy_unit,
            "entries": [e.to_json() for e in entries],
            "mu": "inf" if math.isinf(spent.mu) else spent.mu,
            "epsilon": "inf" if math.isinf(lifetime) else lifetime,
            "delta": policy.lifetime_delta,
            "lifetime_epsilon": str(policy.lifetime_epsilon),
            "head_sha256": ledger.head(),
        }
        print(json.dumps(doc, indent=2, sort_keys=True))
        return 0
    print(f"DP ledger of site {config.site_id} ({ledger.root}), {policy.privacy_unit}-level:")
    for e in entries:
        dp = (
            f"ε = {e.epsilon:.4g} at δ = {e.delta:g} ({e.unit}-level)"
            if e.mu < math.inf
            else "no DP (ε = ∞)"
        )
        print(f"  {e.seq:4d}  round {e.round_number} {e.round_id}  {e.aggregation:26s} {dp}")
    print(
        f"lifetime: ε = {lifetime:.4g} at δ = {policy.lifetime_delta:g} over {spent.entries} "
        f"release(s) (μ = {spent.mu:.4g}); policy lifetime_epsilon = {policy.lifetime_epsilon:g}"
    )
    print(f"head: {ledger.head()} (keep it off the site to detect a cut or edited last entry)")
    return 0


def add_offboard_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (
        "This site leaves the federation: erase (overwrite, then unlink) its statistics "
        "(state_dir/stats/) and its feature caches ([data] cache and holdout), and write a record "
        "of every file deleted (SHA-256, size) to state_dir/offboarding/. The DP ledger, history, "
        "reports, models and the kit are kept (docs/operations.md §10.1). Stop the daemon first."
    )
    p.add_argument("--config", required=True, help="client.toml of the site")
    p.add_argument("--keep-cache", action="store_true", help="keep the feature caches")
    p.add_argument("--yes", action="store_true", help="delete (without it: list only, exit 2)")


def run_offboard(args: argparse.Namespace) -> int:
    from afl.client.config import ConfigError, load_client_config
    from afl.client.offboard import OffboardError, offboard_site, planned_deletions

    try:
        config = load_client_config(args.config)
        targets = planned_deletions(config, keep_cache=args.keep_cache)
        if not args.yes:
            listed = ", ".join(str(t) for t in targets) or "nothing"
            print(
                f"afl-client offboard: would erase {listed}; add --yes to delete",
                file=sys.stderr,
            )
            return 2
        done = offboard_site(config, keep_cache=args.keep_cache)
    except (ConfigError, OffboardError, OSError) as exc:
        print(f"afl-client offboard: error: {exc}", file=sys.stderr)
        return 1
    print(
        f"site {config.site_id}: {done.deleted} file(s), {done.bytes} bytes erased; record "
        f"{done.record} (the DP ledger, history, reports and models are kept)"
    )
    return 0


SUBCOMMANDS: list[tuple[str, str, Callable[[argparse.ArgumentParser], None], Handler]] = [
    (
        "init",
        "make this site's keys and request; then import the operator's bundle",
        add_init_arguments,
        run_init,
    ),
    (
        "extract",
        "images -> feature cache (resumable, shardable)",
        add_extract_arguments,
        run_extract,
    ),
    ("merge", "merge shard caches into one cache", add_merge_arguments, run_merge),
    ("backbones", "list backbones and their expected weight files", lambda p: None, run_backbones),
    ("run", "the site daemon: join the federation's rounds (mTLS)", add_run_arguments, run_daemon),
    (
        "run-many",
        "several site daemons in one process (tests and benchmarks with many sites)",
        add_run_many_arguments,
        run_many,
    ),
    (
        "doctor",
        "check the kit, the connection to the coordinator and the feature cache; print the "
        "values masked rounds use",
        add_doctor_arguments,
        run_doctor,
    ),
    (
        "status",
        "this site's state: enrolment, current round and stage, last model, last error",
        add_status_arguments,
        run_status,
    ),
    (
        "predict",
        "per-class probabilities and decisions for images, from an `afl export` model",
        add_predict_arguments,
        run_predict,
    ),
    (
        "evaluate",
        "BACC/AUC/AP with bootstrap intervals of a verified model on this site's hold-out",
        add_evaluate_arguments,
        run_evaluate,
    ),
    (
        "budget",
        "the site's lifetime DP ledger and what is left of its budget",
        add_budget_arguments,
        run_budget,
    ),
    (
        "offboard",
        "this site leaves: erase its statistics and feature caches, with a record",
        add_offboard_arguments,
        run_offboard,
    ),
]
# Subcommands that never import torch (they handle their own errors).
_LIGHT = (
    "run",
    "run-many",
    "init",
    "doctor",
    "status",
    "budget",
    "offboard",
)  # "evaluate" and "predict" import torch


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="afl-client", description=_DESCRIPTION)
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text, add_args, handler in SUBCOMMANDS:
        # `afl-client CMD --help` says what CMD does (add_args may give a longer description).
        p = sub.add_parser(
            name, help=help_text, description=f"{help_text[:1].upper()}{help_text[1:]}."
        )
        add_args(p)
        p.set_defaults(handler=handler)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "insecure", False):
        from afl.core.devmode import insecure_refusal

        refusal = insecure_refusal(f"afl-client {args.command}")
        if refusal is not None:
            print(refusal, file=sys.stderr)
            return 2
    if args.command in _LIGHT:  # they handle their errors; no torch import on their path
        code: int = args.handler(args)
        return code
    from afl.client.config import ConfigError
    from afl.client.features.backbones import BackboneError
    from afl.client.features.extract import ExtractError
    from afl.client.features.weights import WeightsError
    from afl.client.model.published import ModelFileError
    from afl.core.data.featurecache import FeatureCacheError
    from afl.core.evaluation.calibration import CalibrationError

    known = (BackboneError, ExtractError, FeatureCacheError, ShardError, SiteDataError)
    more = (CalibrationError, ConfigError, ModelFileError, FileNotFoundError)
    try:
        code = args.handler(args)
    except (*known, *more, UnreadableImageError, WeightsError) as exc:
        print(f"afl-client {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C: one line, no traceback (128 + SIGINT, as a shell does)
        print(f"\nafl-client {args.command}: stopped (Ctrl-C){_RESUMES.get(args.command, '')}",
              file=sys.stderr)  # fmt: skip
        return 130
    return code


#: What a command stopped by Ctrl-C keeps, and how to go on.
_RESUMES = {
    "extract": "; the images extracted so far are kept: run the same command again to resume "
    "where it stopped",
}


if __name__ == "__main__":
    raise SystemExit(main())
