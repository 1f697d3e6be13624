"""A site's check of a signed release plan against its local policy (docs/protocol.md §6).

Before anything is uploaded the site reads the exact list of aggregates the server will learn
and refuses when

* it is not a participant, or the plan's aggregation mode is one this client cannot run, or one
  its policy does not allow (``allowed_aggregation``: a downgrade to ``plaintext`` is refused
  unless the site opted in), or a ``ckks`` plan while no decryptor is pinned (``ckks_decryptor``);
* (``mask``) the plan's round threshold t is below a majority of the participants, or a release
  the site is a member of would be unmasked with fewer surviving members than the site accepts:
  ``min_cohort``, or, when DP covers the site, the m − t members its noise was sized for
  (:func:`survivor_floors`; the same floors are enforced again when shares are revealed,
  :class:`afl.crypto.secagg.client.SecAggClient`);
* (``mask``, sparse graph) the graph's failure probability, recomputed by the site for the plan's
  k, t_N and drop-outs D and for max(the plan's colluders, ⌈``mask_assumed_colluders``·n⌉)
  colluders, exceeds 2^-``mask_graph_security_bits``, or the plan misstates it, or its round
  threshold is not n - D (:func:`mask_graph_problem`; docs/protocol.md §4.2 "Sparse graph");
* a release it is a member of has fewer than ``min_cohort`` members;
* (unless ``allow_exposure``) the plan, together with every release the site already took part
  in (``history``: statistics of the same data combine across rounds), lets the server determine
  the site's own contribution by differencing, or the sum of a group smaller than
  ``min_cohort`` that contains the site: the row-space test of :func:`afl.core.leakage.audit_releases`
  (e_k ∈ rowspace(A), docs/protocol.md §6); for an evaluation plan, also when they determine
  ANY site's (or small group's) evaluation statistics (:func:`_exposed_metrics`);
* the plan's DP cost for the site, over its run, exceeds ``max_epsilon``, or over its lifetime
  ledger ``lifetime_epsilon`` (no DP counts as ε = ∞), or the plan's DP cannot be honoured
  (:func:`afl.client.policy.dp.assess_plan`: the site's own accounting from the share it adds,
  under the adversary that sees its upload, never below the server's stated budget).

DP covers small cohorts and exposure (docs/protocol.md §7): when the plan has DP and the site's ε is within
a finite ``max_epsilon``, the min-cohort and differencing rules are waived (every release is noised and
the site's patients are (ε, δ)-DP whatever the server combines); the audit is still reported.

Each class column of a class-vector release is its own quantity (``b[c]``, ``b_pseudo[c]``);
Gram releases share the quantity ``gram``. An evaluation release (score histograms, confusion
counts) sums two quantities per class, ``eval[c]@<model>`` and ``labels[c]``
(:func:`afl.core.evaluation.federated.evaluation_quantities`).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from afl.client.config import LocalPolicy
from afl.client.policy.dp import DpContext, assess_plan
from afl.core import leakage
from afl.core.evaluation.federated import evaluation_quantities
from afl.crypto.errors import CryptoError
from afl.crypto.secagg.config import default_threshold
from afl.crypto.secagg.graph_bounds import colluders_for, failure_probability, log2_probability
from afl.proto import wire
from afl.proto.v1 import common_pb2 as cpb
from afl.proto.wire import DP_STATISTIC_NAMES, EVALUATION_KINDS

__all__ = [
    "PolicyDecision",
    "audit_view",
    "check_plan",
    "mask_graph_problem",
    "mask_threshold_problem",
    "release_quantities",
    "survivor_floors",
    "survivor_problem",
]

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
    #: MASK: the fewest surviving members per release of this site (:func:`survivor_floors`).
    survivor_floors: dict[str, int] = field(default_factory=dict)


_CLASS_VECTORS = {
    cpb.STATISTIC_KIND_CLASS_VECTOR: "b",
    cpb.STATISTIC_KIND_PSEUDO_CLASS_VECTOR: "b_pseudo",
}


def release_quantities(release: cpb.Release) -> list[str]:
    """The linear quantities a release sums (one per class column for class vectors)."""
    kind = release.kind
    if kind == cpb.STATISTIC_KIND_GRAM:
        return ["gram"]
    if kind in EVALUATION_KINDS:  # per class: this model's statistics, and the label counts
        model = release.evaluation.model_sha256.hex()
        return evaluation_quantities(list(release.class_names), model_sha256=model)
    prefix = _CLASS_VECTORS.get(kind) or DP_STATISTIC_NAMES.get(kind)
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


def survivor_floors(
    plan: cpb.ReleasePlan, *, site_id: str, policy: LocalPolicy, covered: bool
) -> dict[str, int]:
    """Per release ``site_id`` is a member of: the fewest surviving members with which it lets
    the release be unmasked: ``min_cohort``, or, when DP covers the site (``covered``), the
    m − t members the release's noise is sized for (docs/protocol.md §7)."""
    floors = {}
    for r in plan.releases:
        if site_id in r.member_site_ids:
            m = len(r.member_site_ids)
            dp_floor = max(1, m - int(r.noise.assumed_colluders))
            floors[r.name] = dp_floor if covered else policy.min_cohort
    return floors


