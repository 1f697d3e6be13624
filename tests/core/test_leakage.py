"""Tests of the release-plan leakage audit (docs/protocol.md §6)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from afl.core import leakage
from afl.core.leakage import (
    Exposure,
    Release,
    ReleasePlanError,
    SiteId,
    audit_releases,
    format_report,
    releases_for_round,
)
from tests.helpers.calls import record_calls

SITES8 = list(range(8))


def rel(name: str, members: range | list[int] | set[int], quantity: str = "sum") -> Release:
    return Release(name, frozenset(members), quantity)


def check_certificate(exp: Exposure, releases: list[Release], sites: Sequence[SiteId]) -> None:
    """Independent check: Σ coefficient · indicator(release) == indicator(exp.sites), exactly."""
    by_name = {r.name: r for r in releases}
    total = {s: Fraction(0) for s in sites}
    for name, coeff in exp.certificate:
        assert by_name[name].quantity == exp.quantity
        for s in by_name[name].members:
            total[s] += coeff
    assert total == {s: Fraction(1 if s in exp.sites else 0) for s in sites}


def singleton_sets(report) -> set[frozenset[object]]:
    return {e.sites for e in report.exposed_sites}


def test_two_overlapping_releases_expose_only_a_difference() -> None:
    # a·{0..6} + b·{1..7} = e_0 needs a = 1 (site 0), b = 0 (site 7), a + b = 0 (site 1): none.
    # The server learns G_0 - G_7, which is neither a site nor a group sum.
    releases = [rel("A", range(7)), rel("B", range(1, 8))]
    report = audit_releases(releases, SITES8)
    assert report.exposed_sites == ()
    assert report.small_groups == ()
    assert report.small_releases == ()
    assert report.passed


def test_adding_the_total_exposes_both_ends() -> None:
    # U - B = e_0 and U - A = e_7; every row is constant on sites 1..6, so no small group there.
    releases = [rel("A", range(7)), rel("B", range(1, 8)), rel("U", range(8))]
    report = audit_releases(releases, SITES8)
    assert singleton_sets(report) == {frozenset({0}), frozenset({7})}
    certs = {e.sites: dict(e.certificate) for e in report.exposed_sites}
    assert certs[frozenset({0})] == {"U": 1, "B": -1}
    assert certs[frozenset({7})] == {"U": 1, "A": -1}
    assert report.small_groups == ()
    assert not report.passed


def test_group_sum_below_min_cohort_is_found() -> None:
    sites = list(range(6))
    releases = [rel("all", range(6)), rel("most", range(2, 6))]
    report = audit_releases(releases, sites, min_cohort=3)
    assert report.exposed_sites == ()
    assert [g.sites for g in report.small_groups] == [frozenset({0, 1})]
    assert dict(report.small_groups[0].certificate) == {"all": 1, "most": -1}
    assert not report.passed
    # A pair is not "smaller than" a minimum cohort of 2.
    assert audit_releases(releases, sites, min_cohort=2).passed


def test_only_minimal_groups_are_reported() -> None:
    # U - A = e_0; A - B = 1_{1,2}; B = 1_{3,4,5} itself; U - B = 1_{0,1,2} contains the
    # exposed {0}: not minimal, not reported.
    sites = list(range(6))
    releases = [rel("U", range(6)), rel("A", range(1, 6)), rel("B", [3, 4, 5])]
    report = audit_releases(releases, sites, min_cohort=4)
    assert singleton_sets(report) == {frozenset({0})}
    assert [g.sites for g in report.small_groups] == [frozenset({1, 2}), frozenset({3, 4, 5})]
    assert report.small_releases == (releases[2],)


def test_missing1_style_plan_exposes_every_site_with_rational_certificates() -> None:
    # K = 4, class c labelled by all sites but c: rows 1 - e_c. Σ rows = 3·1, so
    # e_c = (Σ rows)/3 - row_c: every site is exposed, with coefficients 1/3 and -2/3.
    sites = list(range(4))
    coverage = {f"c{c}": [k for k in sites if k != c] for c in sites}
    releases = releases_for_round(coverage=coverage, participants=sites, gram_scope="per-class")
    report = audit_releases(releases, sites)
    assert report.exposed_site_ids("gram") == frozenset(sites)
    for exp in report.exposed_sites:
        if exp.quantity == "gram":
            coeffs = sorted(c for _, c in exp.certificate)
            assert coeffs == [Fraction(-2, 3), Fraction(1, 3), Fraction(1, 3), Fraction(1, 3)]
            check_certificate(exp, releases, sites)
    # b_c is released once per class: nothing to difference against.
    assert report.exposed_site_ids("b[c0]") == frozenset()


def test_missing7_per_class_exposes_all_and_fails_min_cohort() -> None:
    coverage = {f"class{i}": [i] for i in SITES8}
    releases = releases_for_round(coverage=coverage, participants=SITES8, gram_scope="per-class")
    assert len(releases) == 16
    report = audit_releases(releases, SITES8, min_cohort=3)
    assert report.exposed_site_ids("gram") == frozenset(SITES8)
    assert report.exposed_site_ids("b[class3]") == frozenset({3})
    assert set(report.small_releases) == set(releases)
    assert not report.passed


def test_global_scope_exposes_nothing() -> None:
    coverage = {f"class{i}": [i] for i in SITES8}
    releases = releases_for_round(coverage=coverage, participants=SITES8, gram_scope="global")
    assert {r.members for r in releases} == {frozenset(SITES8)}
    assert len(releases) == 1 + 8
    report = audit_releases(releases, SITES8, min_cohort=3)
    assert report.passed
    assert "PASS" in format_report(report)


def test_per_class_shares_one_gram_release_per_coverage_set() -> None:
    sites = ["h-a", "h-b", "h-c", "h-d"]
    coverage = {
        "Atelectasis": ["h-a", "h-b", "h-c"],
        "Effusion": ["h-c", "h-b", "h-a"],
        "Mass": ["h-b", "h-c", "h-d"],
    }
    releases = releases_for_round(coverage=coverage, participants=sites, gram_scope="per-class")
    grams = [r for r in releases if r.quantity == "gram"]
    assert {r.members for r in grams} == {
        frozenset({"h-a", "h-b", "h-c"}),
        frozenset({"h-b", "h-c", "h-d"}),
    }
    assert grams[0].name == "gram{h-a,h-b,h-c}"
    report = audit_releases(releases, sites, min_cohort=3)
    # The two Gram sums differ by G_a - G_d: no single site, but no group below 3 either.
    assert report.exposed_sites == ()
    assert report.small_groups == ()
    assert report.passed


def test_quantities_are_not_combined() -> None:
    # Same members as the "total exposes" case, but three different quantities: no leak.
    releases = [rel("A", range(7), "x"), rel("B", range(1, 8), "y"), rel("U", range(8), "z")]
    assert audit_releases(releases, SITES8).passed


def test_quantities_with_the_same_members_are_analysed_once_and_labelled_each(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # "x" and "y" have the same member sets (as every b_c of a global-Gram plan): one row space.
    shapes = [range(7), range(1, 8), range(8)]
    releases = [
        *(rel(n, m, "x") for n, m in zip(("A", "B", "U"), shapes, strict=True)),
        *(rel(n, m, "y") for n, m in zip(("A2", "B2", "U2"), shapes, strict=True)),
        rel("C", range(8), "z"),
    ]
    built: list[int] = []
    real = leakage._RowSpace

    class Counting(real):  # type: ignore[misc, valid-type]
        def __init__(self, *args: object) -> None:
            built.append(1)
            super().__init__(*args)

    monkeypatch.setattr(leakage, "_RowSpace", Counting)
    report = audit_releases(releases, SITES8)
    assert len(built) == 2  # {x, y} and z
    for exp in report.exposed_sites:
        check_certificate(exp, releases, SITES8)
    certs = {(e.quantity, e.sites): dict(e.certificate) for e in report.exposed_sites}
    assert certs == {
        ("x", frozenset({0})): {"U": 1, "B": -1},
        ("x", frozenset({7})): {"U": 1, "A": -1},
        ("y", frozenset({0})): {"U2": 1, "B2": -1},
        ("y", frozenset({7})): {"U2": 1, "A2": -1},
    }


@settings(max_examples=60, deadline=None)
@given(
    member_sets=st.lists(
        st.frozensets(st.sampled_from(range(6)), min_size=1), min_size=1, max_size=5
    ),
    min_cohort=st.integers(min_value=1, max_value=4),
)
def test_a_repeated_quantity_is_audited_as_if_alone(
    member_sets: list[frozenset[int]], min_cohort: int
) -> None:
    sites = list(range(6))
    first = [Release(f"p{i}", m, "p") for i, m in enumerate(member_sets)]
    second = [Release(f"q{i}", m, "q") for i, m in enumerate(member_sets)]
    both = audit_releases([*first, *second], sites, min_cohort=min_cohort)
    alone = audit_releases(second, sites, min_cohort=min_cohort)

    def of_q(found: tuple[Exposure, ...]) -> list[Exposure]:
        return [e for e in found if e.quantity == "q"]

    assert of_q(both.exposed_sites) == list(alone.exposed_sites)
    assert of_q(both.small_groups) == list(alone.small_groups)
    for exp in (*both.exposed_sites, *both.small_groups):
        check_certificate(exp, [*first, *second], sites)


def test_group_search_budget() -> None:
    sites = list(range(6))
    releases = [rel("all", range(6)), rel("most", range(2, 6))]
    report = audit_releases(releases, sites, min_cohort=3, max_group_candidates=0)
    assert not report.group_search_exhaustive
    assert report.small_groups == ()
    assert "skipped" in report.method
    assert "skipped" in format_report(report)


def test_format_report_lists_releases_and_findings() -> None:
    releases = [rel("A", range(7)), rel("B", range(1, 8)), rel("U", range(8)), rel("tiny", [3])]
    text = format_report(audit_releases(releases, SITES8))
    assert "Verdict: FAIL" in text
    assert "tiny" in text and "< min cohort" in text
    assert "+1*U" in text and "-1*B" in text
    assert "{0,1,2,3,4,5,6}" in text


@pytest.mark.parametrize(
    ("releases", "sites", "min_cohort"),
    [
        ([rel("A", [0, 9])], SITES8, 3),
        ([rel("A", [0]), rel("A", [1])], SITES8, 3),
        ([rel("A", [0])], [0, 0, 1], 3),
        ([rel("A", [0])], SITES8, 0),
    ],
)
def test_bad_plans_are_rejected(releases, sites, min_cohort) -> None:
    with pytest.raises(ReleasePlanError):
        audit_releases(releases, sites, min_cohort=min_cohort)


def test_bad_coverage_is_rejected() -> None:
    with pytest.raises(ReleasePlanError, match="no participant"):
        releases_for_round(coverage={"a": []}, participants=[0, 1], gram_scope="global")
    with pytest.raises(ReleasePlanError, match="non-participants"):
        releases_for_round(coverage={"a": [5]}, participants=[0, 1], gram_scope="per-class")
    with pytest.raises(ReleasePlanError, match="gram_scope"):
        releases_for_round(coverage={"a": [0]}, participants=[0, 1], gram_scope="bogus")  # type: ignore[arg-type]


def _in_row_space(matrix: np.ndarray, vec: np.ndarray) -> bool:
    """Float rank oracle (exact enough for small 0/1 matrices)."""
    if matrix.shape[0] == 0:
        return not vec.any()
    return bool(np.linalg.matrix_rank(np.vstack([matrix, vec])) == np.linalg.matrix_rank(matrix))


@settings(max_examples=150, deadline=None)
@given(
    n_sites=st.integers(min_value=1, max_value=7),
    data=st.data(),
    min_cohort=st.integers(min_value=1, max_value=4),
)
def test_audit_matches_rank_oracle_and_certificates_hold(n_sites, data, min_cohort) -> None:
    sites = list(range(n_sites))
    member_sets = data.draw(
        st.lists(st.frozensets(st.sampled_from(sites), min_size=1), min_size=1, max_size=6)
    )
    releases = [Release(f"r{i}", m) for i, m in enumerate(member_sets)]
    report = audit_releases(releases, sites, min_cohort=min_cohort)
    for exp in (*report.exposed_sites, *report.small_groups):
        check_certificate(exp, releases, sites)
    incidence = np.array([[1.0 if s in m else 0.0 for s in sites] for m in member_sets])

    def determined(group: tuple[int, ...]) -> bool:
        return _in_row_space(incidence, np.isin(sites, group).astype(float))

    assert singleton_sets(report) == {frozenset({s}) for s in sites if determined((s,))}
    expected_groups = set()
    found: list[frozenset[int]] = [frozenset({s}) for s in sites if determined((s,))]
    for size in range(2, min_cohort):
        for group in itertools.combinations(sites, size):
            g = frozenset(group)
            if determined(group) and not any(f < g for f in found):
                expected_groups.add(g)
                found.append(g)
    assert {e.sites for e in report.small_groups} == expected_groups
    assert set(report.small_releases) == {r for r in releases if len(r.members) < min_cohort}


def test_an_audit_is_computed_once_per_process_for_the_same_inputs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The sites of one host process audit the same plan: the second audit of equal inputs is
    the first's report (immutable), any other input is audited anew, and members given as a
    plain set (not hashable) are audited uncached, with the same verdict."""
    sites = [f"h{i}" for i in range(6)]
    plan = [
        leakage.Release("all", frozenset(sites), "g"),
        leakage.Release("but-h0", frozenset(sites[1:]), "g"),  # differences to h0
    ]
    analysed = record_calls(monkeypatch, leakage, "_audit_quantity")
    leakage._audit_cached.cache_clear()
    first = audit_releases(plan, sites, min_cohort=2)
    assert [e.sites for e in first.exposed_sites] == [frozenset({"h0"})]
    assert len(analysed) == 1
    again = audit_releases(list(plan), list(sites), min_cohort=2)
    assert again is first and len(analysed) == 1
    assert audit_releases(plan, sites, min_cohort=3) is not first and len(analysed) == 2
    loose = [leakage.Release(r.name, set(r.members), r.quantity) for r in plan]  # type: ignore[arg-type]
    assert audit_releases(loose, sites, min_cohort=2).exposed_sites == first.exposed_sites
    assert len(analysed) == 3
