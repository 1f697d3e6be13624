"""The site's view of its connection (afl.client.connectivity): every cause gRPC reports as one
DEADLINE_EXCEEDED is named with the address, against a real afl-server over mutual TLS: wrong
port, a port that does not speak TLS, an unresolvable host, a server of another federation, a site
certificate the server refuses (foreign kit, expired), an expired server certificate, a key that
does not match its certificate. Permanent causes fail the daemon at once; transient ones are
logged and retried."""

from __future__ import annotations

import datetime as dt
import logging
import socket
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization

from afl.client.config import ClientConfig, load_client_config
from afl.client.connectivity import probe, split_address, wait_until_reachable
from afl.client.daemon.transport import DaemonError, RetryPolicy
from afl.crypto.identity import pki
from afl.ops.provisioning import ProvisionedFederation, provision
from afl.server.config import load_config
from afl.server.daemon.main import CoordinatorServer
from tests.helpers.federation import FederationSpec

FEDERATION = FederationSpec(
    sites=["s1", "s2", "s3"], round_settings={"classes": ["a"], "feature_dim": 2}
)


def _expired_copy(federation: ProvisionedFederation, pem: Path, out: Path) -> Path:
    """``pem``'s certificate re-signed by the federation CA, valid until yesterday."""
    ca = pki.load_certificate_pem((federation.root / "ca.pem").read_bytes())
    ca_key = serialization.load_pem_private_key((federation.root / "ca.key").read_bytes(), None)
    leaf = pki.load_certificate_pem(pem.read_bytes())
    now = dt.datetime.now(dt.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(leaf.subject)
        .issuer_name(ca.subject)
        .public_key(leaf.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(days=30))
        .not_valid_after(now - dt.timedelta(days=1))
    )
    for ext in leaf.extensions:
        if not isinstance(ext.value, x509.AuthorityKeyIdentifier):
            builder = builder.add_extension(ext.value, ext.critical)
    cert = builder.sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]
    out.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return out


def _serve(federation: ProvisionedFederation, state: Path, **changes: object) -> CoordinatorServer:
    config = load_config(federation.server_dir / "server.toml")
    server = CoordinatorServer(
        replace(config, listen="127.0.0.1:0", state_dir=state, **changes)  # type: ignore[arg-type]
    )
    server.start()
    return server