def mask_threshold_problem(plan: cpb.ReleasePlan, *, floors: dict[str, int]) -> str:
    """Why a MASK plan's thresholds are unacceptable ("" when they are fine): the round
    threshold t must be a majority of the participants (no split view of the survivors), and
    each release's t_R at least its floor (``floors``, :func:`survivor_floors`)."""
    try:
        config = wire.round_config_from_plan(plan, plan_sha256=b"")  # its parameters only
    except CryptoError as exc:
        return f"the MASK plan is not valid: {exc}"
    n = len(config.cohort)
    if config.t < default_threshold(n):
        return f"the plan's threshold t={config.t} is below a majority of the {n} participants"
    for release in config.releases:
        floor = floors.get(release.name, 0)
        if release.min_survivors < floor:
            return (
                f"release {release.name} would be unmasked with {release.min_survivors} surviving "
                f"member(s), fewer than this site accepts ({floor}: min cohort, or the DP noise's "
                "members)"
            )
    return ""


def mask_graph_problem(plan: cpb.ReleasePlan, *, policy: LocalPolicy) -> str:
    """Why a MASK plan's sparse graph is unacceptable to this site ("" when it is fine or the
    plan uses the full graph): the site recomputes the failure probability itself
    (:func:`afl.crypto.secagg.graph_bounds.failure_probability`) with its own colluder bound."""
    graph = plan.mask_graph
    if not graph.degree:
        return ""
    n, k, t_n, d = len(plan.participants), graph.degree, graph.share_threshold, graph.dropouts
    if plan.mask_threshold != n - d:
        return f"the plan's threshold t={plan.mask_threshold} is not n - D = {n - d}"
    colluders = max(graph.colluders, colluders_for(n, policy.mask_assumed_colluders))
    if colluders + 2 * d >= n:
        return (
            f"a sparse graph cannot hold {colluders} colluders with {d} drop-outs among {n} "
            "participants (it needs C + 2D < n)"
        )
    try:
        stated = failure_probability(
            n=n, degree=k, share_threshold=t_n, colluders=graph.colluders, dropouts=d
        )
        mine = failure_probability(
            n=n, degree=k, share_threshold=t_n, colluders=colluders, dropouts=d
        )
    except ValueError as exc:
        return f"the plan's sparse graph is not valid: {exc}"
    if graph.failure_log2 < log2_probability(stated):
        return (
            f"the plan states a graph failure probability of 2^{graph.failure_log2:.1f}, but "
            f"k={k}, t_N={t_n} give 2^{log2_probability(stated):.1f}"
        )
    if mine > Fraction(1, 2**policy.mask_graph_security_bits):
        return (
            f"the sparse masking graph (k={k}, t_N={t_n}, {n} participants) fails with "
            f"probability 2^{log2_probability(mine):.1f} for {colluders} colluders and {d} "
            f"drop-outs, above this site's limit 2^-{policy.mask_graph_security_bits} "
            "([policy] mask_graph_security_bits, mask_assumed_colluders)"
        )
    return ""


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
    peer_history: Sequence[leakage.Release] | None = None,
    planned_history: Sequence[leakage.Release] | None = None,
) -> PolicyDecision:
    """Accept or refuse ``plan`` for ``site_id`` under ``policy`` (rules in the module docstring).

    ``history`` holds releases of earlier rounds the site took part in (their names must not
    collide with this plan's; :func:`audit_view` with a round ``tag`` does that); ``dp_context``
    what the DP check needs besides the plan (patient ids, ledger, the run's earlier rounds);
    ``peer_history`` (default: ``history``) the releases of the rounds whose sums may have been
    released (the site uploaded to them): what an evaluation plan's exposure of OTHER sites is
    audited with (:func:`_exposed_metrics`; a plan accepted, then aborted before anyone uploaded,
    released nothing, and its re-plan without the site that refused exposes no one);
    ``planned_history`` the releases of ``history`` over their planned members where ``history``
    has them over the survivors they were unmasked over: a plan that, with the survivors, exposes
    a site the planned members did not (a drop-out recorded in an earlier round) is refused
    before any key is exchanged (:func:`survivor_problem` with every participant surviving).
    """
    participants = list(plan.participants)
    if site_id not in participants:
        return _refuse(f"site {site_id} is not a participant of round {plan.round_id}")
    mode = _MODE_NAMES.get(plan.aggregation, str(plan.aggregation))
    if plan.aggregation not in supported_modes:
        return _refuse(f"aggregation mode {mode!r} is not supported by this client")
    if mode not in policy.allowed_aggregation:
        return _refuse(
            f"aggregation mode {mode!r} is not allowed by this site's policy "
            f"(allowed_aggregation = {list(policy.allowed_aggregation)})"
        )
    if plan.aggregation == cpb.AGGREGATION_MODE_CKKS and policy.ckks_decryptor is None:
        return _refuse("a CKKS plan, but no decryptor is pinned in [policy] ckks_decryptor")
    releases = list(plan.releases)
    names = [r.name for r in releases]
    if len(set(names)) != len(names):
        return _refuse("the plan names a release twice")
    dp = assess_plan(plan, site_id=site_id, policy=policy, context=dp_context or DpContext())
    # DP covers small cohorts and exposure by differencing when every release the site is in
    # is noised and the site's ε is within its budgets (docs/protocol.md §6, §7); an unbounded
    # max_epsilon bounds no noise, so it covers nothing (any σ the coordinator picks would do).
    covered = plan.dp.enabled and not dp.refusal and math.isfinite(policy.max_epsilon)
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
    floors = survivor_floors(plan, site_id=site_id, policy=policy, covered=covered)
    if plan.aggregation == cpb.AGGREGATION_MODE_MASK:
        problem = mask_threshold_problem(plan, floors=floors) or mask_graph_problem(
            plan, policy=policy
        )
        if problem:
            return _refuse(problem)
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
        return PolicyDecision(True, "", audit, floors)
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
    if planned_history is not None:
        problem = survivor_problem(
            plan,
            site_id=site_id,
            policy=policy,
            survivors=participants,
            history=history,
            planned_history=planned_history,
            at_plan=True,
        )
        if problem:
            return PolicyDecision(False, problem, audit, floors)
    problem = _exposed_metrics(
        releases,
        current,
        history=history if peer_history is None else peer_history,
        universe=participants,
        min_cohort=policy.min_cohort,
    )
    return PolicyDecision(not problem, problem, audit, floors)


