"""`afl export`: a published model as a deployable classifier (TorchScript + ONNX + model card),
at a site or at the coordinator (docs/operations.md §14; the artefacts: :mod:`afl.client.model.export`).

``--config`` is the exporting party's own configuration: a site's ``client.toml`` or the
coordinator's ``server.toml``. It gives the federation id and the coordinator's public key (the
model's signature is verified with it) and what the party knows about the round for the card:

* a site: the plan it accepted and the DP budget from its round report
  (``state_dir/reports/<round>.json``, used only if its plan digest is the model's), its own
  training images (its feature cache), the weights digest its features were extracted with (an
  export with other weights is refused), and its local evaluation of this model if it ran
  ``afl-client evaluate``;
* the coordinator: the signed plan of the round from its state (checked against the model's plan
  digest), the sites' enrolled backbones.

The backbone is the one the model names; a model trained on features that no registry backbone
produces (the demo's surrogate features) needs ``--backbone NAME`` and the card then says that the
outputs are for testing only.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tomllib
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

from afl.client.model.model_card import TrainingFacts
from afl.client.model.proof import (
    ModelProof,
    ModelProofError,
    build_model_proof,
    kit_witnesses,
    verify_model_proof,
)
from afl.client.model.published import ModelFileError, PublishedModel, load_published_model
from afl.core.evaluation.federated import FEDERATED_EVALUATION_FORMAT
from afl.core.progress import Progress

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of `afl export`."""
    p.add_argument(
        "--model", required=True, help="signed model file (models/<round>.signed-model.pb)"
    )
    p.add_argument(
        "--config", required=True, help="the exporting party's client.toml or server.toml"
    )
    p.add_argument("--weights", required=True, help="the backbone's local weights file")
    p.add_argument("--sha256", help="pin the weights file's SHA-256 (64 hex digits)")
    p.add_argument(
        "--backbone",
        help="registry backbone (default: the model's; required when the model was trained on "
        "features no registry backbone produces, e.g. the demo's surrogate features)",
    )
    p.add_argument("--out", required=True, help="new (or empty) folder for the export")
    p.add_argument("--calibration", help="calibration JSON fitted for this model (copied)")
    p.add_argument(
        "--evaluation",
        action="append",
        default=[],
        help="a site report with local_evaluation, an `afl-client evaluate` result or a "
        "federated evaluation JSON for this model (repeatable): metrics for the card",
    )
    p.add_argument("--no-onnx", action="store_true", help="TorchScript only")
    p.add_argument(
        "--log",
        help="a site: the federation log the operator exported (`afl log export`), from which "
        "the model's log proof is taken (the coordinator reads its own state)",
    )


def _model_proof(
    args: argparse.Namespace, party: _Party, published: PublishedModel
) -> tuple[ModelProof | None, str]:
    """The model's federation-log proof (M-198) and, when it is missing or does not verify with
    the exporting party's roster, one line saying why (the export is still written)."""
    from afl.ops.fedlog import LogFileError, export_state, read_export

    if party.is_site and not args.log:
        return None, "no --log: the export carries no federation-log proof"
    try:
        log = read_export(Path(args.log)) if args.log else export_state(Path(args.config))
    except LogFileError as exc:
        raise ModelFileError(f"cannot read the federation log {args.log}: {exc}") from exc
    if log.federation != party.federation_id or log.coordinator_key != party.server_key:
        raise ModelFileError(
            f"{args.log} is the log of {log.federation!r} under another coordinator key, not "
            f"of this party's federation {party.federation_id!r}"
        )
    proof = build_model_proof(
        federation=log.federation,
        model_sha256=published.model_sha256,
        entries=[entry for _, entry, _ in log.entries],
        checkpoints=log.checkpoints,
        cosignatures=log.cosignatures,
    )
    if party.is_site:
        roster, quorum = kit_witnesses(party.site)
    else:
        roster = {s: e.identity_public_key for s, e in party.server.sites.items()}
        quorum = len(roster) // 2 + 1
    try:
        verify_model_proof(
            proof,
            published=published,
            coordinator_key=party.server_key,
            federation=party.federation_id,
            roster=roster,
            quorum=quorum,
        )
    except ModelProofError as exc:
        return proof, f"{exc}: export again once a quorum of sites cosigned a newer checkpoint"
    return proof, ""


def _version() -> str:
    try:
        return metadata.version("afl")
    except metadata.PackageNotFoundError:  # pragma: no cover
        return "0+unknown"


def _mode_name(text: str | None) -> str | None:
    return (
        None
        if not text
        else text.removeprefix("AGGREGATION_MODE_")
        .removeprefix("GRAM_SCOPE_")
        .lower()
        .replace("_", "-")
    )


