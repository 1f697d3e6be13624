"""afl.crypto.identity.revocation (M-173): a CRL is trusted only when the federation CA signed it;
its entries are the serial numbers revoked; the coordinator's RevocationList names a listed
certificate and refuses everything while its file is missing or forged."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from afl.crypto.identity import pki
from afl.crypto.identity.revocation import RevocationList, issue_crl, load_crl, revoked_serials


@pytest.fixture(scope="module")
def ca() -> pki.CertifiedKey:
    return pki.create_ca(common_name="afl federation CA test")


def test_entries_round_trip_and_only_the_cas_signature_is_trusted(ca: pki.CertifiedKey) -> None:
    when = dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.UTC)
    pem = issue_crl(ca, revoked={7: when, 12345678901234567890: when})
    crl = load_crl(pem, ca_certificate=ca.certificate)
    assert revoked_serials(crl) == {7: when, 12345678901234567890: when}
    impostor = pki.create_ca(common_name="afl federation CA test")  # same name, another key
    with pytest.raises(pki.PkiError, match="signature"):
        load_crl(issue_crl(impostor, revoked={}), ca_certificate=ca.certificate)
    other = pki.create_ca(common_name="another CA")
    with pytest.raises(pki.PkiError, match="not issued"):
        load_crl(issue_crl(other, revoked={}), ca_certificate=ca.certificate)
    der = bytearray(x509.load_pem_x509_crl(pem).public_bytes(serialization.Encoding.DER))
    der[-3] ^= 0x01  # a bit of the signature
    forged = x509.load_der_x509_crl(bytes(der)).public_bytes(serialization.Encoding.PEM)
    with pytest.raises(pki.PkiError):
        load_crl(forged, ca_certificate=ca.certificate)
    with pytest.raises(pki.PkiError, match="not a PEM"):
        load_crl(b"garbage", ca_certificate=ca.certificate)


def test_the_list_names_a_revoked_certificate_and_fails_closed(
    ca: pki.CertifiedKey, tmp_path: Path
) -> None:
    site = pki.certificate_to_pem(pki.issue_site_certificate(ca, site_id="h1").certificate)
    other = pki.certificate_to_pem(pki.issue_site_certificate(ca, site_id="h2").certificate)
    path = tmp_path / "crl.pem"
    checker = RevocationList(path, ca_certificate_pem=ca.certificate_pem())
    assert "cannot be read" in str(checker.refusal(other))  # no list yet: nobody passes
    path.write_bytes(issue_crl(ca, revoked={}))
    assert checker.refusal(site) is None and checker.refusal(other) is None
    serial = pki.load_certificate_pem(site).serial_number
    path.write_bytes(issue_crl(ca, revoked={serial: dt.datetime.now(dt.UTC)}))
    assert f"serial {serial:x}" in str(checker.refusal(site))  # read again: no restart
    assert checker.refusal(other) is None
