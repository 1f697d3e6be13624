"""``afl-client evaluate``: a site checks a published model on its own labelled hold-out before
trusting it (docs/operations.md §14, docs/method.md §3.4).

The model is an ``afl export`` folder, whose signed model and federation-log proof are verified
with the site's kit (:mod:`afl.client.model.proof`, M-199), or a signed model file the daemon
kept (default: the newest in ``state_dir/models``), verified again with the coordinator key of
``client.toml``; any other model file is refused unless ``--unverified-model``. The hold-out is a
feature cache (``--cache``, e.g. from ``afl-client extract`` on held-out images) or a manifest of
images (``--manifest``, features extracted with the model's backbone from a local weights file
into a temporary cache). Without either, the site's ``[data] holdout`` cache when it has one (the
rows a run's evaluation round uses, docs/operations.md §6.1), else its training cache (``[data]
cache``), flagged ``in_sample`` (optimistic: the model was fitted on those rows).

Classes evaluated: the model's classes the hold-out has a column for (a site labelling only some
of the federation's classes evaluates those; a manifest needs no column for the others) and the
site labels (``[data] classes``; when empty, every such class with labelled rows in the hold-out). Metrics and bootstrap intervals:
:func:`afl.core.evaluation.local.bootstrap_evaluation`. The result goes into the site's report of
the model's round (``state_dir/reports/<round>.json``, key ``local_evaluation``), written
atomically; nothing is sent anywhere.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from afl.client.config import ClientConfig
from afl.client.model.proof import PROOF_FILE, SIGNED_MODEL_FILE, ModelProofError, verify_export
from afl.client.model.published import ModelFileError, PublishedModel, load_published_model
from afl.client.payloads.stats import dump_json
from afl.core.data.featurecache import FeatureCache, open_cache
from afl.core.evaluation.local import LocalEvaluation, bootstrap_evaluation
from afl.core.metrics import predict_proba

__all__ = ["EvaluationRun", "evaluate_model", "latest_model", "write_local_evaluation"]


def latest_model(state_dir: Path) -> Path:
    """The newest ``models/*.signed-model.pb`` the daemon kept."""
    found = sorted(
        (state_dir / "models").glob("*.signed-model.pb"), key=lambda p: p.stat().st_mtime_ns
    )
    if not found:
        raise ModelFileError(
            f"no verified model in {state_dir / 'models'}: pass --model, or take part in a round"
        )
    return found[-1]


class EvaluationRun:
    """The evaluated model, the data's description and the result."""

    def __init__(
        self,
        model: PublishedModel,
        data: str,
        in_sample: bool,
        result: LocalEvaluation,
        witnesses: frozenset[str] = frozenset(),
    ) -> None:
        self.model, self.data, self.in_sample, self.result = model, data, in_sample, result
        self.witnesses = witnesses  # who cosigned the log checkpoint of an export's proof

    def to_json(self) -> dict[str, Any]:
        return {
            "model_sha256": self.model.model_sha256,
            "round_id": self.model.model.round_id,
            "data": self.data,
            "in_sample": self.in_sample,
            **self.result.to_json(),
        }


def _extract_holdout(
    manifest: str | os.PathLike[str],
    *,
    model: PublishedModel,
    backbone: str | None,
    weights: str | None,
    sha256: str | None,
    workdir: Path,
) -> FeatureCache:
    from afl.client.features.backbones import load_backbone
    from afl.client.features.extract import extract_features
    from afl.client.features.sitedata import manifest_source

    name = backbone or model.model.backbone
    if weights is None:
        raise ModelFileError("--manifest needs --weights (the backbone's local weights file)")
    bb = load_backbone(name, weights=weights, sha256=sha256)
    if bb.dim != model.weights.shape[0]:
        raise ModelFileError(
            f"backbone {name} gives d = {bb.dim}, the model needs d = {model.weights.shape[0]}"
        )
    with open(manifest, newline="", encoding="utf-8-sig") as fh:
        header = next(csv.reader(fh), [])
    classes = [c for c in model.classes if c in header]
    source = manifest_source(manifest, classes=classes)
    return extract_features(source, bb, workdir / "holdout", workers=0, progress=True).cache


def _evaluated_classes(
    model_classes: Sequence[str], data_classes: Sequence[str], site_classes: Sequence[str]
) -> list[str]:
    """The model's classes (in its order) that the hold-out has a column for and, when the site
    lists the classes it labels (``[data] classes``), that the site labels: a site labelling only
    some of the federation's classes evaluates those."""
    return [
        c for c in model_classes if c in data_classes and (not site_classes or c in site_classes)
    ]


def evaluate_model(
    config: ClientConfig,
    *,
    model_path: str | os.PathLike[str] | None = None,
    cache: str | os.PathLike[str] | None = None,
    manifest: str | os.PathLike[str] | None = None,
    backbone: str | None = None,
    weights: str | None = None,
    sha256: str | None = None,
    n_boot: int = 1000,
    confidence: float = 0.95,
    seed: int = 0,
    unverified: bool = False,
) -> EvaluationRun:
    """Evaluate a verified model on the site's hold-out (module docstring)."""
    model, witnesses = resolve_model(config, model_path, unverified=unverified)
    workdir = Path(tempfile.mkdtemp(prefix="afl-evaluate-"))
    try:
        if manifest is not None:
            data = _extract_holdout(
                manifest, model=model, backbone=backbone, weights=weights, sha256=sha256,
                workdir=workdir,
            )  # fmt: skip
            description, in_sample = f"manifest {manifest}", False
        elif (where := cache if cache is not None else config.data.holdout) is not None:
            data, description, in_sample = open_cache(where), f"feature cache {where}", False
        else:
            data = open_cache(config.data.cache)
            description, in_sample = f"training cache {config.data.cache} (in-sample)", True
        if data.meta.d != model.weights.shape[0]:
            raise ModelFileError(
                f"{description}: d = {data.meta.d} differs from the model's "
                f"{model.weights.shape[0]}: extract the hold-out with the model's backbone "
                f"({model.model.backbone})"
            )
        names = _evaluated_classes(model.classes, data.meta.classes, config.data.classes)
        if not names:
            raise ModelFileError(
                f"{description}: none of the model's classes {list(model.classes)} is labelled "
                f"there (its classes: {list(data.meta.classes)}): give a hold-out with a column "
                "for at least one class this site labels"
            )
        model_cols = [model.classes.index(c) for c in names]
        labels = np.asarray(data.labels[:, [data.meta.classes.index(c) for c in names]])
        if config.data.classes:
            labelled = np.ones(len(names), dtype=bool)
        else:
            labelled = np.asarray((labels >= 0).any(axis=0), dtype=bool)
        probs = predict_proba(data.features, model.weights)[:, model_cols]
        result = bootstrap_evaluation(
            probs,
            labels,
            classes=names,
            labelled=labelled,
            threshold=model.model.decision_threshold or 0.5,
            n_boot=n_boot,
            confidence=confidence,
            seed=seed,
        )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return EvaluationRun(model, description, in_sample, result, witnesses)


def resolve_model(
    config: ClientConfig, model_path: str | os.PathLike[str] | None, *, unverified: bool
) -> tuple[PublishedModel, frozenset[str]]:
    """The model to evaluate and the witnesses of its log proof (M-199): an ``afl export``
    folder (or a file in one) is verified with its log proof (:func:`verify_export`); a model
    this site's daemon kept (``state_dir/models``: it verified it as the published result of a
    round it took part in) by its signature; any other file is refused unless ``unverified``
    (its signature is still checked: the file must parse as this federation's model)."""
    path = Path(model_path) if model_path is not None else latest_model(config.state_dir)
    in_export = path.is_dir() or (
        path.name == SIGNED_MODEL_FILE and (path.parent / PROOF_FILE).is_file()
    )
    own = path.resolve().parent == (config.state_dir / "models").resolve()
    if in_export and not unverified:
        return verify_export(path, config)
    if not (own or unverified):
        raise ModelProofError(
            f"{path} is neither an `afl export` folder with its log proof nor a model this "
            "site's daemon kept: it cannot be shown to be the federation's published model "
            "(--unverified-model scores it anyway, testing only)"
        )
    if path.is_dir():
        path = path / SIGNED_MODEL_FILE
    model = load_published_model(
        path, server_public_key=config.server_public_key, federation_id=config.federation_id
    )
    return model, frozenset()


def write_local_evaluation(state_dir: Path, run: EvaluationRun) -> Path:
    """Merge the result into ``reports/<round>.json`` (key ``local_evaluation``), atomically."""
    path = state_dir / "reports" / f"{run.model.model.round_id}.json"
    report: dict[str, Any] = {}
    if path.exists():
        report = json.loads(path.read_text(encoding="utf-8"))
    report.setdefault("round_id", run.model.model.round_id)
    report["local_evaluation"] = run.to_json()
    dump_json(path, report)
    return path
