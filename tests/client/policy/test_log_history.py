"""A site's whole-history audit from the federation log (docs/protocol.md §11a, M-206, M-207):
the log's release statements rebuilt into the federation's released history (planned members cut
to the logged survivors, data statistics only), and the audit of a new plan with it. The
exposures found are checked numerically: their certificate, applied to sums of generated Gram
matrices, gives the exposed site's own matrix (an oracle independent of the audit)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import Any

import numpy as np
import pytest

from afl.client.policy.loghistory import (
    LogHistoryError,
    logged_release_problem,
    logged_rounds,
    release_fields,
    whole_history_problem,
    with_unmasked,
)
from afl.client.policy.plan import audit_view
from afl.core.audit.history import history_exposures, history_releases
from afl.crypto.transparency.statements import decode_statement, statement_bytes
from afl.proto.v1 import common_pb2 as cpb

FED = "fed-history"
CLASSES = ("A", "B")


def _releases(members: Sequence[str]) -> list[dict[str, object]]:
    """A round's logged releases, as the coordinator writes them: a global Gram, one class
    vector per class, and a pseudo-label vector and an evaluation release that are not data."""
    return [
        {"name": "gram[all]", "kind": "STATISTIC_KIND_GRAM", "classes": [], "members": [*members]},
        *(
            dict[str, object](name=f"b[{c}]", kind="STATISTIC_KIND_CLASS_VECTOR", classes=[c],
                              members=[*members])
            for c in CLASSES
        ),
        {"name": "b_pseudo[A]", "kind": "STATISTIC_KIND_PSEUDO_CLASS_VECTOR", "classes": ["A"],
         "members": [*members]},
        {"name": "eval_hist[all]", "kind": "STATISTIC_KIND_SCORE_HISTOGRAM", "classes": ["A"],
         "members": [*members]},
    ]  # fmt: skip


def _log(*rounds: tuple[str, Sequence[str], Sequence[str]]) -> list[tuple[str, dict[str, object]]]:
    """(kind, fields) of a log whose rounds (id, planned members, survivors) were released, as
    the site decodes them from the log's entries (other statements in between)."""
    out = []
    for round_id, members, survivors in rounds:
        for kind, fields in (
            ("plan", {"round_id": round_id, "plan_sha256": "00" * 32}),
            ("release", {"round_id": round_id, "run_id": f"run-{round_id}",
                         "survivors": sorted(survivors), "releases": _releases(members)}),
        ):  # fmt: skip
            entry = statement_bytes(federation=FED, kind=kind, fields=fields)
            out.append(decode_statement(entry, federation=FED))
    return out


def _plan(round_id: str, members: Sequence[str]) -> cpb.ReleasePlan:
    releases = [
        cpb.Release(name="gram[all]", kind=cpb.STATISTIC_KIND_GRAM, member_site_ids=members),
        *(
            cpb.Release(
                name=f"b[{c}]", kind=cpb.STATISTIC_KIND_CLASS_VECTOR, class_names=[c],
                member_site_ids=members,
            )
            for c in CLASSES
        ),
    ]  # fmt: skip
    return cpb.ReleasePlan(round_id=round_id, participants=members, releases=releases)


FIVE = [f"site-{i}" for i in range(1, 6)]


def test_the_log_s_release_statements_become_the_released_history() -> None:
    rounds = logged_rounds(_log(("r1", FIVE, FIVE[:4])))  # site-5 dropped out of r1
    (r1,) = rounds
    assert (r1.round_id, r1.run_id, sorted(r1.contributors)) == ("r1", "run-r1", FIVE[:4])
    # Data statistics only: the Gram and one quantity per class vector.
    assert sorted(r.quantity for r in r1.releases) == ["b[A]", "b[B]", "gram"]
    history = history_releases(rounds)
    assert {r.name for r in history} == {"r1/gram[all]", "r1/b[A]", "r1/b[B]"}
    assert all(r.members == frozenset(FIVE[:4]) for r in history)  # over the survivors
    assert history_releases(rounds, exclude_round="r1") == []


@pytest.mark.parametrize(
    "fields",
    [
        {"run_id": "x", "survivors": [], "releases": []},  # no round
        {"round_id": "r1", "survivors": "site-1", "releases": []},
        {"round_id": "r1", "survivors": [], "releases": [{"kind": "NOPE", "members": []}]},
        {"round_id": "r1", "survivors": [], "releases": [
            {"name": "g", "kind": "STATISTIC_KIND_GRAM", "classes": [], "members": [3]}]},
    ],
)  # fmt: skip
def test_a_malformed_release_statement_is_refused(fields: dict[str, object]) -> None:
    with pytest.raises(LogHistoryError):
        logged_rounds([("release", fields)])


