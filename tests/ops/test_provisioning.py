"""`afl provision` (docs/protocol.md §3): the files it writes, their modes and contents, refusal to
overwrite, and a real gRPC mutual-TLS loopback check that a kit's certificate is accepted while
certificates from another CA (or none) are refused."""

from __future__ import annotations

import json
import stat
import tomllib
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from afl.crypto.identity import custody, pki, signatures
from afl.ops.provisioning import (
    ProvisionedFederation,
    ProvisioningError,
    ca_key_is_encrypted,
    init_ca,
    init_server_kit,
    provision,
    sign_requests,
)
from tests.helpers.federation import FederationSpec

SITES = ["hospital-a", "hospital-b", "site.c"]
FEDERATION = FederationSpec(sites=SITES, federation_id="fed-test", decryptor="hospital-b")


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _load(path: Path) -> dict[str, Any]:
    with path.open("rb") as handle:
        return tomllib.load(handle)


def test_layout_and_private_file_modes(federation: ProvisionedFederation) -> None:
    root = federation.root
    assert _mode(root / "ca.key") == 0o600
    for name in ("server.key", "identity.key"):
        assert _mode(federation.server_dir / name) == 0o600
    assert _mode(federation.server_dir) == 0o700
    assert sorted(federation.site_dirs) == sorted(SITES)
    for kit in federation.site_dirs.values():
        assert _mode(kit) == 0o700
        assert sorted(p.name for p in kit.iterdir()) == [
            "ca.pem",
            "client.toml",
            "crl.pem",
            "identity.key",
            "roster.json",
            "site.key",
            "site.pem",
        ]
        assert _mode(kit / "site.key") == 0o600 and _mode(kit / "identity.key") == 0o600
    # No kit contains the CA's private key.
    ca_key = (root / "ca.key").read_bytes()
    for path in root.rglob("*"):
        if path.is_file() and path != root / "ca.key":
            assert path.read_bytes() != ca_key


def test_certificates_chain_to_the_ca_and_name_the_site(federation: ProvisionedFederation) -> None:
    ca = pki.load_certificate_pem(federation.ca_cert.read_bytes())
    server = pki.load_certificate_pem((federation.server_dir / "server.pem").read_bytes())
    pki.verify_issued_by(server, ca)
    for site_id, kit in federation.site_dirs.items():
        cert = pki.load_certificate_pem((kit / "site.pem").read_bytes())
        pki.verify_issued_by(cert, ca)
        assert pki.site_id_from_certificate(cert) == site_id
        assert (kit / "ca.pem").read_bytes() == federation.ca_cert.read_bytes()


def test_configs_agree_on_identity_keys(federation: ProvisionedFederation) -> None:
    server_cfg = _load(federation.server_dir / "server.toml")
    assert server_cfg["server"]["federation_id"] == "fed-test"
    server_key = signatures.load_private_key_pem(
        (federation.server_dir / server_cfg["identity"]["key"]).read_bytes()
    )
    server_public = signatures.public_key_to_raw(server_key).hex()
    assert server_cfg["identity"]["public_key"] == server_public
    assert sorted(server_cfg["sites"]) == sorted(SITES)  # "site.c" stays one key, not a table
    manifest = _load(federation.root / "federation.toml")
    for site_id, kit in federation.site_dirs.items():
        cfg = _load(kit / "client.toml")
        assert cfg["client"]["site_id"] == site_id
        assert cfg["client"]["server"] == federation.server_address == "localhost:50051"
        assert cfg["client"]["role"] == ("decryptor" if site_id == "hospital-b" else "participant")
        assert cfg["identity"]["server_public_key"] == server_public
        own = signatures.load_private_key_pem((kit / cfg["identity"]["key"]).read_bytes())
        own_public = signatures.public_key_to_raw(own).hex()
        assert cfg["identity"]["public_key"] == own_public
        assert server_cfg["sites"][site_id]["identity_public_key"] == own_public
        assert manifest["sites"][site_id]["identity_public_key"] == own_public
        assert {s: cfg["peers"][s] for s in SITES} == {
            s: server_cfg["sites"][s]["identity_public_key"] for s in SITES
        }
        assert cfg["policy"]["min_cohort"] == 3 and cfg["policy"]["allow_exposure"] is False
        for rel in (cfg["tls"]["ca_cert"], cfg["tls"]["cert"], cfg["tls"]["key"]):
            assert (kit / rel).is_file()
    # Each site's identity key is distinct.
    assert len(
        {_load(k / "client.toml")["identity"]["public_key"] for k in federation.site_dirs.values()}
    ) == len(SITES)


