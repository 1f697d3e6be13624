"""Bounded influence (afl.core.influence, docs/protocol.md §6.2): the statistics of any dataset of
the declared size pass, sums pass the summed bound, and the in-bound poisoning of ``mask`` (each
entry at 0.99 of the per-entry bound) and a Gram no dataset has are refused. Oracle: statistics
computed by afl.core.stats from generated rows of norm at most L."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from afl.core.influence import InfluenceBound, class_vector_problem, count_problem, gram_problem
from afl.core.stats import local_statistics


def _dataset(seed: int, n: int, d: int, norm: float) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    h = rng.normal(size=(n, d))
    h *= (rng.random((n, 1)) * norm) / np.linalg.norm(h, axis=1, keepdims=True)  # ‖h_i‖ <= L
    y = (rng.random((n, 3)) < 0.4).astype(np.int64)
    y[0], y[1] = 1, 0
    return h, y


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    n=st.integers(4, 60),
    d=st.integers(1, 12),
    norm=st.floats(0.01, 100.0),
    sites=st.integers(1, 4),
)
def test_property_any_dataset_of_the_declared_size_passes_and_so_does_a_sum(
    seed: int, n: int, d: int, norm: float, sites: int
) -> None:
    total = InfluenceBound(0.0, 0.0, 0.0)
    grams, vectors = [], []
    for k in range(sites):
        h, y = _dataset(seed + k, n, d, norm)
        stats = local_statistics(h, y, active=np.ones(3, dtype=bool))
        bound = InfluenceBound.of_dataset(rows=n, max_row_norm=norm)
        assert class_vector_problem(stats.b, bound=bound) == ""
        assert gram_problem(stats.gram, bound=bound) == ""
        assert count_problem(stats.n_pos.astype(np.float64), bound=bound) == ""
        total = total + bound
        grams.append(stats.gram)
        vectors.append(stats.b)
    assert class_vector_problem(np.sum(vectors, axis=0), bound=total) == ""
    assert gram_problem(np.sum(grams, axis=0), bound=total) == ""


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31), d=st.integers(2, 64), norm=st.floats(0.01, 100.0))
def test_property_the_in_bound_mask_attack_is_out_of_bound(seed: int, d: int, norm: float) -> None:
    h, y = _dataset(seed, 40, d, norm)
    stats = local_statistics(h, y, active=np.ones(3, dtype=bool))
    bound = InfluenceBound.of_dataset(rows=40, max_row_norm=norm)
    per_entry = 2.0 * norm  # mask's fixed-point bound on a class vector entry
    attack = -np.sign(stats.b) * 0.99 * per_entry
    attack[attack == 0] = 0.99 * per_entry
    problem = class_vector_problem(attack, bound=bound, classes=("A", "B", "C"))
    assert problem.startswith("class vector norm above 2L") and "A (" in problem


def test_a_gram_no_dataset_has_is_refused() -> None:
    h, y = _dataset(7, 50, 6, 3.0)
    stats = local_statistics(h, y, active=np.ones(3, dtype=bool))
    bound = InfluenceBound.of_dataset(rows=50, max_row_norm=3.0)
    inflated = stats.gram * (bound.gram_trace / np.trace(stats.gram)) * 1.01
    assert "trace" in gram_problem(inflated, bound=bound)
    negative = stats.gram.copy()
    negative[2, 2] = -1.0
    assert "negative diagonal" in gram_problem(negative, bound=bound)
    skew = stats.gram.copy()
    skew[0, 1] = skew[1, 0] = 1.01 * np.sqrt(skew[0, 0] * skew[1, 1])
    assert "sqrt(G_ii·G_jj)" in gram_problem(skew, bound=bound)
    assert "above the declared N" in count_problem(np.array([51.0]), bound=bound)
    assert "not an integer" in count_problem(np.array([1.5]), bound=bound)