def survivor_problem(
    plan: cpb.ReleasePlan,
    *,
    site_id: str,
    policy: LocalPolicy,
    survivors: Collection[str],
    history: Sequence[leakage.Release],
    planned_history: Sequence[leakage.Release],
    covered: bool = False,
    at_plan: bool = False,
) -> str:
    """Why this site must not help unmask ``plan``'s releases over ``survivors`` ("" when it
    may; docs/protocol.md §6, M-205): checked once the site learns the survivor set (MASK:
    the survivor list it is asked to sign), before it signs it or sends any unmask share.

    Each release is summed over its members among ``survivors``; earlier releases over the
    survivors they were unmasked over (``history``; ``planned_history``: the same releases over
    their planned members). Refused when, with the actual sums, a site's (or a group smaller
    than ``min_cohort``'s) contribution is determined by differencing that the planned sums did
    not determine: e.g. two releases over the same members, one of which a member dropped out
    of after ShareKeys, difference to that member. Also refused when this site itself is
    exposed. DP that covers the site (``covered``) or ``allow_exposure`` waive it, as at plan
    time. ``at_plan``: the plan decision's check (every participant surviving), worded so."""
    if policy.allow_exposure or covered:
        return ""
    alive = set(survivors)
    planned = audit_view(list(plan.releases))
    actual = [
        leakage.Release(r.name, frozenset(m for m in r.members if m in alive), r.quantity)
        for r in planned
    ]
    everyone = {*plan.participants, *(s for r in (*history, *planned_history) for s in r.members)}
    universe = sorted(everyone, key=str)

    def found(releases: Sequence[leakage.Release]) -> list[leakage.Exposure]:
        kept = [r for r in releases if r.members]
        report = leakage.audit_releases(kept, universe, min_cohort=policy.min_cohort)
        return [*report.exposed_sites, *report.small_groups]

    planned_all, actual_all = [*planned_history, *planned], [*history, *actual]
    exposures = found(planned_all)
    before = {(e.sites, e.quantity) for e in exposures}
    if actual_all != planned_all:  # nobody dropped out, now or before: one audit tells both
        exposures = found(actual_all)
    for exposure in exposures:
        if (exposure.sites, exposure.quantity) in before and site_id not in exposure.sites:
            continue
        who = ",".join(sorted(str(s) for s in exposure.sites))
        dropped = sorted(set(plan.participants) - alive)
        cert = " ".join(f"{'+' if c > 0 else '-'}{abs(c)}*{n}" for n, c in exposure.certificate)
        what = f"the {exposure.quantity} of {{{who}}} by differencing ({cert})"
        if at_plan:
            return (
                f"with the survivors earlier releases were unmasked over, the plan determines "
                f"{what}; policy allow_exposure = false"
            )
        return (
            f"unmasked over the survivors {{{','.join(sorted(alive))}}} (dropped: "
            f"{','.join(dropped) or 'none'}), the releases determine {what}: this site sends "
            "no unmask share; policy allow_exposure = false"
        )
    return ""


