"""The sparse graph's security parameters (afl.crypto.secagg.graph_bounds, docs/protocol.md §4.2
"Sparse graph"): exact hypergeometric tails (scipy as the oracle), the failure and abort bounds
against their definition, and the choice of k and t_N (meets σ and η, and is the smallest)."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from afl.crypto.secagg.graph_bounds import (
    abort_probability,
    choose_graph,
    colluders_for,
    dropouts_for,
    failure_probability,
    hypergeometric_tail,
    log2_probability,
)


@settings(max_examples=120, deadline=None)
@given(data=st.data())
def test_property_hypergeometric_tail_matches_scipy(data: st.DataObject) -> None:
    population = data.draw(st.integers(1, 300))
    successes = data.draw(st.integers(0, population))
    draws = data.draw(st.integers(0, population))
    at_least = data.draw(st.integers(-1, draws + 1))
    exact = hypergeometric_tail(population, successes, draws, at_least)
    oracle = stats.hypergeom(population, successes, draws).sf(at_least - 1)
    assert 0 <= exact <= 1
    assert float(exact) == pytest.approx(oracle, rel=1e-9, abs=1e-300)


def test_failure_probability_is_the_documented_sum() -> None:
    """P_fail = n·P[Hyp(n-1, C, k) >= t_N] + n(n-k+1)/2·P[Hyp(n, C, k) >= k-D], from scipy."""
    n, k, t_n, c, d = 256, 60, 46, 86, 12
    e1 = n * stats.hypergeom(n - 1, c, k).sf(t_n - 1)
    e2 = n * (n - k + 1) / 2 * stats.hypergeom(n, c, k).sf(k - d - 1)
    p = failure_probability(n=n, degree=k, share_threshold=t_n, colluders=c, dropouts=d)
    assert float(p) == pytest.approx(e1 + e2, rel=1e-9)
    abort = abort_probability(n=n, degree=k, share_threshold=t_n, dropouts=d)
    assert float(abort) == pytest.approx(n * stats.hypergeom(n - 1, d, k).sf(k - t_n), rel=1e-9)


def test_no_colluders_and_more_neighbours_than_dropouts_never_fail() -> None:
    assert failure_probability(n=30, degree=4, share_threshold=2, colluders=0, dropouts=3) == 0
    # k <= D: the coordinator can cut the ring by dropping sites alone.
    assert failure_probability(n=30, degree=4, share_threshold=2, colluders=0, dropouts=4) == 1


def _meets(n: int, k: int, t: int, c: int, d: int) -> bool:
    """Both bounds of the module docstring at σ = 40, η = 30 (the definition, brute force)."""
    fail = failure_probability(n=n, degree=k, share_threshold=t, colluders=c, dropouts=d)
    abort = abort_probability(n=n, degree=k, share_threshold=t, dropouts=d)
    return fail <= Fraction(1, 2**40) and abort <= Fraction(1, 2**30)


@pytest.mark.parametrize("n", [8, 16, 24, 32, 64, 128])
def test_choose_graph_meets_sigma_and_eta_and_is_the_smallest(n: int) -> None:
    c, d = colluders_for(n, 0.333), dropouts_for(n, 0.05)
    choice = choose_graph(n=n, colluders=c, dropouts=d)
    found = [(k, t) for k in range(2, n - 1, 2) for t in range(2, k + 1) if _meets(n, k, t, c, d)]
    if choice is None:  # the full graph: no sparse graph meets both bounds
        assert found == []
        return
    k, t_n = choice.degree, choice.share_threshold
    assert (k, t_n) == min(found)  # the smallest k, and for it the smallest t_N
    fail = failure_probability(n=n, degree=k, share_threshold=t_n, colluders=c, dropouts=d)
    abort = abort_probability(n=n, degree=k, share_threshold=t_n, dropouts=d)
    assert choice.failure_log2 == log2_probability(fail)
    assert choice.abort_log2 == log2_probability(abort)


def test_the_degree_stays_far_below_the_cohort() -> None:
    """At the default fractions k/n falls as n grows (the masking cost per site is k streams,
    not n), and C + 2D >= n is refused."""
    ks = {}
    for n in (64, 128, 256, 512):
        choice = choose_graph(
            n=n, colluders=colluders_for(n, 0.333), dropouts=dropouts_for(n, 0.05)
        )
        assert choice is not None
        ks[n] = choice.degree
    assert ks[64] / 64 > ks[128] / 128 > ks[256] / 256 > ks[512] / 512
    assert ks[256] <= 64
    assert choose_graph(n=100, colluders=50, dropouts=25) is None


def test_fractions_round_to_the_safe_side() -> None:
    assert colluders_for(24, 0.333) == 8 and colluders_for(256, 0.333) == 86
    assert colluders_for(10, 0.3) == 3  # 0.3 · 10 is 3.0000000000000004 in floating point
    assert dropouts_for(24, 0.05) == 1 and dropouts_for(256, 0.05) == 12
    with pytest.raises(ValueError):
        colluders_for(10, 1.0)
    with pytest.raises(ValueError):
        dropouts_for(10, 0.5)
    assert log2_probability(Fraction(0)) == -math.inf
    assert log2_probability(Fraction(1, 2**50)) == -50.0
