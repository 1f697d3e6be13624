"""afl.crypto.identity.pki (docs/protocol.md §3): CA, server and site certificates, site identity
extraction."""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from hypothesis import given, settings
from hypothesis import strategies as st

from afl.crypto.identity import pki


@pytest.fixture(scope="module")
def ca() -> pki.CertifiedKey:
    return pki.create_ca(common_name="test federation CA")


@pytest.fixture(scope="module")
def other_ca() -> pki.CertifiedKey:
    return pki.create_ca(common_name="test federation CA")  # same name, different key


def test_ca_is_a_p256_ca_with_path_length_zero(ca: pki.CertifiedKey) -> None:
    cert = ca.certificate
    constraints = cert.extensions.get_extension_for_class(x509.BasicConstraints).value
    assert constraints.ca and constraints.path_length == 0
    assert cert.extensions.get_extension_for_class(x509.KeyUsage).value.key_cert_sign
    public = cert.public_key()
    assert isinstance(public, ec.EllipticCurvePublicKey)
    assert public.curve.name == "secp256r1"
    assert isinstance(cert.signature_hash_algorithm, hashes.SHA256)
    pki.verify_issued_by(cert, cert)  # self-signed


def test_server_certificate_names_every_host(ca: pki.CertifiedKey) -> None:
    server = pki.issue_server_certificate(
        ca, common_name="coordinator", hosts=["localhost", "127.0.0.1", "afl.example.org", "::1"]
    )
    san = server.certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["localhost", "afl.example.org"]
    assert san.get_values_for_type(x509.IPAddress) == [
        ipaddress.ip_address("127.0.0.1"),
        ipaddress.ip_address("::1"),
    ]
    eku = server.certificate.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.SERVER_AUTH]
    pki.verify_issued_by(server.certificate, ca.certificate)


@pytest.mark.parametrize("host", ["", "bad host", "a/b"])
def test_server_certificate_rejects_bad_hosts(ca: pki.CertifiedKey, host: str) -> None:
    with pytest.raises(pki.PkiError):
        pki.issue_server_certificate(ca, common_name="x", hosts=[host])


def test_site_certificate_carries_the_site_id_twice(ca: pki.CertifiedKey) -> None:
    site = pki.issue_site_certificate(ca, site_id="hospital-a")
    cn = site.certificate.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value
    san = site.certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert cn == "hospital-a"
    assert san.get_values_for_type(x509.UniformResourceIdentifier) == ["afl-site:hospital-a"]
    eku = site.certificate.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    assert pki.site_id_from_certificate(site.certificate) == "hospital-a"
    assert pki.site_id_from_pem(site.certificate_pem()) == "hospital-a"
    assert "PRIVATE" not in repr(site) and "redacted" in repr(site)


_valid_site_ids = st.from_regex(r"[a-z0-9](?:[a-z0-9._-]{0,20}[a-z0-9])?", fullmatch=True)


@settings(max_examples=15, deadline=None)
@given(site_id=_valid_site_ids)
def test_valid_site_ids_round_trip_through_a_certificate(site_id: str) -> None:
    ca = pki.create_ca(common_name="ca")
    site = pki.issue_site_certificate(ca, site_id=site_id)
    assert pki.site_id_from_pem(site.certificate_pem()) == site_id


@pytest.mark.parametrize(
    "site_id", ["", "Hospital", "-a", "a-", "a b", "a/b", "é", "x" * 65, "afl-site:a"]
)
def test_invalid_site_ids_are_refused(ca: pki.CertifiedKey, site_id: str) -> None:
    with pytest.raises(pki.PkiError, match="invalid site id"):
        pki.issue_site_certificate(ca, site_id=site_id)


def _handmade(ca: pki.CertifiedKey, *, cn: str, uris: list[str]) -> x509.Certificate:
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)]))
        .issuer_name(ca.certificate.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=1))
        .not_valid_after(now + dt.timedelta(days=1))
    )
    if uris:
        names: list[x509.GeneralName] = [x509.UniformResourceIdentifier(u) for u in uris]
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return builder.sign(ca.private_key, hashes.SHA256())


@pytest.mark.parametrize(
    ("cn", "uris", "message"),
    [
        ("hospital-a", ["afl-site:hospital-b"], "different sites"),
        ("hospital-a", [], "no subjectAltName"),
        ("hospital-a", ["afl-site:hospital-a", "afl-site:hospital-b"], "exactly one"),
        ("hospital-a", ["https://hospital-a"], "exactly one"),
        ("Bad Id", ["afl-site:Bad Id"], "invalid site id"),
    ],
)
def test_inconsistent_site_identity_is_refused(
    ca: pki.CertifiedKey, cn: str, uris: list[str], message: str
) -> None:
    with pytest.raises(pki.PkiError, match=message):
        pki.site_id_from_certificate(_handmade(ca, cn=cn, uris=uris))