def test_kits_pin_the_protections_and_the_decryptor(
    federation: ProvisionedFederation, tmp_path: Path
) -> None:
    for kit in federation.site_dirs.values():
        policy = _load(kit / "client.toml")["policy"]
        assert policy["allowed_aggregation"] == ["mask", "ckks"]  # no plaintext by default
        assert policy["ckks_decryptor"] == "hospital-b"
        assert policy["disclose_coverage"] is False  # global scope: coverage stays local
    dev = provision(
        tmp_path / "dev",
        sites=["a1", "a2"],
        allow_plaintext=True,
        round_settings={"gram_scope": "per-class"},
    )
    policy = _load(dev.site_dirs["a1"] / "client.toml")["policy"]
    assert policy["allowed_aggregation"] == ["plaintext", "mask", "ckks"]
    assert policy["disclose_coverage"] is True and "ckks_decryptor" not in policy


def test_refuses_to_overwrite_without_force(tmp_path: Path) -> None:
    out = tmp_path / "fed"
    first = provision(out, sites=["a1"])
    before = (out / "ca.key").read_bytes()
    with pytest.raises(ProvisioningError, match="already holds a federation"):
        provision(out, sites=["a1"])
    assert (out / "ca.key").read_bytes() == before
    second = provision(out, sites=["a1"], force=True)
    assert (out / "ca.key").read_bytes() != before
    assert second.federation_id != first.federation_id


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"sites": []}, ProvisioningError),
        ({"sites": ["a", "a"]}, ProvisioningError),
        ({"sites": ["Bad Site"]}, pki.PkiError),
        ({"sites": ["a"], "port": 0}, ProvisioningError),
        ({"sites": ["a"], "decryptor": "zz"}, ProvisioningError),
        ({"sites": ["a"], "server_hosts": []}, ProvisioningError),
    ],
)
def test_bad_arguments_are_refused(tmp_path: Path, kwargs: dict[str, Any], error: type) -> None:
    with pytest.raises(error):
        provision(tmp_path / "fed", **kwargs)
    assert not (tmp_path / "fed" / "ca.key").exists()


# --- real mutual TLS over loopback ------------------------------------------------------------


def _who_am_i(request: bytes, context: grpc.ServicerContext) -> bytes:
    """Echo the site id read from the verified peer certificate (what the coordinator does)."""
    pem = context.auth_context()["x509_pem_cert"][0]
    return pki.site_id_from_pem(pem).encode()


@pytest.fixture(scope="module")
def mtls_port(federation: ProvisionedFederation) -> Iterator[int]:
    server_dir = federation.server_dir
    credentials = grpc.ssl_server_credentials(
        [((server_dir / "server.key").read_bytes(), (server_dir / "server.pem").read_bytes())],
        root_certificates=(server_dir / "ca.pem").read_bytes(),
        require_client_auth=True,
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    handler = grpc.unary_unary_rpc_method_handler(_who_am_i)
    server.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler("afl.test.Identity", {"WhoAmI": handler})]
    )
    port = server.add_secure_port("127.0.0.1:0", credentials)
    assert port > 0
    server.start()
    yield port
    server.stop(grace=None)


