"""X.509 public-key infrastructure of a federation (docs/protocol.md §3): a federation CA, the
server's TLS certificate and one client certificate per site, for gRPC mutual TLS.

Keys are ECDSA P-256 (curve secp256r1) signed with SHA-256: gRPC's TLS stack (BoringSSL) accepts
them everywhere, unlike Ed25519 certificates. The site's Ed25519 *identity* key (signatures in
the protocol, :mod:`afl.crypto.signatures`) is separate from its TLS key.

A site certificate names the site twice, and both must agree:

    subject CN = <site id>,   subjectAltName URI = ``afl-site:<site id>``

:func:`site_id_from_certificate` is what the server calls on the peer certificate of every
request; it never trusts a site id sent in a message body.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from afl.crypto.errors import CryptoError

__all__ = [
    "SITE_URI_SCHEME",
    "CertifiedKey",
    "PkiError",
    "certificate_to_pem",
    "create_ca",
    "issue_server_certificate",
    "issue_site_certificate",
    "load_certificate_pem",
    "load_tls_private_key_pem",
    "make_private_dir",
    "site_id_from_certificate",
    "site_id_from_pem",
    "tls_private_key_to_pem",
    "validate_site_id",
    "verify_issued_by",
    "write_private_file",
]

#: URI scheme of the subjectAltName that carries a site id.
SITE_URI_SCHEME = "afl-site"
#: Site ids: 1-64 characters, lowercase letters, digits, '.', '_', '-'; alphanumeric at both ends.
_SITE_ID_RE = re.compile(r"^[a-z0-9](?:[a-z0-9._-]{0,62}[a-z0-9])?$")
_CLOCK_SKEW = dt.timedelta(minutes=5)


class PkiError(CryptoError, ValueError):
    """Bad PKI input: malformed site id or host, unparsable PEM, or a certificate that does not
    carry a consistent site identity or was not issued by the expected CA."""


@dataclass(frozen=True)
class CertifiedKey:
    """A certificate with its ECDSA P-256 private key."""

    certificate: x509.Certificate
    private_key: ec.EllipticCurvePrivateKey

    def __repr__(self) -> str:  # never print key material
        return (
            f"CertifiedKey(subject={self.certificate.subject.rfc4514_string()!r}, key=<redacted>)"
        )

    def certificate_pem(self) -> bytes:
        """The certificate as PEM."""
        return certificate_to_pem(self.certificate)

    def private_key_pem(self) -> bytes:
        """The private key as unencrypted PKCS#8 PEM (store it with mode 0600)."""
        return tls_private_key_to_pem(self.private_key)


def validate_site_id(site_id: str) -> str:
    """Return ``site_id`` if it is a valid site id (see ``_SITE_ID_RE``); raise :class:`PkiError`."""
    if not isinstance(site_id, str) or not _SITE_ID_RE.fullmatch(site_id):
        raise PkiError(
            f"invalid site id {site_id!r}: use 1-64 characters of a-z, 0-9, '.', '_', '-', "
            "starting and ending with a letter or digit"
        )
    return site_id


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _check_days(valid_days: int) -> int:
    if isinstance(valid_days, bool) or not isinstance(valid_days, int) or valid_days < 1:
        raise PkiError(f"valid_days must be a positive int, got {valid_days!r}")
    return valid_days


def _builder(
    *, subject: x509.Name, issuer: x509.Name, public_key: ec.EllipticCurvePublicKey, days: int
) -> x509.CertificateBuilder:
    now = _now()
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _CLOCK_SKEW)
        .not_valid_after(now + dt.timedelta(days=_check_days(days)))
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
    )


def _leaf_key_usage() -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=False,
        crl_sign=False,
        encipher_only=False,
        decipher_only=False,
    )


