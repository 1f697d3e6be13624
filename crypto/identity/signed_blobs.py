"""Signed protocol blobs of afl-server and afl-client (docs/protocol.md §3, §6; coordinator.proto).

Release plans, models and federated evaluations travel as their serialized protobuf bytes plus an
Ed25519 signature (``SignedReleasePlan``, ``SignedModel``, ``SignedEvaluation``); protobuf
serialization is not canonical, so the signature covers the exact bytes, and receivers verify
BEFORE parsing:

    signature = Ed25519(server identity key, canonical(DOMAIN_TAG, context, blob))

with ``context`` = ``"release-plan"``, ``"model"``, ``"candidate-model"`` (a model solved but
not yet published: the validation gate scores it, docs/protocol.md §6.2) or ``"evaluation"``. The two site-signed
messages of the plaintext flow have their field tuples here too, so both sides build them the
same way:

    enrol proof:    ("enrol", federation_id, site_id, identity_public_key,
                     server_identity_public_key, challenge nonce, role,
                     canonical(labelled_classes), backbone, feature_dim, software_version,
                     protocol_version)
    plan decision:  ("plan-decision", round_id, 1 if accept else 0, sha256(plan bytes)
                     [, graph commitment: sparse-graph MASK plans]
                     [, "rows:held-out" | "rows:in-sample": evaluation plans])

Pure functions over bytes: this module imports nothing of afl outside :mod:`afl.crypto`, so the
client can verify without importing :mod:`afl.server`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from afl.crypto.canonical import Field, canonical_encode
from afl.crypto.identity.signatures import load_public_key_raw, sign_fields, verify_fields

__all__ = [
    "CANDIDATE_CONTEXT",
    "ENROL_CONTEXT",
    "EVALUATION_CONTEXT",
    "MODEL_CONTEXT",
    "PLAN_CONTEXT",
    "PLAN_DECISION_CONTEXT",
    "blob_sha256",
    "enrol_fields",
    "plan_decision_fields",
    "sign_blob",
    "verify_blob",
    "verify_plan_decision",
]

PLAN_CONTEXT = "release-plan"
MODEL_CONTEXT = "model"
CANDIDATE_CONTEXT = "candidate-model"
EVALUATION_CONTEXT = "evaluation"
ENROL_CONTEXT = "enrol"
PLAN_DECISION_CONTEXT = "plan-decision"


def blob_sha256(blob: bytes) -> bytes:
    """SHA-256 digest (32 bytes) of a serialized blob, e.g. the plan bytes decided on."""
    if not isinstance(blob, bytes):
        raise TypeError(f"blob must be bytes, got {type(blob).__name__}")
    return hashlib.sha256(blob).digest()


def sign_blob(private_key: Ed25519PrivateKey, *, context: str, blob: bytes) -> bytes:
    """Signature over canonical(DOMAIN_TAG, context, blob)."""
    if not isinstance(blob, bytes):
        raise TypeError(f"blob must be bytes, got {type(blob).__name__}")
    return sign_fields(private_key, context=context, fields=[blob])


def verify_blob(
    public_key: Ed25519PublicKey | bytes, *, context: str, blob: bytes, signature: bytes
) -> None:
    """Return None if ``signature`` is the signer's over ``blob`` in ``context``.

    ``public_key`` may be raw 32 bytes (as in the startup kits). Raises
    :class:`afl.crypto.errors.SignatureError` (bad signature) or
    :class:`afl.crypto.errors.KeyFormatError` (malformed key).
    """
    key = load_public_key_raw(public_key) if isinstance(public_key, bytes) else public_key
    verify_fields(key, signature, context=context, fields=[blob])


def enrol_fields(
    *,
    federation_id: str,
    site_id: str,
    identity_public_key: bytes,
    server_identity_public_key: bytes,
    challenge: bytes,
    role: int,
    labelled_classes: Sequence[str],
    backbone: str,
    feature_dim: int,
    software_version: str,
    protocol_version: int,
    declared_rows: int = 0,
    declared_max_row_norm: float = 0.0,
    weights_sha256: str = "",
    random_init: bool = False,
) -> list[Field]:
    """Fields of the enrol proof of possession (context :data:`ENROL_CONTEXT`): every field the
    site declares, the server it enrols with and the server's fresh challenge, so a proof is
    valid for one enrolment only and no declared field can be changed under it (the declared row
    norm is bound by its exact hexadecimal float text)."""
    return [
        federation_id,
        site_id,
        identity_public_key,
        server_identity_public_key,
        challenge,
        role,
        canonical_encode(list(labelled_classes)),
        backbone,
        feature_dim,
        software_version,
        protocol_version,
        declared_rows,
        float(declared_max_row_norm).hex(),
        weights_sha256,
        1 if random_init else 0,
    ]


def plan_decision_fields(
    *,
    round_id: str,
    accept: bool,
    plan_sha256: bytes,
    graph_commitment: bytes = b"",
    evaluation_rows: str = "",
) -> list[Field]:
    """Fields of a site's plan decision (context :data:`PLAN_DECISION_CONTEXT`); an acceptance
    of a sparse-graph MASK plan also signs the site's graph commitment, an acceptance of an
    evaluation plan the rows it scores (``"rows:held-out"`` or ``"rows:in-sample"``)."""
    fields: list[Field] = [round_id, 1 if accept else 0, plan_sha256]
    if graph_commitment:
        fields.append(graph_commitment)
    if evaluation_rows:
        fields.append(f"rows:{evaluation_rows}")
    return fields


def verify_plan_decision(
    public_key: Ed25519PublicKey | bytes,
    signature: bytes,
    *,
    round_id: str,
    accept: bool,
    plan_sha256: bytes,
    graph_commitment: bytes = b"",
    evaluation_rows: str = "",
) -> None:
    """Return None if ``signature`` is the site's over its plan decision (context
    :data:`PLAN_DECISION_CONTEXT`, :func:`plan_decision_fields`); raises
    :class:`afl.crypto.errors.SignatureError` or :class:`afl.crypto.errors.KeyFormatError`."""
    key = load_public_key_raw(public_key) if isinstance(public_key, bytes) else public_key
    fields = plan_decision_fields(
        round_id=round_id,
        accept=accept,
        plan_sha256=plan_sha256,
        graph_commitment=graph_commitment,
        evaluation_rows=evaluation_rows,
    )
    verify_fields(key, signature, context=PLAN_DECISION_CONTEXT, fields=fields)
