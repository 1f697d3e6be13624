"""`afl demo` (what `make demo` runs): a real federation on this machine.

1. ``afl provision`` into a temporary folder: a federation CA, the server's kit, 8 site kits;
2. the embedded default data (SURROGATE features on the real NIH ChestX-ray14 PA labels, FedMLP's
   split and partition, :func:`afl.lab.simulate.dataset.default_dataset`) with a Missing-m assignment
   (:func:`afl.core.data.assignment.missing_m_assignment`, seed 1037): each site's feature cache holds
   -1 for the classes it does not label;
3. ``afl-server`` and one ``afl-client run`` per site as separate processes on loopback, over
   mutual TLS, in the MASK aggregation mode by default (pairwise masking, docs/protocol.md §4.2;
   no bounds are set by hand: every site declares its row count and largest row norm at
   enrolment, rounded up to powers of two, and the server derives each release's bound), or
   ``--aggregation plaintext``, or ``--aggregation ckks`` (TenSEAL, docs/protocol.md §4.3: the
   loopback federation then includes a dedicated decryptor site);
4. the published, signed model (every site verified the same one) evaluated on the test cache:
   per-class and macro BACC / AUC / AP (paper eq. 23-25), the bytes each site sent, timings;
5. with ``--evaluate``, the run's evaluation round (docs/operations.md §6.1): every site scores
   its own rows with the model, the coordinator releases only the summed histograms and counts
   under the same protection, and the federated metrics it signed are printed beside the test
   cache's (in-sample: the sites evaluate their training caches).

``--gram-scope per-class`` runs the paper-exact law; under Missing-3 its release plan exposes
single sites' Gram matrices (docs/protocol.md §6), so the demo then sets the operator override on
the server and ``allow_exposure = true`` in every site's policy, and says so.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sqlite3
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from afl.core.data.assignment import missing_m_assignment
from afl.core.data.featurecache import open_cache
from afl.core.metrics import Metrics, evaluate, predict_proba
from afl.core.progress import Progress
from afl.lab.demo.federation import (
    LoopbackFederation,
    LoopbackRun,
    ckks_round_settings,
    prepare_loopback,
    run_loopback,
)
from afl.lab.simulate.dataset import default_dataset
from afl.proto.v1 import coordinator_pb2 as pb

ASSIGNMENT_SEED = 1037
_SETTING = re.compile(r"^missing-(\d+)$")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--setting", default="missing-3", help="Missing-m setting (default missing-3)")
    p.add_argument(
        "--gram-scope",
        choices=("global", "per-class"),
        default="global",
        help="global (default): one Gram sum over all sites; per-class: the paper's law, one per "
        "coverage set (docs/method.md §1.5, docs/protocol.md §6)",
    )
    p.add_argument("--rounds", type=int, choices=(1, 2), default=1, help="2 = pseudo-label round")
    p.add_argument(
        "--aggregation",
        choices=("plaintext", "mask", "ckks"),
        default="mask",
        help="mask (default): pairwise masking, docs/protocol.md §4.2; ckks: TenSEAL with a "
        "decryptor site, docs/protocol.md §4.3; plaintext: the baseline",
    )
    p.add_argument("--sites", type=int, default=8, help="number of sites (default 8)")
    p.add_argument("--d", type=int, default=1024, help="surrogate feature dimension (default 1024)")
    p.add_argument("--keep", metavar="DIR", help="build the federation in DIR and keep it")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds for the whole run")
    p.add_argument("--quiet", action="store_true", help="only the results")
    p.add_argument(
        "--evaluate",
        action="store_true",
        help="add the run's federated evaluation and calibration round (docs/operations.md §6.1)",
    )


def federation_stage(loop: LoopbackFederation) -> str:
    """Where the coordinator's run is, from its state (read-only, as `afl-server status`)."""
    from afl.proto.wire import stage_name
    from afl.server.config import load_config
    from afl.server.errors import StateError
    from afl.server.store import Store

    config = load_config(loop.server_config)
    try:
        store = Store(config.state_dir, federation_id=config.federation_id, read_only=True)
    except (StateError, sqlite3.Error):
        return "starting the coordinator and the sites"
    try:
        rounds = store.rounds()
        enrolled = len(store.enrolments())
    except sqlite3.Error:
        return "starting the coordinator and the sites"
    finally:
        store.close()
    if not rounds:
        return f"{enrolled} of {len(loop.site_ids)} sites enrolled"
    r = rounds[-1]
    stage = stage_name(r.stage).removeprefix("ROUND_STAGE_").replace("_", " ").lower()
    if r.stage == pb.ROUND_STAGE_WAITING_FOR_PARTICIPANTS:
        stage += f" ({enrolled} of {len(loop.site_ids)} sites enrolled)"
    return f"round {r.number} ({r.round_id}): {stage}"


