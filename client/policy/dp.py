"""The DP part of a site's plan check (docs/protocol.md §6, §7; docs/architecture.md §3): what
a plan costs this site, under the adversary that sees its upload, in its run and over its
lifetime, from the site's own accounting (:func:`site_mu`: the sensitivity the plan's clip norm,
unit bound m and label clipping k imply, the noise that protects its upload: its own share in
PLAINTEXT, the n_r - t'_r honest shares in MASK and CKKS with t'_r the larger of the plan's t_r
and the site's own floor ``[policy] dp_assumed_colluders``), so a site never relies on the
server's arithmetic. :func:`assess_plan` composes it with the run's earlier rounds and the
lifetime ledger (:mod:`afl.client.policy.ledger`) and refuses above ``max_epsilon`` /
``lifetime_epsilon``; a plan without DP costs ε = ∞. The payload builder
(:mod:`afl.client.payloads.dp`) imports the unit and noise rules from here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from afl.client.config import LocalPolicy
from afl.client.policy.ledger import LedgerSpend
from afl.core.dp.accounting import (
    compose_mu,
    epsilon_from_mu,
    grid_inflation,
    mu_from_releases,
    rounded_coordinates,
    site_colluders,
    site_view_releases,
    statistic_sensitivity,
)
from afl.core.dp.evaluation import evaluation_sensitivity
from afl.crypto.ckks import params as cp
from afl.proto.v1 import common_pb2 as cpb
from afl.proto.wire import DP_STATISTIC_NAMES, EVALUATION_KINDS

__all__ = [
    "MAX_FRAC_BITS",
    "NOISED_MECHANISMS",
    "DpAssessment",
    "DpContext",
    "assess_plan",
    "dp_report",
    "guarantee",
    "images_per_patient",
    "patient_level",
    "plan_problems",
    "site_epsilon",
    "site_mu",
]

#: The mechanisms that noise a DP release.
NOISED_MECHANISMS = (cpb.NOISE_MECHANISM_DISCRETE_GAUSSIAN, cpb.NOISE_MECHANISM_GAUSSIAN)
#: The finest noise grid 2^-f a payload is computed on (the wire allows at most 40 bits).
MAX_FRAC_BITS = 60


def patient_level(plan: cpb.ReleasePlan) -> bool:
    """True when the plan's unit of privacy is one patient."""
    return bool(plan.dp.unit == cpb.PRIVACY_UNIT_PATIENT)


def images_per_patient(plan: cpb.ReleasePlan) -> int:
    """m: the rows one unit may own (1 for an image-level plan)."""
    return max(1, int(plan.dp.images_per_patient)) if patient_level(plan) else 1


def guarantee(plan: cpb.ReleasePlan) -> str:
    """``patient-level (ε, δ)`` or ``image-level (ε, δ)``."""
    return f"{'patient' if patient_level(plan) else 'image'}-level (ε, δ)"


def _min_sensitivity(release: cpb.Release, plan: cpb.ReleasePlan) -> float:
    """The release's sensitivity at the plan's clip norm, unit bound m and label clipping k
    (:func:`afl.core.dp.accounting.statistic_sensitivity`) plus what rounding to the release's
    noise grid adds (:func:`afl.core.dp.accounting.grid_inflation`, √D·2^-f); another
    class-vector kind is taken as a d x C_r sum of rows like ``t_sum``, and a vector release with
    no classes as 0; an evaluation release's counts as m·√C
    (:func:`afl.core.dp.evaluation.evaluation_sensitivity`)."""
    if release.kind in EVALUATION_KINDS:  # integer counts: m·√C, no rounding
        if not release.class_names:
            return 0.0
        return evaluation_sensitivity(
            n_classes=len(release.class_names), rows_per_individual=images_per_patient(plan)
        )
    kind = DP_STATISTIC_NAMES.get(int(release.kind), "t_sum")
    if kind != "gram" and not release.class_names:
        return 0.0
    k = int(plan.dp.max_positive_labels)
    n_classes = len(release.class_names)
    rounding = grid_inflation(
        coordinates=rounded_coordinates(
            kind, shape=tuple(release.shape), n_classes=n_classes, max_positive_labels=k
        ),
        frac_bits=min(int(release.noise.frac_bits), MAX_FRAC_BITS),
    )
    return rounding + statistic_sensitivity(
        kind,
        clip_norm=plan.dp.clip_norm,
        n_classes=n_classes,
        rows_per_individual=images_per_patient(plan),
        max_positive_labels=k,
    )


