"""Encryptions of zero drawn ahead (afl.crypto.ckks.zeros): a ciphertext made from one decrypts
as a fresh encryption does, within the same derived noise bound, and each is handed out once."""

from __future__ import annotations

import hashlib
import math
from typing import Any

import numpy as np
import pytest
import tenseal as ts
from hypothesis import given, settings
from hypothesis import strategies as st

from afl.crypto.ckks import params as cp
from afl.crypto.ckks import scheme as ckks
from afl.crypto.ckks.decrypt import decrypt_release
from afl.crypto.ckks.zeros import ZeroPool

DIGEST = hashlib.sha256(b"the context's bytes").digest()


def _pool(public_ctx: ts.Context, *, capacity: int = 64) -> ZeroPool:
    return ZeroPool(public_ctx, context_sha256=DIGEST, capacity=capacity)


def _vectors(public_ctx: ts.Context, blobs: list[bytes], length: int) -> list[Any]:
    return ckks.deserialize_ciphertexts(public_ctx, blobs, length=length)


@settings(max_examples=12, deadline=None)
@given(
    k=st.integers(min_value=1, max_value=4),
    n=st.integers(min_value=1, max_value=17000),
    pooled=st.integers(min_value=0, max_value=3),
    seed=st.integers(min_value=0, max_value=2**32 - 1),
)
def test_a_sum_of_pooled_and_fresh_ciphertexts_decrypts_within_the_derived_bound(
    private_ctx: ts.Context, public_ctx: ts.Context, k: int, n: int, pooled: int, seed: int
) -> None:
    """Sites whose ciphertexts come (some or all) from the pool: the decryptor's tag check
    passes and the sum is the float64 sum within ``error_bound``, the bound of fresh ones."""
    rng = np.random.default_rng(seed)
    bound = 3.0
    xs = [rng.uniform(-bound, bound, size=n) for _ in range(k)]
    s = cp.choose_prescale(bound=bound, num_summands=k)
    g = cp.default_grid(prescale=s, num_summands=k)
    tags = [ckks.new_tag(num_summands=k) for _ in xs]
    pool = _pool(public_ctx)
    pool.fill(pooled)  # fewer than the ciphertexts: the rest are encrypted on the spot
    uploads = [
        ckks.encrypt_block_bytes(
            public_ctx,
            x,
            prescale=s,
            num_summands=k,
            tag=r,
            zeros=lambda: pool.take(DIGEST),
        )
        for x, r in zip(xs, tags, strict=True)
    ]
    assert pool.taken == min(pooled, k * cp.num_ciphertexts(n))
    on_server = [_vectors(public_ctx, u, n) for u in uploads]
    summed = ckks.sum_ciphertexts(public_ctx, on_server, length=n)
    out = decrypt_release(
        private_ctx, summed, member_tags=tags, length=n, prescale=s, num_summands=k, grid=g
    )
    oracle = np.array([math.fsum(col) for col in zip(*xs, strict=True)])
    assert np.max(np.abs(out - oracle)) <= cp.error_bound(prescale=s, num_summands=k, grid=g)


def test_a_pooled_ciphertexts_noise_is_within_the_fresh_bound(
    private_ctx: ts.Context, public_ctx: ts.Context
) -> None:
    """The noise of each lane, in slot units, against ``noise_bound_slots(1)``, for 8 pooled
    ciphertexts of random lanes (what a fresh encryption is held to)."""
    rng = np.random.default_rng(7)
    pool = _pool(public_ctx)
    assert pool.fill(8) == 8
    worst = 0.0
    for _ in range(8):
        x = rng.uniform(-1000.0, 1000.0, size=cp.DATA_SLOTS_PER_CIPHERTEXT)
        (blob,) = ckks.encrypt_block_bytes(
            public_ctx, x, prescale=1.0, num_summands=1, tag=0.5, zeros=lambda: pool.take(DIGEST)
        )
        (vector,) = _vectors(private_ctx, [blob], x.size)
        lanes = ckks.decode_lanes(private_ctx, vector)
        worst = max(worst, float(np.max(np.abs(lanes[cp.TAG_LANES :] - x))))
    assert pool.taken == 8 and len(pool) == 0
    assert 0.0 < worst <= cp.noise_bound_slots(1)  # noisy (fresh randomness), and bounded


def test_each_encryption_of_zero_is_handed_out_once(public_ctx: ts.Context) -> None:
    pool = _pool(public_ctx)
    assert pool.fill(3) == 3 and len(pool) == 3
    taken = [pool.take(DIGEST) for _ in range(3)]
    assert all(z is not None for z in taken) and len({id(z) for z in taken}) == 3
    assert pool.take(DIGEST) is None and (pool.drawn, pool.taken) == (3, 3)
    # Two ciphertexts of the same values made from the pool differ: fresh randomness each.
    pool.fill(2)
    x = np.ones(10)
    first, second = (
        ckks.encrypt_block_bytes(
            public_ctx, x, prescale=1.0, num_summands=1, tag=0.25, zeros=lambda: pool.take(DIGEST)
        )
        for _ in range(2)
    )
    assert pool.taken == 5 and first != second


def test_nothing_is_handed_out_for_another_context(
    private_ctx: ts.Context, public_ctx: ts.Context
) -> None:
    """Zeros drawn under one context are never used for another: the encryption falls back to
    SEAL's own, and the ciphertext decrypts."""
    pool = _pool(public_ctx)
    pool.fill(2)
    other = hashlib.sha256(b"another context").digest()
    assert pool.take(other) is None and len(pool) == 2
    x = np.linspace(-1.0, 1.0, 50)
    tag = ckks.new_tag(num_summands=1)
    blobs = ckks.encrypt_block_bytes(
        public_ctx, x, prescale=1.0, num_summands=1, tag=tag, zeros=lambda: pool.take(other)
    )
    out = decrypt_release(
        private_ctx,
        _vectors(public_ctx, blobs, x.size),
        member_tags=[tag],
        length=x.size,
        prescale=1.0,
        num_summands=1,
        grid=cp.default_grid(prescale=1.0, num_summands=1),
    )
    assert len(pool) == 2 and np.allclose(out, x, atol=1e-6)


def test_fill_stops_at_the_capacity_and_when_told(public_ctx: ts.Context) -> None:
    pool = _pool(public_ctx, capacity=4)
    assert pool.fill(10) == 4 and len(pool) == 4
    assert pool.fill(10) == 0  # full
    pool.clear()
    asked = iter([True, True, False])
    assert pool.fill(4, keep_going=lambda: next(asked)) == 2 and len(pool) == 2
    with pytest.raises(ValueError, match="capacity"):
        _pool(public_ctx, capacity=-1)


def test_a_context_with_other_parameters_is_refused() -> None:
    other = ts.context(ts.SCHEME_TYPE.CKKS, poly_modulus_degree=4096, coeff_mod_bit_sizes=[40, 40])
    with pytest.raises(Exception, match="vetted"):
        ZeroPool(other, context_sha256=DIGEST, capacity=1)
