"""X.509 public-key infrastructure of a federation (docs/protocol.md §3): a federation CA, the
server's TLS certificate and one client certificate per site, for gRPC mutual TLS.

Keys are ECDSA P-256 (curve secp256r1) signed with SHA-256: gRPC's TLS stack (BoringSSL) accepts
them everywhere, unlike Ed25519 certificates. The site's Ed25519 *identity* key (signatures in
the protocol, :mod:`afl.crypto.identity.signatures`) is separate from its TLS key.

A site certificate names the site twice, and both must agree:

    subject CN = <site id>,   subjectAltName URI = ``afl-site:<site id>``

:func:`site_id_from_certificate` is what the server calls on the peer certificate of every
request; it never trusts a site id sent in a message body. An operator's certificate for the
Admin service names an admin the same way with ``afl-admin:<name>`` (and no ``afl-site:`` URI),
so a site certificate never opens the Admin service and an admin certificate is never a site.

Keys stay where they are used (docs/protocol.md §1, M-70): a site (or the server) makes its key
and a certificate signing request (:func:`site_csr`, :func:`server_csr`); the CA checks the request
(:func:`check_site_csr`, :func:`check_server_csr`: self-signature, ECDSA P-256, the names asked
for, no other extension) and signs the request's public key
(:func:`issue_site_certificate_for`, :func:`issue_server_certificate_for`) with the extensions
it chooses itself. The CA key may be stored encrypted with a passphrase
(:func:`tls_private_key_to_pem`, :func:`load_tls_private_key_pem`).
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
    "ADMIN_URI_SCHEME",
    "LEAF_VALID_DAYS",
    "SITE_URI_SCHEME",
    "CertifiedKey",
    "PkiError",
    "admin_name_from_pem",
    "certificate_to_pem",
    "check_server_csr",
    "check_site_csr",
    "create_ca",
    "csr_to_pem",
    "generate_tls_key",
    "is_encrypted_pem",
    "issue_admin_certificate",
    "issue_server_certificate",
    "issue_server_certificate_for",
    "issue_site_certificate",
    "issue_site_certificate_for",
    "load_certificate_pem",
    "load_csr_pem",
    "load_tls_private_key_pem",
    "make_private_dir",
    "server_csr",
    "server_san",
    "site_csr",
    "site_id_from_certificate",
    "site_id_from_pem",
    "tls_private_key_to_pem",
    "validate_site_id",
    "verify_issued_by",
    "write_private_file",
]

#: URI scheme of the subjectAltName that carries a site id.
SITE_URI_SCHEME = "afl-site"
#: URI scheme of the subjectAltName that carries an admin (operator) name.
ADMIN_URI_SCHEME = "afl-admin"
#: Site ids: 1-64 characters, lowercase letters, digits, '.', '_', '-'; alphanumeric at both ends.
_SITE_ID_RE = re.compile(r"^[a-z0-9](?:[a-z0-9._-]{0,62}[a-z0-9])?$")
_CLOCK_SKEW = dt.timedelta(minutes=5)
#: Default validity of server, site and admin certificates (days): the CA/Browser Forum's limit
#: for TLS certificates since 2020. A key lost without anyone noticing (so never revoked) stops
#: working within about a year, and yearly rotation keeps a month's margin (docs/operations.md
#: §12); revocation (:mod:`afl.crypto.identity.revocation`) covers the known cases at once.
LEAF_VALID_DAYS = 397


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


def _issue_for(
    ca: CertifiedKey,
    *,
    public_key: ec.EllipticCurvePublicKey,
    common_name: str,
    san: Sequence[x509.GeneralName],
    usage: x509.ObjectIdentifier,
    valid_days: int,
) -> x509.Certificate:
    """A leaf certificate for ``public_key``; every extension is the CA's choice."""
    _check_p256(public_key)
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    ca_ski = ca.certificate.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    return (
        _builder(
            subject=subject,
            issuer=ca.certificate.subject,
            public_key=public_key,
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


def generate_tls_key() -> ec.EllipticCurvePrivateKey:
    """A fresh ECDSA P-256 TLS key (from the OS CSPRNG)."""
    return ec.generate_private_key(ec.SECP256R1())


def _check_p256(public_key: object) -> ec.EllipticCurvePublicKey:
    if not isinstance(public_key, ec.EllipticCurvePublicKey):
        raise PkiError(f"the key must be ECDSA P-256, got {type(public_key).__name__}")
    if not isinstance(public_key.curve, ec.SECP256R1):
        raise PkiError(f"the key must be ECDSA P-256, got curve {public_key.curve.name}")
    return public_key


def _host_name(host: str) -> x509.GeneralName:
    if not isinstance(host, str) or not host or any(c.isspace() for c in host) or "/" in host:
        raise PkiError(f"invalid server host name or address {host!r}")
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def server_san(hosts: Sequence[str]) -> list[x509.GeneralName]:
    """subjectAltName entries for ``hosts`` (DNS names or IP addresses), duplicates dropped,
    order kept; :class:`PkiError` for an empty list or a malformed host."""
    if isinstance(hosts, str) or not hosts:
        raise PkiError("hosts must be a non-empty sequence of host names or IP addresses")
    names: list[x509.GeneralName] = []
    for host in hosts:
        name = _host_name(host)
        if name not in names:
            names.append(name)
    return names


def issue_server_certificate_for(
    ca: CertifiedKey,
    *,
    public_key: ec.EllipticCurvePublicKey,
    common_name: str,
    hosts: Sequence[str],
    valid_days: int = LEAF_VALID_DAYS,
) -> x509.Certificate:
    """The server's TLS certificate for ``public_key``: subjectAltName lists every host."""
    return _issue_for(
        ca,
        public_key=public_key,
        common_name=common_name,
        san=server_san(hosts),
        usage=ExtendedKeyUsageOID.SERVER_AUTH,
        valid_days=valid_days,
    )


def issue_server_certificate(
    ca: CertifiedKey,
    *,
    common_name: str,
    hosts: Sequence[str] = ("localhost", "127.0.0.1"),
    valid_days: int = LEAF_VALID_DAYS,
) -> CertifiedKey:
    """A fresh server key and its certificate (:func:`issue_server_certificate_for`): for the
    all-in-one ``afl provision`` and tests; in production the server makes its own key."""
    key = generate_tls_key()
    certificate = issue_server_certificate_for(
        ca,
        public_key=key.public_key(),
        common_name=common_name,
        hosts=hosts,
        valid_days=valid_days,
    )
    return CertifiedKey(certificate=certificate, private_key=key)


def _site_uri(site_id: str) -> x509.UniformResourceIdentifier:
    return x509.UniformResourceIdentifier(f"{SITE_URI_SCHEME}:{validate_site_id(site_id)}")


def issue_site_certificate_for(
    ca: CertifiedKey,
    *,
    public_key: ec.EllipticCurvePublicKey,
    site_id: str,
    valid_days: int = LEAF_VALID_DAYS,
) -> x509.Certificate:
    """A site's TLS client certificate for ``public_key``: CN = site id, URI SAN
    ``afl-site:<site id>``."""
    return _issue_for(
        ca,
        public_key=public_key,
        common_name=site_id,
        san=[_site_uri(site_id)],
        usage=ExtendedKeyUsageOID.CLIENT_AUTH,
        valid_days=valid_days,
    )


def issue_site_certificate(
    ca: CertifiedKey, *, site_id: str, valid_days: int = LEAF_VALID_DAYS
) -> CertifiedKey:
    """A fresh site key and its certificate (:func:`issue_site_certificate_for`): for the
    all-in-one ``afl provision`` and tests; in production the site makes its own key."""
    validate_site_id(site_id)
    key = generate_tls_key()
    certificate = issue_site_certificate_for(
        ca, public_key=key.public_key(), site_id=site_id, valid_days=valid_days
    )
    return CertifiedKey(certificate=certificate, private_key=key)


# --- certificate signing requests ---------------------------------------------------------------


def _csr(
    key: ec.EllipticCurvePrivateKey, *, common_name: str, san: Sequence[x509.GeneralName]
) -> x509.CertificateSigningRequest:
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    return (
        x509.CertificateSigningRequestBuilder()
        .subject_name(subject)
        .add_extension(x509.SubjectAlternativeName(list(san)), critical=False)
        .sign(key, hashes.SHA256())
    )


def site_csr(key: ec.EllipticCurvePrivateKey, *, site_id: str) -> x509.CertificateSigningRequest:
    """A site's CSR: CN = site id, URI SAN ``afl-site:<site id>``, signed by its own key."""
    return _csr(key, common_name=validate_site_id(site_id), san=[_site_uri(site_id)])


def server_csr(
    key: ec.EllipticCurvePrivateKey, *, hosts: Sequence[str]
) -> x509.CertificateSigningRequest:
    """The server's CSR: CN = the first host, SAN = every host (:func:`server_san`)."""
    return _csr(key, common_name=hosts[0] if hosts else "", san=server_san(hosts))


def _check_csr(
    csr: x509.CertificateSigningRequest, *, common_name: str, san: Sequence[x509.GeneralName]
) -> ec.EllipticCurvePublicKey:
    if not csr.is_signature_valid:
        raise PkiError("the certificate request's self-signature does not verify")
    public_key = _check_p256(csr.public_key())
    names = csr.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    if len(csr.subject) != 1 or len(names) != 1 or names[0].value != common_name:
        raise PkiError(
            f"the certificate request's subject is {csr.subject.rfc4514_string()!r}, "
            f"expected CN={common_name}"
        )
    others = [
        e.oid.dotted_string for e in csr.extensions if e.oid != x509.SubjectAlternativeName.oid
    ]
    if others:
        raise PkiError(f"the certificate request asks for other extensions: {', '.join(others)}")
    try:
        asked = list(csr.extensions.get_extension_for_class(x509.SubjectAlternativeName).value)
    except x509.ExtensionNotFound as exc:
        raise PkiError("the certificate request names no subjectAltName") from exc
    if asked != list(san):
        raise PkiError(
            f"the certificate request asks for names {[str(n.value) for n in asked]}, "
            f"expected {[str(n.value) for n in san]}"
        )
    return public_key


def check_site_csr(
    csr: x509.CertificateSigningRequest, *, site_id: str
) -> ec.EllipticCurvePublicKey:
    """The public key of a valid CSR for ``site_id``; :class:`PkiError` unless it is signed by
    its own ECDSA P-256 key, names exactly CN = site id and URI SAN ``afl-site:<site id>``, and
    asks for no other extension."""
    return _check_csr(csr, common_name=validate_site_id(site_id), san=[_site_uri(site_id)])


def check_server_csr(
    csr: x509.CertificateSigningRequest, *, hosts: Sequence[str]
) -> ec.EllipticCurvePublicKey:
    """The public key of a valid server CSR for ``hosts`` (as :func:`check_site_csr`, with CN =
    the first host and SAN = :func:`server_san` of ``hosts``)."""
    san = server_san(hosts)
    return _check_csr(csr, common_name=hosts[0], san=san)


def csr_to_pem(csr: x509.CertificateSigningRequest) -> bytes:
    """PEM encoding of a certificate signing request."""
    return csr.public_bytes(serialization.Encoding.PEM)


def load_csr_pem(pem: bytes) -> x509.CertificateSigningRequest:
    """Parse one PEM certificate signing request; :class:`PkiError` if malformed."""
    try:
        return x509.load_pem_x509_csr(pem)
    except (ValueError, TypeError) as exc:
        raise PkiError("could not parse PEM certificate signing request") from exc


def issue_admin_certificate(
    ca: CertifiedKey, *, name: str, valid_days: int = LEAF_VALID_DAYS
) -> CertifiedKey:
    """An operator's TLS client certificate for the Admin service: CN = name, URI SAN
    ``afl-admin:<name>`` (never a site: it carries no ``afl-site:`` URI)."""
    validate_site_id(name)
    key = generate_tls_key()
    certificate = _issue_for(
        ca,
        public_key=key.public_key(),
        common_name=name,
        san=[x509.UniformResourceIdentifier(f"{ADMIN_URI_SCHEME}:{name}")],
        usage=ExtendedKeyUsageOID.CLIENT_AUTH,
        valid_days=valid_days,
    )
    return CertifiedKey(certificate=certificate, private_key=key)


def _identity_from_certificate(certificate: x509.Certificate, scheme: str) -> str:
    common_names = certificate.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    if len(common_names) != 1 or not isinstance(common_names[0].value, str):
        raise PkiError("certificate must have exactly one subject common name")
    try:
        san = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound as exc:
        raise PkiError(f"certificate has no subjectAltName naming an {scheme} identity") from exc
    prefix = f"{scheme}:"
    uris = [
        u for u in san.get_values_for_type(x509.UniformResourceIdentifier) if u.startswith(prefix)
    ]
    if len(uris) != 1:
        raise PkiError(f"certificate must carry exactly one '{prefix}<id>' URI, found {len(uris)}")
    name = uris[0][len(prefix) :]
    if name != common_names[0].value:
        raise PkiError(
            f"certificate common name and {scheme} URI name different identities (different sites or admins)"
        )
    return validate_site_id(name)


def site_id_from_certificate(certificate: x509.Certificate) -> str:
    """The site id a client certificate names; :class:`PkiError` unless its CN and its single
    ``afl-site:`` URI SAN agree on one valid site id."""
    return _identity_from_certificate(certificate, SITE_URI_SCHEME)


def site_id_from_pem(pem: bytes) -> str:
    """:func:`site_id_from_certificate` of a PEM certificate (e.g. gRPC's ``x509_pem_cert``)."""
    return site_id_from_certificate(load_certificate_pem(pem))


def admin_name_from_pem(pem: bytes) -> str:
    """The admin name of a PEM client certificate (``afl-admin:`` URI SAN agreeing with its CN);
    :class:`PkiError` for a site certificate or anything else."""
    return _identity_from_certificate(load_certificate_pem(pem), ADMIN_URI_SCHEME)


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


def tls_private_key_to_pem(
    key: ec.EllipticCurvePrivateKey, *, passphrase: bytes | None = None
) -> bytes:
    """PKCS#8 PEM; encrypted with ``passphrase`` when given (the CA key), else unencrypted
    (daemons start unattended; protect the file with mode 0600)."""
    encryption: serialization.KeySerializationEncryption = (
        serialization.BestAvailableEncryption(passphrase)
        if passphrase is not None
        else serialization.NoEncryption()
    )
    return key.private_bytes(
        encoding=serialization.Encoding.PEM,
        format=serialization.PrivateFormat.PKCS8,
        encryption_algorithm=encryption,
    )


def is_encrypted_pem(pem: bytes) -> bool:
    """Whether ``pem`` holds a passphrase-encrypted private key."""
    return b"-----BEGIN ENCRYPTED PRIVATE KEY-----" in pem or b"Proc-Type: 4,ENCRYPTED" in pem


def load_tls_private_key_pem(
    pem: bytes, *, passphrase: bytes | None = None
) -> ec.EllipticCurvePrivateKey:
    """Load a PEM ECDSA private key (decrypting it with ``passphrase`` if it is encrypted);
    :class:`PkiError` if malformed, of another type, encrypted without a passphrase given, or
    the passphrase is wrong."""
    encrypted = is_encrypted_pem(pem)
    if encrypted and passphrase is None:
        raise PkiError("the private key is encrypted: a passphrase is needed")
    try:
        key = serialization.load_pem_private_key(pem, password=passphrase if encrypted else None)
    except (ValueError, TypeError) as exc:
        what = "wrong passphrase, or not a PEM private key" if encrypted else "malformed PEM"
        raise PkiError(f"could not load the private key ({what})") from exc
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


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make the entries of the folder ``path`` durable (a file created or renamed into it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
