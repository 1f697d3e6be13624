"""A site's local policy check of a release plan (afl.client.policy.plan, docs/protocol.md §2, §6):
min cohort, exposure, ε, and what the policy pins whatever the coordinator configures (the
aggregation modes it allows, the CKKS decryptor, the MASK survivor thresholds)."""

from __future__ import annotations

import math
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given, settings
from hypothesis import strategies as st

from afl.client.config import LocalPolicy
from afl.client.policy.plan import audit_view, check_plan
from afl.core import leakage
from afl.crypto.identity.signatures import public_key_to_raw
from afl.proto.v1 import common_pb2 as cpb
from afl.server.config import MaskSettings
from afl.server.modes.mask import MaskMode
from afl.server.plan.release import build_plan, round1_releases

SITES = ["s1", "s2", "s3", "s4"]


def _policy(**kw: object) -> LocalPolicy:
    """The site's policy; the plaintext plans of these tests need the site's opt-in."""
    return LocalPolicy(**{"allowed_aggregation": ("plaintext", "mask", "ckks"), **kw})  # type: ignore[arg-type]


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
        decision = check_plan(GLOBAL, site_id=site, policy=_policy())
        assert decision.accept, decision.reason
        assert decision.audit["passed"] is True


def test_exposed_site_refuses_with_certificate_others_accept() -> None:
    decision = check_plan(EXPOSING, site_id="s4", policy=_policy())
    assert not decision.accept
    assert "expose this site's gram by differencing" in decision.reason
    assert "+1*gram[all]" in decision.reason and "-1*gram{s1,s2,s3}" in decision.reason
    for site in ("s1", "s2", "s3"):
        assert check_plan(EXPOSING, site_id=site, policy=_policy()).accept
    assert check_plan(EXPOSING, site_id="s4", policy=_policy(allow_exposure=True)).accept


def test_small_release_refused_even_with_allow_exposure() -> None:
    plan = _plan([_gram("gram[all]", SITES), _b("A", ["s1", "s2"])])
    for allow in (False, True):
        decision = check_plan(plan, site_id="s1", policy=_policy(allow_exposure=allow))
        assert not decision.accept
        assert decision.reason == "release b[A] has 2 member(s) < min cohort 3"
    assert check_plan(plan, site_id="s3", policy=_policy(allow_exposure=True)).accept
    assert check_plan(plan, site_id="s1", policy=_policy(min_cohort=2)).accept


def test_small_group_determined_is_refused() -> None:
    # gram[all] - gram{s1,s2,s3} ... no: gram[all] - gram{s3,s4} = G_s1 + G_s2, a group of 2.
    plan = _plan([_gram("gram[all]", SITES), _gram("gram{s3,s4}", ["s3", "s4"])])
    decision = check_plan(plan, site_id="s1", policy=_policy(min_cohort=2))
    assert decision.accept  # min cohort 2: groups of 2 are allowed
    decision = check_plan(plan, site_id="s1", policy=_policy(min_cohort=3))
    assert not decision.accept
    assert "determine the gram sum of {s1,s2}" in decision.reason


def test_history_combines_across_rounds() -> None:
    round1 = _plan([_gram("gram{s1,s2,s3}", ["s1", "s2", "s3"]), _b("A", ["s1", "s2", "s3"])])
    round2 = _plan([_gram("gram[all]", SITES)], round_id="r2")
    assert check_plan(round2, site_id="s4", policy=_policy()).accept
    history = audit_view(list(round1.releases), tag="r1/")
    decision = check_plan(round2, site_id="s4", policy=_policy(), history=history)
    assert not decision.accept and "r1/gram{s1,s2,s3}" in decision.reason