def _say(args: argparse.Namespace, text: str) -> None:
    if not args.quiet:
        print(text, flush=True)


def _metrics_table(metrics: Metrics) -> str:
    width = max(len(c) for c in (*metrics.classes, "macro"))
    lines = [f"  {'class':<{width}}  {'BACC %':>7} {'AUC %':>7} {'AP':>7}"]

    def fmt(x: float, scale: float, digits: int = 2) -> str:
        return "    n/a" if not np.isfinite(x) else f"{scale * x:7.{digits}f}"

    rows = zip(metrics.classes, metrics.bacc, metrics.auc, metrics.ap, strict=True)
    for name, b, a, p in rows:
        lines.append(f"  {name:<{width}}  {fmt(b, 100)} {fmt(a, 100)} {fmt(p, 1, 4)}")
    lines.append(
        f"  {'macro':<{width}}  {fmt(metrics.macro_bacc, 100)} {fmt(metrics.macro_auc, 100)} "
        f"{fmt(metrics.macro_ap, 1, 4)}"
    )
    return "\n".join(lines)


def _site_table(run: LoopbackRun, sites: tuple[str, ...]) -> str:
    lines = [
        f"  {'site':<8} {'outcome':<10} {'rounds':>6} {'bytes sent':>12} {'stats s':>8} "
        f"{'upload s':>8} {'round s':>8}"
    ]
    for site in sites:
        reports = list(run.reports.get(site, {}).values())
        done = [r for r in reports if r.get("outcome") == "COMPLETED"]
        sent = sum(int(r.get("bytes_sent", 0)) for r in reports)
        t: dict[str, float] = {}
        for r in reports:
            for key, value in r.get("timings_s", {}).items():
                t[key] = t.get(key, 0.0) + float(value) if key in ("upload", "round") else value
        outcome = run.final_report(site)["outcome"] if reports else "NO REPORT"
        lines.append(
            f"  {site:<8} {outcome:<10} {len(done):>6} {sent:>12,} {t.get('statistics', 0):8.2f} "
            f"{t.get('upload', 0):8.2f} {t.get('round', 0):8.2f}"
        )
    return "\n".join(lines)


def _final_model(run: LoopbackRun, sites: tuple[str, ...]) -> tuple[np.ndarray[Any, Any], str]:
    finals = [
        max((r for r in run.reports[s].values() if "model" in r), key=lambda r: r["_mtime"])
        for s in sites
    ]
    digests = {f["model"]["sha256"] for f in finals}
    if len(digests) != 1:
        raise RuntimeError(f"sites verified different models: {sorted(digests)}")
    weights = np.load(finals[0]["model"]["path"])
    return np.asarray(weights, dtype=np.float64), digests.pop()


def _federated_evaluation(
    run: LoopbackRun, sites: tuple[str, ...], digest: str, *, keep: bool
) -> str:
    """The evaluation every site received (signed by the coordinator), as a table."""
    found = [r["evaluation"] for s in sites for r in run.reports[s].values() if "evaluation" in r]
    if len(found) != len(sites) or any(e["model_sha256"] != digest for e in found):
        raise RuntimeError("not every site received the federated evaluation of the model")
    doc = json.loads(Path(found[0]["files"]["evaluation"]).read_text(encoding="utf-8"))
    lines = [f"Federated evaluation ({len(doc['members'])} sites, their training rows: in-sample)"]
    for name, m in doc["per_class"].items():
        auc = "-" if m["auc"] is None else f"{100 * m['auc']:.2f}"
        lines.append(
            f"  {name:<20} AUC {auc:>6}  positives {m['n_pos']:>6}  negatives {m['n_neg']:>6}"
        )
    macro = doc["macro"]["auc"]
    lines.append(f"  {'macro':<20} AUC {'-' if macro is None else f'{100 * macro:.2f}':>6}")
    if "calibration" in found[0]["files"] and keep:
        lines.append(
            f"  calibration fitted from the summed histograms: {found[0]['files']['calibration']}"
        )
    return "\n".join(lines)


