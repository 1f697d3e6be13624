"""The survivors a release was actually unmasked over (docs/protocol.md M-204, M-205): a site
records them in its history (afl.client.daemon.state) and audits them before it signs the
survivor list or sends an unmask share (afl.client.policy.plan.survivor_problem), so two
releases that differ only by a member who dropped out after ShareKeys are refused. The oracle
of each exposure is the difference written out by hand (numpy), not the audit."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from afl.client.config import LocalPolicy
from afl.client.daemon.state import DaemonState
from afl.client.policy.plan import check_plan, survivor_problem
from afl.core import leakage
from afl.proto.v1 import common_pb2 as cpb
from tests.helpers.calls import record_calls

FIVE = ["s1", "s2", "s3", "s4", "s5"]
POLICY = LocalPolicy(allowed_aggregation=("mask",))


def _plan(
    round_id: str, members: list[str], aggregation: int = cpb.AGGREGATION_MODE_MASK
) -> cpb.ReleasePlan:
    gram = cpb.Release(
        name="gram[all]", member_site_ids=members, kind=cpb.STATISTIC_KIND_GRAM, shape=[3, 3]
    )
    return cpb.ReleasePlan(
        round_id=round_id,
        participants=members,
        aggregation=aggregation,  # type: ignore[arg-type]
        releases=[gram],
    )


def _check(
    state: DaemonState,
    plan: cpb.ReleasePlan,
    *,
    site_id: str,
    survivors: list[str],
    policy: LocalPolicy = POLICY,
    covered: bool = False,
) -> str:
    """The site's check with its history as the daemon reads it (actual and planned)."""
    return survivor_problem(
        plan,
        site_id=site_id,
        policy=policy,
        survivors=survivors,
        history=state.history(exclude_round=plan.round_id),
        planned_history=state.history(exclude_round=plan.round_id, planned=True),
        covered=covered,
    )


def test_the_history_keeps_the_survivors_and_a_replanned_round_keeps_them(
    tmp_path: Path,
) -> None:
    state = DaemonState(tmp_path)
    state.remember(_plan("r1", FIVE))
    state.record_survivors("r1", ["s1", "s2", "s3", "s4", "sX"])  # sX: not a member
    (actual,) = state.history(exclude_round="")
    (planned,) = state.history(exclude_round="", planned=True)
    assert actual.members == frozenset(FIVE[:4]) and planned.members == frozenset(FIVE)
    state.remember(_plan("r1", FIVE))  # accepted again (a resumed round)
    assert state.history(exclude_round="")[0].members == frozenset(FIVE[:4])
    assert DaemonState(tmp_path).history(exclude_round="r1") == []


def test_a_member_dropping_after_share_keys_in_a_second_run_is_refused(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    grams = {s: rng.normal(size=(3, 3)) for s in FIVE}
    state = DaemonState(tmp_path)
    state.remember(_plan("run1-r1", FIVE))
    state.record_survivors("run1-r1", FIVE)
    second = _plan("run2-r1", FIVE)
    state.remember(second)
    # What the coordinator would hold: run 1 over five, run 2 unmasked over four.
    run1 = sum(grams[s] for s in FIVE)
    run2 = sum(grams[s] for s in FIVE[:4])
    assert np.allclose(run1 - run2, grams["s5"])  # the leak the audit must see
    why = _check(state, second, site_id="s1", survivors=FIVE[:4])
    assert "{s5}" in why and "dropped: s5" in why and "no unmask share" in why, why
    assert "\n" not in why
    everyone = _check(state, second, site_id="s1", survivors=FIVE)
    assert everyone == ""  # the same five: the two sums are equal, nothing to difference


def test_a_drop_out_recorded_in_an_earlier_round_is_caught_at_the_next_unmask(
    tmp_path: Path,
) -> None:
    """Run 1 lost s5 after ShareKeys (unmasked over four), run 2 has all five: planned members
    alone show two equal releases; the recorded survivors show s5's Gram."""
    state = DaemonState(tmp_path)
    state.remember(_plan("run1-r1", FIVE))
    state.record_survivors("run1-r1", FIVE[:4])
    second = _plan("run2-r1", FIVE)
    why = _check(state, second, site_id="s2", survivors=FIVE)
    assert "{s5}" in why and "dropped: none" in why, why


def test_dp_cover_and_allow_exposure_waive_it_and_a_first_run_passes(tmp_path: Path) -> None:
    state = DaemonState(tmp_path)
    state.remember(_plan("run1-r1", FIVE))
    state.record_survivors("run1-r1", FIVE)
    second = _plan("run2-r1", FIVE)
    assert _check(state, second, site_id="s1", survivors=FIVE[:4], covered=True) == ""
    lenient = LocalPolicy(allowed_aggregation=("mask",), allow_exposure=True)
    assert _check(state, second, site_id="s1", survivors=FIVE[:4], policy=lenient) == ""
    first = survivor_problem(
        _plan("r1", FIVE), site_id="s1", policy=POLICY, survivors=FIVE[:4], history=[],
        planned_history=[],
    )  # fmt: skip
    assert first == ""  # one release over four survivors determines no one


def test_the_plan_decision_already_refuses_a_drop_out_recorded_earlier(tmp_path: Path) -> None:
    """At the plan decision, before any key is exchanged: run 1 was unmasked over four of its five members, run 2
    plans all five (check_plan with the planned and the actual history)."""
    state = DaemonState(tmp_path)
    state.remember(_plan("run1-r1", FIVE))
    state.record_survivors("run1-r1", FIVE[:4])
    second = _plan("run2-r1", FIVE, cpb.AGGREGATION_MODE_PLAINTEXT)  # the audit is the same
    policy = LocalPolicy(allowed_aggregation=("plaintext",))
    decision = check_plan(
        second,
        site_id="s1",
        policy=policy,
        history=state.history(exclude_round="run2-r1"),
        planned_history=state.history(exclude_round="run2-r1", planned=True),
    )
    assert not decision.accept
    assert "survivors earlier releases were unmasked over" in decision.reason
    assert "{s5}" in decision.reason, decision.reason
    unrecorded = check_plan(  # without the survivors (planned members only) nothing shows
        second,
        site_id="s1",
        policy=policy,
        history=state.history(exclude_round="run2-r1", planned=True),
        planned_history=state.history(exclude_round="run2-r1", planned=True),
    )
    assert unrecorded.accept, unrecorded.reason


def test_with_nobody_dropped_one_audit_decides_and_a_site_still_sees_its_own_exposure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every member survives, now and in the history: the actual releases are the planned ones,
    so one audit stands for both (a plan of K members is audited once, not twice, per check);
    an exposure the plan already had stops only the site it exposes."""
    plan = _plan("r1", FIVE)
    plan.releases.append(
        cpb.Release(
            name="gram[x]", member_site_ids=FIVE[1:], kind=cpb.STATISTIC_KIND_GRAM, shape=[3, 3]
        )
    )  # gram[all] - gram[x] = s1's Gram, in the plan itself
    audits = record_calls(monkeypatch, leakage, "audit_releases")
    state = DaemonState(tmp_path)
    why = _check(state, plan, site_id="s1", survivors=FIVE)
    assert "{s1}" in why and "no unmask share" in why, why
    assert _check(state, plan, site_id="s2", survivors=FIVE) == ""  # planned: not new
    assert len(audits) == 2  # one per check
    audits.clear()
    assert _check(state, plan, site_id="s2", survivors=FIVE[:4]) == ""  # s5 dropped: s1 again
    assert len(audits) == 2  # planned and actual differ: both audited