def _channel(port: int, ca_pem: bytes, key: bytes | None, cert: bytes | None) -> grpc.Channel:
    credentials = grpc.ssl_channel_credentials(
        root_certificates=ca_pem, private_key=key, certificate_chain=cert
    )
    # Dial 127.0.0.1 but verify the server certificate for "localhost" (both are in its SAN).
    return grpc.secure_channel(
        f"127.0.0.1:{port}", credentials, options=[("grpc.ssl_target_name_override", "localhost")]
    )


def _check_health(channel: grpc.Channel) -> Any:
    stub = health_pb2_grpc.HealthStub(channel)
    return stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)


def test_mtls_accepts_a_kit_and_sees_its_site_id(
    federation: ProvisionedFederation, mtls_port: int
) -> None:
    kit = federation.site_dirs["site.c"]
    with _channel(
        mtls_port,
        (kit / "ca.pem").read_bytes(),
        (kit / "site.key").read_bytes(),
        (kit / "site.pem").read_bytes(),
    ) as channel:
        assert _check_health(channel).status == health_pb2.HealthCheckResponse.SERVING
        who = channel.unary_unary("/afl.test.Identity/WhoAmI")(b"", timeout=10)
        assert who == b"site.c"


def test_mtls_refuses_a_certificate_from_another_ca(
    federation: ProvisionedFederation, mtls_port: int, tmp_path: Path
) -> None:
    rogue = provision(tmp_path / "rogue", sites=["site.c"])  # same site id, another CA
    kit = rogue.site_dirs["site.c"]
    with _channel(
        mtls_port,
        federation.ca_cert.read_bytes(),  # the client trusts the real server ...
        (kit / "site.key").read_bytes(),  # ... but presents a foreign certificate
        (kit / "site.pem").read_bytes(),
    ) as channel:
        with pytest.raises(grpc.RpcError) as info:
            _check_health(channel)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_mtls_refuses_a_client_without_certificate(
    federation: ProvisionedFederation, mtls_port: int
) -> None:
    with _channel(mtls_port, federation.ca_cert.read_bytes(), None, None) as channel:
        with pytest.raises(grpc.RpcError) as info:
            _check_health(channel)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE


# --- production: CA, server request, signing requests (M-70, M-71, M-73) ----------------------


def _requests(tmp_path: Path, sites: dict[str, str]) -> list[Path]:
    """A server request made in its own kit and one request per site (``sites``: id -> role)."""
    paths = [init_server_kit(tmp_path / "server-kit", hosts=["afl.example.org"], port=6000)[0]]
    for site_id, role in sites.items():
        _, request = custody.new_site_request(site_id=site_id, role=role)
        path = tmp_path / "inbox" / f"{site_id}.request.json"
        path.parent.mkdir(exist_ok=True)
        path.write_text(request.to_json())
        paths.append(path)
    return paths


def test_signing_requests_writes_public_material_only(tmp_path: Path) -> None:
    ca_dir, fed_id = init_ca(tmp_path / "ca", federation_id="fed-p", passphrase=b"pw")
    assert fed_id == "fed-p"
    assert b"ENCRYPTED PRIVATE KEY" in (ca_dir / "ca.key").read_bytes()
    assert _mode(ca_dir / "ca.key") == 0o600 and ca_key_is_encrypted(ca_dir)
    kit = tmp_path / "server-kit"
    paths = _requests(tmp_path, {"h1": "participant", "h2": "decryptor"})
    assert _mode(kit / "server.key") == 0o600 and _mode(kit / "identity.key") == 0o600
    signed = sign_requests(ca_dir, paths, tmp_path / "out", passphrase=b"pw")
    written = [p for p in signed.root.rglob("*") if p.is_file()]
    assert written and not [p for p in written if b"PRIVATE KEY" in p.read_bytes()]
    ca = pki.load_certificate_pem((ca_dir / "ca.pem").read_bytes())
    requests = {r.name: r for r in signed.requests}
    server_cert = pki.load_certificate_pem((signed.server_dir / "server.pem").read_bytes())
    pki.verify_issued_by(server_cert, ca)
    assert server_cert.public_key() == requests["afl.example.org"].verify()
    server_cfg = _load(signed.server_dir / "server.toml")
    assert (
        server_cfg["identity"]["public_key"]
        == requests["afl.example.org"].identity_public_key.hex()
    )
    assert server_cfg["server"]["listen"] == "0.0.0.0:6000"
    roster = custody.roster_from_json((signed.root / "roster.json").read_text())
    assert roster == signed.roster and roster.server_address == "afl.example.org:6000"
    assert roster.federation_id == fed_id == server_cfg["server"]["federation_id"]
    for site_id, folder in signed.site_dirs.items():
        cert = pki.load_certificate_pem((folder / "site.pem").read_bytes())
        pki.verify_issued_by(cert, ca)
        assert pki.site_id_from_certificate(cert) == site_id
        assert cert.public_key() == requests[site_id].verify()
        key = requests[site_id].identity_public_key.hex()
        assert server_cfg["sites"][site_id] == {
            "identity_public_key": key,
            "role": requests[site_id].role,
        }
        template = _load(folder / "client.toml")
        assert "policy" not in template and template["identity"]["public_key"] == key
        assert (folder / "roster.json").read_text() == (signed.root / "roster.json").read_text()


