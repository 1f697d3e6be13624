"""``afl-client``: the hospital-side command line (extract features, merge shards, list backbones,
run the daemon).

Subcommands are listed in :data:`SUBCOMMANDS` as ``(name, help, add_arguments, run)``.
``main`` returns the process exit code:
0 success, 1 a reported error (bad input, missing weights, unreadable file with --on-error fail),
2 usage errors (argparse).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from afl.client.shards import SHARD_MODES, ShardError, parse_shard
from afl.client.sitedata import NIH_PAPER_CLASSES, SiteDataError, UnreadableImageError

Handler = Callable[[argparse.Namespace], int]
_DESCRIPTION = (
    "The hospital side of afl: extract features from chest X-rays, merge shard caches, list the "
    "backbones, and run the site daemon that takes part in the federation's rounds."
)


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
    p.add_argument("--workers", type=int, default=4, help="DataLoader worker processes")
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
    p.add_argument("--path-column", default="path", help="manifest: image path column")
    p.add_argument("--id-column", help="manifest: image id column (default: the path)")
    p.add_argument(
        "--patient-column",
        default="patient",
        help="manifest: patient id column, the DP privacy unit (default: patient, when present)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run_extract(args: argparse.Namespace) -> int:
    from afl.client.backbones import load_backbone
    from afl.client.extract import extract_features
    from afl.client.sitedata import manifest_source, nih_source

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
            patient_column=args.patient_column,
        )
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
    print(
        f"{args.out}: {meta.n} images x {meta.d} features from {meta.provenance}; "
        f"{len(result.unreadable)} unreadable (listed in {args.out}/unreadable.csv); "
        f"{result.images_per_s:.1f} images/s"
    )
    return 0


def add_merge_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("shards", nargs="+", help="shard cache directories (all i/n of one run)")
    p.add_argument("--out", required=True, help="merged feature cache directory")


def run_merge(args: argparse.Namespace) -> int:
    from afl.client.merge import merge_shards

    cache = merge_shards(args.shards, args.out)
    print(f"{args.out}: {cache.meta.n} images merged from {len(args.shards)} shards")
    return 0


def run_backbones(args: argparse.Namespace) -> int:
    from afl.client.backbones import BACKBONES

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


def run_daemon(args: argparse.Namespace) -> int:
    import logging

    from afl.client.config import ConfigError, load_client_config
    from afl.client.daemon import ClientDaemon
    from afl.client.daemon_stats import PayloadError
    from afl.client.daemon_transport import DaemonError
    from afl.client.daemon_verify import VerificationError
    from afl.core.featurecache import FeatureCacheError

    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
        stream=sys.stderr,
    )
    if args.insecure:
        print("WARNING: --insecure: no TLS, development only", file=sys.stderr)
    try:
        config = load_client_config(args.config)
        for warning in config.warnings:
            logging.getLogger("afl.client").warning("%s", warning)
        if config.role == "decryptor":  # the CKKS decryptor site (docs/protocol.md §4.3)
            from afl.client.decryptor import DecryptorDaemon

            return DecryptorDaemon(config, insecure=args.insecure).run()
        return ClientDaemon(config, insecure=args.insecure, max_rounds=args.rounds).run()
    except (ConfigError, DaemonError, PayloadError, VerificationError, FeatureCacheError) as exc:
        print(f"afl-client run: error: {exc}", file=sys.stderr)
        return 1


def add_budget_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="client.toml of the site")
    p.add_argument("--json", action="store_true", help="print the ledger and totals as JSON")


def run_budget(args: argparse.Namespace) -> int:
    """The site's lifetime DP ledger (docs/operations.md): every release it took part in, and
    the composition against its policy's lifetime budget."""
    import json
    import math

    from afl.client.config import ConfigError, load_client_config
    from afl.client.dp_ledger import DpLedger, LedgerError

    try:
        config = load_client_config(args.config)
        ledger = DpLedger(config.state_dir / "dp-ledger")
        entries = ledger.entries()
        policy = config.policy
        spent = ledger.spent(unit=policy.privacy_unit)
    except (ConfigError, LedgerError) as exc:
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


SUBCOMMANDS: list[tuple[str, str, Callable[[argparse.ArgumentParser], None], Handler]] = [
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
        "budget",
        "the site's lifetime DP ledger and what is left of its budget",
        add_budget_arguments,
        run_budget,
    ),
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="afl-client", description=_DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text, add_args, handler in SUBCOMMANDS:
        p = sub.add_parser(name, help=help_text)
        add_args(p)
        p.set_defaults(handler=handler)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command in ("run", "budget"):  # they handle their errors; no torch import on the path
        code: int = args.handler(args)
        return code
    from afl.client.backbones import BackboneError
    from afl.client.extract import ExtractError
    from afl.client.weights import WeightsError
    from afl.core.featurecache import FeatureCacheError

    known = (BackboneError, ExtractError, FeatureCacheError, ShardError, SiteDataError)
    try:
        code = args.handler(args)
    except (*known, UnreadableImageError, WeightsError) as exc:
        print(f"afl-client {args.command}: error: {exc}", file=sys.stderr)
        return 1
    return code


if __name__ == "__main__":
    raise SystemExit(main())
