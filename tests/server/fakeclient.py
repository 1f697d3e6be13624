"""A minimal afl site for driving afl-server in tests: generated stubs, real mTLS, no policy.

It is deliberately independent of afl.client (the real daemon is built elsewhere): it builds the
payloads of the contract (little-endian float64, packed upper-triangle Gram, SHA-256 on the last
chunk) from :class:`afl.core.stats.LocalStats` by hand.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from numpy.typing import NDArray

from afl.core.packing import pack_upper
from afl.core.stats import LocalStats, local_statistics
from afl.crypto.identity import signatures
from afl.crypto.identity.signed_blobs import (
    MODEL_CONTEXT,
    PLAN_CONTEXT,
    PLAN_DECISION_CONTEXT,
    blob_sha256,
    plan_decision_fields,
    verify_blob,
)
from afl.proto.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from tests.helpers.enrol import signed_enrol_request

CHUNK = 1 << 20


def make_stats(
    rng: np.random.Generator, *, n: int, d: int, classes: Sequence[str], labelled: Sequence[str]
) -> LocalStats:
    """Random features and labels; classes not in ``labelled`` are -1 (not labelled)."""
    features = rng.normal(size=(n, d))
    labels = (rng.random((n, len(classes))) < 0.4).astype(np.int64)
    labels[:2] = [1] * len(classes)  # both classes present in every labelled column
    labels[2:4] = [0] * len(classes)
    active = np.array([c in labelled for c in classes])
    labels[:, ~active] = -1
    return local_statistics(features, labels, active=active)


def payload(release: common_pb2.Release, stats: LocalStats, classes: Sequence[str]) -> bytes:
    """What a site uploads for ``release`` (plaintext mode)."""
    if release.kind == common_pb2.STATISTIC_KIND_GRAM:
        return pack_upper(stats.gram).astype("<f8").tobytes()
    columns = [list(classes).index(c) for c in release.class_names]
    return np.ascontiguousarray(stats.b[:, columns], dtype="<f8").tobytes()


def chunks(
    round_id: str, release: str, data: bytes, *, size: int = CHUNK, digest: bytes | None = None
) -> list[coordinator_pb2.UploadChunk]:
    parts = [data[i : i + size] for i in range(0, len(data), size)] or [b""]
    return [
        coordinator_pb2.UploadChunk(
            round_id=round_id,
            release_name=release,
            chunk_index=i,
            total_chunks=len(parts),
            data=part,
            sha256=(digest or hashlib.sha256(data).digest()) if i == len(parts) - 1 else b"",
            kind=coordinator_pb2.PAYLOAD_KIND_STATISTIC,
            total_bytes=len(data),
        )
        for i, part in enumerate(parts)
    ]


@dataclass
class FakeSite:
    """One site's kit plus a channel to the server."""

    site_id: str
    kit: Path
    port: int
    key_pem: bytes | None = None
    cert_pem: bytes | None = None

    def __post_init__(self) -> None:
        credentials = grpc.ssl_channel_credentials(
            root_certificates=(self.kit / "ca.pem").read_bytes(),
            private_key=self.key_pem or (self.kit / "site.key").read_bytes(),
            certificate_chain=self.cert_pem or (self.kit / "site.pem").read_bytes(),
        )
        self.channel = grpc.secure_channel(
            f"127.0.0.1:{self.port}",
            credentials,
            options=[("grpc.ssl_target_name_override", "localhost")],
        )
        self.stub = coordinator_pb2_grpc.CoordinatorStub(self.channel)
        self.identity = signatures.load_private_key_pem((self.kit / "identity.key").read_bytes())

    def close(self) -> None:
        self.channel.close()

    def enroll(
        self, labelled: Sequence[str] = (), d: int = 0, **declared: Any
    ) -> coordinator_pb2.EnrollResponse:
        """Enrol as the real site does (challenge, then a proof over every field);
        ``declared``: further EnrollRequest fields (weights digest, row bounds...)."""
        challenge = self.challenge()
        request = signed_enrol_request(
            self.identity,
            challenge=challenge,
            server_public_key=self.server_public_key(),
            labelled_classes=labelled,
            feature_dim=d,
            **declared,
        )
        response: coordinator_pb2.EnrollResponse = self.stub.Enroll(request, timeout=10)
        return response

    def challenge(self) -> coordinator_pb2.EnrolChallenge:
        out: coordinator_pb2.EnrolChallenge = self.stub.GetEnrolChallenge(
            coordinator_pb2.EnrolChallengeRequest(), timeout=10
        )
        return out

    def server_public_key(self) -> bytes:
        """The server identity key of this site's kit (client.toml)."""
        import tomllib

        text = (self.kit / "client.toml").read_text()
        return bytes.fromhex(tomllib.loads(text)["identity"]["server_public_key"])

    def status(self, round_id: str = "") -> coordinator_pb2.StatusResponse:
        out: coordinator_pb2.StatusResponse = self.stub.GetStatus(
            coordinator_pb2.StatusRequest(round_id=round_id), timeout=10
        )
        return out

    def config(self, round_id: str = "") -> coordinator_pb2.RoundConfig:
        out: coordinator_pb2.RoundConfig = self.stub.GetRoundConfig(
            common_pb2.RoundRef(round_id=round_id), timeout=10
        )
        return out

    def verified_plan(
        self, config: coordinator_pb2.RoundConfig, server_key: bytes
    ) -> common_pb2.ReleasePlan:
        signed = config.release_plan
        verify_blob(server_key, context=PLAN_CONTEXT, blob=signed.plan, signature=signed.signature)
        return common_pb2.ReleasePlan.FromString(signed.plan)

    def decide(
        self, config: coordinator_pb2.RoundConfig, *, accept: bool, reason: str = ""
    ) -> None:
        digest = blob_sha256(config.release_plan.plan)
        signature = signatures.sign_fields(
            self.identity,
            context=PLAN_DECISION_CONTEXT,
            fields=plan_decision_fields(
                round_id=config.round_id, accept=accept, plan_sha256=digest
            ),
        )
        self.stub.RespondToPlan(
            coordinator_pb2.PlanDecision(
                round_id=config.round_id,
                accept=accept,
                reason=reason,
                plan_sha256=digest,
                signature=signature,
            ),
            timeout=10,
        )

    def send(self, parts: Sequence[coordinator_pb2.UploadChunk]) -> coordinator_pb2.UploadReceipt:
        def stream() -> Iterator[coordinator_pb2.UploadChunk]:
            yield from parts

        receipt: coordinator_pb2.UploadReceipt = self.stub.Upload(stream(), timeout=30)
        return receipt

    def upload_all(
        self, config: coordinator_pb2.RoundConfig, plan: common_pb2.ReleasePlan, stats: LocalStats
    ) -> list[coordinator_pb2.UploadReceipt]:
        return [
            self.send(chunks(config.round_id, r.upload_name, payload(r, stats, config.class_names)))
            for r in plan.releases
            if self.site_id in r.member_site_ids
        ]

    def model(
        self, server_key: bytes, round_id: str = ""
    ) -> tuple[coordinator_pb2.Model, NDArray[np.float64]]:
        signed: coordinator_pb2.SignedModel = self.stub.GetModel(
            coordinator_pb2.ModelRequest(round_id=round_id), timeout=10
        )
        verify_blob(
            server_key, context=MODEL_CONTEXT, blob=signed.model, signature=signed.signature
        )
        model = coordinator_pb2.Model.FromString(signed.model)
        weights = np.frombuffer(model.weights.data, dtype="<f8").reshape(tuple(model.weights.shape))
        return model, weights.astype(np.float64)


def enrol_and_accept(
    sites: Mapping[str, FakeSite],
    server_key: bytes,
    *,
    coverage: Mapping[str, Sequence[str]],
    d: int,
) -> tuple[coordinator_pb2.RoundConfig, common_pb2.ReleasePlan]:
    """Enrol every site with its coverage, read and verify the plan, and accept it everywhere."""
    for s, site in sites.items():
        assert site.enroll(coverage[s], d).site_id == s
    first = next(iter(sites.values()))
    config = first.config()
    plan = first.verified_plan(config, server_key)
    for site in sites.values():
        site.decide(site.config(), accept=True)
    return config, plan
