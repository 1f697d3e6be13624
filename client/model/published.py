"""A published model file, verified: ``<round>.signed-model.pb`` (a ``SignedModel``) as the
daemons keep it (site: ``state_dir/models``; coordinator: ``state_dir/models``, docs/architecture.md
§8). The coordinator's signature is checked over the exact ``Model`` bytes with the key of the
federation's configuration before anything is parsed, then the content
(:func:`afl.client.daemon.verify.verify_model`). No torch here: a site can evaluate a model
on a feature cache without the backbone.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from google.protobuf.message import DecodeError
from numpy.typing import NDArray

from afl.client.daemon.transport import DaemonError, check_round_id
from afl.client.daemon.verify import VerificationError, verify_model
from afl.crypto.errors import SignatureError
from afl.crypto.identity import signatures, signed_blobs
from afl.proto.v1 import coordinator_pb2 as pb

__all__ = ["ModelFileError", "PublishedModel", "load_published_model"]


class ModelFileError(Exception):
    """A model file is unreadable, not signed by the federation's server, or malformed."""


@dataclass(frozen=True)
class PublishedModel:
    """A signed model whose signature and content were verified."""

    path: Path
    signed: pb.SignedModel
    model: pb.Model
    weights: NDArray[np.float64]
    model_sha256: str  # of the signed Model bytes (what the audit log and site reports record)

    @property
    def classes(self) -> tuple[str, ...]:
        return tuple(self.model.class_names)

    def summary(self) -> dict[str, Any]:
        m = self.model
        return {
            "federation_id": m.federation_id,
            "round_id": m.round_id,
            "round_number": m.round_number,
            "model_sha256": self.model_sha256,
            "plan_sha256": m.plan_sha256.hex(),
            "created_unix_ms": m.created_unix_ms,
            "gamma": m.gamma,
            "decision_threshold": m.decision_threshold,
            "contributors": list(m.contributors),
            "backbone": m.backbone,
            "shape": list(self.weights.shape),
        }


def load_published_model(
    path: str | os.PathLike[str],
    *,
    server_public_key: bytes,
    federation_id: str,
    context: str = signed_blobs.MODEL_CONTEXT,
) -> PublishedModel:
    """Read ``<round>.signed-model.pb`` (a SignedModel), verify the coordinator's signature over
    the exact bytes, then its content (:func:`afl.client.daemon.verify.verify_model`)."""
    file = Path(path)
    try:
        signed = pb.SignedModel.FromString(file.read_bytes())
    except OSError as exc:
        raise ModelFileError(f"cannot read the model {file}: {exc}") from exc
    except Exception as exc:  # protobuf's DecodeError
        raise ModelFileError(f"{file} is not a signed model: {exc}") from exc
    key = signatures.load_public_key_raw(server_public_key)
    try:
        signed_blobs.verify_blob(
            key, context=context, blob=signed.model, signature=signed.signature
        )
    except SignatureError as exc:
        raise ModelFileError(
            f"{file}: the model is not signed by this federation's server"
        ) from exc
    try:
        model = pb.Model.FromString(signed.model)
        check_round_id(model.round_id)  # ``afl-client evaluate`` names a report by it
    except (DecodeError, DaemonError) as exc:
        raise ModelFileError(f"{file}: {exc}") from exc
    try:
        verified = verify_model(
            signed,
            server_key=key,
            federation_id=federation_id,
            round_id=model.round_id,
            class_names=list(model.class_names),
            d=int(model.weights.shape[0]) if model.weights.shape else 0,
            plan_sha256=None,
            context=context,
        )
    except VerificationError as exc:
        raise ModelFileError(f"{file}: {exc}") from exc
    return PublishedModel(file, signed, verified.model, verified.weights, verified.model_sha256)
