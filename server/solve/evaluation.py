"""The evaluation round of a run: a federated evaluation (and calibration) of the run's published
model (docs/protocol.md §6.1, docs/operations.md §6.1).

A run with ``[round] evaluate = true`` does not end when its final round publishes the model: the
round machine (:mod:`afl.server.rounds`) opens one more round, number ``rounds + 1`` (round id
``e<n>-…``), over the final round's participants, whose signed plan releases, under the run's
aggregation mode,

* ``eval_hist[all]`` (SCORE_HISTOGRAM, shape [C, 2, bins]) and
* ``eval_confusion[all]`` (CONFUSION_COUNTS, shape [C, 4]),

over every participant and every class of the run (classes a site does not label, or does not
hold, are zeros), each naming the model (SHA-256 of its signed ``Model`` bytes), the default
score bins (:data:`afl.core.evaluation.scorebins.DEFAULT_SCORE_BINS`) and the decision threshold 0.5
(:func:`evaluation_releases`). The plan is audited like any plan, with the releases of every
earlier evaluation round of the federation (:func:`earlier_evaluations`: the label counts
``labels[c]`` of two evaluations of different models, or of one model over different member
sets, can be differenced); a plan failing the audit is not opened unless the run sets
``operator_override``.

Encodings: the counts are integers, exact in every mode. ``mask`` and ``ckks`` bound one site's
count by N (:func:`count_bound`): ``eval_max_rows``, else (``mask``) ``mask_max_samples``, else the
largest row count the release's members declared at enrolment (docs/protocol.md §4.2); ``ckks``
decrypts onto the integer grid (step 1), so the released sums are the exact counts.

From the released sums (:func:`evaluation_result`): the pooled statistics
(:meth:`afl.core.evaluation.federated.EvaluationStats.from_sums`), the federated evaluation document
(:func:`afl.core.evaluation.federated.federated_evaluation_document`, which ``afl export --evaluation`` and
``afl report`` read) and, unless ``eval_calibration = "none"``, a calibration fitted from the
summed histograms (:func:`afl.core.evaluation.calibration.fit_calibration`, document
:func:`afl.core.evaluation.calibration.calibration_document`). Both documents are signed by the server's
identity key as one ``Evaluation`` message (:func:`build_signed_evaluation`, context
``"evaluation"``), kept as ``evaluations/<round>.signed-evaluation.pb`` beside the state before
the round is PUBLISHED, with its SHA-256 in the PUBLISHED stage record.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from numpy.typing import NDArray

from afl.core.dp.evaluation import noisy_evaluation
from afl.core.evaluation.calibration import calibration_document, fit_calibration
from afl.core.evaluation.federated import EvaluationStats, federated_evaluation_document
from afl.core.evaluation.scorebins import DEFAULT_SCORE_BINS, ScoreBins
from afl.core.metrics import THRESHOLD
from afl.core.row_bounds import RowBounds
from afl.crypto.identity.signed_blobs import EVALUATION_CONTEXT, blob_sha256, sign_blob
from afl.proto.v1 import common_pb2 as cpb
from afl.proto.v1 import coordinator_pb2 as pb
from afl.proto.wire import EVALUATION_KINDS, evaluation_shape
from afl.server.plan.release import EvaluationTarget, PlannedRelease

__all__ = [
    "CONFUSION",
    "EVALUATION_ROWS",
    "HISTOGRAMS",
    "EvaluationResult",
    "build_signed_evaluation",
    "count_bound",
    "earlier_evaluations",
    "evaluation_releases",
    "evaluation_result",
    "is_evaluation",
    "members_in_sample",
    "published_detail",
]

HISTOGRAMS = "eval_hist[all]"
CONFUSION = "eval_confusion[all]"
#: What the evaluated rows are (the sites choose; docs/operations.md §6.1).
ROWS_NOTE = (
    "each member's hold-out cache ([data] holdout in its client.toml), else its training cache "
    "(in-sample); each member's round report says which"
)


#: The signed evaluation's warning when a member scored its training rows.
IN_SAMPLE_WARNING = (
    "IN-SAMPLE: {sites} scored the images the model was trained on; these figures are "
    "optimistic and are not a measure of performance on new patients"
)
#: How a DP evaluation's figures are computed (its document's ``dp.note``).
DP_NOTE = (
    "every released count carries discrete Gaussian noise of the stated sigma (the members are "
    "(epsilon, delta)-DP over this evaluation); the AUC is that of the noisy histograms, the "
    "counts, BACC, AP and the calibration use the noisy counts rounded and clipped at 0"
)


#: What a site's signed acceptance of an evaluation plan may say about its rows ("" before
#: this field existed: not stated).
EVALUATION_ROWS = frozenset({"", "held-out", "in-sample"})


def members_in_sample(decisions: Mapping[str, str], members: Sequence[str]) -> dict[str, bool]:
    """``{site: in-sample?}`` for the ``members`` whose signed acceptance (``decisions``: site ->
    its ``evaluation_rows``) stated its rows; a member that stated nothing is left out (the
    report then says the evaluation is not shown to be out-of-sample)."""
    return {s: decisions[s] == "in-sample" for s in sorted(members) if decisions.get(s)}


def is_evaluation(releases: Sequence[PlannedRelease]) -> bool:
    """Whether a plan's releases are an evaluation round's."""
    return any(r.kind in EVALUATION_KINDS for r in releases)


def evaluation_releases(
    *,
    classes: Sequence[str],
    participants: Sequence[str],
    model_sha256: bytes,
    bins: ScoreBins = DEFAULT_SCORE_BINS,
    threshold: float = THRESHOLD,
) -> list[PlannedRelease]:
    """The two releases of an evaluation round over every participant (module docstring)."""
    members = tuple(sorted(participants))
    target = EvaluationTarget(model_sha256, bins, threshold)
    return [
        PlannedRelease(
            name,
            members,
            kind,
            tuple(classes),
            tuple(evaluation_shape(kind, classes=len(classes), bins=bins)),
            target,
        )
        for name, kind in (
            (HISTOGRAMS, cpb.STATISTIC_KIND_SCORE_HISTOGRAM),
            (CONFUSION, cpb.STATISTIC_KIND_CONFUSION_COUNTS),
        )
    ]


def earlier_evaluations(
    rounds: Sequence[tuple[str, Sequence[PlannedRelease]]], *, exclude: str
) -> list[tuple[str, Sequence[PlannedRelease]]]:
    """The (round id, releases) of the evaluation rounds among ``rounds`` (those whose sums were
    released), without the round ``exclude``: what an evaluation plan is audited with."""
    return [(rid, rel) for rid, rel in rounds if rid != exclude and is_evaluation(rel)]


def count_bound(members: Collection[str], *, declared: Mapping[str, RowBounds], rows: int) -> float:
    """N, the bound on one member's count: ``rows`` when configured (> 0), else the largest row
    count the members declared; ValueError naming the members that declared none."""
    if rows > 0:
        return float(rows)
    missing = sorted(s for s in members if s not in declared)
    if missing:
        raise ValueError(
            f"the evaluation counts need each member's declared row count, and {missing} "
            "declared none: set [round] eval_max_rows (docs/protocol.md §6.1)"
        )
    return float(max(declared[s].rows for s in members))


@dataclass(frozen=True)
class EvaluationResult:
    """The pooled statistics and the two documents of an evaluation round."""

    stats: EvaluationStats
    evaluation: dict[str, Any]
    calibration: dict[str, Any] | None


def evaluation_result(
    releases: Sequence[PlannedRelease],
    sums: Mapping[str, NDArray[np.float64]],
    *,
    members: Sequence[str],
    calibration: str,
    context: Mapping[str, Any],
    dp: Mapping[str, Any] | None = None,
    in_sample: Mapping[str, bool] | None = None,
) -> EvaluationResult:
    """Decode the released sums into the pooled statistics, the federated evaluation document
    (with ``context``: run, rounds) and, unless ``calibration`` is "none", the calibration fitted
    from the summed histograms. ValueError (EvaluationError, CalibrationError) on bad sums.

    ``dp`` (a DP evaluation: its ε, δ and σ per release, written into the document as ``dp``):
    the sums carry noise, so they are post-processed (:func:`afl.core.dp.evaluation.
    noisy_evaluation`): the AUC of the noisy histograms as they are, every other figure and the
    calibration from the counts rounded and clipped at 0."""
    by_name = {r.name: r for r in releases}
    hist, conf = by_name[HISTOGRAMS], by_name[CONFUSION]
    target = hist.evaluation
    if target is None or conf.evaluation != target or conf.class_names != hist.class_names:
        raise ValueError("the evaluation releases do not evaluate one model on one grid")
    model = target.model_sha256.hex()
    classes, bins, threshold = hist.class_names, target.bins, target.threshold
    if dp is None:
        stats = EvaluationStats.from_sums(
            classes=classes,
            bins=bins,
            threshold=threshold,
            histograms=sums[HISTOGRAMS],
            confusion=sums[CONFUSION],
        )
        document = federated_evaluation_document(stats, model_sha256=model, members=members)
    else:
        noisy = noisy_evaluation(
            classes=classes,
            bins=bins,
            threshold=threshold,
            histograms=sums[HISTOGRAMS],
            confusion=sums[CONFUSION],
        )
        stats = noisy.stats
        document = federated_evaluation_document(stats, model_sha256=model, members=members)
        for c, name in enumerate(stats.classes):
            auc = float(noisy.auc[c])
            document["per_class"][name]["auc"] = auc if np.isfinite(auc) else None
        macro = noisy.macro_auc
        document["macro"]["auc"] = macro if np.isfinite(macro) else None
        document["dp"] = {**dp, "note": DP_NOTE}
    document = {**document, "members": sorted(members), **context, "rows": ROWS_NOTE}
    if in_sample is not None:  # per member, from its signed acceptance (docs/protocol.md §6.1)
        document["in_sample"] = dict(in_sample)
        inside = sorted(s for s, v in in_sample.items() if v)
        if inside:
            document["warning"] = IN_SAMPLE_WARNING.format(sites=", ".join(inside))
    fitted = None
    if calibration != "none":
        method = cast(Literal["platt", "isotonic"], calibration)
        fit = fit_calibration(stats, model_sha256=model, method=method)
        fitted = {**calibration_document(fit, stats), **context}
    return EvaluationResult(stats, document, fitted)


def _json(document: Mapping[str, Any] | None) -> bytes:
    return b"" if document is None else json.dumps(document, indent=2).encode("utf-8")


def build_signed_evaluation(
    result: EvaluationResult,
    *,
    identity_key: Ed25519PrivateKey,
    federation_id: str,
    run_id: str,
    round_id: str,
    model_round_id: str,
    members: Sequence[str],
    plan_bytes: bytes,
) -> pb.SignedEvaluation:
    """Serialize the Evaluation once and sign those bytes (context "evaluation")."""
    target = bytes.fromhex(str(result.evaluation["model_sha256"]))
    evaluation = pb.Evaluation(
        version=1,
        federation_id=federation_id,
        run_id=run_id,
        round_id=round_id,
        model_round_id=model_round_id,
        model_sha256=target,
        plan_sha256=blob_sha256(plan_bytes),
        members=sorted(members),
        evaluation_json=_json(result.evaluation),
        calibration_json=_json(result.calibration),
        created_unix_ms=int(time.time() * 1000),
    )
    blob = evaluation.SerializeToString()
    return pb.SignedEvaluation(
        evaluation=blob, signature=sign_blob(identity_key, context=EVALUATION_CONTEXT, blob=blob)
    )


def published_detail(signed: pb.SignedEvaluation) -> dict[str, object]:
    """What the PUBLISHED stage record of an evaluation round carries: the SHA-256 of the signed
    ``Evaluation`` bytes, of each document and of the evaluated model, and the members."""
    evaluation = pb.Evaluation.FromString(signed.evaluation)
    calibration = evaluation.calibration_json
    return {
        "evaluation_sha256": hashlib.sha256(signed.evaluation).hexdigest(),
        "evaluated_model_sha256": evaluation.model_sha256.hex(),
        "evaluation_document_sha256": hashlib.sha256(evaluation.evaluation_json).hexdigest(),
        "calibration_sha256": hashlib.sha256(calibration).hexdigest() if calibration else "",
        "members": list(evaluation.members),
    }
