"""A coordinator that runs one masked round under two signed plans (docs/protocol.md §4.2,
M-223): the operator, who imported into site-1's kit a roster giving site-3's place to a key of
its own, shows site-1 a plan binding that roster and the other sites the true one. The two plans
agree on every field the masking protocol read before (round id, salt, cohort, thresholds,
releases), so without the plan's digest in the signed advert fields each side would accept the
other's adverts and share its secrets under keys the operator chose. The sites run the real mask
mode (:class:`afl.client.modes.mask.MaskMode`, its own plan and plan digest, identity keys from
its own kit); the coordinator is a script that relays every advert into every directory. The
honest site refuses site-1's advert and the victim refuses the honest sites' adverts, and neither
sends a single share.

Lower-level than tests/adversarial/test_malicious_coordinator.py (no daemons): the refusal is the
site's mask mode, which the daemon calls unchanged, and a loopback federation per run would take
minutes under load."""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import pytest

from afl.client.daemon.transport import DaemonError
from afl.client.modes.base import RoundSession
from afl.client.modes.mask import MaskMode
from afl.client.payloads.stats import SlotPayload
from afl.crypto.identity.signatures import generate_identity_key, public_key_to_raw
from afl.crypto.secagg.messages import AdvertiseKeys, KeyDirectory
from afl.crypto.transparency.statements import roster_digest
from afl.proto import wire
from afl.proto.v1 import common_pb2 as cpb
from afl.proto.v1 import coordinator_pb2 as pb
from afl.server.config import MaskSettings
from afl.server.modes.mask import MaskMode as CoordinatorMask
from afl.server.plan.release import build_plan, round1_releases

SITES = ("site-1", "site-2", "site-3")
VICTIM, HONEST, SWAPPED = SITES
FEDERATION = "fed-split-plan"
KEYS = {s: generate_identity_key() for s in SITES}
TRUE_ROSTER = {s: public_key_to_raw(k.public_key()) for s, k in KEYS.items()}
OPERATOR = generate_identity_key()  # the key the operator put in site-1's kit for site-3
VICTIM_ROSTER = {**TRUE_ROSTER, SWAPPED: public_key_to_raw(OPERATOR.public_key())}


def _plans() -> tuple[cpb.ReleasePlan, cpb.ReleasePlan]:
    """The true plan and the victim's: one round, one salt, the same releases; only the roster
    digest differs."""
    mode = CoordinatorMask(
        MaskSettings(gram_bound=1.0e3, vector_bound=10.0), identities=TRUE_ROSTER
    )
    releases = round1_releases(
        classes=("A", "B"), participants=SITES, coverage={}, gram_scope="global", d=3,
        need_global_gram=False,
    )  # fmt: skip
    true = build_plan(
        federation_id=FEDERATION, round_id="r1-split", round_number=1, participants=SITES,
        gram_scope="global", releases=releases, options=mode.plan_options(SITES),
    )  # fmt: skip
    true.roster_sha256 = roster_digest(federation=FEDERATION, keys=TRUE_ROSTER)
    forged = cpb.ReleasePlan()
    forged.CopyFrom(true)
    forged.roster_sha256 = roster_digest(federation=FEDERATION, keys=VICTIM_ROSTER)
    return true, forged


@dataclass
class _Relay:
    """The coordinator's RPCs as one site sees them: every advert it holds, the site's own
    included once sent, goes into the directory; what the site sends is recorded."""

    site: str
    adverts: list[AdvertiseKeys]
    sent: list[str] = field(default_factory=list)

    def await_stage(
        self, round_id: str, *, at_least: int, stage_only: bool = False
    ) -> pb.RoundStatus:
        return pb.RoundStatus(round_id=round_id, stage=at_least)  # type: ignore[arg-type]

    def call(self, method: str, request: Any, **kw: Any) -> Any:
        if method == "GetAdvertisedKeys":
            return wire.directory_to_proto(KeyDirectory(request.round_id, tuple(self.adverts)))
        if method == "AdvertiseKeys":
            self.adverts.append(wire.advert_from_proto(self.site, request))
        self.sent.append(method)
        return cpb.Ack()


def _session(site: str, plan: cpb.ReleasePlan, kit: dict[str, bytes], rpc: Any) -> RoundSession:
    return RoundSession(
        rpc=cast(Any, rpc), round_id=plan.round_id, site_id=site, plan=plan,
        identity_key=KEYS[site], peer_keys=kit,
        plan_sha256=hashlib.sha256(plan.SerializeToString()).digest(),
    )  # fmt: skip


def _payloads(plan: cpb.ReleasePlan, site: str) -> list[SlotPayload]:
    out = []
    for r in plan.releases:
        if site in r.member_site_ids:
            data = np.zeros(wire.release_length(r), dtype="<f8").tobytes()
            out.append(SlotPayload(r.name, (r.name,), data, hashlib.sha256(data).hexdigest()))
    return out


def _advert(
    site: str, plan: cpb.ReleasePlan, kit: dict[str, bytes], key: Any = None
) -> AdvertiseKeys:
    """``site``'s AdvertiseKeys under ``plan`` (signed with ``key``: the site's own by default)."""
    session = _session(site, plan, kit, _Relay(site, []))
    if key is not None:
        session = dataclasses.replace(session, identity_key=key)
    return MaskMode.secagg_client(session, _payloads(plan, site)).advertise_keys()


def test_the_two_plans_agree_on_everything_but_the_plan_digest() -> None:
    true, forged = _plans()
    assert true.SerializeToString() != forged.SerializeToString()
    bare = [wire.round_config_from_plan(p, plan_sha256=b"") for p in (true, forged)]
    assert bare[0].digest() == bare[1].digest()  # what adverts bound before M-223
    bound = [
        wire.round_config_from_plan(p, plan_sha256=hashlib.sha256(p.SerializeToString()).digest())
        for p in (true, forged)
    ]
    assert bound[0].digest() != bound[1].digest()


@pytest.mark.parametrize("site", [HONEST, VICTIM])
def test_a_site_refuses_adverts_made_under_the_other_plan(site: str) -> None:
    true, forged = _plans()
    adverts = [
        _advert(VICTIM, forged, VICTIM_ROSTER),
        _advert(HONEST, true, TRUE_ROSTER),
        # site-3 as each side knows it: the real site under the true plan for site-2, the
        # operator's key under the victim's plan for site-1.
        _advert(SWAPPED, true, TRUE_ROSTER)
        if site == HONEST
        else _advert(SWAPPED, forged, VICTIM_ROSTER, key=OPERATOR),
    ]
    plan, kit = (true, TRUE_ROSTER) if site == HONEST else (forged, VICTIM_ROSTER)
    relay = _Relay(site, [a for a in adverts if a.site_id != site])
    other = VICTIM if site == HONEST else HONEST
    with pytest.raises(DaemonError, match=f"masked exchange refused: advert of '{other}' does not"):
        MaskMode().exchange(_session(site, plan, kit, relay), _payloads(plan, site))
    assert relay.sent == ["AdvertiseKeys"]  # no ShareKeys: not one share of its secrets left
