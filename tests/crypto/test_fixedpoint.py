"""Tests of afl.crypto.fixedpoint: exact wrapping sums decode to the float64 sum (docs/protocol.md
§5)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from afl.crypto.errors import EncodingRangeError, FixedPointConfigError
from afl.crypto.fixedpoint import (
    RING_HALF,
    FixedPointCodec,
    choose_frac_bits,
    max_encoded_magnitude,
)


def _ring_sum(encoded: list[np.ndarray]) -> np.ndarray:
    total = np.zeros_like(encoded[0])
    for e in encoded:
        total += e  # uint64 wraps mod 2^64
    return total


def _fsum(xs: np.ndarray) -> np.ndarray:
    """Correctly rounded elementwise sum over axis 0 (oracle)."""
    flat = xs.reshape(xs.shape[0], -1)
    return np.array([math.fsum(flat[:, j]) for j in range(flat.shape[1])]).reshape(xs.shape[1:])


def _check_sum(codec: FixedPointCodec, xs: np.ndarray) -> np.ndarray:
    decoded = codec.decode(_ring_sum([codec.encode(x) for x in xs]))
    exact = _fsum(xs)
    err = np.abs(decoded - exact)
    bound = codec.sum_error_bound + 2.0**-52 * np.abs(exact)
    assert np.all(err <= bound), float(np.max(err - bound))
    return decoded


@given(
    k=st.integers(1, 16),
    bound=st.floats(1e-3, 1e12),
)
def test_choose_frac_bits_is_maximal_and_valid(k: int, bound: float) -> None:
    f = choose_frac_bits(bound=bound, max_summands=k)
    assert k * max_encoded_magnitude(bound=bound, frac_bits=f) < RING_HALF
    assert k * max_encoded_magnitude(bound=bound, frac_bits=f + 1) >= RING_HALF
    FixedPointCodec(bound=bound, frac_bits=f, max_summands=k)  # valid
    with pytest.raises(FixedPointConfigError, match="overflows"):
        FixedPointCodec(bound=bound, frac_bits=f + 1, max_summands=k)


def test_construction_checks_k_b_2f() -> None:
    # 8 · 1e5 · 2^43 ≈ 7.0e18 < 2^63 ≈ 9.22e18 < 8 · 1e5 · 2^44.
    FixedPointCodec(bound=1e5, frac_bits=43, max_summands=8)
    with pytest.raises(FixedPointConfigError, match="overflows"):
        FixedPointCodec(bound=1e5, frac_bits=44, max_summands=8)
    assert FixedPointCodec.for_bound(bound=1e5, max_summands=8).frac_bits == 43


@pytest.mark.parametrize(
    "kwargs",
    [
        {"bound": 0.0, "frac_bits": 10, "max_summands": 2},
        {"bound": -1.0, "frac_bits": 10, "max_summands": 2},
        {"bound": math.nan, "frac_bits": 10, "max_summands": 2},
        {"bound": math.inf, "frac_bits": 10, "max_summands": 2},
        {"bound": 1.0, "frac_bits": -1, "max_summands": 2},
        {"bound": 1.0, "frac_bits": 10, "max_summands": 0},
        {"bound": 1.0, "frac_bits": 1.5, "max_summands": 2},
        {"bound": True, "frac_bits": 10, "max_summands": 2},
    ],
)
def test_invalid_parameters_raise(kwargs: dict[str, object]) -> None:
    with pytest.raises(FixedPointConfigError):
        FixedPointCodec(**kwargs)  # type: ignore[arg-type]


def test_bound_too_large_for_any_frac_bits() -> None:
    with pytest.raises(FixedPointConfigError, match="0 fractional bits"):
        choose_frac_bits(bound=2.0**62, max_summands=4)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_encode_rejects_non_finite(bad: float) -> None:
    codec = FixedPointCodec.for_bound(bound=10.0, max_summands=4)
    with pytest.raises(EncodingRangeError, match="NaN or inf"):
        codec.encode(np.array([1.0, bad, 2.0]))


def test_encode_rejects_out_of_bound_without_clipping() -> None:
    codec = FixedPointCodec.for_bound(bound=8.0, max_summands=4)
    with pytest.raises(EncodingRangeError, match="exceed the declared bound"):
        codec.encode(np.array([0.0, 8.0000001, -3.0]))
    with pytest.raises(EncodingRangeError, match="exceed the declared bound"):
        codec.encode(-9.0)
    with pytest.raises(EncodingRangeError, match="dtype"):
        codec.encode(np.array(["a"]))


def test_extremes_all_at_plus_and_minus_bound() -> None:
    k = 8
    codec = FixedPointCodec.for_bound(bound=1e5, max_summands=k)
    for sign in (1.0, -1.0):
        xs = np.full((k, 3), sign * 1e5)
        decoded = _check_sum(codec, xs)
        assert np.all(decoded == sign * 8e5)


def test_negative_values_wrap_and_decode() -> None:
    codec = FixedPointCodec.for_bound(bound=1.0, max_summands=3)
    enc = codec.encode(np.array([-0.5, 0.25, -1.0]))
    assert enc.dtype == np.uint64
    assert int(enc[0]) > RING_HALF  # two's complement representation of a negative number
    np.testing.assert_array_equal(codec.decode(enc), [-0.5, 0.25, -1.0])


def test_decode_requires_uint64() -> None:
    codec = FixedPointCodec.for_bound(bound=1.0, max_summands=3)
    with pytest.raises(EncodingRangeError, match="uint64"):
        codec.decode(np.array([1, 2], dtype=np.int64))


def test_codec_is_immutable_and_shape_preserving() -> None:
    codec = FixedPointCodec.for_bound(bound=2.0, max_summands=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        codec.frac_bits = 3  # type: ignore[misc]
    x = np.linspace(-2, 2, 12).reshape(3, 4)
    enc = codec.encode(x)
    assert enc.shape == (3, 4)
    np.testing.assert_allclose(codec.decode(enc), x, rtol=0, atol=codec.resolution)
    assert codec.encode(np.array([1, -2], dtype=np.int32)).dtype == np.uint64


@settings(max_examples=60, deadline=None)
@given(
    k=st.integers(1, 12),
    data=st.data(),
)
def test_sum_property_b_like(k: int, data: st.DataObject) -> None:
    """b-like blocks: entries O(1), declared bound 4."""
    codec = FixedPointCodec.for_bound(bound=4.0, max_summands=k)
    xs = data.draw(
        hnp.arrays(np.float64, (k, 7), elements=st.floats(-4.0, 4.0, allow_subnormal=False))
    )
    _check_sum(codec, xs)


@settings(max_examples=60, deadline=None)
@given(
    k=st.integers(1, 12),
    data=st.data(),
)
def test_sum_property_gram_like(k: int, data: st.DataObject) -> None:
    """Gram-like blocks: entries up to 1e5 with their own codec; ≤1e-9 relative (norm-wise)."""
    codec = FixedPointCodec.for_bound(bound=1e5, max_summands=k)
    xs = data.draw(
        hnp.arrays(np.float64, (k, 7), elements=st.floats(-1e5, 1e5, allow_subnormal=False))
    )
    decoded = _check_sum(codec, xs)
    exact = _fsum(xs)
    scale = max(float(np.max(np.abs(exact))), 1.0)
    assert float(np.max(np.abs(decoded - exact))) <= 1e-9 * scale


def test_realistic_gram_and_b_blocks_to_1e_9_relative() -> None:
    """Per-site Gram G_k = H_kᵀH_k and b_k = H_kᵀy_k/N_k with separate codecs (docs/protocol.md
    §5)."""
    rng = np.random.default_rng(0)  # test data only, not key material
    k, d = 8, 32
    grams, bs = [], []
    for _ in range(k):
        n = int(rng.integers(200, 400))
        h = rng.random((n, d))
        y = (rng.random(n) < 0.3).astype(np.float64)
        grams.append(h.T @ h)
        bs.append(h.T @ y / max(y.sum(), 1.0))
    g_codec = FixedPointCodec.for_bound(bound=1e5, max_summands=k)
    b_codec = FixedPointCodec.for_bound(bound=4.0, max_summands=k)
    g_sum = g_codec.decode(_ring_sum([g_codec.encode(g) for g in grams]))
    b_sum = b_codec.decode(_ring_sum([b_codec.encode(b) for b in bs]))
    g_ref, b_ref = _fsum(np.array(grams)), _fsum(np.array(bs))
    np.testing.assert_allclose(g_sum, g_ref, rtol=1e-9, atol=0)
    np.testing.assert_allclose(b_sum, b_ref, rtol=1e-9, atol=0)
    # One scale does not fit both: b's codec cannot encode the Gram block at all.
    with pytest.raises(EncodingRangeError):
        b_codec.encode(grams[0])


def test_numpy_scalar_parameters_and_tiny_bounds() -> None:
    codec = FixedPointCodec.for_bound(
        bound=np.float32(2.5),  # type: ignore[arg-type]
        max_summands=np.int64(8),  # type: ignore[arg-type]
    )
    assert codec.frac_bits == choose_frac_bits(bound=2.5, max_summands=8)
    tiny = FixedPointCodec.for_bound(bound=1e-200, max_summands=4)
    xs = np.array([[1e-200, -3e-201], [5e-201, 1e-200]])
    _check_sum(tiny, xs)
    with pytest.raises(FixedPointConfigError, match="too large"):
        FixedPointCodec(bound=10**400, frac_bits=0, max_summands=1)
