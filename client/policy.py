"""A site's check of a signed release plan against its local policy (docs/protocol.md §6).

Before anything is uploaded the site reads the exact list of aggregates the server will learn
and refuses when

* it is not a participant, or the plan's aggregation mode is one this client cannot run;
* a release it is a member of has fewer than ``min_cohort`` members;
* (unless ``allow_exposure``) the plan, together with every release the site already took part
  in (``history``: statistics of the same data combine across rounds), lets the server determine
  the site's own contribution by differencing, or the sum of a group smaller than
  ``min_cohort`` that contains the site: the row-space test of :func:`afl.core.leakage.audit_releases`
  (e_k ∈ rowspace(A), docs/protocol.md §6);
* the plan's DP cost for the site, over its run, exceeds ``max_epsilon``, or over its lifetime
  ledger ``lifetime_epsilon`` (no DP counts as ε = ∞), or the plan's DP cannot be honoured
  (:func:`afl.client.dp_policy.assess_plan`: the site's own accounting from the share it adds,
  under the adversary that sees its upload, never below the server's stated budget).

DP covers small cohorts and exposure (docs/protocol.md §7): when the plan has DP and the site's ε is within
``max_epsilon``, the min-cohort and differencing rules are waived (every release is noised and
the site's patients are (ε, δ)-DP whatever the server combines); the audit is still reported.

Each class column of a class-vector release is its own quantity (``b[c]``, ``b_pseudo[c]``);
Gram releases share the quantity ``gram``.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from afl.client.config import LocalPolicy
from afl.client.dp_policy import DpContext, assess_plan
from afl.core import leakage
from afl.proto.v1 import common_pb2 as cpb

__all__ = ["PolicyDecision", "audit_view", "check_plan", "release_quantities"]

_MODE_NAMES = {
    cpb.AGGREGATION_MODE_PLAINTEXT: "plaintext",
    cpb.AGGREGATION_MODE_MASK: "mask",
    cpb.AGGREGATION_MODE_CKKS: "ckks",
}


@dataclass(frozen=True)
class PolicyDecision:
    """``accept`` or a refusal ``reason`` (one line, no statistics) plus the audit summary."""

    accept: bool
    reason: str = ""
    audit: dict[str, Any] = field(default_factory=dict)


def release_quantities(release: cpb.Release) -> list[str]:
    """The linear quantities a release sums (one per class column for class vectors)."""
    kind = release.kind
    if kind == cpb.STATISTIC_KIND_GRAM:
        return ["gram"]
    prefix = {
        cpb.STATISTIC_KIND_CLASS_VECTOR: "b",
        cpb.STATISTIC_KIND_PSEUDO_CLASS_VECTOR: "b_pseudo",
        cpb.STATISTIC_KIND_POSITIVE_SUM: "s_pos",
        cpb.STATISTIC_KIND_FEATURE_SUM: "t_sum",
        cpb.STATISTIC_KIND_COUNT: "counts",
        cpb.STATISTIC_KIND_PSEUDO_POSITIVE_SUM: "pseudo_s_pos",
        cpb.STATISTIC_KIND_PSEUDO_FEATURE_SUM: "pseudo_t_sum",
        cpb.STATISTIC_KIND_PSEUDO_COUNT: "pseudo_counts",
    }.get(kind)
    if prefix is not None:
        return [f"{prefix}[{c}]" for c in release.class_names] or [prefix]
    return [cpb.StatisticKind.Name(kind).removeprefix("STATISTIC_KIND_").lower()]


def audit_view(releases: Sequence[cpb.Release], *, tag: str = "") -> list[leakage.Release]:
    """The plan's releases as :class:`afl.core.leakage.Release` rows, one per quantity."""
    out = []
    for r in releases:
        for q in release_quantities(r):
            name = f"{tag}{r.name}" + (f"#{q}" if q not in ("gram", r.name) else "")
            out.append(leakage.Release(name, frozenset(r.member_site_ids), q))
    return out


def _refuse(reason: str, audit: dict[str, Any] | None = None) -> PolicyDecision:
    return PolicyDecision(False, reason, audit or {})


def check_plan(
    plan: cpb.ReleasePlan,
    *,
    site_id: str,
    policy: LocalPolicy,
    supported_modes: Collection[int] = (cpb.AGGREGATION_MODE_PLAINTEXT,),
    history: Sequence[leakage.Release] = (),
    dp_context: DpContext | None = None,
) -> PolicyDecision:
    """Accept or refuse ``plan`` for ``site_id`` under ``policy`` (rules in the module docstring).

    ``history`` holds releases of earlier rounds the site took part in (their names must not
    collide with this plan's; :func:`audit_view` with a round ``tag`` does that); ``dp_context``
    what the DP check needs besides the plan (patient ids, ledger, the run's earlier rounds).
    """
    participants = list(plan.participants)
    if site_id not in participants:
        return _refuse(f"site {site_id} is not a participant of round {plan.round_id}")
    if plan.aggregation not in supported_modes:
        mode = _MODE_NAMES.get(plan.aggregation, str(plan.aggregation))
        return _refuse(f"aggregation mode {mode!r} is not supported by this client")
    releases = list(plan.releases)
    names = [r.name for r in releases]
    if len(set(names)) != len(names):
        return _refuse("the plan names a release twice")
    dp = assess_plan(plan, site_id=site_id, policy=policy, context=dp_context or DpContext())
    # DP covers small cohorts and exposure by differencing when every release the site is in
    # is noised and the site's ε is within its budgets (docs/protocol.md §6, §7).
    covered = plan.dp.enabled and not dp.refusal
    for r in releases:
        unknown = set(r.member_site_ids) - set(participants)
        if unknown:
            return _refuse(f"release {r.name} names non-participants {sorted(unknown)}")
        small = len(r.member_site_ids) < policy.min_cohort
        if site_id in r.member_site_ids and small and not covered:
            return _refuse(
                f"release {r.name} has {len(r.member_site_ids)} member(s) < min cohort "
                f"{policy.min_cohort}"
            )
    if dp.refusal:
        return _refuse(
            dp.refusal, {**dp.to_audit(), "covered_by_dp": False} if plan.dp.enabled else None
        )
    current = audit_view(releases)
    universe = sorted({*participants, *(s for r in history for s in r.members)}, key=str)
    try:
        report = leakage.audit_releases(
            [*history, *current], universe, min_cohort=policy.min_cohort
        )
    except leakage.ReleasePlanError as exc:
        return _refuse(f"malformed release plan: {exc}")
    audit = report.to_dict()
    if plan.dp.enabled:
        audit.update(dp.to_audit(), covered_by_dp=covered)
    if policy.allow_exposure or covered:
        return PolicyDecision(True, "", audit)
    for exposure in report.exposed_sites:
        if site_id in exposure.sites:
            cert = " ".join(f"{'+' if c > 0 else '-'}{abs(c)}*{n}" for n, c in exposure.certificate)
            return _refuse(
                f"the releases expose this site's {exposure.quantity} by differencing "
                f"({cert}); policy allow_exposure = false",
                audit,
            )
    for group in report.small_groups:
        if site_id in group.sites:
            members = ",".join(sorted(str(s) for s in group.sites))
            return _refuse(
                f"the releases determine the {group.quantity} sum of {{{members}}}, a group "
                f"smaller than min cohort {policy.min_cohort}; policy allow_exposure = false",
                audit,
            )
    return PolicyDecision(True, "", audit)
