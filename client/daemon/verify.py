"""Signature and consistency checks of what the coordinator sends a site or the decryptor
(docs/protocol.md §3, §6).

* Release plan (:func:`verify_signed_plan`): Ed25519 signature of the server's identity key (from
  the startup kit, never from the wire) over the exact serialized bytes with context
  "release-plan" (:mod:`afl.crypto.identity.signed_blobs`), verified before parsing; the plan must name this
  federation. :func:`verify_round_config` also checks that it is bound to the round and repeats
  the round config's participants, mode and scope.
* Model: signature with context ``"model"`` over the serialized ``Model``; it must name this
  federation and round, the round's classes, the plan the site accepted, and hold a finite
  float64 W of shape (d, C).
* Federated evaluation (:func:`verify_evaluation`): signature with context ``"evaluation"`` over
  the serialized ``Evaluation``; it must name this federation (and, when given, the evaluation
  round and the evaluated model), and its documents must be an evaluation and a calibration of
  that model.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from google.protobuf.message import DecodeError
from numpy.typing import NDArray

from afl.core.evaluation.calibration import Calibration, CalibrationError
from afl.core.evaluation.federated import FEDERATED_EVALUATION_FORMAT
from afl.crypto.errors import SignatureError
from afl.crypto.identity import signed_blobs
from afl.proto.v1 import common_pb2 as cpb
from afl.proto.v1 import coordinator_pb2 as pb

__all__ = [
    "VerificationError",
    "VerifiedModel",
    "verify_evaluation",
    "verify_model",
    "verify_round_config",
    "verify_signed_plan",
]


class VerificationError(ValueError):
    """A plan or model is not signed by the federation's server or does not match the round."""


def _require_server_signature(
    server_key: Ed25519PublicKey, *, context: str, blob: bytes, signature: bytes, what: str
) -> None:
    """:class:`VerificationError` "``what`` is not signed by this federation's server" unless
    the server key of the kit signed ``blob`` in ``context``."""
    try:
        signed_blobs.verify_blob(server_key, context=context, blob=blob, signature=signature)
    except SignatureError as exc:
        raise VerificationError(f"{what} is not signed by this federation's server") from exc


def verify_signed_plan(
    signed: cpb.SignedReleasePlan, *, server_key: Ed25519PublicKey, federation_id: str, what: str
) -> tuple[cpb.ReleasePlan, bytes]:
    """The plan of ``signed`` and the SHA-256 of its bytes, if the server of the startup kit
    signed it for this federation; :class:`VerificationError` (naming ``what``) otherwise."""
    _require_server_signature(
        server_key,
        context=signed_blobs.PLAN_CONTEXT,
        blob=signed.plan,
        signature=signed.signature,
        what=f"{what}: the release plan",
    )
    try:
        plan = cpb.ReleasePlan.FromString(signed.plan)
    except DecodeError as exc:
        raise VerificationError(f"{what}: the signed release plan does not parse") from exc
    if plan.federation_id != federation_id:
        raise VerificationError(
            f"{what}: federation {plan.federation_id!r} is not {federation_id!r}"
        )
    return plan, hashlib.sha256(signed.plan).digest()


def verify_round_config(
    config: pb.RoundConfig, *, server_key: Ed25519PublicKey, federation_id: str
) -> tuple[cpb.ReleasePlan, bytes]:
    """The verified plan and the SHA-256 of its bytes; :class:`VerificationError` otherwise."""
    what = f"round {config.round_id}"
    plan, digest = verify_signed_plan(
        config.release_plan, server_key=server_key, federation_id=federation_id, what=what
    )
    problems = []
    if config.federation_id != federation_id:
        problems.append(f"federation {config.federation_id!r} is not {federation_id!r}")
    if plan.round_id != config.round_id:
        problems.append(f"plan is bound to round {plan.round_id!r}, not {config.round_id!r}")
    if plan.round_number != config.round_number:
        problems.append("plan and config disagree on the round number")
    if list(plan.participants) != list(config.participants):
        problems.append("plan and config disagree on the participants")
    if plan.aggregation != config.aggregation or plan.gram_scope != config.gram_scope:
        problems.append("plan and config disagree on the aggregation mode or gram scope")
    if problems:
        raise VerificationError(f"{what}: " + "; ".join(problems))
    return plan, digest


