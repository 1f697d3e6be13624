"""Row bounds a site declares for masked rounds (afl.core.row_bounds): powers of two that cover
the site's statistics. Oracles: the statistics computed directly in numpy (G = HᵀH, balanced b)
and exact powers of two."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from afl.core.row_bounds import RowBounds, measure, next_power_of_two, release_bounds


@given(st.floats(min_value=1e-300, max_value=1e300, allow_nan=False, allow_infinity=False))
def test_next_power_of_two_is_the_smallest_power_at_or_above(x: float) -> None:
    p = next_power_of_two(x)
    assert p >= x and p / 2 < x
    assert math.frexp(p)[0] == 0.5  # an exact power of two


def test_next_power_of_two_refuses_non_positive() -> None:
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="finite positive"):
            next_power_of_two(bad)


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(2, 40),
    d=st.integers(1, 12),
    scale=st.floats(1e-3, 1e4),
    seed=st.integers(0, 2**16),
)
def test_declared_bounds_cover_the_gram_and_the_balanced_class_vector(
    n: int, d: int, scale: float, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    h = (rng.normal(size=(n, d)) * scale).astype(np.float32)
    measured = measure(h, block=7)  # several blocks
    h64 = h.astype(np.float64)
    assert measured.rows == n
    assert measured.max_row_norm == pytest.approx(
        float(np.linalg.norm(h64, axis=1).max()), rel=1e-12
    )
    declared = measured.declared()
    assert declared.rows >= n and declared.max_row_norm > measured.max_row_norm
    assert math.frexp(declared.rows)[0] == 0.5 and math.frexp(declared.max_row_norm)[0] == 0.5
    assert declared.declared() == RowBounds(declared.rows, 2 * declared.max_row_norm)  # margin
    assert declared.powers_of_two() == declared  # what the coordinator keeps is idempotent
    y = np.zeros(n)
    y[: n // 2] = 1
    target = np.where(y == 1, 1 / (y == 1).sum(), -1 / (y == 0).sum())
    assert np.abs(h64.T @ h64).max() <= declared.gram_bound
    assert np.abs(h64.T @ target).max() <= declared.vector_bound


def test_release_bounds_take_the_largest_member_bound() -> None:
    small, wide, long = RowBounds(1024, 1.0), RowBounds(4, 64.0), RowBounds(2**20, 0.5)
    gram, vector = release_bounds([small, wide, long])
    assert gram == max(1024 * 1.0, 4 * 64.0**2, 2**20 * 0.25) == 2**18
    assert vector == 128.0
    with pytest.raises(ValueError, match="at least one member"):
        release_bounds([])


def test_empty_or_zero_caches_declare_a_valid_bound() -> None:
    assert measure(np.zeros((0, 3))) == RowBounds(0, 0.0)
    declared = measure(np.zeros((5, 3))).declared()
    assert declared.valid and declared.rows == 8 and declared.max_row_norm > 0
    assert not RowBounds(0, 1.0).valid and not RowBounds(3, 0.0).valid