def _exposed_metrics(
    releases: Sequence[cpb.Release],
    current: Sequence[leakage.Release],
    *,
    history: Sequence[leakage.Release],
    universe: Sequence[str],
    min_cohort: int,
) -> str:
    """Why an evaluation plan is refused although this site is not exposed: with the releases
    of ``history``, it determines ANOTHER site's (or a small group's) evaluation statistics
    (docs/protocol.md §6.1, M-99). A site left out of a plan never sees it, so the sites of the
    plan refuse on its behalf (an evaluation over everyone, then over everyone but the victim)."""
    quantities = {q for r in releases if r.kind in EVALUATION_KINDS for q in release_quantities(r)}
    if not quantities:
        return ""
    sites = sorted({*universe, *(s for r in history for s in r.members)}, key=str)
    report = leakage.audit_releases([*history, *current], sites, min_cohort=min_cohort)
    for found in (*report.exposed_sites, *report.small_groups):
        if found.quantity in quantities:
            members = ",".join(sorted(str(s) for s in found.sites))
            return (
                f"with the evaluations this site took part in, the plan determines the "
                f"{found.quantity} sum of {{{members}}} by differencing: a site's metrics must "
                "not be recoverable (docs/protocol.md §6.1); policy allow_exposure = false"
            )
    return ""
