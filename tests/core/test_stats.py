"""Streaming statistics equal their direct definitions (eq. 7, 11, 12)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from afl.core.labels import LabelError, balanced_targets
from afl.core.packing import pack_upper, packed_length, unpack_upper
from afl.core.stats import StatsAccumulator, local_statistics
from tests.helpers.probe import run_probe


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), batch=st.integers(1, 50))
def test_streaming_equals_direct(seed, batch):
    rng = np.random.default_rng(seed)
    n, d, c = int(rng.integers(5, 80)), 6, 3
    h = rng.normal(size=(n, d)).astype(np.float32)
    y = (rng.random((n, c)) < 0.4).astype(np.int8)
    active = np.array([True, False, True])
    y[:, 1] = -1
    stats = local_statistics(h, y, active=active, batch_size=batch)
    h64 = h.astype(np.float64)
    np.testing.assert_allclose(stats.gram, h64.T @ h64, rtol=1e-12, atol=1e-12)
    target = balanced_targets(y, active=active)
    np.testing.assert_allclose(stats.b, h64.T @ target.targets, rtol=1e-10, atol=1e-12)
    np.testing.assert_array_equal(stats.contributes, target.usable)
    assert stats.n == n


def test_gram_is_symmetric_and_float64():
    rng = np.random.default_rng(0)
    acc = StatsAccumulator(d=5, num_classes=1)
    for _ in range(3):
        acc.update(rng.normal(size=(7, 5)), np.zeros((7, 1), dtype=np.int8))
    g = acc.gram()
    assert g.dtype == np.float64
    np.testing.assert_array_equal(g, g.T)


def test_class_without_positives_is_skipped_with_reason():
    h = np.ones((4, 2))
    y = np.array([[0, 1], [0, 0], [0, 1], [0, 0]], dtype=np.int8)
    stats = local_statistics(h, y, active=np.array([True, True]))
    assert stats.contributes.tolist() == [False, True]
    np.testing.assert_array_equal(stats.b[:, 0], 0.0)
    assert len(stats.skipped) == 1 and "0 positives" in stats.skipped[0]


def test_bad_input_is_rejected():
    acc = StatsAccumulator(d=3, num_classes=2)
    with pytest.raises(ValueError, match="features must be"):
        acc.update(np.ones((2, 4)), np.zeros((2, 2), dtype=np.int8))
    with pytest.raises(ValueError, match="NaN"):
        acc.update(np.full((2, 3), np.nan), np.zeros((2, 2), dtype=np.int8))
    with pytest.raises(LabelError):
        acc.update(np.ones((2, 3)), np.full((2, 2), 3, dtype=np.int8))
    acc.update(np.ones((2, 3)), np.array([[1, -1], [0, -1]], dtype=np.int8))
    with pytest.raises(LabelError, match="unlabelled"):
        acc.finalize(active=np.array([True, True]))


@settings(max_examples=20, deadline=None)
@given(d=st.integers(1, 40), seed=st.integers(0, 1000))
def test_pack_roundtrip(d, seed):
    m = np.random.default_rng(seed).normal(size=(d, d))
    sym = m + m.T
    packed = pack_upper(sym)
    assert packed.shape == (packed_length(d),)
    np.testing.assert_array_equal(unpack_upper(packed), sym)


def test_packed_length_of_densenet_features():
    assert packed_length(1024) == 524_800
    with pytest.raises(ValueError):
        unpack_upper(np.zeros(5))


def test_restriction_equals_computing_with_fewer_active_classes():
    rng = np.random.default_rng(4)
    h = rng.normal(size=(50, 4))
    y = (rng.random((50, 3)) < 0.3).astype(np.int8)
    y[:, 2] = 0  # class 2 has no positives: skipped wherever it is active
    full = local_statistics(h, y, active=np.ones(3, dtype=bool))
    active = np.array([True, False, True])
    y_partial = y.copy()
    y_partial[:, 1] = -1
    direct = local_statistics(h, y_partial, active=active)
    restricted = full.restricted_to(active)
    np.testing.assert_array_equal(restricted.contributes, direct.contributes)
    np.testing.assert_allclose(restricted.b, direct.b, rtol=1e-13, atol=1e-15)
    np.testing.assert_array_equal(restricted.n_pos, direct.n_pos)
    assert restricted.skipped == direct.skipped


def test_accumulating_statistics_imports_no_scipy() -> None:
    # A site daemon whose rounds need only its statistics starts without scipy (its start-up is
    # a third of the daemon's CPU); numpy's h.T @ h is BLAS dsyrk as well.
    probe = (
        "import sys\n"
        "import numpy as np\n"
        "from afl.core.stats import StatsAccumulator\n"
        "acc = StatsAccumulator(d=3, num_classes=1)\n"
        "h = np.arange(12.0).reshape(4, 3)\n"
        "acc.update(h, np.array([[1], [0], [1], [-1]]))\n"
        "assert (acc.gram() == h.T @ h).all()\n"
        "print('scipy' in sys.modules)\n"
    )
    assert run_probe(probe) == "False"
