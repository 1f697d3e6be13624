"""Key custody: the public statements of distributed provisioning (docs/protocol.md §1, M-70..M-72).

Every party makes its own private keys where it runs and sends only a *key request*:

    kind                "site" or "server"
    name                the site id, or the server's first host name
    role                "participant" or "decryptor" (sites), "server"
    identity_public_key raw 32-byte Ed25519 key
    csr                 PEM certificate signing request, ECDSA P-256, signed by the TLS key
    hosts, port         the server's host names and port (server requests only)
    identity_proof      Ed25519(identity key, canonical(DOMAIN_TAG, "key-request", *fields))

with fields = (kind, name, role, identity_public_key, SubjectPublicKeyInfo DER of the CSR's key,
canonical(hosts), port). The proof binds the identity key to the TLS key and the name, so a
request changed in transit no longer verifies; whoever replaces *both* keys is caught by the
fingerprint, SHA-256 of the same canonical bytes cut to 16 bytes (32 hex digits in groups of 4),
which the site reads to the operator out of band.

The operator answers with a *roster*, the federation's public material:

    federation_id, server_address, ca_certificate (PEM), server_identity_public_key,
    sites: {site id: (identity_public_key, role)}

and its fingerprint, SHA-256(canonical(DOMAIN_TAG, "roster", federation_id, server_address,
SHA-256(CA certificate DER), server_identity_public_key, n, (site id, key, role) for each site in
sorted order)) cut as above, which the operator publishes out of band and every site compares
before trusting the roster.

Both travel as JSON files (:meth:`KeyRequest.to_json`, :func:`request_from_json`,
:meth:`Roster.to_json`, :func:`roster_from_json`); parsing validates every field.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.types import CertificatePublicKeyTypes

from afl.crypto.canonical import Field, canonical_encode
from afl.crypto.errors import CryptoError
from afl.crypto.identity import pki, signatures

__all__ = [
    "REQUEST_FORMAT",
    "ROSTER_FORMAT",
    "SITE_ROLES",
    "CustodyError",
    "KeyRequest",
    "PrivateKeys",
    "Roster",
    "RosterSite",
    "format_fingerprint",
    "new_server_request",
    "new_site_request",
    "request_from_json",
    "roster_from_json",
]

REQUEST_FORMAT = "afl-key-request/1"
ROSTER_FORMAT = "afl-roster/1"
SITE_ROLES = ("participant", "decryptor")
SERVER_ROLE = "server"
_REQUEST_CONTEXT = "key-request"
_ROSTER_CONTEXT = "roster"
_FINGERPRINT_BYTES = 16


class CustodyError(CryptoError, ValueError):
    """A key request or roster is malformed, does not verify, or contradicts what it must match."""


def format_fingerprint(digest: bytes) -> str:
    """The first 16 bytes of ``digest`` as 32 hex digits in groups of 4 (for reading aloud)."""
    text = digest[:_FINGERPRINT_BYTES].hex()
    return " ".join(text[i : i + 4] for i in range(0, len(text), 4))


@dataclass(frozen=True)
class PrivateKeys:
    """A party's two private keys; they never leave the machine that made them."""

    tls_key: ec.EllipticCurvePrivateKey
    identity_key: Ed25519PrivateKey

    def __repr__(self) -> str:  # never print key material
        return "PrivateKeys(<redacted>)"

    def tls_pem(self) -> bytes:
        """The TLS key as unencrypted PKCS#8 PEM (store it with mode 0600)."""
        return pki.tls_private_key_to_pem(self.tls_key)

    def identity_pem(self) -> bytes:
        """The identity key as unencrypted PKCS#8 PEM (store it with mode 0600)."""
        return signatures.private_key_to_pem(self.identity_key)


def _spki(public_key: CertificatePublicKeyTypes) -> bytes:
    return public_key.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )


