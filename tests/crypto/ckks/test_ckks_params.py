"""Tests of afl.crypto.ckks.params: security level, pre-scaling rule, derived bounds
(docs/protocol.md §4.3)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from afl.crypto.ckks import params as cp
from afl.crypto.errors import CkksConfigError


def test_parameters_meet_the_he_standard_128_bit_bound() -> None:
    # homomorphicencryption.org Table 1: N = 8192 allows log2(Q) <= 218 at 128-bit security.
    assert cp.POLY_MODULUS_DEGREE == 8192
    assert sum(cp.COEFF_MOD_BIT_SIZES) <= cp.HE_STANDARD_MAX_LOG_Q_128[8192] == 218
    assert cp.SECURITY_LEVEL_BITS == 128
    assert cp.SLOT_COUNT == 4096 and cp.LANES_PER_CIPHERTEXT == 8192
    assert cp.DATA_SLOTS_PER_CIPHERTEXT == 8190  # both parts of each slot, less the two tags


def test_slot_budget_leaves_a_margin_below_half_the_data_prime() -> None:
    # q0 > 2^59 (60-bit prime): decryption is exact while Δ·|z| + noise < q0/2 = 2^58; a slot's
    # two lanes each within 2^17 give |z| <= √2·2^17, Δ·|z| <= 2^57.5.
    assert cp.GLOBAL_SCALE * cp.SUM_SLOT_BOUND == 2.0**57
    assert cp.GLOBAL_SCALE * math.sqrt(2) * cp.SUM_SLOT_BOUND <= 2.0**57.5
    assert cp.GLOBAL_SCALE * cp.noise_bound_slots(2**16) < 2.0**57.5


def test_num_ciphertexts_of_the_d1024_upper_triangle() -> None:
    assert cp.num_ciphertexts(1024 * 1025 // 2) == 65  # 524,800 values / 8190 per ciphertext
    assert cp.num_ciphertexts(1) == 1 and cp.num_ciphertexts(8190) == 1
    assert cp.num_ciphertexts(8191) == 2
    with pytest.raises(CkksConfigError):
        cp.num_ciphertexts(0)


@settings(max_examples=200, deadline=None)
@given(
    bound=st.floats(min_value=1e-12, max_value=1e12, allow_nan=False),
    k=st.integers(min_value=1, max_value=1000),
)
def test_prescale_is_a_power_of_two_filling_half_to_all_of_the_budget(bound: float, k: int) -> None:
    s = cp.choose_prescale(bound=bound, num_summands=k)
    mantissa, _ = math.frexp(s)
    assert mantissa == 0.5  # exact power of two
    assert k * bound * s <= cp.SUM_SLOT_BOUND < 2 * k * bound * s


@settings(max_examples=100, deadline=None)
@given(
    bound=st.floats(min_value=1e-6, max_value=1e9, allow_nan=False),
    k=st.integers(min_value=1, max_value=256),
)
def test_default_grid_covers_the_noise_and_relative_error_is_tiny(bound: float, k: int) -> None:
    s = cp.choose_prescale(bound=bound, num_summands=k)
    finest = cp.min_grid(prescale=s, num_summands=k)
    g = cp.default_grid(prescale=s, num_summands=k)
    assert math.frexp(g)[0] == 0.5 and 2 * finest <= g < 4 * finest
    # Derived relative error vs the declared K·B: (g/2 + noise/s)/(K·B) <= 3·noise·2/2^17.
    rel = cp.error_bound(prescale=s, num_summands=k, grid=g) / (k * bound)
    assert rel <= 6 * cp.noise_bound_slots(k) / cp.SUM_SLOT_BOUND
    assert rel < 1e-10


def test_noise_bound_grows_like_sqrt_k() -> None:
    fp = cp.FP_SLOT_BOUND
    ratio = (cp.noise_bound_slots(16) - fp) / (cp.noise_bound_slots(1) - fp)
    assert ratio == pytest.approx(4.0)


@pytest.mark.parametrize("bad", [0.0, -1.0, math.inf, math.nan])
def test_bad_bounds_are_rejected(bad: float) -> None:
    with pytest.raises(CkksConfigError):
        cp.choose_prescale(bound=bad, num_summands=3)


@pytest.mark.parametrize("bad", [0, -2, True, 2**16 + 1])
def test_bad_summand_counts_are_rejected(bad: int) -> None:
    with pytest.raises(CkksConfigError):
        cp.per_site_slot_bound(bad)