def test_mode_participation_and_epsilon() -> None:
    masked = _plan(list(GLOBAL.releases), aggregation=cpb.AGGREGATION_MODE_MASK)
    decision = check_plan(masked, site_id="s1", policy=_policy())
    assert not decision.accept and "'mask' is not supported" in decision.reason
    decision = check_plan(GLOBAL, site_id="s9", policy=_policy())
    assert not decision.accept and "not a participant" in decision.reason
    decision = check_plan(GLOBAL, site_id="s1", policy=_policy(max_epsilon=4.0))
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
    assert check_plan(dp, site_id="s1", policy=_policy(max_epsilon=4.0, privacy_unit=image)).accept
    decision = check_plan(dp, site_id="s1", policy=_policy(max_epsilon=2.0, privacy_unit=image))
    assert not decision.accept and "image-level ε = 3 " in decision.reason
    assert "> policy max_epsilon 2" in decision.reason
    assert check_plan(
        dp, site_id="s1", policy=_policy(max_epsilon=math.inf, privacy_unit=image)
    ).accept
    decision = check_plan(dp, site_id="s1", policy=_policy(max_epsilon=4.0))
    assert not decision.accept and "requires patient-level DP" in decision.reason
    # A DP plan whose releases carry no noise is not DP, whatever budget the server states.
    bare = _plan(list(GLOBAL.releases), dp=dp.dp, budgets=list(dp.budgets))
    decision = check_plan(bare, site_id="s1", policy=_policy(max_epsilon=4.0, privacy_unit=image))
    assert not decision.accept and "carries no DP noise" in decision.reason


def test_malformed_plans_are_refused() -> None:
    dup = _plan([_gram("gram[all]", SITES), _gram("gram[all]", SITES)])
    assert "names a release twice" in check_plan(dup, site_id="s1", policy=_policy()).reason
    stranger = _plan([_gram("gram[all]", [*SITES, "s9"])])
    reason = check_plan(stranger, site_id="s1", policy=_policy()).reason
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
    decision = check_plan(_plan(releases), site_id=site, policy=_policy())
    report = leakage.audit_releases(
        [leakage.Release(f"g{i}", frozenset(c), "gram") for i, c in enumerate(covers)], SITES
    )
    small = any(site in c and len(c) < 3 for c in covers)
    exposed = site in report.exposed_site_ids()
    grouped = any(site in g.sites for g in report.small_groups)
    assert decision.accept == (not small and not exposed and not grouped)


# --- what a site's policy pins whatever the coordinator configures (docs/protocol.md §2) --------


def _mask_plan(*, t: int = 0, t_r: dict[str, int] | None = None, sites: list[str] = SITES) -> Any:
    """A MASK plan as the server builds it, with the coordinator's choice of t and t_R."""
    mode = MaskMode(
        MaskSettings(gram_bound=1.0e4, vector_bound=10.0),
        identities={s: public_key_to_raw(Ed25519PrivateKey.generate()) for s in sites},
    )
    releases = round1_releases(
        classes=("A",), participants=tuple(sites), coverage={}, gram_scope="global", d=4,
        need_global_gram=False,
    )  # fmt: skip
    plan = build_plan(
        federation_id="fed", round_id="r1-m", round_number=1, participants=tuple(sites),
        gram_scope="global", releases=releases, options=mode.plan_options(tuple(sites)),
    )  # fmt: skip
    if t:
        plan.mask_threshold = t
    for release in plan.releases:
        if release.name in (t_r or {}):
            release.encoding.fixed_point.min_survivors = (t_r or {})[release.name]
    return plan


MASK_POLICY = {"supported_modes": (cpb.AGGREGATION_MODE_MASK,)}


def test_downgrade_to_plaintext_is_refused_unless_the_site_opted_in() -> None:
    default = check_plan(GLOBAL, site_id="s1", policy=LocalPolicy())
    assert not default.accept
    assert default.reason == (
        "aggregation mode 'plaintext' is not allowed by this site's policy "
        "(allowed_aggregation = ['mask', 'ckks'])"
    )
    masked_only = LocalPolicy(allowed_aggregation=("mask",))
    ckks = _plan(list(GLOBAL.releases), aggregation=cpb.AGGREGATION_MODE_CKKS)
    everything = (cpb.AGGREGATION_MODE_PLAINTEXT, cpb.AGGREGATION_MODE_CKKS)
    decision = check_plan(ckks, site_id="s1", policy=masked_only, supported_modes=everything)
    assert not decision.accept and "'ckks' is not allowed" in decision.reason
    opted_in = LocalPolicy(allowed_aggregation=("plaintext", "mask", "ckks"))
    assert check_plan(GLOBAL, site_id="s1", policy=opted_in).accept