@dataclass(frozen=True)
class KeyRequest:
    """A party's key request (module docstring). Construct with :func:`new_site_request`,
    :func:`new_server_request` or :func:`request_from_json`; check with :meth:`verify`."""

    kind: str
    name: str
    role: str
    identity_public_key: bytes
    csr_pem: bytes
    identity_proof: bytes
    hosts: tuple[str, ...] = ()
    port: int = 0

    def _fields(self) -> list[Field]:
        return [
            self.kind,
            self.name,
            self.role,
            self.identity_public_key,
            _spki(pki.load_csr_pem(self.csr_pem).public_key()),
            canonical_encode(list(self.hosts)),
            self.port,
        ]

    def signed_message(self) -> bytes:
        """The bytes ``identity_proof`` signs and the fingerprint hashes (module docstring)."""
        return signatures.signed_message(context=_REQUEST_CONTEXT, fields=self._fields())

    @property
    def what(self) -> str:
        """How messages name this request, e.g. ``site 'hospital-a'``."""
        return f"{self.kind} {self.name!r}"

    @property
    def fingerprint(self) -> str:
        """The fingerprint to compare out of band (module docstring)."""
        return format_fingerprint(hashlib.sha256(self.signed_message()).digest())

    def verify(self) -> ec.EllipticCurvePublicKey:
        """The request's TLS public key, after every check: well-formed fields, the CSR (its
        self-signature, ECDSA P-256, exactly the names of this request, no other extension) and
        the identity proof. :class:`CustodyError` names what fails."""
        try:
            _check_shape(self)
            csr = pki.load_csr_pem(self.csr_pem)
            if self.kind == "site":
                public = pki.check_site_csr(csr, site_id=self.name)
            else:
                public = pki.check_server_csr(csr, hosts=self.hosts)
            signatures.verify(
                signatures.load_public_key_raw(self.identity_public_key),
                self.identity_proof,
                self.signed_message(),
            )
        except CustodyError:
            raise
        except CryptoError as exc:
            raise CustodyError(f"{self.what}: {exc}") from exc
        return public

    def to_json(self) -> str:
        """The request file's text (JSON; public: it holds no private key)."""
        document: dict[str, Any] = {
            "format": REQUEST_FORMAT,
            "kind": self.kind,
            "name": self.name,
            "role": self.role,
            "identity_public_key": self.identity_public_key.hex(),
            "csr": self.csr_pem.decode("ascii"),
            "hosts": list(self.hosts),
            "port": self.port,
            "identity_proof": self.identity_proof.hex(),
            "fingerprint": self.fingerprint,
        }
        return json.dumps(document, indent=2) + "\n"


def _check_shape(request: KeyRequest) -> None:
    if request.kind == "site":
        pki.validate_site_id(request.name)
        if request.role not in SITE_ROLES:
            raise CustodyError(f"{request.what}: role must be one of {SITE_ROLES}")
        if request.hosts or request.port:
            raise CustodyError(f"{request.what}: a site request names no hosts or port")
    elif request.kind == "server":
        if request.role != SERVER_ROLE or not request.hosts or request.name != request.hosts[0]:
            raise CustodyError(f"{request.what}: a server request is named by its first host")
        if not 1 <= request.port <= 65535:
            raise CustodyError(f"{request.what}: port must be in 1..65535, got {request.port}")
    else:
        raise CustodyError(f"unknown request kind {request.kind!r} (site or server)")


def _signed_request(
    keys: PrivateKeys,
    *,
    kind: str,
    name: str,
    role: str,
    csr_pem: bytes,
    hosts: Sequence[str],
    port: int,
) -> KeyRequest:
    unsigned = KeyRequest(
        kind=kind,
        name=name,
        role=role,
        identity_public_key=signatures.public_key_to_raw(keys.identity_key),
        csr_pem=csr_pem,
        identity_proof=b"",
        hosts=tuple(hosts),
        port=port,
    )
    proof = signatures.sign(keys.identity_key, unsigned.signed_message())
    request = dataclasses.replace(unsigned, identity_proof=proof)
    request.verify()
    return request


def _new_keys() -> PrivateKeys:
    return PrivateKeys(pki.generate_tls_key(), signatures.generate_identity_key())


def new_site_request(*, site_id: str, role: str = "participant") -> tuple[PrivateKeys, KeyRequest]:
    """Fresh keys for ``site_id`` (made here, from the OS CSPRNG) and their signed request."""
    pki.validate_site_id(site_id)
    keys = _new_keys()
    csr = pki.csr_to_pem(pki.site_csr(keys.tls_key, site_id=site_id))
    request = _signed_request(
        keys, kind="site", name=site_id, role=role, csr_pem=csr, hosts=(), port=0
    )
    return keys, request


def new_server_request(*, hosts: Sequence[str], port: int) -> tuple[PrivateKeys, KeyRequest]:
    """Fresh keys for the coordinator that clients dial at ``hosts`` (first = its name) and
    ``port``, and their signed request."""
    keys = _new_keys()
    csr = pki.csr_to_pem(pki.server_csr(keys.tls_key, hosts=hosts))
    request = _signed_request(
        keys, kind="server", name=hosts[0], role=SERVER_ROLE, csr_pem=csr, hosts=hosts, port=port
    )
    return keys, request


def _load_json(text: str, what: str, expected_format: str) -> dict[str, Any]:
    try:
        document = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CustodyError(f"{what} is not valid JSON ({exc})") from exc
    if not isinstance(document, dict) or document.get("format") != expected_format:
        raise CustodyError(f"{what} is not an {expected_format} document")
    return document


def _get(document: Mapping[str, Any], key: str, kind: type, what: str) -> Any:
    value = document.get(key)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise CustodyError(f"{what}: field {key!r} is missing or not a {kind.__name__}")
    return value


def _hex_key(text: str, what: str) -> bytes:
    try:
        raw = bytes.fromhex(text)
        signatures.load_public_key_raw(raw)
    except (ValueError, CryptoError) as exc:
        raise CustodyError(f"{what}: not a 32-byte Ed25519 public key in hex") from exc
    return raw


def _check_fingerprint(document: Mapping[str, Any], actual: str, what: str) -> None:
    stated = document.get("fingerprint")
    if stated is not None and stated != actual:
        raise CustodyError(f"{what}: the stated fingerprint does not match the contents")