def test_separate_views_expose_a_site_no_refusing_site_shared_a_run_with() -> None:
    """Attack 2: {A,B,V}, then {C,D}, then {A,B,C,D}: V = G(ABV) − G(ABCD) + G(CD)."""
    log = _log(("r1", ["A", "B", "V"], ["A", "B", "V"]), ("r2", ["C", "D"], ["C", "D"]))
    plan = _plan("r3", ["A", "B", "C", "D"])
    reason, detail = whole_history_problem(plan, rounds=logged_rounds(log), min_cohort=2)
    assert "V" in reason.split("statistics of ")[1].split(" (")[0]
    assert "r1/gram[all]" in reason and "r2/gram[all]" in reason and "M-206" in reason
    assert "wait until more sites join" in reason and "DP" in reason
    assert detail is not None and detail["passed"] is False
    # The certificate is V's Gram, from the three sums alone.
    _, exposed = history_exposures(
        audit_view(list(plan.releases)),
        history=history_releases(logged_rounds(log)),
        sites=list(plan.participants),
        min_cohort=2,
    )
    gram = next(e for e in exposed if e.quantity == "gram")
    assert gram.sites == frozenset({"V"})
    rng = np.random.default_rng(7)
    grams = {s: (lambda h: h.T @ h)(rng.normal(size=(20, 3))) for s in "ABCDV"}
    members = {"r1/gram[all]": "ABV", "r2/gram[all]": "CD", "gram[all]": "ABCD"}
    sums = {name: sum(grams[s] for s in who) for name, who in members.items()}
    recovered = sum(float(Fraction(c)) * sums[name] for name, c in gram.certificate)
    np.testing.assert_allclose(recovered, grams["V"], rtol=1e-12, atol=1e-9)


@pytest.mark.parametrize(
    ("members", "exposed"),
    [
        (FIVE[:4], "site-5"),  # attack 1: re-training after site-5 left
        ([*FIVE[:3], "site-5"], "site-4"),
        ([*FIVE, "site-6"], "site-6"),  # a site joined alone
        (FIVE, ""),  # the same sites again
        ([*FIVE, "site-6", "site-7"], ""),  # two joined: only their sum, not below min_cohort 2
    ],
)
def test_which_plans_the_log_s_history_refuses(members: list[str], exposed: str) -> None:
    rounds = logged_rounds(_log(("r1", FIVE, FIVE)))
    reason, _ = whole_history_problem(_plan("r2", members), rounds=rounds, min_cohort=2)
    assert (exposed in reason) if exposed else reason == "", reason


def test_the_survivors_not_the_planned_members_are_what_was_released() -> None:
    rounds = logged_rounds(_log(("r1", FIVE, FIVE[:4])))  # site-5 dropped out
    assert whole_history_problem(_plan("r2", FIVE[:4]), rounds=rounds, min_cohort=3)[0] == ""
    reason, _ = whole_history_problem(_plan("r2", FIVE), rounds=rounds, min_cohort=3)
    assert "site-5" in reason


def test_a_small_group_is_refused_and_what_was_known_before_is_not() -> None:
    rounds = logged_rounds(_log(("r1", FIVE, FIVE)))
    reason, _ = whole_history_problem(_plan("r2", FIVE[:3]), rounds=rounds, min_cohort=3)
    assert "site-4, site-5" in reason  # their sum, a group below min_cohort 3
    # r1 and r2 over the same sites already determined nothing new: a third run passes, and a
    # history that already exposes a site (an earlier DP run) does not refuse every later plan.
    old = _log(("r1", FIVE, FIVE), ("r2", FIVE[:4], FIVE[:4]))
    assert (
        whole_history_problem(_plan("r3", FIVE), rounds=logged_rounds(old), min_cohort=3)[0] == ""
    )
    assert whole_history_problem(_plan("r3", FIVE), rounds=[], min_cohort=3) == ("", None)


def _stated(round_id: str, members: Sequence[str], survivors: Sequence[str], **extra: object
            ) -> list[tuple[str, dict[str, object]]]:  # fmt: skip
    """The log's statements of a round whose release statement lists the plan's data releases
    over ``members`` and ``survivors`` (with ``extra`` fields)."""
    fields = {"round_id": round_id, "run_id": "run-1", "survivors": sorted(survivors),
              "releases": _releases(members)[:3], **extra}  # fmt: skip
    entry = statement_bytes(federation=FED, kind="release", fields=fields)
    return [decode_statement(entry, federation=FED)]