def test_ckks_plan_needs_the_pinned_decryptor() -> None:
    ckks = _plan(list(GLOBAL.releases), aggregation=cpb.AGGREGATION_MODE_CKKS)
    modes = (cpb.AGGREGATION_MODE_CKKS,)
    decision = check_plan(ckks, site_id="s1", policy=LocalPolicy(), supported_modes=modes)
    assert not decision.accept and "no decryptor is pinned" in decision.reason
    pinned = LocalPolicy(ckks_decryptor="dec")
    assert check_plan(ckks, site_id="s1", policy=pinned, supported_modes=modes).accept


def test_lowered_survivor_threshold_is_refused() -> None:
    honest = _mask_plan()
    decision = check_plan(honest, site_id="s1", policy=LocalPolicy(), **MASK_POLICY)  # type: ignore[arg-type]
    assert decision.accept, decision.reason
    assert decision.survivor_floors == {"gram[all]": 3, "b[A]": 3}
    # The attack: t_R = 1 for a 4-member release (the coordinator then drops the others).
    lowered = _mask_plan(t_r={"b[A]": 1})
    decision = check_plan(lowered, site_id="s1", policy=LocalPolicy(), **MASK_POLICY)  # type: ignore[arg-type]
    assert not decision.accept
    assert decision.reason == (
        "release b[A] would be unmasked with 1 surviving member(s), fewer than this site accepts "
        "(3: min cohort, or the DP noise's members)"
    )
    # The site's own min cohort, not the server's default, sets the floor.
    strict = LocalPolicy(min_cohort=4)
    decision = check_plan(honest, site_id="s1", policy=strict, **MASK_POLICY)  # type: ignore[arg-type]
    assert not decision.accept and "fewer than this site accepts (4" in decision.reason
    # A round threshold below a majority (split views of the survivors) is refused too.
    decision = check_plan(_mask_plan(t=2), site_id="s1", policy=LocalPolicy(), **MASK_POLICY)  # type: ignore[arg-type]
    assert not decision.accept and "below a majority of the 4 participants" in decision.reason


@settings(max_examples=30, deadline=None)
@given(t_r=st.integers(1, 5), min_cohort=st.integers(1, 5), site=st.sampled_from(SITES))
def test_survivor_threshold_acceptance_matches_the_rule(
    t_r: int, min_cohort: int, site: str
) -> None:
    """Oracle: the site accepts iff every t_R of its releases is >= its min cohort and <= the
    release's 4 members (t_R > m is an invalid plan), and its min cohort allows 4 members."""
    plan = _mask_plan(t_r={"gram[all]": t_r})
    policy = LocalPolicy(min_cohort=min_cohort)
    decision = check_plan(plan, site_id=site, policy=policy, **MASK_POLICY)  # type: ignore[arg-type]
    b_floor = max(default_floor(4), 3)  # the server's default t_R of b[A]
    expected = min_cohort <= 4 and min_cohort <= t_r <= 4 and min_cohort <= b_floor
    assert decision.accept == expected, decision.reason


def default_floor(m: int) -> int:
    """The default release threshold of docs/protocol.md §4.2: a majority of the members."""
    return m // 2 + 1


# --- sparse masking graph (docs/protocol.md §4.2 "Sparse graph") ---------------------------------

SPARSE_SITES = [f"s{i:02d}" for i in range(24)]


def _sparse_plan(**graph: float) -> Any:
    """A MASK plan over 24 sites as the server builds it with mask_graph = "sparse" (defaults:
    a third colluding, 5 % drop-outs, 2^-40), then ``graph`` fields changed by the coordinator."""
    mode = MaskMode(
        MaskSettings(gram_bound=1.0e4, vector_bound=10.0, graph="sparse"),
        identities={s: public_key_to_raw(Ed25519PrivateKey.generate()) for s in SPARSE_SITES},
    )
    sites = tuple(SPARSE_SITES)
    releases = round1_releases(
        classes=("A",), participants=sites, coverage={}, gram_scope="global", d=4,
        need_global_gram=False,
    )  # fmt: skip
    plan = build_plan(
        federation_id="fed", round_id="r1-s", round_number=1, participants=sites,
        gram_scope="global", releases=releases, options=mode.plan_options(sites),
    )  # fmt: skip
    for key, value in graph.items():
        setattr(plan.mask_graph, key, value)
    return plan


