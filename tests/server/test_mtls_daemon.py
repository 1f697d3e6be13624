"""M-01 against the real coordinator daemon (docs/protocol.md §3): afl-server's
:class:`~afl.server.daemon.main.CoordinatorServer` started on port 0 with the TLS material of a
provisioned federation. A site of the federation gets through; a certificate from another CA (for
the same site id) or no client certificate is refused at the TLS handshake, on every service the
port serves (Coordinator, Admin, health), before any handler runs: the coordinator's state is
unchanged."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from afl.ops.provisioning import ProvisionedFederation, provision
from afl.proto.v1 import admin_pb2, admin_pb2_grpc, coordinator_pb2, coordinator_pb2_grpc
from afl.server.config import load_config
from afl.server.daemon.main import CoordinatorServer
from tests.helpers.federation import FederationSpec
from tests.ops.test_provisioning import _channel  # a channel with a given client certificate

SITE = "site.m"
FEDERATION = FederationSpec(
    sites=[SITE, "site.n", "site.o"],
    federation_id="fed-mtls",
    round_settings={"classes": ["a", "b"], "feature_dim": 4},
)


@pytest.fixture(scope="module")
def daemon(
    federation: ProvisionedFederation, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[CoordinatorServer]:
    config = load_config(federation.server_dir / "server.toml")
    config = replace(
        config, listen="127.0.0.1:0", state_dir=tmp_path_factory.mktemp("mtls") / "state"
    )
    server = CoordinatorServer(config, tick_s=0.05)  # mTLS: the default, no --insecure
    server.start()
    yield server
    server.stop(None)


def _calls(channel: grpc.Channel) -> dict[str, object]:
    """One call on each service the daemon's port serves."""
    coordinator = coordinator_pb2_grpc.CoordinatorStub(channel)
    admin = admin_pb2_grpc.AdminStub(channel)
    health = health_pb2_grpc.HealthStub(channel)
    return {
        "GetEnrolChallenge": lambda: coordinator.GetEnrolChallenge(
            coordinator_pb2.EnrolChallengeRequest(), timeout=20
        ),
        "GetStatus": lambda: coordinator.GetStatus(coordinator_pb2.StatusRequest(), timeout=20),
        "ListRuns": lambda: admin.ListRuns(admin_pb2.ListRunsRequest(), timeout=20),
        "Check": lambda: health.Check(health_pb2.HealthCheckRequest(service=""), timeout=20),
    }


def _refused_at_tls(channel: grpc.Channel) -> dict[str, grpc.StatusCode]:
    """The status of each call; a handler that ran would answer OK or PERMISSION_DENIED."""
    codes = {}
    for name, call in _calls(channel).items():
        with pytest.raises(grpc.RpcError) as info:
            call()  # type: ignore[operator]
        codes[name] = info.value.code()
    return codes


def _state(daemon: CoordinatorServer) -> tuple[int, int]:
    """What a call that reached the coordinator could change: audit records, enrolments."""
    return len(daemon.store.audit_entries()), len(daemon.store.enrolments())


def test_the_daemon_serves_a_certificate_of_its_federation(
    federation: ProvisionedFederation, daemon: CoordinatorServer
) -> None:
    kit = federation.site_dirs[SITE]
    with _channel(
        daemon.port,
        (kit / "ca.pem").read_bytes(),
        (kit / "site.key").read_bytes(),
        (kit / "site.pem").read_bytes(),
    ) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        challenge = stub.GetEnrolChallenge(coordinator_pb2.EnrolChallengeRequest(), timeout=20)
        assert len(challenge.nonce) == 32
        health = health_pb2_grpc.HealthStub(channel)
        status = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=20).status
        assert status == health_pb2.HealthCheckResponse.SERVING


def test_the_daemon_refuses_a_certificate_from_another_ca_at_the_handshake(
    federation: ProvisionedFederation, daemon: CoordinatorServer, tmp_path: Path
) -> None:
    rogue = provision(tmp_path / "rogue", sites=[SITE])  # the same site id, another CA
    kit = rogue.site_dirs[SITE]
    before = _state(daemon)
    with _channel(
        daemon.port,
        federation.ca_cert.read_bytes(),  # the client trusts the real server ...
        (kit / "site.key").read_bytes(),  # ... but presents a certificate of another CA
        (kit / "site.pem").read_bytes(),
    ) as channel:
        codes = _refused_at_tls(channel)
    assert set(codes.values()) == {grpc.StatusCode.UNAVAILABLE}, codes
    assert _state(daemon) == before


def test_the_daemon_refuses_a_client_without_certificate_at_the_handshake(
    federation: ProvisionedFederation, daemon: CoordinatorServer
) -> None:
    before = _state(daemon)
    with _channel(daemon.port, federation.ca_cert.read_bytes(), None, None) as channel:
        codes = _refused_at_tls(channel)
    assert set(codes.values()) == {grpc.StatusCode.UNAVAILABLE}, codes
    assert _state(daemon) == before
