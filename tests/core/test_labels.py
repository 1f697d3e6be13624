"""Balanced label projection (eq. 7) invariants."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from afl.core.labels import LabelError, balanced_targets


@settings(max_examples=60, deadline=None)
@given(
    labels=hnp.arrays(
        np.int8, st.tuples(st.integers(1, 60), st.integers(1, 6)), elements=st.integers(0, 1)
    ),
    data=st.data(),
)
def test_balanced_columns_sum_to_zero_and_have_unit_mass(labels, data):
    active = np.array(
        data.draw(st.lists(st.booleans(), min_size=labels.shape[1], max_size=labels.shape[1]))
    )
    lab = labels.copy()
    lab[:, ~active] = -1
    out = balanced_targets(lab, active=active)
    for c in range(lab.shape[1]):
        col = out.targets[:, c]
        if out.usable[c]:
            assert col[lab[:, c] == 1].sum() == pytest.approx(1.0)
            assert col[lab[:, c] == 0].sum() == pytest.approx(-1.0)
            assert col.sum() == pytest.approx(0.0, abs=1e-12)
        else:
            assert not col.any()
    usable_expected = active & (lab == 1).any(axis=0) & (lab == 0).any(axis=0)
    np.testing.assert_array_equal(out.usable, usable_expected)
    assert len(out.skipped) == int((active & ~usable_expected).sum())


def test_known_values():
    lab = np.array([[1, -1], [0, -1], [0, -1], [0, -1]], dtype=np.int8)
    out = balanced_targets(lab, active=np.array([True, False]))
    np.testing.assert_allclose(out.targets[:, 0], [1.0, -1 / 3, -1 / 3, -1 / 3])
    np.testing.assert_array_equal(out.targets[:, 1], 0.0)


def test_active_class_with_unlabelled_rows_is_an_error():
    with pytest.raises(LabelError, match="unlabelled"):
        balanced_targets(np.array([[1], [-1]], dtype=np.int8), active=np.array([True]))
    with pytest.raises(LabelError, match="-1"):
        balanced_targets(np.array([[2]], dtype=np.int8), active=np.array([True]))
