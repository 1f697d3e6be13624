"""The roster a plan binds (docs/protocol.md §11a, M-221): the coordinator logs its roster (every
site's identity key) and puts its digest into every signed plan; a site acts on a plan only
when that digest is the one of its own kit's roster, ``[peers]`` and itself
(:func:`afl.crypto.transparency.statements.roster_digest`). A site whose imported roster gives a
peer's place to another key (the operator's) is then refused every plan of the real federation,
instead of masking with, sharing to, or tagging for that key."""

from __future__ import annotations

from afl.client.config import ClientConfig
from afl.crypto.transparency.statements import roster_digest
from afl.proto.v1 import common_pb2 as cpb

__all__ = ["kit_roster", "roster_problem"]


def kit_roster(config: ClientConfig) -> dict[str, bytes]:
    """Every site's identity key in the site's kit: ``[peers]`` and the site itself."""
    return {**config.peers, config.site_id: config.identity_public_key}


def roster_problem(plan: cpb.ReleasePlan, *, config: ClientConfig) -> str:
    """Why the site refuses ``plan``'s roster ("" when its digest is the kit's)."""
    mine = roster_digest(federation=config.federation_id, keys=kit_roster(config))
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
