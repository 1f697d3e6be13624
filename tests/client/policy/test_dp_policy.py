"""The DP part of a site's plan check (afl.client.policy.dp, docs/protocol.md §7): the site's ε
from the share it adds, under the adversary that sees its upload (docs/protocol.md [M-86]), the
unit it can honour, its run and its lifetime ledger. Oracle: the independent analytic-Gaussian
accountant of tests/helpers/dp_oracle.py on the plan's (Δ, σ) and the site's own share."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from afl.client.config import LocalPolicy
from afl.client.policy.dp import DpContext, assess_plan
from afl.client.policy.ledger import LedgerSpend
from afl.client.policy.plan import check_plan
from afl.core.dp.accounting import statistic_sensitivity
from afl.proto.v1 import common_pb2 as cpb
from afl.proto.wire import DP_STATISTIC_NAMES
from afl.server.plan.dp import DpSettings, apply_dp, calibrate, dp_releases
from afl.server.plan.dp_ckks import dp_ckks_encodings
from afl.server.plan.dp_mask import dp_mask_encodings
from afl.server.plan.release import PlanOptions, build_plan
from tests.helpers import dp_oracle

SITES = ["a", "b", "c", "d"]
CLASSES = ["x", "y"]
WITH_IDS = DpContext(has_patient_ids=True)


def _plan(
    *,
    aggregation: int,
    local: bool,
    epsilon: float = 4.0,
    delta: float = 1e-5,
    tolerated: int = 0,
) -> cpb.ReleasePlan:
    """A DP plan calibrated with t = n - 1 (``local``, the honest plaintext plan) or
    t = ``tolerated`` (default 0)."""
    releases = dp_releases(
        classes=CLASSES, participants=SITES, coverage={}, gram_scope="global", d=3
    )
    plan = build_plan(
        federation_id="f", round_id="r1", round_number=1, participants=SITES,
        gram_scope="global", releases=releases,
    )  # fmt: skip
    plan.aggregation = aggregation  # type: ignore[assignment]
    settings = DpSettings(epsilon=epsilon, delta=delta, clip_norm=2.0, tolerated=tolerated)
    apply_dp(plan, calibrate(releases, settings, participants=SITES, plaintext=local))
    return plan


def _oracle_epsilon(plan: cpb.ReleasePlan, *, own_share_only: bool, colluders: int = 0) -> float:
    """ε of site a from the plan's (Δ, σ): σ itself, the site's share σ/√(n - t) alone, or
    (``colluders`` c > t) the n - c honest shares σ/√(n - t)·√(n - c)."""
    pairs = []
    for r in plan.releases:
        n, t = len(r.member_site_ids), r.noise.assumed_colluders
        share = r.noise.sigma / math.sqrt(n - t)
        sigma = share if own_share_only else share * math.sqrt(n - max(t, colluders))
        pairs.append((r.noise.sensitivity, sigma))
    return dp_oracle.epsilon(dp_oracle.composed_mu(pairs), 1e-5)


TRUSTING = 0.0  # [policy] dp_assumed_colluders = 0: the site takes the plan's t on trust


def _encoded(plan: cpb.ReleasePlan) -> cpb.ReleasePlan:
    """The plan with its mode's DP encodings (mask fixed point, or CKKS pre-scale and grid)."""
    if plan.aggregation == cpb.AGGREGATION_MODE_MASK:
        dp_mask_encodings(plan, max_samples=1000)
    else:
        dp_ckks_encodings(plan, max_samples=1000)
    return plan