def test_a_member_checks_the_log_s_statement_of_its_round_against_what_it_signed() -> None:
    """M-230: every other site's whole-history audit reads the round's release statement; the
    round's members check it states the plan's releases and the survivors they signed."""
    plan = _plan("r1", FIVE)
    assert logged_release_problem(plan, _stated("r1", FIVE, FIVE), survivors=set(FIVE)) == ""
    assert logged_release_problem(plan, _stated("r1", FIVE, FIVE[:4]), survivors=None) == ""
    problems = {
        # the log hides that site-5 is in the sums (a later run over site-1..4 would then look
        # like no difference to it)
        "site-5": logged_release_problem(plan, _stated("r1", FIVE, FIVE[:4]), survivors=FIVE),
        "not-a-site": logged_release_problem(
            plan, _stated("r1", FIVE, [*FIVE, "not-a-site"]), survivors=None
        ),
        "the signed plan as": logged_release_problem(
            plan, _stated("r1", FIVE[:4], FIVE), survivors=None
        ),
        "no release statement of round r1": logged_release_problem(
            plan, _stated("r1", FIVE, FIVE, published=False), survivors=None
        ),
        "names releases": logged_release_problem(
            cpb.ReleasePlan(round_id="r1", participants=FIVE, releases=plan.releases[:1]),
            _stated("r1", FIVE, FIVE),
            survivors=None,
        ),
    }
    for expected, problem in problems.items():
        assert expected in problem and "r1" in problem, (expected, problem)
    assert "no release statement of round r2" in logged_release_problem(
        _plan("r2", FIVE), _stated("r1", FIVE, FIVE), survivors=None
    )


def test_a_round_this_site_helped_unmask_counts_whatever_the_log_says_of_it() -> None:
    """A masked round over {A,B,X} is aborted after the coordinator decoded its sums, and the
    coordinator logs no release of it, or one naming less than it decoded. A, B and X signed its
    survivors and recorded it (:func:`release_fields`); their audit of the next plan, over
    {A,B,X,V}, counts all of it as released: every difference exposes V's statistics."""
    hidden = _plan("r-hidden", ["A", "B", "X"])
    recorded = [release_fields(hidden, survivors=["A", "B", "X"])]
    plan = _plan("r2", ["A", "B", "X", "V"])

    def exposed(log: Sequence[tuple[str, Mapping[str, Any]]]) -> set[str]:
        _, detail = whole_history_problem(plan, rounds=logged_rounds(log), min_cohort=2)
        found = detail["exposed"] if detail is not None else []
        assert isinstance(found, list)
        assert all(e["sites"] == ["V"] for e in found)
        return {str(e["quantity"]) for e in found}

    everything = {"gram", "b[A]", "b[B]"}
    b_a_only = {
        "round_id": "r-hidden", "run_id": "run-1", "survivors": ["A", "B", "X"],
        "published": False, "releases": _releases(["A", "B", "X"])[1:2],
    }  # fmt: skip
    for log, from_log_alone in (([], set()), ([("release", b_a_only)], {"b[A]"})):
        assert exposed(log) == from_log_alone
        statements, unlogged = with_unmasked(log, recorded)
        assert unlogged == ([] if log else ["r-hidden"])
        assert exposed(statements) == everything
    # A round the log states as this site recorded it is counted once, as it was.
    log = _log(("r1", FIVE, FIVE))
    statements, unlogged = with_unmasked(log, [release_fields(_plan("r1", FIVE), survivors=FIVE)])
    assert unlogged == []
    assert history_releases(logged_rounds(statements)) == history_releases(logged_rounds(log))
    for members in (FIVE[:4], FIVE):
        alone, _ = whole_history_problem(
            _plan("r2", members), rounds=logged_rounds(log), min_cohort=2
        )
        merged, _ = whole_history_problem(
            _plan("r2", members), rounds=logged_rounds(statements), min_cohort=2
        )
        assert merged == alone


def test_a_round_id_stated_twice_is_two_sums_and_a_released_round_id_is_not_planned_again() -> None:
    """A coordinator logs r0 over {C,V}, r1 over {A,B,C}, then reuses the id r1 for a round
    over {D,E} (D and E never saw the first r1). A, B and C recorded the first r1 themselves.
    The plan r2 over {A,B,D,E} gives V = r0 − r1 + r2 − r1′: every site's audit counts both
    statements of r1 (the site's own record does not replace the log's) and refuses it. A plan
    reusing a released round id is refused outright."""
    log = _log(("r0", ["C", "V"], ["C", "V"]), ("r1", ["A", "B", "C"], ["A", "B", "C"]))
    log += _log(("r1", ["D", "E"], ["D", "E"]))[1:]  # its release statement only
    plan = _plan("r2", ["A", "B", "D", "E"])
    own = [release_fields(_plan("r1", ["A", "B", "C"]), survivors=["A", "B", "C"])]
    for statements in (log, with_unmasked(log, own)[0]):
        reason, _ = whole_history_problem(plan, rounds=logged_rounds(statements), min_cohort=2)
        assert "statistics of C, V" in reason, reason  # and C = r1 − r2 + r1′
        assert "r1/gram[all]~2" in reason or "r1/b[A]~2" in reason, reason
    gated = _log(("r1", FIVE, FIVE)) + _log(("r1", FIVE, FIVE))[1:]  # candidate, then published
    assert len(history_releases(logged_rounds(gated))) == len(
        history_releases(logged_rounds(_log(("r1", FIVE, FIVE))))
    )
    reason, _ = whole_history_problem(_plan("r1", FIVE), rounds=logged_rounds(log), min_cohort=2)
    assert "already holds a release of round r1" in reason


