"""The production provisioning path end to end (docs/protocol.md §1, M-70; docs/operations.md §2):
the CA, the coordinator and every site make their own keys in their own folders, the operator
signs the requests into public bundles, each site checks and imports its bundle against the
roster fingerprint; then afl-server and one afl-client per site complete a masked round over
loopback mutual TLS. No site's private key (PEM or raw) appears in any file outside that site's
kit folder, and the operator's folders hold no private key but the encrypted CA key."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from cryptography.hazmat.primitives.asymmetric import ec

from afl.crypto.identity import pki, signatures
from afl.lab.demo.federation import mask_round_settings, prepare_loopback, run_loopback
from tests.e2e.loopback import SiteData

D = 12
CLASSES = ("A", "B")
DATA = SiteData(d=D, classes=len(CLASSES), rows=90, rows_step=15, positive_rate=0.4, seed=5)


def _secrets_of(kit: Path) -> list[bytes]:
    """The kit's private keys as the bytes that would betray them: PEM and raw."""
    tls_pem, identity_pem = (kit / "site.key").read_bytes(), (kit / "identity.key").read_bytes()
    tls = pki.load_tls_private_key_pem(tls_pem)
    assert isinstance(tls, ec.EllipticCurvePrivateKey)
    identity = signatures.load_private_key_pem(identity_pem)
    return [
        tls_pem,
        identity_pem,
        tls.private_numbers().private_value.to_bytes(32, "big"),
        identity.private_bytes_raw(),
    ]


def test_production_provisioned_federation_completes_a_masked_round(tmp_path: Path) -> None:
    feats, labels = DATA.draw(3)
    loop = prepare_loopback(
        tmp_path,
        classes=CLASSES,
        site_features=feats,
        site_labels=labels,
        active=np.ones((3, len(CLASSES)), dtype=bool),
        test_features=feats[0][:20],
        test_labels=labels[0][:20],
        round_settings={"gram_scope": "global", **mask_round_settings(feats)},
        production=True,
    )
    run = run_loopback(loop, timeout_s=300)
    assert run.client_rcs == dict.fromkeys(loop.site_ids, 0), run.logs
    for site in loop.site_ids:
        report = run.final_report(site)
        assert report["outcome"] == "COMPLETED", report

    fed = loop.provisioned
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    for site, kit in fed.site_dirs.items():
        secrets = _secrets_of(kit)
        outside = [p for p in files if not p.is_relative_to(kit)]
        leaks = [p for p in outside if any(s in p.read_bytes() for s in secrets)]
        assert not leaks, f"{site}'s private key found in {leaks}"
    operator = fed.root / "operator"
    holding_keys = [
        p for p in operator.rglob("*") if p.is_file() and b"PRIVATE KEY" in p.read_bytes()
    ]
    assert holding_keys == [operator / "ca" / "ca.key"]
    assert b"ENCRYPTED PRIVATE KEY" in (operator / "ca" / "ca.key").read_bytes()