def request_from_json(text: str) -> KeyRequest:
    """Parse and :meth:`~KeyRequest.verify` a request file; :class:`CustodyError` if it is
    malformed, tampered with (proof or stated fingerprint) or its CSR is not acceptable."""
    doc = _load_json(text, "the key request", REQUEST_FORMAT)
    what = "the key request"
    hosts = _get(doc, "hosts", list, what)
    if not all(isinstance(h, str) for h in hosts):
        raise CustodyError(f"{what}: hosts must be strings")
    try:
        proof = bytes.fromhex(_get(doc, "identity_proof", str, what))
    except ValueError as exc:
        raise CustodyError(f"{what}: identity_proof is not hex") from exc
    request = KeyRequest(
        kind=_get(doc, "kind", str, what),
        name=_get(doc, "name", str, what),
        role=_get(doc, "role", str, what),
        identity_public_key=_hex_key(_get(doc, "identity_public_key", str, what), what),
        csr_pem=_get(doc, "csr", str, what).encode("ascii", "replace"),
        identity_proof=proof,
        hosts=tuple(hosts),
        port=_get(doc, "port", int, what),
    )
    request.verify()
    _check_fingerprint(doc, request.fingerprint, request.what)
    return request


@dataclass(frozen=True)
class RosterSite:
    """A provisioned site, as the roster and server.toml's [sites] list it: its Ed25519 identity
    public key (raw) and role."""

    identity_public_key: bytes
    role: str


@dataclass(frozen=True)
class Roster:
    """The federation's public material (module docstring)."""

    federation_id: str
    server_address: str
    ca_certificate_pem: bytes
    server_identity_public_key: bytes
    sites: Mapping[str, RosterSite] = field(default_factory=dict)

    @property
    def fingerprint(self) -> str:
        """The fingerprint the operator publishes and every site compares (module docstring)."""
        ca_der = pki.load_certificate_pem(self.ca_certificate_pem).public_bytes(
            serialization.Encoding.DER
        )
        fields: list[Field] = [
            self.federation_id,
            self.server_address,
            hashlib.sha256(ca_der).digest(),
            self.server_identity_public_key,
            len(self.sites),
        ]
        for site_id in sorted(self.sites):
            entry = self.sites[site_id]
            fields += [site_id, entry.identity_public_key, entry.role]
        message = signatures.signed_message(context=_ROSTER_CONTEXT, fields=fields)
        return format_fingerprint(hashlib.sha256(message).digest())

    def identity_keys(self) -> dict[str, bytes]:
        """Site id -> identity public key, sorted by site id."""
        return {s: self.sites[s].identity_public_key for s in sorted(self.sites)}

    def to_json(self) -> str:
        """The roster file's text (JSON; public)."""
        document: dict[str, Any] = {
            "format": ROSTER_FORMAT,
            "federation_id": self.federation_id,
            "server_address": self.server_address,
            "ca_certificate": self.ca_certificate_pem.decode("ascii"),
            "server_identity_public_key": self.server_identity_public_key.hex(),
            "sites": {
                s: {"identity_public_key": e.identity_public_key.hex(), "role": e.role}
                for s, e in sorted(self.sites.items())
            },
            "fingerprint": self.fingerprint,
        }
        return json.dumps(document, indent=2) + "\n"


def roster_from_json(text: str) -> Roster:
    """Parse a roster file, checking every field; :class:`CustodyError` if malformed or its stated
    fingerprint does not match its contents."""
    what = "the roster"
    doc = _load_json(text, what, ROSTER_FORMAT)
    sites_raw = _get(doc, "sites", dict, what)
    sites: dict[str, RosterSite] = {}
    for site_id, entry in sites_raw.items():
        try:
            pki.validate_site_id(site_id)
        except pki.PkiError as exc:
            raise CustodyError(f"{what}: {exc}") from exc
        if not isinstance(entry, dict):
            raise CustodyError(f"{what}: site {site_id!r} must be an object")
        role = _get(entry, "role", str, f"{what}, site {site_id!r}")
        if role not in SITE_ROLES:
            raise CustodyError(f"{what}: site {site_id!r} has unknown role {role!r}")
        key = _hex_key(_get(entry, "identity_public_key", str, what), f"{what}, site {site_id!r}")
        sites[site_id] = RosterSite(key, role)
    ca_pem = _get(doc, "ca_certificate", str, what).encode("ascii", "replace")
    try:
        pki.load_certificate_pem(ca_pem)
    except pki.PkiError as exc:
        raise CustodyError(f"{what}: ca_certificate: {exc}") from exc
    roster = Roster(
        federation_id=_get(doc, "federation_id", str, what),
        server_address=_get(doc, "server_address", str, what),
        ca_certificate_pem=ca_pem,
        server_identity_public_key=_hex_key(
            _get(doc, "server_identity_public_key", str, what), what
        ),
        sites=sites,
    )
    if not roster.federation_id.strip() or not roster.server_address.strip():
        raise CustodyError(f"{what}: federation_id and server_address must not be empty")
    _check_fingerprint(doc, roster.fingerprint, what)
    return roster
