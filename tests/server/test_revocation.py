"""Certificate revocation (docs/protocol.md M-173, docs/operations.md §12): over real mutual TLS
on a loopback port, `afl ca revoke SITE` adds the site's certificate to the CA-signed revocation
list the coordinator's server.toml names, and from the next call on the coordinator refuses that
certificate (no restart) while the other sites go on; an admin certificate is revoked the same
way. A revocation list the CA did not sign refuses everyone (fail closed), and `afl-server check`
calls it a PROBLEM."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import grpc
import pytest

from afl.crypto.identity.kit_check import OK, PROBLEM
from afl.lab.cli import main as afl_main
from afl.ops.provisioning import ProvisionedFederation
from afl.proto.v1 import admin_pb2, admin_pb2_grpc
from afl.proto.v1 import coordinator_pb2 as pb
from afl.server.config import load_config
from afl.server.daemon.check import check_server
from afl.server.daemon.main import CoordinatorServer
from tests.helpers.federation import FederationSpec
from tests.server.fakeclient import FakeSite

FEDERATION = FederationSpec(
    sites=["s1", "s2", "s3"],
    federation_id="fed-revoke",
    round_settings={"classes": ["a", "b"], "feature_dim": 4},
)


@pytest.fixture
def server(federation: ProvisionedFederation, tmp_path: Path) -> Iterator[int]:
    config = load_config(federation.server_dir / "server.toml")
    assert config.crl == federation.server_dir / "crl.pem"  # provisioning names the CA's list
    running = CoordinatorServer(replace(config, listen="127.0.0.1:0", state_dir=tmp_path / "state"))
    port = running.start()
    yield port
    running.stop(None)


def _status(site: FakeSite) -> grpc.StatusCode | None:
    try:
        site.stub.GetStatus(pb.StatusRequest(), timeout=10)
    except grpc.RpcError as exc:
        assert "revoked" in str(exc.details()) or "status unknown" in str(exc.details())
        return exc.code()
    return None


def test_a_revoked_site_certificate_is_refused_and_the_others_go_on(
    federation: ProvisionedFederation,
    server: int,
    capsys: pytest.CaptureFixture[str],
) -> None:
    sites = {s: FakeSite(s, federation.site_dirs[s], server) for s in ("s1", "s2")}
    try:
        assert sites["s2"].enroll(["a"], 4).site_id == "s2"
        assert _status(sites["s1"]) is None and _status(sites["s2"]) is None
        root = str(federation.root)  # provision's layout is the CA folder and `afl ca sign`'s
        assert afl_main(["ca", "revoke", "s2", "--ca", root, "--out", root]) == 0
        assert "revoked CN=s2" in capsys.readouterr().out
        assert _status(sites["s2"]) == grpc.StatusCode.PERMISSION_DENIED
        with pytest.raises(grpc.RpcError) as refused:  # enrolment too: nothing opens
            sites["s2"].challenge()
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "s2: the client certificate" in str(refused.value.details())
        assert _status(sites["s1"]) is None  # a fresh channel is unaffected as well
        fresh = FakeSite("s3", federation.site_dirs["s3"], server)
        assert _status(fresh) is None
        fresh.close()
    finally:
        for site in sites.values():
            site.close()


def test_an_admin_certificate_is_revoked_the_same_way(
    federation: ProvisionedFederation, server: int
) -> None:
    kit = federation.root / "admins" / "operator"
    credentials = grpc.ssl_channel_credentials(
        root_certificates=(kit / "ca.pem").read_bytes(),
        private_key=(kit / "admin.key").read_bytes(),
        certificate_chain=(kit / "admin.pem").read_bytes(),
    )
    options = [("grpc.ssl_target_name_override", "localhost")]
    with grpc.secure_channel(f"127.0.0.1:{server}", credentials, options=options) as channel:
        stub = admin_pb2_grpc.AdminStub(channel)
        stub.ListRuns(admin_pb2.ListRunsRequest(), timeout=10)
        root = str(federation.root)
        code = afl_main(
            ["ca", "revoke", "--cert", str(kit / "admin.pem"), "--ca", root, "--out", root]
        )
        assert code == 0
        with pytest.raises(grpc.RpcError) as refused:
            stub.ListRuns(admin_pb2.ListRunsRequest(), timeout=10)
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "revoked" in str(refused.value.details())


def test_a_list_the_federation_ca_did_not_sign_refuses_everyone(
    federation: ProvisionedFederation, server: int, tmp_path: Path
) -> None:
    from afl.crypto.identity import pki
    from afl.crypto.identity.revocation import issue_crl

    crl = federation.server_dir / "crl.pem"
    saved = tmp_path / "crl.pem"
    shutil.copyfile(crl, saved)
    other = pki.create_ca(common_name=f"afl federation CA {federation.federation_id}")
    crl.write_bytes(issue_crl(other, revoked={}))  # same name, another key: not the CA's
    config = load_config(federation.server_dir / "server.toml")
    site = FakeSite("s1", federation.site_dirs["s1"], server)
    try:
        assert _status(site) == grpc.StatusCode.PERMISSION_DENIED
        (found,) = [f for f in check_server(config) if "revocation list" in f.message]
        assert found.level == PROBLEM and "every call would be refused" in found.message
        shutil.copyfile(saved, crl)
        assert _status(site) is None
        (found,) = [f for f in check_server(config) if "revocation list" in f.message]
        assert found.level == OK, found.message
    finally:
        site.close()
