"""Certificate revocation: an X.509 CRL signed by the federation CA (docs/protocol.md M-173,
docs/operations.md §12).

``afl ca sign`` writes an empty CRL beside the coordinator's kit (``crl.pem``, named by
server.toml ``[tls] crl``); ``afl ca revoke`` adds a certificate's serial number to it, signed
again by the CA on its offline machine. The coordinator holds a :class:`RevocationList` and
refuses every call whose client certificate is listed, before anything else reads the call. A
CRL is trusted only when the federation CA signed it and names itself as its issuer; one that
cannot be read or verified refuses every certificate (fail closed), and a changed file is read
again on the next call (no restart).
"""

from __future__ import annotations

import datetime as dt
import os
import threading
from collections.abc import Mapping
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from afl.crypto.identity.pki import CertifiedKey, PkiError, load_certificate_pem

__all__ = ["CRL_NAME", "RevocationList", "issue_crl", "load_crl", "revoked_serials"]

CRL_NAME = "crl.pem"
#: How long a CRL says it is current (RFC 5280 nextUpdate); the coordinator keeps honouring an
#: older one (its entries stay revoked), so this only tells other readers when to expect the next.
_NEXT_UPDATE = dt.timedelta(days=30)


def issue_crl(ca: CertifiedKey, *, revoked: Mapping[int, dt.datetime]) -> bytes:
    """A PEM CRL of the serial numbers in ``revoked`` (serial -> revocation time), signed by
    ``ca``."""
    now = dt.datetime.now(dt.UTC)
    builder = (
        x509.CertificateRevocationListBuilder()
        .issuer_name(ca.certificate.subject)
        .last_update(now)
        .next_update(now + _NEXT_UPDATE)
    )
    for serial, when in sorted(revoked.items()):
        builder = builder.add_revoked_certificate(
            x509.RevokedCertificateBuilder().serial_number(serial).revocation_date(when).build()
        )
    crl = builder.sign(ca.private_key, hashes.SHA256())
    return crl.public_bytes(serialization.Encoding.PEM)


def load_crl(pem: bytes, *, ca_certificate: x509.Certificate) -> x509.CertificateRevocationList:
    """Parse ``pem`` and check that ``ca_certificate`` issued and signed it; :class:`PkiError`
    otherwise."""
    try:
        crl = x509.load_pem_x509_crl(pem)
    except ValueError as exc:
        raise PkiError("not a PEM certificate revocation list") from exc
    key = ca_certificate.public_key()
    if crl.issuer != ca_certificate.subject or not isinstance(key, ec.EllipticCurvePublicKey):
        raise PkiError("the revocation list was not issued by this federation's CA")
    try:
        valid = crl.is_signature_valid(key)
    except (InvalidSignature, TypeError, ValueError):
        valid = False
    if not valid:
        raise PkiError("the revocation list's signature does not verify with the federation CA")
    return crl


def revoked_serials(crl: x509.CertificateRevocationList) -> dict[int, dt.datetime]:
    """serial -> revocation time of every entry of ``crl``."""
    return {entry.serial_number: entry.revocation_date_utc for entry in crl}


class RevocationList:
    """The coordinator's view of ``crl.pem``: :meth:`refusal` of a client certificate."""

    def __init__(self, path: Path, *, ca_certificate_pem: bytes) -> None:
        self.path = Path(path)
        self._ca = load_certificate_pem(ca_certificate_pem)
        self._lock = threading.Lock()
        self._stamp: tuple[int, int, int] | None = None
        self._serials: frozenset[int] = frozenset()
        self._error: str | None = None

    def _current(self) -> tuple[frozenset[int], str | None]:
        try:
            st = os.stat(self.path)
            stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        except OSError as exc:
            return frozenset(), f"the revocation list {self.path} cannot be read ({exc.strerror})"
        with self._lock:
            if stamp != self._stamp:
                try:
                    crl = load_crl(self.path.read_bytes(), ca_certificate=self._ca)
                    self._serials, self._error = frozenset(revoked_serials(crl)), None
                except (OSError, PkiError) as exc:
                    self._serials, self._error = frozenset(), f"{self.path}: {exc}"
                self._stamp = stamp
            return self._serials, self._error

    def refusal(self, certificate_pem: bytes) -> str | None:
        """Why the certificate is refused (revoked, or no usable CRL), or None."""
        serials, error = self._current()
        if error is not None:
            return f"certificate status unknown: {error}"
        serial = load_certificate_pem(certificate_pem).serial_number
        if serial in serials:
            return f"the client certificate (serial {serial:x}) is revoked by the federation CA"
        return None
