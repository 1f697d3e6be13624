"""A site's part in a run's evaluation round (docs/protocol.md §6.1, docs/operations.md §6.1).

A coordinator whose run sets ``evaluate = true`` opens, after the run's model is published, a
round whose plan releases score histograms and confusion counts of that model
(:mod:`afl.server.solve.evaluation`). The site's daemon (:mod:`afl.client.daemon.loop`) checks and answers it
like any plan (signature, policy with its history of earlier evaluations, min cohort, MASK
survivor floors; an evaluation plan that determines ANY site's counts by differencing is refused,
:func:`afl.client.policy.plan.check_plan`), and in addition here:

* :func:`evaluation_problem`: the plan holds evaluation releases only, each checked by
  :func:`afl.proto.wire.read_evaluation` (32-byte model digest, finite strictly increasing bins
  within :data:`afl.core.evaluation.scorebins.MAX_EDGES`, threshold in (0, 1), shape), all naming ONE model;
  and that model is one the site verified itself (:func:`evaluated_model`): a
  ``state_dir/models/<round>.signed-model.pb`` it kept at the end of a round it took part in,
  whose signature verifies again with the server key of its own kit and whose ``Model`` SHA-256
  equals the plan's. A coordinator can sign any W with its key; a site never scores its rows with
  a W it did not receive as the published result of a round it accepted (a crafted W, e.g. a unit
  vector, would release the histogram of one feature);
* the validation gate (docs/protocol.md §6.2): the model may instead be a CANDIDATE the site
  kept at the end of a round it took part in (``state_dir/candidates/<round>.signed-model.pb``,
  signed with context "candidate-model", its ``Model`` bound to that round and to the plan the
  site accepted); a site without ``[data] holdout`` refuses to score a candidate, saying so (the
  gate uses the other sites);
* :func:`evaluation_rows`: which rows it evaluates on, the site's choice: the feature cache of
  ``[data] holdout`` (held-out labelled images, same d and class names) when configured, else its
  training cache, flagged in-sample in its report and in the warnings of the report it sends;
* :func:`save_evaluation`: the signed result, verified (:func:`afl.client.daemon.verify.
  verify_evaluation`), kept as ``state_dir/evaluations/<model round>.evaluation.json`` and
  ``.calibration.json`` (for ``afl-client predict --calibration``, ``afl export --evaluation``
  and ``--calibration``) beside the signed bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from numpy.typing import NDArray

from afl.client.config import DataConfig
from afl.client.model.published import ModelFileError, PublishedModel, load_published_model
from afl.client.payloads.stats import PayloadError, labelled_mask
from afl.core.data.featurecache import FeatureCache, FeatureCacheError, open_cache
from afl.crypto.identity.pki import write_private_file
from afl.crypto.identity.signed_blobs import CANDIDATE_CONTEXT, MODEL_CONTEXT
from afl.proto.v1 import common_pb2 as cpb
from afl.proto.v1 import coordinator_pb2 as pb
from afl.proto.wire import EVALUATION_KINDS, WireError, read_evaluation

__all__ = [
    "EvaluationRows",
    "evaluated_model",
    "evaluation_problem",
    "evaluation_rows",
    "is_candidate",
    "save_evaluation",
]


def _model_digest(plan: cpb.ReleasePlan) -> str:
    """The one model (hex SHA-256) the plan's releases evaluate; ValueError otherwise."""
    if not all(r.kind in EVALUATION_KINDS for r in plan.releases):
        raise ValueError("an evaluation plan must hold evaluation releases only")
    try:
        digests = {read_evaluation(r).model_sha256 for r in plan.releases}
    except WireError as exc:
        raise ValueError(str(exc)) from exc
    if len(digests) != 1:
        raise ValueError(f"the plan's releases evaluate {len(digests)} models, not one")
    return digests.pop()


