"""Tests of afl.crypto.shamir: t-of-n sharing of 32-byte secrets over GF(2^521 - 1)."""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from afl.crypto.errors import ShamirError
from afl.crypto.shamir import (
    PRIME,
    SHARE_BYTES,
    Share,
    interpolate_at_zero,
    lagrange_weights_at_zero,
    reconstruct_many,
    reconstruct_secret,
    split_secret,
)

secrets32 = st.binary(min_size=32, max_size=32)


@st.composite
def split_case(draw: st.DrawFn) -> tuple[bytes, int, int, list[int]]:
    n = draw(st.integers(1, 12))
    t = draw(st.integers(1, n))
    secret = draw(secrets32)
    subset = draw(st.permutations(range(n)))
    k = draw(st.integers(t, n))
    return secret, t, n, list(subset[:k])


def test_prime_is_mersenne_521_and_larger_than_secrets() -> None:
    assert PRIME == 2**521 - 1
    assert PRIME > 2**256
    # Fermat check with a few bases (M521 is a known prime; this guards against typos).
    for base in (2, 3, 5, 7, 11):
        assert pow(base, PRIME - 1, PRIME) == 1


@settings(max_examples=60, deadline=None)
@given(split_case())
def test_any_t_or_more_shares_reconstruct(case: tuple[bytes, int, int, list[int]]) -> None:
    secret, t, n, chosen = case
    shares = split_secret(secret, threshold=t, n_shares=n)
    assert [s.index for s in shares] == list(range(1, n + 1))
    assert reconstruct_secret([shares[i] for i in chosen], threshold=t) == secret


@settings(max_examples=60, deadline=None)
@given(split_case())
def test_t_minus_one_shares_do_not_determine_the_secret(
    case: tuple[bytes, int, int, list[int]],
) -> None:
    secret, t, n, chosen = case
    if t < 2:
        return
    shares = split_secret(secret, threshold=t, n_shares=n)
    few = [shares[i] for i in chosen[: t - 1]]
    with pytest.raises(ShamirError, match="at least"):
        reconstruct_secret(few, threshold=t)
    # Interpolating only t-1 points gives a different value (with probability 1 - 1/p).
    assert interpolate_at_zero(few) != int.from_bytes(secret, "big")


def test_single_share_is_uniform_regardless_of_secret() -> None:
    """For t = 2 one share f(1) = s + a_1 is uniform in GF(p), whatever s is."""
    means = []
    for secret in (bytes(32), b"\xff" * 32):
        vals = [split_secret(secret, threshold=2, n_shares=2)[0].value / PRIME for _ in range(3000)]
        mean = sum(vals) / len(vals)
        means.append(mean)
        sigma = (1 / 12 / len(vals)) ** 0.5
        assert abs(mean - 0.5) < 6 * sigma
    assert abs(means[0] - means[1]) < 6 * (2 / 12 / 3000) ** 0.5


def test_fresh_randomness_per_split() -> None:
    secret = os.urandom(32)
    a = split_secret(secret, threshold=3, n_shares=5)
    b = split_secret(secret, threshold=3, n_shares=5)
    assert [s.value for s in a] != [s.value for s in b]


def test_parameter_errors() -> None:
    s = os.urandom(32)
    with pytest.raises(ShamirError, match="exceeds"):
        split_secret(s, threshold=4, n_shares=3)
    with pytest.raises(ShamirError, match=">= 1"):
        split_secret(s, threshold=0, n_shares=3)
    with pytest.raises(ShamirError, match="32 bytes"):
        split_secret(s[:31], threshold=2, n_shares=3)
    with pytest.raises(ShamirError, match="int"):
        split_secret(s, threshold=2.0, n_shares=3)  # type: ignore[arg-type]


def test_duplicate_and_inconsistent_shares() -> None:
    shares = split_secret(os.urandom(32), threshold=2, n_shares=4)
    with pytest.raises(ShamirError, match="duplicate"):
        reconstruct_secret([shares[0], shares[0]], threshold=2)
    forged = Share(index=shares[2].index, value=(shares[2].value + 1) % PRIME)
    with pytest.raises(ShamirError, match="inconsistent"):
        reconstruct_secret([shares[0], shares[1], forged], threshold=2)
    with pytest.raises(ShamirError, match="no shares"):
        interpolate_at_zero([])


def test_mixed_shares_of_two_secrets_are_rejected() -> None:
    a = split_secret(os.urandom(32), threshold=2, n_shares=3)
    b = split_secret(os.urandom(32), threshold=2, n_shares=3)
    with pytest.raises(ShamirError, match="not a 32-byte secret"):
        reconstruct_secret([a[0], b[1]], threshold=2)


@given(st.integers(1, 65535), st.integers(0, PRIME - 1))
def test_share_serialization_roundtrip(index: int, value: int) -> None:
    share = Share(index=index, value=value)
    data = share.to_bytes()
    assert len(data) == SHARE_BYTES
    assert Share.from_bytes(data) == share


def test_share_validation_and_redacted_repr() -> None:
    with pytest.raises(ShamirError):
        Share(index=0, value=1)
    with pytest.raises(ShamirError):
        Share(index=1, value=PRIME)
    with pytest.raises(ShamirError):
        Share.from_bytes(b"\x00" * (SHARE_BYTES - 1))
    assert "redacted" in repr(Share(index=1, value=12345))
    assert "12345" not in repr(Share(index=1, value=12345))


@settings(max_examples=25, deadline=None)
@given(
    secrets_=st.lists(st.binary(min_size=32, max_size=32), min_size=1, max_size=4),
    t=st.integers(min_value=1, max_value=6),
    extra=st.integers(min_value=0, max_value=3),
)
def test_reconstruct_many_matches_reconstruct_secret(
    secrets_: list[bytes], t: int, extra: int
) -> None:
    share_sets = [split_secret(s, threshold=t, n_shares=t + extra)[extra:] for s in secrets_]
    assert reconstruct_many(share_sets, threshold=t) == secrets_
    assert reconstruct_many(share_sets, threshold=t) == [
        reconstruct_secret(shares, threshold=t) for shares in share_sets
    ]


def test_reconstruct_many_rejects_too_few_shares_and_weights_sum_to_one() -> None:
    shares = split_secret(bytes(range(32)), threshold=3, n_shares=3)
    with pytest.raises(ShamirError, match="at least 3"):
        reconstruct_many([shares[:2]], threshold=3)
    # Interpolating the constant polynomial 1 at zero: the weights sum to 1 (mod p).
    assert sum(lagrange_weights_at_zero([2, 5, 9])) % PRIME == 1
