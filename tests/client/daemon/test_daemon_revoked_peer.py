"""A site refuses a revoked peer (docs/protocol.md M-178, docs/operations.md §12): `afl ca revoke`
writes the CA-signed revocation list into every site's bundle, its entry naming the site and its
identity key; the site daemon, unmodified, refuses a plan that makes that key its peer, in one
line naming the peer and the revocation, while plans without it go on. A list the CA did not
sign refuses every plan (fail closed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from afl.client.daemon.loop import ClientDaemon
from afl.crypto.identity import pki
from afl.crypto.identity.revocation import issue_crl
from afl.lab.cli import main as afl_main
from afl.ops.provisioning import ProvisionedFederation
from afl.proto.v1 import common_pb2 as cpb
from afl.server.plan.release import PlannedRelease
from tests.client.daemon.test_daemon_round_binding import (
    CLASSES,
    SITES,
    Coordinator,
    D,
    site,
)
from tests.helpers.federation import FederationSpec

__all__ = ["site"]  # the fixture, shared with the round-binding tests

FEDERATION = FederationSpec(
    sites=list(SITES),
    federation_id="fed-round-binding",
    round_settings={"classes": list(CLASSES), "feature_dim": D},
)


def _releases() -> list[PlannedRelease]:
    gram = PlannedRelease("gram[all]", SITES, cpb.STATISTIC_KIND_GRAM, (), (D, D))
    return [gram] + [
        PlannedRelease(f"b[{c}]", SITES, cpb.STATISTIC_KIND_CLASS_VECTOR, (c,), (D, 1))
        for c in CLASSES
    ]


def test_a_plan_with_a_revoked_peer_is_refused_naming_the_peer_and_the_revocation(
    site: tuple[ClientDaemon, Coordinator, Path],
    federation: ProvisionedFederation,
    capsys: pytest.CaptureFixture[str],
) -> None:
    daemon, coordinator, _ = site
    assert daemon.config.tls.crl == federation.site_dirs["s4"] / "crl.pem"  # in the kit
    cfg = coordinator.round_config("r1-aaaa", _releases())
    decision, _, _ = daemon._decide(cfg, round_id="r1-aaaa")
    assert decision.accept, decision.reason  # nobody revoked yet
    root = str(federation.root)
    assert afl_main(["ca", "revoke", "s2", "--ca", root, "--out", root]) == 0
    capsys.readouterr()
    serial = pki.load_certificate_pem(
        (federation.site_dirs["s2"] / "site.pem").read_bytes()
    ).serial_number
    decision, _, _ = daemon._decide(cfg, round_id="r1-aaaa")  # the file changed: read again
    assert not decision.accept
    assert decision.reason.startswith("peer 's2' is revoked by the federation CA")
    assert f"serial {serial:x}" in decision.reason and "\n" not in decision.reason
    assert daemon.config.peers["s2"].hex()[:16] in decision.reason
    kit_crl = federation.site_dirs["s4"] / "crl.pem"
    impostor = pki.create_ca(common_name="afl federation CA")
    kit_crl.write_bytes(issue_crl(impostor, revoked={}))  # not the federation CA's: fail closed
    decision, _, _ = daemon._decide(cfg, round_id="r1-aaaa")
    assert not decision.accept and "peer revocation status unknown" in decision.reason