def create_ca(*, common_name: str, valid_days: int = 3650) -> CertifiedKey:
    """A self-signed federation CA (ECDSA P-256, path length 0: it signs leaves only)."""
    if not common_name.strip():
        raise PkiError("the CA common name must not be empty")
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    certificate = (
        _builder(subject=name, issuer=name, public_key=key.public_key(), days=valid_days)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    return CertifiedKey(certificate=certificate, private_key=key)


def _issue(
    ca: CertifiedKey,
    *,
    common_name: str,
    san: Sequence[x509.GeneralName],
    usage: x509.ObjectIdentifier,
    valid_days: int,
) -> CertifiedKey:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    ca_ski = ca.certificate.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    certificate = (
        _builder(
            subject=subject,
            issuer=ca.certificate.subject,
            public_key=key.public_key(),
            days=valid_days,
        )
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_leaf_key_usage(), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(x509.SubjectAlternativeName(list(san)), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False
        )
        .sign(ca.private_key, hashes.SHA256())
    )
    return CertifiedKey(certificate=certificate, private_key=key)


def _host_name(host: str) -> x509.GeneralName:
    if not isinstance(host, str) or not host or any(c.isspace() for c in host) or "/" in host:
        raise PkiError(f"invalid server host name or address {host!r}")
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def issue_server_certificate(
    ca: CertifiedKey,
    *,
    common_name: str,
    hosts: Sequence[str] = ("localhost", "127.0.0.1"),
    valid_days: int = 825,
) -> CertifiedKey:
    """The server's TLS certificate: subjectAltName lists every host (DNS name or IP address)
    clients may dial; duplicates are dropped, order is kept."""
    if isinstance(hosts, str) or not hosts:
        raise PkiError("hosts must be a non-empty sequence of host names or IP addresses")
    names: list[x509.GeneralName] = []
    for host in hosts:
        name = _host_name(host)
        if name not in names:
            names.append(name)
    return _issue(
        ca,
        common_name=common_name,
        san=names,
        usage=ExtendedKeyUsageOID.SERVER_AUTH,
        valid_days=valid_days,
    )


def issue_site_certificate(
    ca: CertifiedKey, *, site_id: str, valid_days: int = 825
) -> CertifiedKey:
    """A site's TLS client certificate: CN = site id, URI SAN ``afl-site:<site id>``."""
    validate_site_id(site_id)
    return _issue(
        ca,
        common_name=site_id,
        san=[x509.UniformResourceIdentifier(f"{SITE_URI_SCHEME}:{site_id}")],
        usage=ExtendedKeyUsageOID.CLIENT_AUTH,
        valid_days=valid_days,
    )


def site_id_from_certificate(certificate: x509.Certificate) -> str:
    """The site id a client certificate names; :class:`PkiError` unless its CN and its single
    ``afl-site:`` URI SAN agree on one valid site id."""
    common_names = certificate.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    if len(common_names) != 1 or not isinstance(common_names[0].value, str):
        raise PkiError("certificate must have exactly one subject common name")
    try:
        san = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound as exc:
        raise PkiError("certificate has no subjectAltName naming a site") from exc
    prefix = f"{SITE_URI_SCHEME}:"
    uris = [
        u for u in san.get_values_for_type(x509.UniformResourceIdentifier) if u.startswith(prefix)
    ]
    if len(uris) != 1:
        raise PkiError(f"certificate must carry exactly one '{prefix}<id>' URI, found {len(uris)}")
    site_id = uris[0][len(prefix) :]
    if site_id != common_names[0].value:
        raise PkiError("certificate common name and afl-site URI name different sites")
    return validate_site_id(site_id)


def site_id_from_pem(pem: bytes) -> str:
    """:func:`site_id_from_certificate` of a PEM certificate (e.g. gRPC's ``x509_pem_cert``)."""
    return site_id_from_certificate(load_certificate_pem(pem))


def verify_issued_by(certificate: x509.Certificate, ca_certificate: x509.Certificate) -> None:
    """Raise :class:`PkiError` unless ``certificate`` is signed by ``ca_certificate``'s key, names
    it as issuer, and both are within their validity period now."""
    try:
        certificate.verify_directly_issued_by(ca_certificate)
    except (ValueError, TypeError, InvalidSignature) as exc:
        raise PkiError("certificate was not issued by this federation's CA") from exc
    now = _now()
    for cert, what in ((certificate, "certificate"), (ca_certificate, "CA certificate")):
        if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc:
            raise PkiError(f"{what} is outside its validity period")


def certificate_to_pem(certificate: x509.Certificate) -> bytes:
    """PEM encoding of a certificate."""
    return certificate.public_bytes(serialization.Encoding.PEM)


def load_certificate_pem(pem: bytes) -> x509.Certificate:
    """Parse one PEM certificate; :class:`PkiError` if malformed."""
    try:
        return x509.load_pem_x509_certificate(pem)
    except (ValueError, TypeError) as exc:
        raise PkiError("could not parse PEM certificate") from exc


def tls_private_key_to_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    """Unencrypted PKCS#8 PEM (daemons start unattended; protect the file with mode 0600)."""
    return key.private_bytes(
        encoding=serialization.Encoding.PEM,
        format=serialization.PrivateFormat.PKCS8,
        encryption_algorithm=serialization.NoEncryption(),
    )


def load_tls_private_key_pem(pem: bytes) -> ec.EllipticCurvePrivateKey:
    """Load a PEM ECDSA private key; :class:`PkiError` if malformed or of another type."""
    try:
        key = serialization.load_pem_private_key(pem, password=None)
    except (ValueError, TypeError) as exc:
        raise PkiError("could not load PEM private key") from exc
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise PkiError(f"expected an ECDSA private key, got {type(key).__name__}")
    return key


def write_private_file(path: str | os.PathLike[str], data: bytes, *, mode: int = 0o600) -> Path:
    """Write ``data`` atomically to ``path`` with permission bits ``mode`` (default 0600, for
    keys): the file never exists with wider permissions or partial contents."""
    target = Path(path)
    tmp = target.with_name(f".{target.name}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as handle:
            os.fchmod(handle.fileno(), mode)
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return target


def make_private_dir(path: str | os.PathLike[str]) -> Path:
    """Create ``path`` and every missing parent with mode 0700 (``Path.mkdir(parents=True)``
    gives the parents the umask's default instead); an existing ``path`` owned by this user is
    tightened to 0700. Returns the path."""
    target = Path(path)
    missing = []
    probe = target
    while not probe.exists():
        missing.append(probe)
        probe = probe.parent
    for folder in reversed(missing):
        folder.mkdir(mode=0o700, exist_ok=True)
    if target.stat().st_uid == os.getuid():
        os.chmod(target, 0o700)
    return target
