"""The DP part of a site's plan check (docs/protocol.md §6, §7): what the plan costs this site,
under the adversary that sees its upload, in its run and over its lifetime.

For a plan with DP the site

* checks the releases it is in are noised and encoded so the noise survives
  (:func:`afl.client.payloads.dp.plan_problems`), and that it can honour the unit (a patient-level
  plan needs the cache's patient ids; a site whose policy asks for ``privacy_unit = "patient"``
  refuses an image-level plan);
* computes μ of its own releases from the share it adds and the sensitivity implied by the
  plan's clip norm, unit bound m and label clipping k (:func:`afl.client.payloads.dp.site_mu`):
  in plaintext the coordinator sees its upload alone, so only its own share counts; in mask and
  ckks the honest shares that protect it are n_r - t'_r, t'_r = max(the plan's t_r, its own
  floor ⌈``dp_assumed_colluders``·n_r⌉) (the plan's t is the coordinator's word, default 0);
* composes it with the earlier rounds of the same run (round 1 for a round-2 plan) and refuses
  when that ε (at the plan's δ, or at ``lifetime_delta`` when that is smaller: δ is the
  coordinator's choice too), or the server's stated one if larger, exceeds ``max_epsilon``;
* composes it with everything in its lifetime ledger (:mod:`afl.client.policy.ledger`) and refuses
  when that ε at ``lifetime_delta`` exceeds ``lifetime_epsilon``.

A plan without DP costs ε = ∞: it passes only with ``max_epsilon = inf`` and
``lifetime_epsilon = inf`` (the defaults; docs/operations.md says how to set them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from afl.client.config import LocalPolicy
from afl.client.payloads.dp import guarantee, patient_level, plan_problems, site_mu
from afl.client.policy.ledger import LedgerSpend
from afl.core.dp.accounting import compose_mu, epsilon_from_mu, site_colluders
from afl.proto.v1 import common_pb2 as cpb

__all__ = ["DpAssessment", "DpContext", "assess_plan", "dp_report"]


@dataclass(frozen=True)
class DpContext:
    """What the site knows besides the plan: whether its cache has patient ids, its ledger's
    composition (without this round) and μ of the earlier rounds of this plan's run."""

    has_patient_ids: bool = False
    ledger: LedgerSpend | None = None
    run_mu: float = 0.0


@dataclass(frozen=True)
class DpAssessment:
    """The plan's cost for the site: μ and ε of this plan, of its run so far, of its lifetime
    after this plan; ``refusal`` is "" when the policy accepts it."""

    mu: float
    epsilon: float
    epsilon_run: float
    epsilon_lifetime: float
    refusal: str = ""

    def to_audit(self) -> dict[str, Any]:
        return {
            "epsilon": self.epsilon,
            "epsilon_run": self.epsilon_run,
            "epsilon_lifetime": self.epsilon_lifetime,
        }


def _eps(mu: float, delta: float) -> float:
    return math.inf if math.isinf(mu) else epsilon_from_mu(mu=mu, delta=delta)


def _unit_name(plan: cpb.ReleasePlan) -> str:
    return "patient" if patient_level(plan) else "image"


def _view(plan: cpb.ReleasePlan, site_id: str, fraction: float) -> str:
    """The adversary the site's ε is against, in words, for a refusal."""
    if plan.aggregation == cpb.AGGREGATION_MODE_PLAINTEXT:
        return " against the coordinator that sees its upload alone (plaintext)"
    mine = [r for r in plan.releases if site_id in r.member_site_ids]
    stated = max((int(r.noise.assumed_colluders) for r in mine), default=0)
    assumed = max(
        (
            site_colluders(
                members=len(r.member_site_ids),
                stated=min(int(r.noise.assumed_colluders), len(r.member_site_ids) - 1),
                fraction=fraction,
            )
            for r in mine
        ),
        default=0,
    )
    if assumed <= stated:
        return ""
    return (
        f" against the coordinator with {assumed} colluding member(s) (this site's floor, "
        f"[policy] dp_assumed_colluders {fraction:g}; the plan assumes {stated})"
    )