def test_wrong_or_missing_ca_passphrase_is_one_clear_error(tmp_path: Path) -> None:
    ca_dir, _ = init_ca(tmp_path / "ca", passphrase=b"right")
    paths = _requests(tmp_path, {"h1": "participant"})
    with pytest.raises(ProvisioningError, match="wrong passphrase"):
        sign_requests(ca_dir, paths, tmp_path / "out", passphrase=b"wrong")
    with pytest.raises(ProvisioningError, match="passphrase is needed"):
        sign_requests(ca_dir, paths, tmp_path / "out", passphrase=None)
    assert not (tmp_path / "out").exists()
    with pytest.raises(ProvisioningError, match="already holds a federation CA"):
        init_ca(tmp_path / "ca", passphrase=None)


@pytest.mark.parametrize(
    ("sites", "message"),
    [
        ({"h1": "decryptor", "h2": "decryptor"}, "at most one decryptor"),
        ({}, "at least one site"),
    ],
)
def test_requests_that_are_no_federation_are_refused(
    tmp_path: Path, sites: dict[str, str], message: str
) -> None:
    ca_dir, _ = init_ca(tmp_path / "ca", passphrase=None)
    with pytest.raises(ProvisioningError, match=message):
        sign_requests(ca_dir, _requests(tmp_path, sites), tmp_path / "out", passphrase=None)


def test_duplicate_and_tampered_requests_are_refused(tmp_path: Path) -> None:
    ca_dir, _ = init_ca(tmp_path / "ca", passphrase=None)
    paths = _requests(tmp_path, {"h1": "participant"})
    with pytest.raises(ProvisioningError, match="two requests for the same site"):
        sign_requests(ca_dir, [*paths, paths[1]], tmp_path / "out", passphrase=None)
    with pytest.raises(ProvisioningError, match="exactly one server request"):
        sign_requests(ca_dir, [paths[1]], tmp_path / "out", passphrase=None)
    document = json.loads(paths[1].read_text())
    document["identity_public_key"] = signatures.public_key_to_raw(
        signatures.generate_identity_key()
    ).hex()  # the operator's, or anyone's on the way, in place of the site's
    del document["fingerprint"]
    paths[1].write_text(json.dumps(document))
    with pytest.raises(custody.CustodyError, match="does not verify"):
        sign_requests(ca_dir, paths, tmp_path / "out", passphrase=None)
    assert not (tmp_path / "out").exists()


def test_server_keys_are_never_overwritten(tmp_path: Path) -> None:
    path, _ = init_server_kit(tmp_path / "kit", hosts=["localhost"])
    key = (tmp_path / "kit" / "server.key").read_bytes()
    with pytest.raises(ProvisioningError, match="already holds"):
        init_server_kit(tmp_path / "kit", hosts=["localhost"])
    assert (tmp_path / "kit" / "server.key").read_bytes() == key and path.is_file()
