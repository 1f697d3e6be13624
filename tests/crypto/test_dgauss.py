"""The CSPRNG discrete Gaussian sampler (afl.crypto.dgauss): exact pmf oracle, moments, symmetry,
and no use of numpy's RNG. Tolerances are 6 standard errors (false alarm rate < 1e-8)."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numpy.typing import NDArray

from afl.crypto.dgauss import DiscreteGaussianError, discrete_gaussian, uniform_open01


def _pmf(sigma: float) -> tuple[NDArray[np.int64], NDArray[np.float64]]:
    """Exact pmf of N_Z(0, σ²) on its effective support (the oracle)."""
    k = np.arange(-int(20 * sigma) - 5, int(20 * sigma) + 6)
    w = np.exp(-(k.astype(np.float64) ** 2) / (2 * sigma * sigma))
    return k, w / w.sum()


@pytest.mark.parametrize("sigma", [0.5, 1.5, 4.0])
def test_frequencies_match_the_exact_pmf(sigma: float) -> None:
    n = 200_000
    x = discrete_gaussian(sigma, n)
    k, p = _pmf(sigma)
    counts = np.array([(x == v).sum() for v in k])
    assert counts.sum() == n  # nothing outside the support of the oracle
    se = np.sqrt(n * p * (1 - p)) + 1.0
    assert np.all(np.abs(counts - n * p) <= 6 * se)


@pytest.mark.parametrize("sigma", [1.0, 7.3, 1e6])
def test_mean_and_variance(sigma: float) -> None:
    n = 400_000
    x = discrete_gaussian(sigma, n).astype(np.float64)
    var = sigma**2
    if sigma < 100:
        k, p = _pmf(sigma)
        var = float((k.astype(np.float64) ** 2 * p).sum())
    assert abs(x.mean()) <= 6 * math.sqrt(var / n)
    # Var of the sample variance of a near-Gaussian variable is about 2σ⁴/n.
    assert abs(x.var() - var) <= 6 * var * math.sqrt(2 / n)


def test_symmetry_of_positive_and_negative_values() -> None:
    n = 300_000
    x = discrete_gaussian(2.5, n)
    for v in range(1, 6):
        a, b = int((x == v).sum()), int((x == -v).sum())
        assert abs(a - b) <= 6 * math.sqrt(a + b)


def test_uses_the_os_csprng_only(monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*_: object, **__: object) -> None:
        raise AssertionError("numpy's RNG must not be used")

    for name in ("default_rng", "random", "normal", "randint", "standard_normal", "RandomState"):
        monkeypatch.setattr(np.random, name, forbidden)
    calls: list[int] = []
    real = os.urandom

    def counting(n: int) -> bytes:
        calls.append(n)
        out: bytes = real(n)
        return out

    monkeypatch.setattr(os, "urandom", counting)
    discrete_gaussian(3.0, 1000)
    assert calls and sum(calls) >= 8 * 4 * 1000  # 3 uniforms per trial, >= 1 trial per value


def test_fixed_urandom_gives_fixed_output(monkeypatch: pytest.MonkeyPatch) -> None:
    # Determinism given the byte stream shows the bytes are the only randomness.
    def stream(n: int) -> bytes:
        return bytes((i * 37 + 11) % 251 for i in range(n))

    monkeypatch.setattr(os, "urandom", stream)
    assert np.array_equal(discrete_gaussian(5.0, 50), discrete_gaussian(5.0, 50))


@settings(max_examples=30, deadline=None)
@given(
    sigma=st.one_of(
        st.floats(min_value=0.0, max_value=1e12, allow_nan=False),
        st.floats(min_value=0.0, max_value=0.1, allow_subnormal=True),
    ),
    shape=st.tuples(st.integers(0, 7), st.integers(0, 7)),
)
def test_shape_dtype_and_zero_sigma(sigma: float, shape: tuple[int, int]) -> None:
    x = discrete_gaussian(sigma, shape)
    assert x.shape == shape and x.dtype == np.int64
    if sigma < 0.02:  # P(Y != 0) < 2e^-1250
        assert not x.any()
    # |x| beyond 40σ has probability < e^-800: treat as a bug.
    assert np.all(np.abs(x.astype(np.float64)) <= 40 * sigma + 1)


def test_uniforms_lie_in_the_half_open_unit_interval() -> None:
    u = uniform_open01(100_000)
    assert u.min() > 0.0 and u.max() <= 1.0
    assert abs(u.mean() - 0.5) <= 6 * math.sqrt(1 / 12 / u.size)


@pytest.mark.parametrize("sigma", [-1.0, float("nan"), float("inf"), 2.0**51])
def test_bad_sigma_is_rejected(sigma: float) -> None:
    with pytest.raises(DiscreteGaussianError):
        discrete_gaussian(sigma, 3)


def test_negative_size_is_rejected() -> None:
    with pytest.raises(DiscreteGaussianError):
        discrete_gaussian(1.0, -1)
    with pytest.raises(DiscreteGaussianError):
        uniform_open01(-1)