def test_the_servers_sparse_plan_is_accepted_by_a_default_site() -> None:
    plan = _sparse_plan()
    graph = plan.mask_graph
    assert 2 <= graph.degree < len(SPARSE_SITES) - 1 and graph.degree % 2 == 0
    assert (graph.colluders, graph.dropouts) == (8, 1)  # ⌈0.333·24⌉, ⌊0.05·24⌋
    assert plan.mask_threshold == len(SPARSE_SITES) - graph.dropouts
    decision = check_plan(plan, site_id="s00", policy=LocalPolicy(), **MASK_POLICY)  # type: ignore[arg-type]
    assert decision.accept, decision.reason


def test_a_lowered_degree_or_threshold_is_refused_with_the_failure_probability() -> None:
    """The coordinator lowers k (cheaper, but a site's neighbourhood is then likely to hold t_N
    colluders) and states a reassuring failure probability: each site recomputes it."""
    for change in ({"degree": 4, "share_threshold": 3}, {"share_threshold": 3}):
        plan = _sparse_plan(**change, failure_log2=-60.0)
        decision = check_plan(plan, site_id="s00", policy=LocalPolicy(), **MASK_POLICY)  # type: ignore[arg-type]
        assert not decision.accept
        assert decision.reason.startswith("the plan states a graph failure probability of 2^-60.0")


def test_the_site_uses_its_own_colluder_bound_not_the_plans() -> None:
    """A plan sized for no colluders (C = 0: then k = 4 is 'safe') is refused by a site that
    assumes a third of the participants may collude, and accepted by one assuming none."""
    plan = _sparse_plan(degree=4, share_threshold=3, colluders=0, failure_log2=-math.inf)
    decision = check_plan(plan, site_id="s00", policy=LocalPolicy(), **MASK_POLICY)  # type: ignore[arg-type]
    assert not decision.accept
    assert "for 8 colluders and 1 drop-outs, above this site's limit 2^-40" in decision.reason
    assert "[policy] mask_graph_security_bits, mask_assumed_colluders" in decision.reason
    trusting = LocalPolicy(mask_assumed_colluders=0.0)
    assert check_plan(plan, site_id="s00", policy=trusting, **MASK_POLICY).accept  # type: ignore[arg-type]
    # A more cautious site (45 % colluders) refuses the server's default plan.
    cautious = LocalPolicy(mask_assumed_colluders=0.45)
    decision = check_plan(_sparse_plan(), site_id="s00", policy=cautious, **MASK_POLICY)  # type: ignore[arg-type]
    assert not decision.accept and "for 11 colluders and 1 drop-outs" in decision.reason


def test_a_sparse_plan_with_inconsistent_drop_outs_or_releases_is_refused() -> None:
    plan = _sparse_plan()
    plan.mask_threshold -= 1  # more drop-outs than the graph was chosen for
    decision = check_plan(plan, site_id="s00", policy=LocalPolicy(), **MASK_POLICY)  # type: ignore[arg-type]
    assert not decision.accept and "is not n - D" in decision.reason
    plan = _sparse_plan(dropouts=9, colluders=8)
    plan.mask_threshold = len(SPARSE_SITES) - 9
    decision = check_plan(plan, site_id="s00", policy=LocalPolicy(), **MASK_POLICY)  # type: ignore[arg-type]
    assert not decision.accept and "it needs C + 2D < n" in decision.reason
    plan = _sparse_plan()
    del plan.releases[-1].member_site_ids[
        -1
    ]  # a release over a subset: the graph would not cover it
    decision = check_plan(plan, site_id="s00", policy=LocalPolicy(), **MASK_POLICY)  # type: ignore[arg-type]
    assert not decision.accept and "not over the whole cohort" in decision.reason