@dataclass(frozen=True)
class VerifiedModel:
    """A model whose signature and binding were checked."""

    model: pb.Model
    weights: NDArray[np.float64]
    model_sha256: str
    weights_sha256: str


def verify_model(
    signed: pb.SignedModel,
    *,
    server_key: Ed25519PublicKey,
    federation_id: str,
    round_id: str,
    class_names: list[str],
    d: int,
    plan_sha256: bytes | None,
    context: str = signed_blobs.MODEL_CONTEXT,
) -> VerifiedModel:
    """Check the model's signature (``context`` "model", or "candidate-model" for the candidate
    a validation gate scores) and binding (module docstring); return W as float64."""
    _require_server_signature(
        server_key,
        context=context,
        blob=signed.model,
        signature=signed.signature,
        what=f"round {round_id}: the model",
    )
    model = pb.Model()
    try:
        model.ParseFromString(signed.model)
    except DecodeError as exc:
        raise VerificationError(f"round {round_id}: the signed model does not parse") from exc
    w = model.weights
    shape = (d, len(class_names))
    problems = []
    if model.federation_id != federation_id or model.round_id != round_id:
        problems.append(f"model is for round {model.round_id!r} of {model.federation_id!r}")
    if list(model.class_names) != class_names:
        problems.append("model classes differ from the round's")
    if plan_sha256 is not None and model.plan_sha256 != plan_sha256:
        problems.append("model was solved under a different release plan than the one accepted")
    if tuple(w.shape) != shape or w.dtype != cpb.DTYPE_FLOAT64_LE:
        problems.append(
            f"weights are {list(w.shape)} {cpb.DType.Name(w.dtype)}, want {list(shape)}"
        )
    elif w.packing not in (cpb.PACKING_DENSE, cpb.PACKING_UNSPECIFIED):
        problems.append("weights must be dense")
    elif len(w.data) != 8 * d * len(class_names):
        problems.append(f"weights hold {len(w.data)} bytes, want {8 * d * len(class_names)}")
    if problems:
        raise VerificationError(f"round {round_id}: " + "; ".join(problems))
    weights = np.frombuffer(w.data, dtype="<f8").astype(np.float64).reshape(shape)
    if not np.isfinite(weights).all():
        raise VerificationError(f"round {round_id}: the model's weights contain NaN or inf")
    return VerifiedModel(
        model=model,
        weights=weights,
        model_sha256=hashlib.sha256(signed.model).hexdigest(),
        weights_sha256=hashlib.sha256(w.data).hexdigest(),
    )


def verify_evaluation(
    signed: pb.SignedEvaluation,
    *,
    server_key: Ed25519PublicKey,
    federation_id: str,
    round_id: str | None = None,
    model_sha256: str | None = None,
) -> pb.Evaluation:
    """The ``Evaluation`` of ``signed`` if the server of the kit signed it for this federation
    (and round, and the model ``model_sha256`` (hex)) and its documents belong to that model;
    :class:`VerificationError` otherwise."""
    _require_server_signature(
        server_key,
        context=signed_blobs.EVALUATION_CONTEXT,
        blob=signed.evaluation,
        signature=signed.signature,
        what="the evaluation",
    )
    evaluation = pb.Evaluation.FromString(signed.evaluation)
    model = evaluation.model_sha256.hex()
    problems = []
    if evaluation.federation_id != federation_id:
        problems.append(f"it belongs to federation {evaluation.federation_id!r}")
    if round_id is not None and evaluation.round_id != round_id:
        problems.append(f"it is for round {evaluation.round_id!r}, not {round_id!r}")
    if model_sha256 is not None and model != model_sha256:
        problems.append(f"it evaluates model {model[:16]}…, not {model_sha256[:16]}…")
    try:
        document = json.loads(evaluation.evaluation_json)
        if document.get("format") != FEDERATED_EVALUATION_FORMAT:
            problems.append("its evaluation document has another format")
        elif document.get("model_sha256") != model:
            problems.append("its evaluation document is for another model")
        if evaluation.calibration_json:
            calibration = Calibration.from_json(json.loads(evaluation.calibration_json))
            if calibration.model_sha256 != model:
                problems.append("its calibration is for another model")
    except (ValueError, AttributeError, CalibrationError) as exc:
        problems.append(f"its documents are malformed ({exc})")
    if problems:
        raise VerificationError(f"evaluation {evaluation.round_id}: " + "; ".join(problems))
    return evaluation