def test_plaintext_noise_sized_for_the_sum_is_refused_naming_the_sites_epsilon() -> None:
    # The attack: a plaintext plan calibrated with t = 0 (shares σ/√n, as if the coordinator
    # saw only the sum) states ε = 4; the coordinator sees each upload alone, so the site's
    # own share is all that protects it: ε ≈ 9 with n = 4.
    attack = _plan(aggregation=cpb.AGGREGATION_MODE_PLAINTEXT, local=False)
    assert all(b.epsilon == pytest.approx(4.0, rel=1e-6) for b in attack.budgets)
    real = _oracle_epsilon(attack, own_share_only=True)
    assert real > 8.5
    dp = assess_plan(attack, site_id="a", policy=LocalPolicy(max_epsilon=5.0), context=WITH_IDS)
    assert dp.epsilon == pytest.approx(real, rel=1e-6)
    opted_in = LocalPolicy(max_epsilon=5.0, allowed_aggregation=("plaintext", "mask"))
    decision = check_plan(attack, site_id="a", policy=opted_in, dp_context=WITH_IDS)
    assert not decision.accept
    assert f"ε = {dp.epsilon:g} against the coordinator that sees its upload alone" in (
        decision.reason
    )
    assert "the server states 4" in decision.reason and "max_epsilon 5" in decision.reason
    # The honest plaintext plan (every site adds the full σ) and a mask plan with t = 0 (the
    # coordinator sees sums only) both cost exactly the stated ε = 4 and are accepted by a site
    # that takes the plan's colluder count on trust.
    trusting = LocalPolicy(max_epsilon=5.0, dp_assumed_colluders=TRUSTING)
    for plan in (
        _plan(aggregation=cpb.AGGREGATION_MODE_PLAINTEXT, local=True),
        _plan(aggregation=cpb.AGGREGATION_MODE_MASK, local=False),
    ):
        ok = assess_plan(plan, site_id="a", policy=trusting, context=WITH_IDS)
        assert ok.refusal == "" or "mask encoding" in ok.refusal  # mask: encodings unset here
        assert ok.epsilon == pytest.approx(_oracle_epsilon(plan, own_share_only=False), rel=1e-6)
        assert ok.epsilon == pytest.approx(4.0, rel=1e-6)


@pytest.mark.parametrize("mode", [cpb.AGGREGATION_MODE_MASK, cpb.AGGREGATION_MODE_CKKS])
def test_a_plan_trusting_no_colluders_is_refused_by_the_sites_own_floor(mode: int) -> None:
    # docs/protocol.md [M-126]: the plan says t = 0 and ε = 4 for n = 4; the site's own floor
    # (default dp_assumed_colluders 0.333: ⌈4/3⌉ = 2 colluders) leaves 2 honest shares of
    # σ/√4 each, so its real ε is that of σ/√2 (5.99 at δ = 1e-5), above max_epsilon 5.
    plan = _encoded(_plan(aggregation=mode, local=False))
    assert all(r.noise.assumed_colluders == 0 for r in plan.releases)
    assert all(b.epsilon == pytest.approx(4.0, rel=1e-6) for b in plan.budgets)
    assert LocalPolicy().dp_assumed_colluders == pytest.approx(0.333)
    real = _oracle_epsilon(plan, own_share_only=False, colluders=math.ceil(len(SITES) / 3))
    assert real == pytest.approx(5.99, abs=0.01)
    policy = LocalPolicy(max_epsilon=5.0, allowed_aggregation=("mask", "ckks"))
    dp = assess_plan(plan, site_id="a", policy=policy, context=WITH_IDS)
    assert dp.epsilon == pytest.approx(real, rel=1e-6)
    assert f"ε = {real:g}" in dp.refusal and "> policy max_epsilon 5" in dp.refusal
    assert "2 colluding member(s)" in dp.refusal and "dp_assumed_colluders" in dp.refusal
    # One colluder assumed (fraction 0.25): 4.72 (the figure), still refused at 4.5.
    one = replace(policy, dp_assumed_colluders=0.25, max_epsilon=4.5)
    one_real = _oracle_epsilon(plan, own_share_only=False, colluders=1)
    assert one_real == pytest.approx(4.72, abs=0.01)
    refused = assess_plan(plan, site_id="a", policy=one, context=WITH_IDS)
    assert refused.epsilon == pytest.approx(one_real, rel=1e-6) and refused.refusal
    # A plan whose own t covers the floor costs what it states, and the floor never lowers it.
    honest = _encoded(_plan(aggregation=mode, local=False, tolerated=2))
    ok = assess_plan(honest, site_id="a", policy=policy, context=WITH_IDS)
    assert ok.epsilon == pytest.approx(4.0, rel=1e-6) and ok.refusal == ""


def test_the_unit_the_site_can_honour() -> None:
    plan = _plan(aggregation=cpb.AGGREGATION_MODE_PLAINTEXT, local=True)
    assert plan.dp.unit == cpb.PRIVACY_UNIT_PATIENT
    no_ids = assess_plan(plan, site_id="a", policy=LocalPolicy(), context=DpContext())
    assert "no patient ids" in no_ids.refusal
    image = cpb.ReleasePlan()
    image.CopyFrom(plan)
    image.dp.unit = cpb.PRIVACY_UNIT_IMAGE
    refused = assess_plan(image, site_id="a", policy=LocalPolicy(), context=WITH_IDS)
    assert "requires patient-level DP" in refused.refusal
    ok = assess_plan(
        image, site_id="a", policy=LocalPolicy(privacy_unit="image"), context=DpContext()
    )
    assert ok.refusal == ""
    # A plan claiming m = 1 image per patient cannot under-state the sensitivity: the site
    # takes at least m·Δ(1 image) from the plan's own m, so m = 3 costs 3x μ.
    three = cpb.ReleasePlan()
    three.CopyFrom(plan)
    three.dp.images_per_patient = 3
    mu_three = assess_plan(three, site_id="a", policy=LocalPolicy(), context=WITH_IDS).mu
    mu_one = assess_plan(plan, site_id="a", policy=LocalPolicy(), context=WITH_IDS).mu
    assert mu_three == pytest.approx(3 * mu_one, rel=1e-3)