class _Party:
    """What the exporting party's configuration gives: key, federation and facts."""

    def __init__(self, path: Path) -> None:
        try:
            doc = tomllib.loads(path.read_text(encoding="utf-8"))
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ModelFileError(f"cannot read the configuration {path}: {exc}") from exc
        self.is_site = "client" in doc
        self.metrics: dict[str, Any] = {}
        self.feature_source: str | None = None
        self.weights_sha256: str | None = None
        if self.is_site:
            from afl.client.config import load_client_config

            self.site = load_client_config(path)
            self.server_key = self.site.server_public_key
            self.federation_id = self.site.federation_id
        else:
            from afl.server.config import load_config

            self.server = load_config(path)
            self.server_key = self.server.identity_public_key
            self.federation_id = self.server.federation_id

    def facts(self, published: PublishedModel) -> TrainingFacts:
        return self._site_facts(published) if self.is_site else self._server_facts(published)

    def _site_facts(self, published: PublishedModel) -> TrainingFacts:
        from afl.core.data.featurecache import FeatureCacheError, open_cache

        cfg = self.site
        images: dict[str, int] = {}
        surrogate = False
        try:
            cache = open_cache(cfg.data.cache)
            images[cfg.site_id] = cache.meta.n
            surrogate = cache.meta.surrogate
            extra = cache.meta.extra
            self.weights_sha256 = extra.get("weights_sha256")
            self.feature_source = (
                cfg.data.backbone
                or extra.get("backbone")
                or ("surrogate" if cache.meta.surrogate else cache.meta.source)
            )
        except FeatureCacheError:
            pass
        report_path = cfg.state_dir / "reports" / f"{published.model.round_id}.json"
        report: dict[str, Any] = {}
        if report_path.exists():
            report = json.loads(report_path.read_text(encoding="utf-8"))
        plan = report.get("plan") or {}
        same_plan = plan.get("sha256") == published.model.plan_sha256.hex()
        local = report.get("local_evaluation")
        if isinstance(local, Mapping) and local.get("model_sha256") == published.model_sha256:
            self.metrics[f"local evaluation ({cfg.site_id})"] = {
                **local,
                "source": f"afl-client evaluate at {cfg.site_id}: {local.get('data')}",
            }
        dp = report.get("dp") if same_plan else None
        return TrainingFacts(
            source=f"site {cfg.site_id}: {report_path}"
            + ("" if same_plan else " (no report of this model's plan)"),
            aggregation=_mode_name(plan.get("aggregation")) if same_plan else None,
            gram_scope=_mode_name(plan.get("gram_scope")) if same_plan else None,
            participants=tuple(plan.get("participants", ())) if same_plan else (),
            dp=dp if isinstance(dp, Mapping) else None,
            training_images=images,
            surrogate=surrogate,
        )

    def _server_facts(self, published: PublishedModel) -> TrainingFacts:
        from afl.proto.v1 import common_pb2 as cpb
        from afl.server.store import Store

        cfg = self.server
        if not (cfg.state_dir / "server.sqlite3").exists():
            return TrainingFacts(source=f"coordinator: no state in {cfg.state_dir}")
        store = Store(cfg.state_dir, federation_id=cfg.federation_id)
        try:
            rows = [r for r in store.rounds() if r.round_id == published.model.round_id]
            backbones = {e.backbone for e in store.enrolments().values() if e.backbone}
        finally:
            store.close()
        if len(backbones) == 1:
            self.feature_source = backbones.pop()
        if not rows or rows[0].plan is None:
            return TrainingFacts(source=f"coordinator: round not in {cfg.state_dir}")
        if hashlib.sha256(rows[0].plan).digest() != published.model.plan_sha256:
            return TrainingFacts(source="coordinator: the stored plan is not the model's")
        plan = cpb.ReleasePlan.FromString(rows[0].plan)
        dp = None
        if plan.dp.enabled:
            dp = {
                "epsilon": max((b.epsilon for b in plan.budgets), default=plan.dp.epsilon),
                "delta": plan.dp.delta,
                "per_site": {b.site_id: b.epsilon for b in plan.budgets},
            }
        return TrainingFacts(
            source=f"coordinator: signed plan of round {published.model.round_id}",
            aggregation=_mode_name(cpb.AggregationMode.Name(plan.aggregation)),
            gram_scope=_mode_name(cpb.GramScope.Name(plan.gram_scope)),
            participants=tuple(plan.participants),
            dp=dp,
            surrogate=self.feature_source == "surrogate",
        )