def test_a_made_up_release_neither_lets_a_plan_through_nor_stops_every_later_plan() -> None:
    """M-233: the coordinator logs a release of a round nobody took part in (r0: site-5 alone),
    which would make site-5's statistics look exposed before. Runs over {1,2,5} and {3,4} were
    witnessed (every survivor signed an opening). The plan over {1,2,3,4} gives site-5 as
    G(125) - G(1234) + G(34): judged with the made-up release as known before it passed; with
    only the witnessed releases known before it is refused, naming site-5. A plan that adds
    nothing to the witnessed history (all five sites) still passes: the made-up release alone
    does not stop the federation."""
    one_two_five, three_four = ["site-1", "site-2", "site-5"], ["site-3", "site-4"]
    witnessed = logged_rounds(
        _log(("r1", one_two_five, one_two_five), ("r2", three_four, three_four))
    )
    made_up = logged_rounds(_log(("r0", ["site-5"], ["site-5"])))
    every = [*made_up, *witnessed]
    plan = _plan("r3", FIVE[:4])
    assert whole_history_problem(plan, rounds=every, min_cohort=2)[0] == ""  # the old rule
    reason, detail = whole_history_problem(plan, rounds=every, known=witnessed, min_cohort=2)
    assert "would expose" in reason and "site-5" in reason, reason
    assert "r1/gram[all]" in reason and "r2/gram[all]" in reason, reason
    assert detail is not None and not detail["passed"]
    assert (
        whole_history_problem(_plan("r3", FIVE), rounds=every, known=witnessed, min_cohort=2)[0]
        == ""
    )
    # what the witnessed history shows alone is known before, as it always was
    leaked = logged_rounds(_log(("r1", FIVE, FIVE), ("r2", FIVE[:4], FIVE[:4])))
    again = _plan("r3", FIVE)
    assert (
        whole_history_problem(again, rounds=[*made_up, *leaked], known=leaked, min_cohort=2)[0]
        == ""
    )


def test_a_made_up_release_does_not_hide_a_real_round_that_was_not_witnessed() -> None:
    """A masked round is unmasked over its survivors U3 once t of them signed the consistency
    check (afl.crypto.secagg.client: fewer than t signatures refuse, a missing one does not),
    so a survivor whose opening the coordinator refused to log (or who crashed before logging
    it) is in the sum, and the release is in the log (the other survivors' openings, the
    coordinator's statement) without being witnessed. r1 over {1,2,5} is such a round (site-5's
    opening was not logged); r2 over {1,2,3,4} was witnessed; r0 is made up over site-5 alone.
    The plan r3 over {3,4} gives site-5 as G(125) - G(1234) + G(34) from real releases only. Its
    participants never took part in r1 (their own records hold r2), so what they know before
    is r2 alone, which the plan adds nothing to; the whole history adds site-5's exposure only
    together with r0, which the whole-history rule counts as known before. The plan is refused
    because r1 is among what some site signed (sites 1 and 2 opened it), and the plan adds
    site-5's exposure to that part of the history (M-233)."""
    one_two_five, one_to_four, three_four = ["site-1", "site-2", "site-5"], FIVE[:4], FIVE[2:4]
    unwitnessed = logged_rounds(_log(("r1", one_two_five, one_two_five)))
    witnessed = logged_rounds(_log(("r2", one_to_four, one_to_four)))
    made_up = logged_rounds(_log(("r0", ["site-5"], ["site-5"])))
    plan = _plan("r3", three_four)
    real = [*unwitnessed, *witnessed]
    # the real history alone: the plan exposes site-5, and every rule refuses it
    refused, _ = whole_history_problem(plan, rounds=real, known=witnessed, min_cohort=2)
    assert "would expose" in refused and "site-5" in refused, refused
    # with the made-up release in the log, as site-3 or site-4 audits it (M-233): r1 is not
    # witnessed, but the openings of sites 1 and 2 put it among what some site signed
    reason, _ = whole_history_problem(
        plan, rounds=[*made_up, *real], known=witnessed, signed=real, min_cohort=2
    )
    assert "would expose" in reason and "site-5" in reason, reason
    # had only the witnessed part counted as signed, the made-up release would have hidden it
    lenient, _ = whole_history_problem(
        plan, rounds=[*made_up, *real], known=witnessed, signed=witnessed, min_cohort=2
    )
    assert lenient == ""