def test_run_and_lifetime_budgets() -> None:
    plan = _plan(aggregation=cpb.AGGREGATION_MODE_PLAINTEXT, local=True, epsilon=2.0)
    mu = assess_plan(plan, site_id="a", policy=LocalPolicy(), context=WITH_IDS).mu
    # Round 2 of a run: composed with round 1's μ against max_epsilon.
    run = DpContext(has_patient_ids=True, run_mu=mu)
    second = assess_plan(plan, site_id="a", policy=LocalPolicy(max_epsilon=2.5), context=run)
    assert second.epsilon_run == pytest.approx(dp_oracle.epsilon(math.sqrt(2) * mu, 1e-5))
    assert "over its run" in second.refusal and "max_epsilon 2.5" in second.refusal
    # Lifetime: three earlier releases of the same μ; the fourth passes 5 but not 4.
    spent = DpContext(has_patient_ids=True, ledger=LedgerSpend("patient", 3, math.sqrt(3) * mu))
    life = dp_oracle.epsilon(2 * mu, 1e-5)
    ok = assess_plan(plan, site_id="a", policy=LocalPolicy(lifetime_epsilon=life + 0.01),
                     context=spent)  # fmt: skip
    assert ok.refusal == "" and ok.epsilon_lifetime == pytest.approx(life, rel=1e-6)
    tight = LocalPolicy(lifetime_epsilon=life - 0.01, allowed_aggregation=("plaintext",))
    refused = check_plan(plan, site_id="a", policy=tight, dp_context=spent)
    assert not refused.accept
    assert f"lifetime ε over 4 recorded release(s) would be {life:g}" in refused.reason
    # A plan without DP passes a finite lifetime budget never.
    plain = cpb.ReleasePlan()
    plain.CopyFrom(plan)
    plain.dp.enabled = False
    bare = assess_plan(plain, site_id="a", policy=LocalPolicy(lifetime_epsilon=10), context=spent)
    assert "lifetime ε would be ∞" in bare.refusal


def test_encodings_that_lose_the_noise_are_refused() -> None:
    plan = _plan(aggregation=cpb.AGGREGATION_MODE_MASK, local=False)
    for r in plan.releases:  # what afl.server.plan.dp_mask writes: f >= f_noise + 1, t_R >= n - t
        r.encoding.fixed_point.frac_bits = r.noise.frac_bits + 1
        r.encoding.fixed_point.min_survivors = len(r.member_site_ids) - r.noise.assumed_colluders
    ok = assess_plan(plan, site_id="a", policy=LocalPolicy(), context=WITH_IDS)
    assert ok.refusal == ""
    plan.releases[0].encoding.fixed_point.min_survivors = 1  # a sum of fewer shares than n - t
    bad = assess_plan(plan, site_id="a", policy=LocalPolicy(), context=WITH_IDS)
    assert "does not keep the noise" in bad.refusal
    ckks = _plan(aggregation=cpb.AGGREGATION_MODE_CKKS, local=False)
    for r in ckks.releases:
        r.encoding.ckks.prescale = 2.0**-30  # resolves steps of about 100 only
        r.encoding.ckks.grid_step = 2.0 ** -(r.noise.frac_bits + 1)
    coarse = assess_plan(ckks, site_id="a", policy=LocalPolicy(), context=WITH_IDS)
    assert "does not recover the noisy sum" in coarse.refusal