def evaluated_model(
    plan: cpb.ReleasePlan, *, state_dir: Path, server_public_key: bytes, federation_id: str
) -> PublishedModel:
    """The model the plan evaluates, from this site's own verified models or candidates (module
    docstring; :func:`is_candidate` tells which); ValueError naming the problem otherwise."""
    digest = _model_digest(plan)
    for folder, context in (("models", MODEL_CONTEXT), ("candidates", CANDIDATE_CONTEXT)):
        for path in sorted((state_dir / folder).glob("*.signed-model.pb")):
            try:
                model = load_published_model(
                    path,
                    server_public_key=server_public_key,
                    federation_id=federation_id,
                    context=context,
                )
            except ModelFileError:
                continue
            if model.model_sha256 == digest:
                return model
    raise ValueError(
        f"the plan evaluates model {digest[:16]}…, which this site has not verified (no model it "
        "received at the end of a round it took part in has this digest)"
    )


def is_candidate(model: PublishedModel) -> bool:
    """Whether ``model`` (from :func:`evaluated_model`) is a candidate the gate scores."""
    return model.path.parent.name == "candidates"


def evaluation_problem(
    plan: cpb.ReleasePlan,
    *,
    state_dir: Path,
    server_public_key: bytes,
    federation_id: str,
    has_holdout: bool = True,
) -> str:
    """Why this site refuses an evaluation plan ("" if it does not; module docstring)."""
    try:
        model = evaluated_model(
            plan,
            state_dir=state_dir,
            server_public_key=server_public_key,
            federation_id=federation_id,
        )
    except ValueError as exc:
        return str(exc)
    if is_candidate(model) and not has_holdout:
        return (
            "this site has no hold-out rows to score the candidate model in the validation gate "
            "(set [data] holdout in client.toml); the gate uses the other sites"
        )
    return ""


@dataclass(frozen=True)
class EvaluationRows:
    """The rows a site evaluates on: the cache, its labelled classes, whether in-sample."""

    cache: FeatureCache
    labelled: NDArray[np.bool_]
    in_sample: bool
    source: Path

    def to_json(self) -> dict[str, object]:
        return {
            "rows": int(self.cache.meta.n),
            "cache": str(self.source),
            "in_sample": self.in_sample,
            "note": "training cache: in-sample (optimistic)"
            if self.in_sample
            else "[data] holdout cache",
        }


def evaluation_rows(
    data: DataConfig, *, training: FeatureCache, labelled: NDArray[np.bool_]
) -> EvaluationRows:
    """``[data] holdout`` when configured (same d as the training cache), else the training
    cache (in-sample); PayloadError names a hold-out that does not fit."""
    holdout = data.holdout
    if holdout is None:
        return EvaluationRows(training, labelled, True, data.cache)
    try:
        cache = open_cache(holdout)
    except (OSError, ValueError, FeatureCacheError) as exc:
        raise PayloadError(f"[data] holdout {holdout}: {exc}") from exc
    if cache.meta.d != training.meta.d:
        raise PayloadError(
            f"[data] holdout {holdout} has d = {cache.meta.d}, the training cache d = "
            f"{training.meta.d}"
        )
    mask, _ = labelled_mask(cache, data.classes)
    return EvaluationRows(cache, mask, False, holdout)


def save_evaluation(
    signed: pb.SignedEvaluation, evaluation: pb.Evaluation, folder: Path
) -> dict[str, str]:
    """Keep a verified evaluation: the signed bytes and its documents as JSON files named after
    the evaluated model's round; returns {what: path}."""
    stem = evaluation.model_round_id or evaluation.round_id
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    paths = {"signed": folder / f"{evaluation.round_id}.signed-evaluation.pb"}
    write_private_file(paths["signed"], signed.SerializeToString())
    paths["evaluation"] = folder / f"{stem}.evaluation.json"
    write_private_file(paths["evaluation"], bytes(evaluation.evaluation_json))
    if evaluation.calibration_json:
        paths["calibration"] = folder / f"{stem}.calibration.json"
        write_private_file(paths["calibration"], bytes(evaluation.calibration_json))
    return {k: str(v) for k, v in paths.items()}
