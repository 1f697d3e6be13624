"""The roster a plan binds (docs/protocol.md §11a, M-221): the coordinator logs its roster (every
site's identity key) and puts its digest into every signed plan; a site acts on a plan only
when that digest is the one of its own kit's roster, ``[peers]`` and itself
(:func:`afl.crypto.transparency.statements.roster_digest`). A site whose imported roster gives a
peer's place to another key (the operator's) is then refused every plan of the real federation,
instead of masking with, sharing to, or tagging for that key."""

from __future__ import annotations

from collections.abc import Mapping

from afl.client.config import ClientConfig
from afl.crypto.identity.revocation import PeerRevocations
from afl.crypto.transparency.statements import roster_digest
from afl.proto.v1 import common_pb2 as cpb

__all__ = [
    "kit_revocations",
    "kit_roster",
    "revoked_participant",
    "roster_mismatch",
    "roster_problem",
]


def kit_roster(config: ClientConfig) -> dict[str, bytes]:
    """Every site's identity key in the site's kit: ``[peers]`` and the site itself."""
    return {**config.peers, config.site_id: config.identity_public_key}


def roster_problem(plan: cpb.ReleasePlan, *, config: ClientConfig) -> str:
    """Why the site refuses ``plan``'s roster ("" when its digest is the kit's)."""
    return roster_mismatch(plan, federation_id=config.federation_id, roster=kit_roster(config))


def roster_mismatch(
    plan: cpb.ReleasePlan, *, federation_id: str, roster: Mapping[str, bytes]
) -> str:
    """Why ``plan``'s roster digest is not the one of ``roster`` (site id -> identity key: the
    kit's, :func:`kit_roster`) in ``federation_id`` ("" when it is)."""
    mine = roster_digest(federation=federation_id, keys=roster)
    theirs = bytes(plan.roster_sha256)
    if not theirs:
        return (
            f"the plan of round {plan.round_id} binds no roster digest: a coordinator of this "
            "version puts its logged roster's digest in every plan"
        )
    if theirs != mine:
        return (
            f"the plan of round {plan.round_id} binds roster {theirs.hex()[:16]}…, this site's "
            f"[peers] roster is {mine.hex()[:16]}…: the coordinator's roster and this site's "
            "kit differ (compare the roster fingerprint with the operator, out of band)"
        )
    return ""


def kit_revocations(config: ClientConfig) -> PeerRevocations | None:
    """The federation CA's revocation list of the kit (``[tls] crl``), None without one."""
    if config.tls.crl is None:
        return None
    return PeerRevocations(config.tls.crl, ca_certificate_pem=config.tls.ca_cert.read_bytes())


def revoked_participant(
    plan: cpb.ReleasePlan,
    *,
    revocations: PeerRevocations | None,
    peers: Mapping[str, bytes],
    site_id: str,
) -> str:
    """Why ``plan``'s participants are refused by the federation's revocation list (M-178): a
    participant whose identity key in the kit's ``[peers]`` the CA revoked, or a list that cannot
    be read or verified; "" otherwise (or without ``[tls] crl``: ``revocations`` None)."""
    if revocations is None:
        return ""
    members = {s: peers[s] for s in plan.participants if s != site_id and s in peers}
    return revocations.refusal(members) or ""