def _failure(run: LoopbackRun) -> str:
    lines = [f"afl demo: FAILED (server exit {run.server_rc}, clients {dict(run.client_rcs)})"]
    for name, path in run.logs.items():
        if path.exists():
            tail = path.read_text(errors="replace").splitlines()[-8:]
            lines += [f"--- {name} log (last lines) ---", *tail]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    match = _SETTING.match(args.setting)
    if not match:
        raise SystemExit(f"afl demo: --setting must look like missing-M, got {args.setting!r}")
    started = time.perf_counter()
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="afl-demo-"))
    if args.keep and root.exists() and any(root.iterdir()):
        raise SystemExit(f"afl demo: --keep {root} is not empty")
    try:
        _say(args, f"afl demo: generating the embedded default data (d={args.d}) ...")
        t0 = time.perf_counter()
        fed = default_dataset(num_sites=args.sites, d=args.d)
        active = missing_m_assignment(
            num_clients=args.sites,
            num_classes=len(fed.classes),
            missing=int(match.group(1)),
            seed=ASSIGNMENT_SEED,
        )
        data_s = time.perf_counter() - t0
        per_class = args.gram_scope == "per-class"
        settings: dict[str, Any] = {"gram_scope": args.gram_scope, "rounds": args.rounds}
        settings["evaluate"] = bool(args.evaluate)
        if args.aggregation == "mask":  # bounds from the sites' declarations (protocol.md §4.2)
            settings["aggregation"] = "mask"
        if args.aggregation == "ckks":  # CKKS pre-scale's declared bound (docs/protocol.md §4.3)
            settings.update(ckks_round_settings(fed.site_features))
        policy = {}
        if per_class:
            settings["operator_override"] = True
            settings["override_reason"] = "afl demo: paper-exact per-class scope"
            policy = {f"site-{k + 1}": {"allow_exposure": True} for k in range(args.sites)}
            _say(args, "WARNING: per-class scope: exposure allowed by every site (demo only)")
        loop = prepare_loopback(
            root,
            classes=fed.classes,
            site_features=fed.site_features,
            site_labels=fed.site_labels,
            active=active,
            test_features=fed.test_features,
            test_labels=fed.test_labels,
            round_settings=settings,
            policy=policy,
            source=fed.provenance,
            decryptor=args.aggregation == "ckks",  # a dedicated decryptor site (no data)
            # The sites' policy refuses plaintext unless they opt in (docs/protocol.md §2).
            allow_plaintext=args.aggregation == "plaintext",
        )
        _say(args, f"afl demo: provisioned {args.sites} sites under {root}; starting daemons ...")
        progress = Progress("afl demo", enabled=None if not args.quiet else False)
        result = run_loopback(
            loop, timeout_s=args.timeout, on_wait=lambda: progress(federation_stage(loop))
        )
        if any(rc != 0 for rc in result.client_rcs.values()):
            print(_failure(result))
            return 1
        weights, digest = _final_model(result, loop.site_ids)
        test = open_cache(loop.test_cache)
        metrics = evaluate(
            predict_proba(test.features, weights), test.labels, classes=test.meta.classes
        )
        print(f"Features: {fed.provenance}")
        print(
            "NOTE: SURROGATE features - the protocol runs at real scale, figures are not the paper's."
        )
        print(
            f"Setting {args.setting} (seed {ASSIGNMENT_SEED}), gram_scope {args.gram_scope}, "
            f"{args.rounds} round(s), {args.aggregation} aggregation over mTLS, {args.sites} sites, "
            f"d = {args.d}, {test.meta.n} test images"
        )
        print(f"Model sha256 {digest} (signature verified by every site)\n")
        print(_metrics_table(metrics))
        print()
        print(_site_table(result, loop.site_ids))
        if args.evaluate:
            print()
            print(_federated_evaluation(result, loop.site_ids, digest, keep=bool(args.keep)))
        print(
            f"\nTimings: data {data_s:.1f} s, federation {result.wall_s:.1f} s, "
            f"total {time.perf_counter() - started:.1f} s"
        )
        return 0
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