def _evaluation_metrics(paths: list[str], published: PublishedModel) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for text in paths:
        path = Path(text)
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ModelFileError(f"cannot read the evaluation {path}: {exc}") from exc
        body = doc.get("local_evaluation", doc) if isinstance(doc, dict) else None
        if not isinstance(body, dict) or "per_class" not in body:
            raise ModelFileError(f"{path} holds no evaluation (no per_class metrics)")
        if body.get("model_sha256") != published.model_sha256:
            raise ModelFileError(f"{path} evaluates another model than {published.path}")
        title = (
            "federated evaluation"
            if body.get("format") == FEDERATED_EVALUATION_FORMAT
            else f"local evaluation ({path.name})"
        )
        out[title] = {**body, "source": str(path)}
    return out


def _mark_in_sample(metrics: dict[str, Any], *, state_dir: Path, site_id: str) -> None:
    """A federated evaluation that does not say whether it is in-sample gets what this site's
    report of that evaluation round says (``evaluation.in_sample``), as ``{site: bool}``: the
    card and `afl report` then say so where the figures appear."""
    for body in metrics.values():
        if body.get("format") != FEDERATED_EVALUATION_FORMAT or "in_sample" in body:
            continue
        for path in sorted((state_dir / "reports").glob("*.json")):
            try:
                evaluation = json.loads(path.read_text(encoding="utf-8")).get("evaluation")
            except (OSError, ValueError, AttributeError):
                continue
            if isinstance(evaluation, dict) and evaluation.get("model_sha256") == body.get(
                "model_sha256"
            ):
                body["in_sample"] = {site_id: bool(evaluation.get("in_sample"))}


def run(args: argparse.Namespace) -> int:
    """Verify, build and write the export; one line per known failure, exit status 2."""
    from afl.client.config import ConfigError as ClientConfigError
    from afl.client.features.backbones import BACKBONES, BackboneError, load_backbone
    from afl.client.features.weights import WeightsError
    from afl.client.model.export import ExportError, export_classifier
    from afl.core.evaluation.calibration import Calibration, CalibrationError
    from afl.server.errors import ConfigError as ServerConfigError
    from afl.server.errors import StateError

    progress = Progress("afl export")
    try:
        progress("verifying the signed model")
        party = _Party(Path(args.config))
        published = load_published_model(
            args.model, server_public_key=party.server_key, federation_id=party.federation_id
        )
        facts = party.facts(published)
        declared = published.model.backbone or party.feature_source
        name = args.backbone or declared
        if name not in BACKBONES:
            raise ExportError(
                f"the model was trained on features from {declared or 'an unnamed source'!r}, "
                "not a registry backbone (`afl-client backbones`); pass --backbone NAME to pair "
                "its head with one (testing only: the card says so)"
            )
        progress(f"loading the backbone {name} and checking its weights file")
        backbone = load_backbone(name, weights=args.weights, sha256=args.sha256)
        if party.weights_sha256 and backbone.weights_sha256 != party.weights_sha256:
            raise ExportError(
                f"{args.weights} (sha256 {backbone.weights_sha256}) is not the weights file this "
                f"site's features were extracted with (sha256 {party.weights_sha256})"
            )
        metrics = {**party.metrics, **_evaluation_metrics(args.evaluation, published)}
        if party.is_site:
            _mark_in_sample(metrics, state_dir=party.site.state_dir, site_id=party.site.site_id)
        calibration = Calibration.load(args.calibration) if args.calibration else None
        progress("taking the model's proof from the federation log")
        proof, proof_problem = _model_proof(args, party, published)
        progress("tracing the classifier (TorchScript" + (")" if args.no_onnx else ", ONNX)"))
        card = export_classifier(
            published,
            backbone,
            args.out,
            facts=facts,
            trained_on=declared if declared != name else None,
            metrics=metrics,
            calibration=calibration,
            onnx=not args.no_onnx,
            software_version=_version(),
            proof=proof,
        )
    except (
        ModelFileError,
        BackboneError,
        WeightsError,
        CalibrationError,
        ClientConfigError,
        ServerConfigError,
        StateError,
    ) as exc:
        print(f"afl export: error: {exc}", file=sys.stderr)
        return 2
    print(
        f"exported model {published.model_sha256[:16]}… (round {published.model.round_id}, "
        f"{len(card['classes'])} classes) with backbone {name} into {args.out}: "
        + ", ".join(card["files"].values())
    )
    if proof_problem:
        print(
            f"WARNING: {proof_problem}; `afl-client predict` and `evaluate` refuse this export "
            "without --unverified-model",
            file=sys.stderr,
        )
    if facts.surrogate or card["backbone"]["trained_on"]:
        print(f"WARNING: {card['must_not_be_used_for'][0]}", file=sys.stderr)
    return 0