def test_dp_under_an_unbounded_budget_waives_neither_min_cohort_nor_the_audit() -> None:
    """A MASK plan whose every release has site a alone, with noise for ε = 1000: the coordinator
    unmasks a's statistics, nearly exact. DP covers small cohorts and exposure only under the
    site's own finite max_epsilon; with the default (inf, as kits are provisioned) the site
    applies min_cohort and the audit as to any plan."""
    releases = dp_releases(
        classes=CLASSES, participants=["a"], coverage={}, gram_scope="global", d=3
    )
    plan = build_plan(
        federation_id="f", round_id="r1", round_number=1, participants=SITES,
        gram_scope="global", releases=releases,
        options=PlanOptions(aggregation=cpb.AGGREGATION_MODE_MASK, mask_threshold=3),
    )  # fmt: skip
    settings = DpSettings(epsilon=1000.0, delta=1e-5, clip_norm=2.0)
    apply_dp(plan, calibrate(releases, settings, participants=["a"], plaintext=False))
    dp_mask_encodings(plan, max_samples=64)
    modes = (cpb.AGGREGATION_MODE_MASK,)
    default = check_plan(plan, site_id="a", policy=LocalPolicy(), supported_modes=modes,
                         dp_context=WITH_IDS)  # fmt: skip
    assert not default.accept and "min cohort 3" in default.reason
    bounded = LocalPolicy(max_epsilon=4.0)
    refused = check_plan(plan, site_id="a", policy=bounded, supported_modes=modes,
                         dp_context=WITH_IDS)  # fmt: skip
    assert not refused.accept  # ε = 1000 > 4: no cover, and the 1-member release is refused


def test_a_release_listing_a_class_twice_is_refused() -> None:
    """Sensitivities assume a release's classes are distinct: with label clipping k = 1, s_pos
    over C_r classes moves by √min(k, C_r)·L = L. The same class listed c times moves by √c·L
    (every copy holds the same column, each with its own noise: averaging the copies divides σ
    by √c), so the site would under-state its ε by a factor up to √c. (Refused today because the
    audit's quantity rows would repeat a name; this pins the refusal.)"""
    plan = _plan(aggregation=cpb.AGGREGATION_MODE_PLAINTEXT, local=True, epsilon=2.0)
    s_pos = next(r for r in plan.releases if r.kind == cpb.STATISTIC_KIND_POSITIVE_SUM)
    del s_pos.class_names[:]
    s_pos.class_names.extend(["x"] * 16)
    s_pos.shape[:] = [3, 16]
    opted_in = LocalPolicy(max_epsilon=5.0, allowed_aggregation=("plaintext",))
    decision = check_plan(plan, site_id="a", policy=opted_in, dp_context=WITH_IDS)
    assert not decision.accept


def test_a_large_delta_does_not_shrink_the_sites_epsilon() -> None:
    """δ is the coordinator's choice too: noise calibrated for ε = 4 at δ = 0.9 (a mechanism that
    may fail with probability 0.9) is far less than at δ = 1e-5. The site judges ε at its own δ
    (``lifetime_delta``) when the plan's is larger."""
    plan = _plan(aggregation=cpb.AGGREGATION_MODE_PLAINTEXT, local=True, epsilon=4.0, delta=0.9)
    policy = LocalPolicy(max_epsilon=5.0, allowed_aggregation=("plaintext",))
    dp = assess_plan(plan, site_id="a", policy=policy, context=WITH_IDS)
    pairs = [(r.noise.sensitivity, r.noise.sigma) for r in plan.releases]
    assert dp.epsilon == pytest.approx(dp_oracle.epsilon(dp_oracle.composed_mu(pairs), 1e-5))
    assert dp.epsilon > 5.0 and "δ = 1e-05" in dp.refusal and "max_epsilon 5" in dp.refusal
    assert not check_plan(plan, site_id="a", policy=policy, dp_context=WITH_IDS).accept


def test_the_rounding_to_a_coarse_noise_grid_counts_in_the_sites_sensitivity() -> None:
    """Rounding D values to the grid 2^-f moves them by up to √D·2^-f (docs/protocol.md §7): an
    honest plan states Δ + √D·2^-f. A coordinator that sets f = 0 and states the bare Δ would
    have the site account for Δ alone; the site adds the inflation of the grid it is given."""
    plan = _plan(aggregation=cpb.AGGREGATION_MODE_PLAINTEXT, local=True, epsilon=4.0)
    for r in plan.releases:
        r.noise.frac_bits = 0
        kind = DP_STATISTIC_NAMES[r.kind]
        r.noise.sensitivity = statistic_sensitivity(
            kind, clip_norm=2.0, n_classes=len(r.class_names), max_positive_labels=1
        )
    coordinates = {r.name: math.prod(r.shape) for r in plan.releases}
    coordinates["counts"] = len(CLASSES)  # only the weighted positive counts are rounded
    pairs = [
        (r.noise.sensitivity + math.sqrt(coordinates[r.name]), r.noise.sigma) for r in plan.releases
    ]
    dp = assess_plan(plan, site_id="a", policy=LocalPolicy(max_epsilon=5.0), context=WITH_IDS)
    assert dp.epsilon == pytest.approx(dp_oracle.epsilon(dp_oracle.composed_mu(pairs), 1e-5))
    assert dp.epsilon > 5.0 and "max_epsilon 5" in dp.refusal
