"""A site's local policy check of a release plan (afl.client.policy, docs/protocol.md §6)."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from afl.client.config import LocalPolicy
from afl.client.policy import audit_view, check_plan
from afl.core import leakage
from afl.proto.v1 import common_pb2 as cpb

SITES = ["s1", "s2", "s3", "s4"]


def _gram(name: str, members: list[str]) -> cpb.Release:
    return cpb.Release(
        name=name, member_site_ids=members, kind=cpb.STATISTIC_KIND_GRAM, shape=[4, 4]
    )


def _b(cls: str, members: list[str]) -> cpb.Release:
    return cpb.Release(
        name=f"b[{cls}]",
        member_site_ids=members,
        kind=cpb.STATISTIC_KIND_CLASS_VECTOR,
        class_names=[cls],
        shape=[4, 1],
    )


def _plan(releases: list[cpb.Release], **kw: object) -> cpb.ReleasePlan:
    fields: dict[str, object] = {
        "round_id": "r1",
        "participants": SITES,
        "aggregation": cpb.AGGREGATION_MODE_PLAINTEXT,
        "releases": releases,
        **kw,
    }
    return cpb.ReleasePlan(**fields)  # type: ignore[arg-type]


GLOBAL = _plan([_gram("gram[all]", SITES), _b("A", SITES), _b("B", SITES)])
# Per-class plan where class B is labelled by s1..s3 only: gram[all] - gram{s1,s2,s3} = G_s4.
EXPOSING = _plan(
    [
        _gram("gram[all]", SITES),
        _gram("gram{s1,s2,s3}", ["s1", "s2", "s3"]),
        _b("A", SITES),
        _b("B", ["s1", "s2", "s3"]),
    ]
)


def test_global_plan_is_accepted_by_everyone() -> None:
    for site in SITES:
        decision = check_plan(GLOBAL, site_id=site, policy=LocalPolicy())
        assert decision.accept, decision.reason
        assert decision.audit["passed"] is True


def test_exposed_site_refuses_with_certificate_others_accept() -> None:
    decision = check_plan(EXPOSING, site_id="s4", policy=LocalPolicy())
    assert not decision.accept
    assert "expose this site's gram by differencing" in decision.reason
    assert "+1*gram[all]" in decision.reason and "-1*gram{s1,s2,s3}" in decision.reason
    for site in ("s1", "s2", "s3"):
        assert check_plan(EXPOSING, site_id=site, policy=LocalPolicy()).accept
    assert check_plan(EXPOSING, site_id="s4", policy=LocalPolicy(allow_exposure=True)).accept


def test_small_release_refused_even_with_allow_exposure() -> None:
    plan = _plan([_gram("gram[all]", SITES), _b("A", ["s1", "s2"])])
    for allow in (False, True):
        decision = check_plan(plan, site_id="s1", policy=LocalPolicy(allow_exposure=allow))
        assert not decision.accept
        assert decision.reason == "release b[A] has 2 member(s) < min cohort 3"
    assert check_plan(plan, site_id="s3", policy=LocalPolicy(allow_exposure=True)).accept
    assert check_plan(plan, site_id="s1", policy=LocalPolicy(min_cohort=2)).accept


def test_small_group_determined_is_refused() -> None:
    # gram[all] - gram{s1,s2,s3} ... no: gram[all] - gram{s3,s4} = G_s1 + G_s2, a group of 2.
    plan = _plan([_gram("gram[all]", SITES), _gram("gram{s3,s4}", ["s3", "s4"])])
    decision = check_plan(plan, site_id="s1", policy=LocalPolicy(min_cohort=2))
    assert decision.accept  # min cohort 2: groups of 2 are allowed
    decision = check_plan(plan, site_id="s1", policy=LocalPolicy(min_cohort=3))
    assert not decision.accept
    assert "determine the gram sum of {s1,s2}" in decision.reason


def test_history_combines_across_rounds() -> None:
    round1 = _plan([_gram("gram{s1,s2,s3}", ["s1", "s2", "s3"]), _b("A", ["s1", "s2", "s3"])])
    round2 = _plan([_gram("gram[all]", SITES)], round_id="r2")
    assert check_plan(round2, site_id="s4", policy=LocalPolicy()).accept
    history = audit_view(list(round1.releases), tag="r1/")
    decision = check_plan(round2, site_id="s4", policy=LocalPolicy(), history=history)
    assert not decision.accept and "r1/gram{s1,s2,s3}" in decision.reason


def test_mode_participation_and_epsilon() -> None:
    masked = _plan(list(GLOBAL.releases), aggregation=cpb.AGGREGATION_MODE_MASK)
    decision = check_plan(masked, site_id="s1", policy=LocalPolicy())
    assert not decision.accept and "'mask' is not supported" in decision.reason
    decision = check_plan(GLOBAL, site_id="s9", policy=LocalPolicy())
    assert not decision.accept and "not a participant" in decision.reason
    decision = check_plan(GLOBAL, site_id="s1", policy=LocalPolicy(max_epsilon=4.0))
    assert not decision.accept and "no differential privacy" in decision.reason
    noised = [cpb.Release() for _ in GLOBAL.releases]
    for copy, r in zip(noised, GLOBAL.releases, strict=True):
        copy.CopyFrom(r)
        copy.noise.CopyFrom(
            cpb.DpNoise(mechanism=cpb.NOISE_MECHANISM_DISCRETE_GAUSSIAN, sigma=100.0, sensitivity=1)
        )
    dp = _plan(
        noised,  # the site recomputes ε from the noise: σ = 100 gives far less than 3
        dp=cpb.DpParams(enabled=True, epsilon=3.0, delta=1e-5, clip_norm=1.0),
        budgets=[cpb.SiteBudget(site_id="s1", epsilon=3.0, delta=1e-5)],
    )
    image = "image"  # an image-level plan (no unit stated)
    assert check_plan(
        dp, site_id="s1", policy=LocalPolicy(max_epsilon=4.0, privacy_unit=image)
    ).accept
    decision = check_plan(dp, site_id="s1", policy=LocalPolicy(max_epsilon=2.0, privacy_unit=image))
    assert not decision.accept and "image-level ε = 3 " in decision.reason
    assert "> policy max_epsilon 2" in decision.reason
    assert check_plan(
        dp, site_id="s1", policy=LocalPolicy(max_epsilon=math.inf, privacy_unit=image)
    ).accept
    decision = check_plan(dp, site_id="s1", policy=LocalPolicy(max_epsilon=4.0))
    assert not decision.accept and "requires patient-level DP" in decision.reason
    # A DP plan whose releases carry no noise is not DP, whatever budget the server states.
    bare = _plan(list(GLOBAL.releases), dp=dp.dp, budgets=list(dp.budgets))
    decision = check_plan(
        bare, site_id="s1", policy=LocalPolicy(max_epsilon=4.0, privacy_unit=image)
    )
    assert not decision.accept and "carries no DP noise" in decision.reason


def test_malformed_plans_are_refused() -> None:
    dup = _plan([_gram("gram[all]", SITES), _gram("gram[all]", SITES)])
    assert "names a release twice" in check_plan(dup, site_id="s1", policy=LocalPolicy()).reason
    stranger = _plan([_gram("gram[all]", [*SITES, "s9"])])
    reason = check_plan(stranger, site_id="s1", policy=LocalPolicy()).reason
    assert "non-participants ['s9']" in reason


@settings(max_examples=40, deadline=None)
@given(
    covers=st.lists(st.sets(st.sampled_from(SITES), min_size=1), min_size=1, max_size=4),
    site=st.sampled_from(SITES),
)
def test_acceptance_agrees_with_independent_audit(covers: list[set[str]], site: str) -> None:
    """Oracle: a site accepts iff none of its releases is small and the leakage audit neither
    exposes it nor determines a small group containing it."""
    releases = [_gram(f"g{i}", sorted(c)) for i, c in enumerate(covers)]
    decision = check_plan(_plan(releases), site_id=site, policy=LocalPolicy())
    report = leakage.audit_releases(
        [leakage.Release(f"g{i}", frozenset(c), "gram") for i, c in enumerate(covers)], SITES
    )
    small = any(site in c and len(c) < 3 for c in covers)
    exposed = site in report.exposed_site_ids()
    grouped = any(site in g.sites for g in report.small_groups)
    assert decision.accept == (not small and not exposed and not grouped)
