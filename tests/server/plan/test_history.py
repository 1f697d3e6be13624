"""A training plan audited with the federation's released history (M-124): the exposures it adds
are found, cut to the sites actually in each sum, and their certificate reproduces the exposed
site's statistics from the sums (a numeric check independent of the audit)."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

from afl.server.plan.history import (
    ReleasedRound,
    history_exposures,
    history_refusal,
    released_history,
)
from afl.server.plan.release import PlannedRelease, round1_releases

CLASSES = ("A", "B")
FIVE = [f"site-{i}" for i in range(1, 6)]


def plan(members: list[str]) -> list[PlannedRelease]:
    return round1_releases(
        classes=CLASSES,
        participants=members,
        coverage={s: set(CLASSES) for s in members},
        gram_scope="global",
        d=4,
        need_global_gram=False,
    )


def published(round_id: str, members: list[str], contributors: list[str]) -> ReleasedRound:
    return ReleasedRound(round_id, f"run-{round_id}", plan(members), contributors)


def test_a_run_without_a_site_that_left_exposes_it_and_its_certificate_is_its_data() -> None:
    history = released_history([published("r1", FIVE, FIVE)])
    report, exposed = history_exposures(plan(FIVE[:4]), FIVE[:4], history=history)
    assert {s for e in exposed for s in e.sites} == {"site-5"}
    assert {e.quantity for e in exposed} == {"gram", "b[A]", "b[B]"}
    # The certificate, applied to the sums the coordinator decoded, gives site-5's Gram exactly.
    rng = np.random.default_rng(5)
    grams = {s: (lambda h: h.T @ h)(rng.normal(size=(30, 4))) for s in FIVE}
    sums = {
        name: sum(grams[s] for s in members)
        for name, members in [
            *((f"r1/{r.name}", r.members) for r in history[0][1]),
            *((r.name, r.members) for r in plan(FIVE[:4])),
        ]
    }
    gram = next(e for e in exposed if e.quantity == "gram")
    recovered = sum(float(Fraction(c)) * sums[name.split("#")[0]] for name, c in gram.certificate)
    np.testing.assert_allclose(recovered, grams["site-5"], rtol=1e-12, atol=1e-9)
    assert not report.passed
    reason = history_refusal(exposed, round_id="r2")
    assert "site-5" in reason and "r1/gram[all]" in reason and "M-124" in reason


@pytest.mark.parametrize(
    ("members", "exposed_sites"),
    [
        (FIVE, set()),  # the same sites again: nothing new
        ([*FIVE[:3], "site-5"], {"site-4"}),  # another site left
        ([*FIVE, "site-6"], {"site-6"}),  # a site joined alone
        ([*FIVE, "site-6", "site-7"], set()),  # two joined: only their sum is determined
    ],
)
def test_which_plans_the_history_refuses(members: list[str], exposed_sites: set[str]) -> None:
    history = released_history([published("r1", FIVE, FIVE)])
    _, exposed = history_exposures(plan(members), members, history=history)
    assert {s for e in exposed if len(e.sites) == 1 for s in e.sites} == exposed_sites


def test_the_history_holds_the_sites_actually_in_each_sum() -> None:
    # Round r1 planned five sites, site-5 dropped out: its sums hold four.
    history = released_history([published("r1", FIVE, FIVE[:4])])
    assert all(r.members == tuple(FIVE[:4]) for r in history[0][1])
    _, same_four = history_exposures(plan(FIVE[:4]), FIVE[:4], history=history)
    assert same_four == []
    _, five = history_exposures(plan(FIVE), FIVE, history=history)
    assert {s for e in five for s in e.sites} == {"site-5"}


def test_without_history_or_outside_a_run_nothing_is_added() -> None:
    _, exposed = history_exposures(plan(FIVE[:4]), FIVE[:4], history=[])
    assert exposed == []
    history = released_history([published("r1", FIVE, FIVE)], exclude_run="run-r1")
    assert history == []
