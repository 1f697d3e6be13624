"""Enrolment as a site does it (docs/protocol.md §3, M-74), for tests that drive the coordinator
without the site daemon: sign an ``EnrollRequest`` over a server challenge and every declared
field (:func:`afl.proto.wire.enrol_proof_fields`), in process or through a gRPC stub."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from afl.crypto.identity import signatures
from afl.crypto.identity.signed_blobs import ENROL_CONTEXT
from afl.proto import wire
from afl.proto.v1 import coordinator_pb2 as pb


def signed_enrol_request(
    identity: Ed25519PrivateKey,
    *,
    challenge: pb.EnrolChallenge,
    server_public_key: bytes,
    labelled_classes: Sequence[str] = (),
    feature_dim: int = 0,
    role: int = pb.SITE_ROLE_UNSPECIFIED,
    backbone: str = "",
    software_version: str = "",
    protocol_version: int = wire.PROTOCOL_VERSION,
    **declared: Any,
) -> pb.EnrollRequest:
    """The request a site sends for ``challenge`` (its federation and site id are the
    challenge's), with its proof; ``declared``: further EnrollRequest fields (weights digest, row
    bounds, random-init stamp), covered by the proof like the others."""
    request = pb.EnrollRequest(
        identity_public_key=signatures.public_key_to_raw(identity),
        role=role,  # type: ignore[arg-type]
        labelled_classes=list(labelled_classes),
        backbone=backbone,
        feature_dim=feature_dim,
        software_version=software_version,
        protocol_version=protocol_version,
        challenge=challenge.nonce,
        **declared,
    )
    fields = wire.enrol_proof_fields(
        request,
        federation_id=challenge.federation_id,
        site_id=challenge.site_id,
        server_identity_public_key=server_public_key,
    )
    request.proof = signatures.sign_fields(identity, context=ENROL_CONTEXT, fields=fields)
    return request


def enrol_in_process(
    coordinator: Any,
    site_id: str,
    identity: Ed25519PrivateKey,
    *,
    labelled_classes: Sequence[str] = (),
    feature_dim: int = 0,
) -> pb.EnrollResponse:
    """Enrol ``site_id`` with an in-process :class:`afl.server.coordinator.Coordinator`."""
    request = signed_enrol_request(
        identity,
        challenge=coordinator.enrol_challenge(site_id),
        server_public_key=coordinator.config.identity_public_key,
        labelled_classes=labelled_classes,
        feature_dim=feature_dim,
    )
    response: pb.EnrollResponse = coordinator.enroll(site_id, request)
    return response