@pytest.fixture(scope="module")
def server(
    federation: ProvisionedFederation, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[CoordinatorServer]:
    running = _serve(federation, tmp_path_factory.mktemp("state"))
    yield running
    running.stop(None)


def _site(federation: ProvisionedFederation, server: CoordinatorServer) -> ClientConfig:
    config = load_client_config(federation.site_dirs["s1"] / "client.toml")
    return replace(config, server_address=f"localhost:{server.port}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def test_a_good_kit_reaches_the_server(
    federation: ProvisionedFederation, server: CoordinatorServer
) -> None:
    result = probe(_site(federation, server))
    assert (
        result.ok
        and f"localhost:{server.port}" in result.message
        and "mutual TLS" in result.message
    )


def test_network_causes_are_named_and_transient(
    federation: ProvisionedFederation, server: CoordinatorServer
) -> None:
    config = _site(federation, server)
    port = _free_port()
    refused = probe(replace(config, server_address=f"localhost:{port}"))
    assert not refused.ok and refused.transient
    assert (
        f"connection refused by localhost:{port}" in refused.message
        and "wrong port" in refused.message
    )
    unknown = probe(replace(config, server_address="no-such-host.invalid:50051"))
    assert (
        not unknown.ok
        and unknown.transient
        and "cannot resolve host 'no-such-host.invalid'" in unknown.message
    )
    bad = probe(replace(config, server_address="localhost"))
    assert not bad.ok and not bad.transient and "must be host:port" in bad.message


def test_a_port_that_does_not_speak_tls_is_named(
    federation: ProvisionedFederation, server: CoordinatorServer, tmp_path: Path
) -> None:
    metrics = _free_port()
    other = _serve(federation, tmp_path / "state", metrics_port=metrics)
    try:
        result = probe(replace(_site(federation, server), server_address=f"localhost:{metrics}"))
    finally:
        other.stop(None)
    assert not result.ok and not result.transient
    assert f"localhost:{metrics}" in result.message and "does not speak TLS" in result.message


def test_tls_causes_are_named(
    federation: ProvisionedFederation, server: CoordinatorServer, tmp_path: Path
) -> None:
    config = _site(federation, server)
    other = provision(tmp_path / "other", sites=["s1"])
    # This kit trusts another federation's CA: the server's certificate does not chain to it.
    foreign_ca = replace(config, tls=replace(config.tls, ca_cert=other.site_dirs["s1"] / "ca.pem"))
    result = probe(foreign_ca)
    assert not result.ok and "not issued by this kit's CA" in result.message
    # A site certificate of another federation: the server refuses it; the kit check says why.
    foreign = replace(
        config,
        tls=replace(
            config.tls,
            cert=other.site_dirs["s1"] / "site.pem",
            key=other.site_dirs["s1"] / "site.key",
        ),
    )
    result = probe(foreign)
    assert not result.ok and "refused this site's certificate" in result.message
    assert "NOT issued by the CA" in result.message
    # An expired site certificate.
    expired = _expired_copy(federation, config.tls.cert, tmp_path / "expired-site.pem")
    result = probe(replace(config, tls=replace(config.tls, cert=expired)))
    assert (
        not result.ok
        and "refused this site's certificate" in result.message
        and "EXPIRED" in result.message
    )
    # A key that does not belong to the certificate never leaves the site.
    mismatch = replace(config, tls=replace(config.tls, key=other.site_dirs["s1"] / "site.key"))
    result = probe(mismatch)
    assert not result.ok and "does not match its certificate" in result.message


def test_an_expired_server_certificate_is_named(
    federation: ProvisionedFederation, tmp_path: Path
) -> None:
    expired = _expired_copy(
        federation, federation.server_dir / "server.pem", tmp_path / "server.pem"
    )
    stale = _serve(federation, tmp_path / "state", cert=expired)
    try:
        result = probe(_site(federation, stale))
    finally:
        stale.stop(None)
    assert not result.ok and "server's certificate has EXPIRED" in result.message


def test_permanent_causes_fail_at_once_transient_ones_are_logged_and_retried(
    federation: ProvisionedFederation,
    server: CoordinatorServer,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    config = _site(federation, server)
    pauses: list[float] = []
    policy = RetryPolicy(attempts=3, initial_s=1.0)
    wait_until_reachable(config, insecure=False, retry=policy, sleep=pauses.append)
    assert pauses == []
    other = provision(tmp_path / "other", sites=["s1"])
    foreign = replace(config, tls=replace(config.tls, ca_cert=other.site_dirs["s1"] / "ca.pem"))
    with pytest.raises(DaemonError, match=r"cannot reach afl-server: localhost:\d+ .*not issued"):
        wait_until_reachable(foreign, insecure=False, retry=policy, sleep=pauses.append)
    assert pauses == []  # no retry of a cause that waiting cannot fix
    port = _free_port()
    caplog.set_level(logging.WARNING, logger="afl.client")
    with pytest.raises(DaemonError, match=rf"connection refused by localhost:{port}"):
        wait_until_reachable(
            replace(config, server_address=f"localhost:{port}"),
            insecure=False,
            retry=policy,
            sleep=pauses.append,
        )
    assert len(pauses) == 2  # every attempt but the last is followed by a pause...
    warnings = [r.getMessage() for r in caplog.records if "retrying in" in r.getMessage()]
    assert len(warnings) == 2 and all(
        f"localhost:{port}" in w for w in warnings
    )  # ...and a log line


def test_split_address() -> None:
    assert split_address("afl.example.org:50051") == ("afl.example.org", 50051)
    assert split_address("[::1]:50051") == ("::1", 50051)
    for bad in ("afl.example.org", ":50051", "host:port"):
        with pytest.raises(ValueError, match="host:port"):
            split_address(bad)