def assess_plan(
    plan: cpb.ReleasePlan, *, site_id: str, policy: LocalPolicy, context: DpContext
) -> DpAssessment:
    """The cost of ``plan`` for ``site_id`` and the policy's verdict (module docstring)."""
    ledger = context.ledger or LedgerSpend(policy.privacy_unit, 0, 0.0)
    if not plan.dp.enabled:
        lifetime = math.inf
        refusal = ""
        if policy.max_epsilon < math.inf:
            refusal = (
                f"the plan gives this site no differential privacy (ε = ∞) > policy max_epsilon "
                f"{policy.max_epsilon:g}"
            )
        elif policy.lifetime_epsilon < math.inf:
            refusal = (
                f"the plan has no differential privacy: this site's lifetime ε would be ∞ > "
                f"policy lifetime_epsilon {policy.lifetime_epsilon:g}"
            )
        return DpAssessment(math.inf, math.inf, math.inf, lifetime, refusal)
    # δ is the coordinator's choice as well: a plan's δ above the site's own (lifetime_delta)
    # would shrink every ε (ε → 0 as δ → 1); the site judges ε at the smaller of the two.
    delta = min(plan.dp.delta, policy.lifetime_delta)
    mu = site_mu(plan, site_id, colluder_fraction=policy.dp_assumed_colluders)
    mu_run = compose_mu([context.run_mu, mu])
    eps, eps_run = _eps(mu, delta), _eps(mu_run, delta)
    life_mu = compose_mu(
        [ledger.mu, mu if patient_level(plan) or ledger.unit == "image" else math.inf]
    )
    eps_life = _eps(life_mu, policy.lifetime_delta)
    stated = max(
        [b.epsilon_run or b.epsilon for b in plan.budgets if b.site_id == site_id], default=0.0
    )

    def verdict(reason: str) -> DpAssessment:
        return DpAssessment(mu, eps, eps_run, eps_life, reason)

    problem = plan_problems(plan, site_id)
    if problem:
        return verdict(problem)
    if policy.privacy_unit == "patient" and not patient_level(plan):
        return verdict(
            "the plan's DP unit is one image; this site's policy requires patient-level DP "
            '(privacy_unit = "patient")'
        )
    if patient_level(plan) and not context.has_patient_ids:
        return verdict(
            "the plan asks for patient-level DP but this site's feature cache has no patient ids"
        )
    worst = max(eps_run, stated)
    if worst > policy.max_epsilon:
        view = _view(plan, site_id, policy.dp_assumed_colluders)
        run = " over its run (this round and the earlier ones)" if context.run_mu > 0 else ""
        server = f"; the server states {stated:g}" if not math.isclose(stated, eps_run) else ""
        return verdict(
            f"the plan gives this site {guarantee(plan).replace('(ε, δ)', '')}ε = {worst:g}"
            f"{run}{view} (δ = {delta:g}{server}) > policy max_epsilon {policy.max_epsilon:g}"
        )
    if eps_life > policy.lifetime_epsilon:
        return verdict(
            f"with this plan (ε = {eps:g}) this site's lifetime ε over {ledger.entries + 1} "
            f"recorded release(s) would be {eps_life:g} (δ = {policy.lifetime_delta:g}) > "
            f"policy lifetime_epsilon {policy.lifetime_epsilon:g}"
        )
    return verdict("")


def dp_report(plan: cpb.ReleasePlan, site_id: str, assessment: DpAssessment) -> dict[str, object]:
    """The DP part of the site's round report: the guarantee, ε and δ as the site computed them
    (this plan, its run, its lifetime) and as the server claims them, and every release's noise."""
    claimed = [b for b in plan.budgets if b.site_id == site_id]
    return {
        "guarantee": guarantee(plan),
        "unit": _unit_name(plan),
        "images_per_patient": int(plan.dp.images_per_patient) if patient_level(plan) else 1,
        "max_positive_labels": int(plan.dp.max_positive_labels),
        "mu": assessment.mu,
        "epsilon": assessment.epsilon,
        "epsilon_run": assessment.epsilon_run,
        "epsilon_lifetime": assessment.epsilon_lifetime,
        "epsilon_server": max(b.epsilon for b in claimed) if claimed else None,
        "epsilon_server_run": max(b.epsilon_run for b in claimed) if claimed else None,
        "delta": plan.dp.delta,
        "clip_norm": plan.dp.clip_norm,
        "epsilon_target": plan.dp.epsilon,
        "releases": {
            r.name: {
                "sigma": r.noise.sigma,
                "sensitivity": r.noise.sensitivity,
                "assumed_colluders": r.noise.assumed_colluders,
                "share_sigma": r.noise.sigma
                / math.sqrt(len(r.member_site_ids) - r.noise.assumed_colluders),
            }
            for r in plan.releases
            if site_id in r.member_site_ids
        },
    }