def site_mu(plan: cpb.ReleasePlan, site_id: str, *, colluder_fraction: float = 0.0) -> float:
    """μ (GDP) of ``site_id``'s releases in this plan under the adversary that sees its upload
    (module docstring), assuming in MASK and CKKS max(the plan's t_r, ⌈``colluder_fraction``·n_r⌉)
    colluders (:func:`afl.core.dp.accounting.site_colluders`; the site's ``[policy]
    dp_assumed_colluders``); inf without DP noise on one of them."""
    if not plan.dp.enabled or not 0 < plan.dp.delta < 1 or not plan.dp.clip_norm > 0:
        return math.inf
    local = plan.aggregation == cpb.AGGREGATION_MODE_PLAINTEXT
    stated = []
    for r in plan.releases:
        if site_id not in r.member_site_ids:
            continue
        n, t = len(r.member_site_ids), int(r.noise.assumed_colluders)
        if r.noise.mechanism not in NOISED_MECHANISMS or not r.noise.sigma > 0 or not 0 <= t < n:
            return math.inf
        sens = max(float(r.noise.sensitivity), _min_sensitivity(r, plan))
        stated.append((r.name, sens, float(r.noise.sigma), n, t))
    return mu_from_releases(
        site_view_releases(stated, local=local, colluder_fraction=colluder_fraction)
    )


def site_epsilon(plan: cpb.ReleasePlan, site_id: str, *, colluder_fraction: float = 0.0) -> float:
    """ε of ``site_id`` in this plan at the plan's δ (:func:`site_mu`; inf without DP)."""
    mu = site_mu(plan, site_id, colluder_fraction=colluder_fraction)
    if math.isinf(mu):
        return math.inf
    return epsilon_from_mu(mu=mu, delta=plan.dp.delta)


def plan_problems(plan: cpb.ReleasePlan, site_id: str) -> str:
    """Why this site cannot take part in a DP plan's releases as encoded ("" when it can): each
    release it is in must carry noise on a grid of at most 40 bits, and in MASK mode encode the
    half noise grid exactly and unmask no sum of fewer than n - t members (docs/protocol.md
    [M-84]), in CKKS mode have the half noise grid as the decryptor's grid with a pre-scale fine
    enough to recover the noisy sum exactly (:mod:`afl.server.plan.dp_ckks`)."""
    for r in plan.releases:
        if site_id not in r.member_site_ids:
            continue
        n, t, f = len(r.member_site_ids), int(r.noise.assumed_colluders), int(r.noise.frac_bits)
        if r.noise.mechanism not in NOISED_MECHANISMS or not r.noise.sigma > 0:
            return f"release {r.name} carries no DP noise"
        if not 0 <= t < n or f > 40:
            return f"release {r.name}: assumed colluders {t} or noise grid 2^-{f} out of range"
        if plan.aggregation == cpb.AGGREGATION_MODE_MASK:
            fp = r.encoding.fixed_point
            if fp.frac_bits < f + 1 or fp.min_survivors < n - t:
                return (
                    f"release {r.name}: the mask encoding ({fp.frac_bits} fractional bits, "
                    f"{fp.min_survivors} survivors) does not keep the noise of {n - t} members "
                    f"on the grid 2^-{f + 1}"
                )
        if plan.aggregation == cpb.AGGREGATION_MODE_CKKS:
            ck = r.encoding.ckks
            try:
                finest = cp.min_grid(prescale=ck.prescale, num_summands=n)
            except ValueError as exc:
                return f"release {r.name}: {exc}"
            if ck.grid_step != 2.0 ** -(f + 1) or not 2.0 * finest <= ck.grid_step:
                return (
                    f"release {r.name}: the CKKS grid {ck.grid_step:g} (pre-scale "
                    f"{ck.prescale:g}) does not recover the noisy sum on the grid 2^-{f + 1}"
                )
    return ""


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
