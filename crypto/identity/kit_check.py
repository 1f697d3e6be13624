"""Checks of a TLS kit (CA certificate, certificate, private key) for `afl-client doctor` and
`afl-server check` (docs/protocol.md §3): each finding is one line naming the file and the cause.

* the CA certificate parses and is within its validity period;
* the certificate parses, was signed by that CA (else: a kit of another federation), and is
  within its validity period (a warning when it expires within ``warn_days``);
* the private key parses, belongs to the certificate, and only its owner may read it.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization

from afl.crypto.identity.pki import PkiError, load_certificate_pem, load_tls_private_key_pem

__all__ = [
    "OK",
    "PROBLEM",
    "WARNING",
    "Finding",
    "check_tls_kit",
    "describe_names",
    "report_lines",
]

OK, WARNING, PROBLEM = "ok", "warning", "problem"


@dataclass(frozen=True)
class Finding:
    """One checked item: ``level`` is OK, WARNING or PROBLEM; ``message`` is one line."""

    level: str
    message: str


def _validity(cert: x509.Certificate, what: str, now: dt.datetime, warn_days: int) -> Finding:
    start, end = cert.not_valid_before_utc, cert.not_valid_after_utc
    if now < start:
        return Finding(PROBLEM, f"{what} is not valid before {start:%Y-%m-%d %H:%M} UTC")
    if now > end:
        return Finding(
            PROBLEM, f"{what} EXPIRED on {end:%Y-%m-%d} (re-issue it, docs/operations.md §12)"
        )
    days = (end - now).days
    level = WARNING if days < warn_days else OK
    return Finding(level, f"{what} valid until {end:%Y-%m-%d} ({days} days left)")


def describe_names(cert: x509.Certificate) -> str:
    """Subject CN and subjectAltName entries, e.g. ``CN=site-1, afl-site:site-1``."""
    names = [f"CN={a.value!s}" for a in cert.subject]
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        names += [str(getattr(g, "value", g)) for g in san]
    except x509.ExtensionNotFound:
        pass
    return ", ".join(names)


def check_tls_kit(
    *, ca_cert: Path, cert: Path, key: Path, now: dt.datetime | None = None, warn_days: int = 30
) -> list[Finding]:
    """Findings for one kit's CA certificate, certificate and key (module docstring)."""
    when = now or dt.datetime.now(dt.UTC)
    out: list[Finding] = []
    try:
        ca = load_certificate_pem(ca_cert.read_bytes())
        leaf = load_certificate_pem(cert.read_bytes())
    except (OSError, PkiError) as exc:
        return [Finding(PROBLEM, f"cannot read the certificates {ca_cert}, {cert}: {exc}")]
    out.append(_validity(ca, f"CA certificate {ca_cert}", when, warn_days))
    try:
        leaf.verify_directly_issued_by(ca)
        out.append(Finding(OK, f"{cert} ({describe_names(leaf)}) is issued by {ca_cert}"))
    except (ValueError, TypeError, InvalidSignature):
        out.append(
            Finding(
                PROBLEM,
                f"{cert} was NOT issued by the CA in {ca_cert} (a certificate from another "
                "federation's kit?); every file must come from the same `afl provision`",
            )
        )
    out.append(_validity(leaf, f"certificate {cert}", when, warn_days))
    try:
        private = load_tls_private_key_pem(key.read_bytes())
    except (OSError, PkiError) as exc:
        out.append(Finding(PROBLEM, f"cannot load the TLS key {key}: {exc}"))
        return out
    spki = serialization.PublicFormat.SubjectPublicKeyInfo
    mine = private.public_key().public_bytes(serialization.Encoding.DER, spki)
    theirs = leaf.public_key().public_bytes(serialization.Encoding.DER, spki)
    if mine == theirs:
        out.append(Finding(OK, f"TLS key {key} belongs to {cert}"))
        if key.stat().st_mode & 0o077:
            out.append(Finding(WARNING, f"{key} is readable by other users (chmod 600 {key})"))
    else:
        out.append(Finding(PROBLEM, f"TLS key {key} does NOT belong to {cert} (key mismatch)"))
    return out


def report_lines(findings: list[Finding]) -> list[str]:
    """One aligned line per finding (``ok      ...``, ``WARNING ...``, ``PROBLEM ...``)."""
    tag = {OK: "ok     ", WARNING: "WARNING", PROBLEM: "PROBLEM"}
    return [f"  {tag[f.level]} {f.message}" for f in findings]
