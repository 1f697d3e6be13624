"""TLS kit checks (afl.crypto.identity.kit_check) behind `afl-client doctor` and `afl-server check`: each
problem of a kit is named in one line (foreign CA, expiry, key mismatch, key file mode)."""

from __future__ import annotations

import datetime as dt
import os
from pathlib import Path
from typing import NamedTuple

import pytest

from afl.crypto.identity import pki
from afl.crypto.identity.kit_check import OK, PROBLEM, WARNING, Finding, check_tls_kit, report_lines


class Kit(NamedTuple):
    ca_cert: Path
    cert: Path
    key: Path

    def check(self, now: dt.datetime | None = None) -> list[Finding]:
        return check_tls_kit(ca_cert=self.ca_cert, cert=self.cert, key=self.key, now=now)


def _write(folder: Path, ca: pki.CertifiedKey, leaf: pki.CertifiedKey) -> Kit:
    folder.mkdir(parents=True, exist_ok=True)
    kit = Kit(folder / "ca.pem", folder / "site.pem", folder / "site.key")
    pki.write_private_file(kit.ca_cert, ca.certificate_pem(), mode=0o644)
    pki.write_private_file(kit.cert, leaf.certificate_pem(), mode=0o644)
    pki.write_private_file(kit.key, leaf.private_key_pem())
    return kit


@pytest.fixture(scope="module")
def ca() -> pki.CertifiedKey:
    return pki.create_ca(common_name="kit CA")


def _levels(findings: list[Finding]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {OK: [], WARNING: [], PROBLEM: []}
    for f in findings:
        out[f.level].append(f.message)
    return out


def test_a_good_kit_has_no_problem(ca: pki.CertifiedKey, tmp_path: Path) -> None:
    paths = _write(tmp_path, ca, pki.issue_site_certificate(ca, site_id="site-a", valid_days=400))
    levels = _levels(paths.check())
    assert not levels[PROBLEM] and not levels[WARNING]
    assert any("is issued by" in m and "afl-site:site-a" in m for m in levels[OK])
    assert any("days left" in m for m in levels[OK])
    assert all(line.startswith("  ok") for line in report_lines(paths.check()))


def test_foreign_certificate_expiry_and_key_mismatch_are_named(
    ca: pki.CertifiedKey, tmp_path: Path
) -> None:
    other = pki.create_ca(common_name="kit CA")  # same name, another key: another federation
    foreign = _write(tmp_path / "f", ca, pki.issue_site_certificate(other, site_id="site-a"))
    assert any("NOT issued by the CA" in m for m in _levels(foreign.check())[PROBLEM])
    site = pki.issue_site_certificate(ca, site_id="site-a", valid_days=100)
    paths = _write(tmp_path / "s", ca, site)
    now = dt.datetime.now(dt.UTC)
    late = _levels(paths.check(now + dt.timedelta(days=101)))
    assert any("EXPIRED on" in m and "site.pem" in m for m in late[PROBLEM])
    soon = _levels(paths.check(now + dt.timedelta(days=90)))
    assert any("days left" in m for m in soon[WARNING]) and not soon[PROBLEM]
    stranger = pki.issue_site_certificate(ca, site_id="site-b")
    pki.write_private_file(paths.key, stranger.private_key_pem())
    assert any("does NOT belong" in m for m in _levels(paths.check())[PROBLEM])


def test_a_key_readable_by_others_is_a_warning(ca: pki.CertifiedKey, tmp_path: Path) -> None:
    paths = _write(tmp_path, ca, pki.issue_site_certificate(ca, site_id="site-a"))
    os.chmod(paths.key, 0o644)
    assert any("chmod 600" in m for m in _levels(paths.check())[WARNING])


def test_unreadable_files_are_one_problem(ca: pki.CertifiedKey, tmp_path: Path) -> None:
    paths = _write(tmp_path, ca, pki.issue_site_certificate(ca, site_id="site-a"))
    paths.cert.write_text("not a certificate")
    (finding,) = paths.check()
    assert finding.level == PROBLEM and "cannot read the certificates" in finding.message
