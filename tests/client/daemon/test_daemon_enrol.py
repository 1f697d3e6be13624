"""The site's side of enrolment (client/daemon/rpc.py, docs/protocol.md §3, M-74) against the real
coordinator: every attempt, retries included, is signed over a new challenge (a lost reply never
makes the site replay a used nonce), and a challenge for another federation or site is refused."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest

from afl.client.config import TimingConfig
from afl.client.daemon.rpc import CoordinatorClient
from afl.client.daemon.transport import DaemonError, RetryPolicy
from afl.crypto.identity import signatures
from afl.ops.provisioning import ProvisionedFederation
from afl.proto.v1 import coordinator_pb2 as pb
from afl.server.config import load_config
from afl.server.coordinator import Coordinator
from afl.server.store import Store
from tests.helpers.federation import FederationSpec

FEDERATION = FederationSpec(
    sites=["h1", "h2", "h3"],
    federation_id="fed-daemon-enrol",
    round_settings={"classes": ["a"], "feature_dim": 4},
)


class _Lost(grpc.RpcError):  # type: ignore[misc]
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "reply lost"


class _Stub:
    """The coordinator in process; the reply of the first ``lose`` Enroll calls is lost after the
    server acted on them. ``federation`` overrides what the challenges say."""

    def __init__(self, coordinator: Coordinator, site: str, *, lose: int = 0) -> None:
        self.coordinator, self.site, self.lose = coordinator, site, lose
        self.nonces: list[bytes] = []
        self.federation: str | None = None

    def GetEnrolChallenge(self, request: Any, **kw: Any) -> pb.EnrolChallenge:
        challenge = self.coordinator.enrol_challenge(self.site)
        if self.federation is not None:
            challenge.federation_id = self.federation
        return challenge

    def Enroll(self, request: pb.EnrollRequest, **kw: Any) -> pb.EnrollResponse:
        self.nonces.append(bytes(request.challenge))
        response = self.coordinator.enroll(self.site, request)
        if self.lose:
            self.lose -= 1
            raise _Lost()
        return response


def _client(fed: ProvisionedFederation, tmp_path: Path, **stub_kw: Any) -> tuple[Any, _Stub]:
    config = replace(load_config(fed.server_dir / "server.toml"), state_dir=tmp_path / "state")
    key = signatures.load_private_key_pem(config.identity_key.read_bytes())
    coordinator = Coordinator(
        config, Store(config.state_dir, federation_id="fed-daemon-enrol"), key
    )
    stub = _Stub(coordinator, "h1", **stub_kw)
    client = CoordinatorClient(
        stub,
        site_id="h1",
        timing=TimingConfig(),
        retry=RetryPolicy(attempts=3, initial_s=0.001, max_s=0.001),
    )
    identity = signatures.load_private_key_pem((fed.site_dirs["h1"] / "identity.key").read_bytes())
    kw: dict[str, Any] = {
        "federation_id": "fed-daemon-enrol",
        "identity": identity,
        "identity_public_key": signatures.public_key_to_raw(identity),
        "server_public_key": config.identity_public_key,
        "role": pb.SITE_ROLE_PARTICIPANT,
        "labelled_classes": ["a"],
        "feature_dim": 4,
    }
    return (lambda: client.enroll(**kw)), stub


def test_a_retry_after_a_lost_reply_uses_a_new_challenge(
    federation: ProvisionedFederation, tmp_path: Path
) -> None:
    enroll, stub = _client(federation, tmp_path, lose=1)
    assert enroll().site_id == "h1"
    assert len(stub.nonces) == 2 and stub.nonces[0] != stub.nonces[1]
    assert "h1" in stub.coordinator.store.enrolments()


def test_a_challenge_for_another_federation_is_refused(
    federation: ProvisionedFederation, tmp_path: Path
) -> None:
    enroll, stub = _client(federation, tmp_path)
    stub.federation = "fed-elsewhere"
    with pytest.raises(DaemonError, match="not this site's federation"):
        enroll()
    assert stub.nonces == []