def test_certificate_from_another_ca_fails_verification(
    ca: pki.CertifiedKey, other_ca: pki.CertifiedKey
) -> None:
    foreign = pki.issue_site_certificate(other_ca, site_id="hospital-a")
    with pytest.raises(pki.PkiError, match="not issued by"):
        pki.verify_issued_by(foreign.certificate, ca.certificate)
    pki.verify_issued_by(foreign.certificate, other_ca.certificate)


def test_pem_round_trips_and_malformed_pem_is_refused(ca: pki.CertifiedKey) -> None:
    site = pki.issue_site_certificate(ca, site_id="hospital-b")
    assert pki.load_certificate_pem(site.certificate_pem()) == site.certificate
    key = pki.load_tls_private_key_pem(site.private_key_pem())
    assert key.private_numbers() == site.private_key.private_numbers()
    with pytest.raises(pki.PkiError):
        pki.load_certificate_pem(b"-----BEGIN CERTIFICATE-----\nnope\n-----END CERTIFICATE-----\n")
    with pytest.raises(pki.PkiError):
        pki.load_tls_private_key_pem(b"not a key")


def test_bad_validity_is_refused(ca: pki.CertifiedKey) -> None:
    with pytest.raises(pki.PkiError, match="valid_days"):
        pki.issue_site_certificate(ca, site_id="a", valid_days=0)


def test_write_private_file_is_0600_and_replaces_atomically(tmp_path: os.PathLike[str]) -> None:
    path = os.path.join(os.fspath(tmp_path), "k.pem")
    with open(path, "wb") as handle:  # a pre-existing world-readable file
        handle.write(b"old")
    os.chmod(path, 0o644)
    pki.write_private_file(path, b"secret")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    with open(path, "rb") as handle:
        assert handle.read() == b"secret"
    assert sorted(os.listdir(tmp_path)) == ["k.pem"]  # no temp file left behind


# --- certificate signing requests and the encrypted CA key (M-71, M-73) -----------------------


def test_site_csr_is_checked_and_signed_for_its_own_key(ca: pki.CertifiedKey) -> None:
    key = pki.generate_tls_key()
    csr = pki.load_csr_pem(pki.csr_to_pem(pki.site_csr(key, site_id="hospital-a")))
    public = pki.check_site_csr(csr, site_id="hospital-a")
    cert = pki.issue_site_certificate_for(ca, public_key=public, site_id="hospital-a")
    pki.verify_issued_by(cert, ca.certificate)
    assert pki.site_id_from_certificate(cert) == "hospital-a"
    assert cert.public_key() == key.public_key()
    with pytest.raises(pki.PkiError, match="subject"):
        pki.check_site_csr(csr, site_id="hospital-b")


def test_server_csr_must_name_exactly_the_hosts(ca: pki.CertifiedKey) -> None:
    key = pki.generate_tls_key()
    csr = pki.server_csr(key, hosts=["afl.example.org", "127.0.0.1"])
    public = pki.check_server_csr(csr, hosts=["afl.example.org", "127.0.0.1"])
    cert = pki.issue_server_certificate_for(
        ca, public_key=public, common_name="afl.example.org", hosts=["afl.example.org", "127.0.0.1"]
    )
    pki.verify_issued_by(cert, ca.certificate)
    with pytest.raises(pki.PkiError, match="names"):
        pki.check_server_csr(csr, hosts=["afl.example.org", "127.0.0.1", "evil.example.org"])


def test_csr_with_a_broken_self_signature_is_refused() -> None:
    good = pki.site_csr(pki.generate_tls_key(), site_id="hospital-a")
    tampered = bytearray(good.public_bytes(serialization.Encoding.DER))
    tampered[-5] ^= 0x01  # a bit of the signature
    csr = x509.load_der_x509_csr(bytes(tampered))
    with pytest.raises(pki.PkiError, match="self-signature"):
        pki.check_site_csr(csr, site_id="hospital-a")


def test_encrypted_private_key_needs_its_passphrase() -> None:
    key = pki.generate_tls_key()
    pem = pki.tls_private_key_to_pem(key, passphrase=b"correct horse")
    assert pki.is_encrypted_pem(pem) and not pki.is_encrypted_pem(pki.tls_private_key_to_pem(key))
    loaded = pki.load_tls_private_key_pem(pem, passphrase=b"correct horse")
    assert loaded.private_numbers() == key.private_numbers()
    with pytest.raises(pki.PkiError, match="wrong passphrase"):
        pki.load_tls_private_key_pem(pem, passphrase=b"wrong")
    with pytest.raises(pki.PkiError, match="passphrase is needed"):
        pki.load_tls_private_key_pem(pem)


def test_fsync_dir_syncs_a_folder_and_names_a_missing_one(tmp_path: Path) -> None:
    folder = pki.make_private_dir(tmp_path / "payloads" / "site")
    pki.write_private_file(folder / "payload.bin", b"x")
    pki.fsync_dir(folder)  # a folder opens read-only and syncs
    with pytest.raises(FileNotFoundError):
        pki.fsync_dir(tmp_path / "missing")
