"""Tests of afl.crypto.ckks.scheme and ckks_decrypt: contexts, encrypted sums, tags, release-once.

Tolerance of every "equals the plaintext sum" assertion: ``ckks_params.error_bound`` =
g/2 + noise_bound_slots(K)/s, DERIVED in the ckks_params docstring from the scale Δ = 2^40, the
number of summands K (noise grows as √K), the pre-scale s (from the declared bound) and the grid
step g; it is not tuned to these tests. Oracle: the float64 sum of the same vectors (math.fsum).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import tenseal as ts
from hypothesis import given, settings
from hypothesis import strategies as st

from afl.crypto.ckks import params as cp
from afl.crypto.ckks import scheme as ckks
from afl.crypto.ckks.decrypt import decrypt_release
from afl.crypto.errors import (
    CkksConfigError,
    CkksContextError,
    CkksMalformedError,
    CkksRangeError,
    CkksTagMismatchError,
)


def _oracle(xs: list[np.ndarray]) -> np.ndarray:
    return np.array([math.fsum(col) for col in zip(*xs, strict=True)])


def _round_trip(
    private_ctx: ts.Context,
    public_ctx: ts.Context,
    xs: list[np.ndarray],
    *,
    bound: float,
) -> tuple[np.ndarray, float, float]:
    """Clients encrypt, server sums (public context only), decryptor decrypts with tag check."""
    k, n = len(xs), xs[0].size
    s = cp.choose_prescale(bound=bound, num_summands=k)
    g = cp.default_grid(prescale=s, num_summands=k)
    tags = [ckks.new_tag(num_summands=k) for _ in xs]
    uploads = [
        ckks.serialize_ciphertexts(
            ckks.encrypt_block(public_ctx, x, prescale=s, num_summands=k, tag=r)
        )
        for x, r in zip(xs, tags, strict=True)
    ]
    on_server = [ckks.deserialize_ciphertexts(public_ctx, u, length=n) for u in uploads]
    summed = ckks.serialize_ciphertexts(ckks.sum_ciphertexts(public_ctx, on_server, length=n))
    out = decrypt_release(
        private_ctx,
        summed,
        member_tags=tags,
        length=n,
        prescale=s,
        num_summands=k,
        grid=g,
    )
    return out, s, g


def _releaser(
    private_ctx: ts.Context, tags: list[float], *, length: int, prescale: float
) -> Callable[[list[Any]], np.ndarray]:
    """The decryptor's release of a sum of ``len(tags)`` members at the default grid."""
    k = len(tags)

    def release(summed: list[Any]) -> np.ndarray:
        return decrypt_release(
            private_ctx,
            summed,
            member_tags=tags,
            length=length,
            prescale=prescale,
            num_summands=k,
            grid=cp.default_grid(prescale=prescale, num_summands=k),
        )

    return release


# --- contexts -----------------------------------------------------------------------------------


def test_public_context_has_no_secret_galois_or_relin_keys(private_ctx: ts.Context) -> None:
    data = ckks.public_context_bytes(private_ctx)
    raw = ts.context_from(data)  # loaded without our checks
    assert raw.is_public() and not raw.is_private() and not raw.has_secret_key()
    assert not raw.has_galois_keys() and not raw.has_relin_keys()
    assert raw.has_public_key()
    assert len(data) < len(ckks.private_context_bytes(private_ctx))
    # Whoever holds only the public bytes cannot decrypt.
    (vec,) = ckks.encrypt_block(raw, [1.0], prescale=1.0, num_summands=1, tag=0.0)
    with pytest.raises(ValueError, match="secret_key"):
        vec.decrypt()


def test_private_context_is_rejected_for_servers_and_clients(private_ctx: ts.Context) -> None:
    with pytest.raises(CkksContextError, match="secret key"):
        ckks.ensure_public(private_ctx)
    with pytest.raises(CkksContextError, match="secret key"):
        ckks.load_public_context(ckks.private_context_bytes(private_ctx))


def test_private_context_round_trips_for_the_decryptor(private_ctx: ts.Context) -> None:
    loaded = ckks.load_private_context(ckks.private_context_bytes(private_ctx))
    assert loaded.is_private()
    with pytest.raises(CkksContextError, match="no secret key"):
        ckks.load_private_context(ckks.public_context_bytes(private_ctx))


def test_public_context_cannot_decrypt(public_ctx: ts.Context) -> None:
    with pytest.raises(CkksContextError):
        ckks.ensure_private(public_ctx)
    with pytest.raises(CkksContextError):
        decrypt_release(
            public_ctx, [], member_tags=[0.0], length=1, prescale=1.0, num_summands=1, grid=1.0
        )


def test_other_parameters_and_garbage_are_rejected() -> None:
    weak = ts.context(ts.SCHEME_TYPE.CKKS, 4096, coeff_mod_bit_sizes=[40, 40])
    with pytest.raises(CkksContextError, match="vetted"):
        ckks.load_public_context(weak.serialize(save_secret_key=False))
    symmetric = ts.context(
        ts.SCHEME_TYPE.CKKS,
        8192,
        coeff_mod_bit_sizes=list(cp.COEFF_MOD_BIT_SIZES),
        encryption_type=ts.ENCRYPTION_TYPE.SYMMETRIC,
    )
    with pytest.raises(CkksContextError, match="public key"):
        ckks.check_parameters(symmetric)
    with pytest.raises(CkksContextError):
        ckks.load_public_context(b"not a context")
    with pytest.raises(CkksContextError):
        ckks.check_parameters("context")


def test_fingerprint_is_sha256(private_ctx: ts.Context) -> None:
    data = ckks.public_context_bytes(private_ctx)
    assert len(ckks.context_fingerprint(data)) == 32
    assert ckks.context_fingerprint(data) != ckks.context_fingerprint(data + b"x")


# --- encrypted sums -----------------------------------------------------------------------------


def test_gram_like_sum_matches_float64(private_ctx: ts.Context, public_ctx: ts.Context) -> None:
    rng = np.random.default_rng(1)  # test data, not secrets
    d, k = 90, 3  # upper triangle of 4,095 values + 1: two ciphertexts
    xs = []
    for _ in range(k):
        h = rng.uniform(0.0, 5.0, size=(400, d))
        gram = h.T @ h  # entries up to ~1e4
        xs.append(gram[np.triu_indices(d)])
    bound = 2.0 ** math.ceil(math.log2(max(float(np.max(np.abs(x))) for x in xs)))
    out, s, g = _round_trip(private_ctx, public_ctx, xs, bound=bound)
    exact = _oracle(xs)
    tol = cp.error_bound(prescale=s, num_summands=k, grid=g)
    assert np.max(np.abs(out - exact)) <= tol
    # Relative to the largest entry of the sum, what the derived bound guarantees here:
    assert tol / np.max(np.abs(exact)) < 1e-9
    assert np.all(np.round(out / g) * g == out)  # values are on the declared grid


def test_b_like_sum_matches_float64(private_ctx: ts.Context, public_ctx: ts.Context) -> None:
    rng = np.random.default_rng(2)
    k = 4
    xs = [rng.normal(0.0, 1e-3, size=5000) for _ in range(k)]
    out, s, g = _round_trip(private_ctx, public_ctx, xs, bound=1e-2)
    exact = _oracle(xs)
    tol = cp.error_bound(prescale=s, num_summands=k, grid=g)
    assert np.max(np.abs(out - exact)) <= tol
    assert tol / np.max(np.abs(exact)) < 1e-9  # bound 1e-2 declared for O(1e-3) entries


@settings(max_examples=8, deadline=None)
@given(
    k=st.integers(min_value=1, max_value=4),
    n=st.integers(min_value=1, max_value=4100),
    log_bound=st.integers(min_value=-12, max_value=12),
    seed=st.integers(min_value=0, max_value=2**32 - 1),
)
def test_encrypted_sum_within_derived_bound(
    private_ctx: ts.Context, public_ctx: ts.Context, k: int, n: int, log_bound: int, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    bound = 10.0**log_bound
    xs = [rng.uniform(-bound, bound, size=n) for _ in range(k)]
    out, s, g = _round_trip(private_ctx, public_ctx, xs, bound=bound)
    assert out.shape == (n,)
    assert np.max(np.abs(out - _oracle(xs))) <= cp.error_bound(prescale=s, num_summands=k, grid=g)


@pytest.mark.slow
def test_full_size_d1024_gram_sum(private_ctx: ts.Context, public_ctx: ts.Context) -> None:
    rng = np.random.default_rng(3)
    d, k = 1024, 8
    xs = [rng.uniform(0.0, 1e5, size=d * (d + 1) // 2) for _ in range(k)]
    out, s, g = _round_trip(private_ctx, public_ctx, xs, bound=1e5)
    exact = _oracle(xs)
    assert np.max(np.abs(out - exact)) <= cp.error_bound(prescale=s, num_summands=k, grid=g)
    assert np.max(np.abs(out - exact)) / np.max(np.abs(exact)) < 1e-9


# --- input validation ---------------------------------------------------------------------------


def test_out_of_range_values_and_tags_are_rejected(public_ctx: ts.Context) -> None:
    s = cp.choose_prescale(bound=1.0, num_summands=2)
    limit = cp.per_site_slot_bound(2)
    with pytest.raises(CkksRangeError, match="slot bound"):
        ckks.encrypt_block(public_ctx, [3.0 * limit / s], prescale=s, num_summands=2, tag=0.0)
    with pytest.raises(CkksRangeError, match="NaN"):
        ckks.encrypt_block(public_ctx, [math.nan], prescale=s, num_summands=2, tag=0.0)
    with pytest.raises(CkksRangeError, match="tag"):
        ckks.encrypt_block(public_ctx, [0.5], prescale=s, num_summands=2, tag=2 * limit)
    with pytest.raises(CkksRangeError):
        ckks.encrypt_block(public_ctx, np.zeros((2, 2)), prescale=s, num_summands=2, tag=0.0)


def test_tags_are_random_and_within_the_budget() -> None:
    tags = [ckks.new_tag(num_summands=8) for _ in range(64)]
    assert len(set(tags)) == 64
    assert all(abs(t) <= cp.per_site_slot_bound(8) for t in tags)


def test_layout_checks(private_ctx: ts.Context, public_ctx: ts.Context) -> None:
    n = cp.DATA_SLOTS_PER_CIPHERTEXT + 1  # two ciphertexts
    vecs = ckks.encrypt_block(public_ctx, np.ones(n), prescale=1.0, num_summands=1, tag=1.0)
    ckks.check_ciphertexts(vecs, length=n)
    with pytest.raises(CkksMalformedError, match="expected 1 ciphertexts"):
        ckks.check_ciphertexts(vecs, length=10)
    with pytest.raises(CkksMalformedError, match="expected 3 ciphertexts"):
        ckks.check_ciphertexts(vecs, length=2 * cp.DATA_SLOTS_PER_CIPHERTEXT + 1)
    with pytest.raises(CkksMalformedError, match="slots"):  # a vector of fewer slots
        ckks.check_ciphertexts([ts.CKKSVector(public_ctx, [1.0, 2.0])], length=1)
    other_scale = ts.CKKSVector(public_ctx, [1.0] * cp.SLOT_COUNT, scale=2.0**30)
    with pytest.raises(CkksMalformedError, match="scale"):
        ckks.check_ciphertexts([other_scale], length=1)
    with pytest.raises(CkksMalformedError, match="parse"):
        ckks.deserialize_ciphertexts(public_ctx, [b"\x00" * 64], length=1)
    with pytest.raises(CkksMalformedError):
        ckks.sum_ciphertexts(public_ctx, [vecs, vecs[:1]], length=n)
    with pytest.raises(CkksContextError):
        ckks.sum_ciphertexts(private_ctx, [vecs], length=n)


def test_server_cannot_multiply_by_a_scaled_plaintext(public_ctx: ts.Context) -> None:
    # Δ² = 2^80 exceeds the 60-bit data modulus: SEAL refuses ct × pt at scale Δ outright.
    (vec,) = ckks.encrypt_block(public_ctx, [1.0, 2.0], prescale=1.0, num_summands=1, tag=0.0)
    with pytest.raises(ValueError, match="scale out of bounds"):
        vec.mul([1.0, 0.0] * (cp.SLOT_COUNT // 2))


def test_grid_finer_than_noise_is_refused(private_ctx: ts.Context) -> None:
    finest = cp.min_grid(prescale=1.0, num_summands=3)
    with pytest.raises(CkksConfigError, match="finer"):
        decrypt_release(
            private_ctx,
            [],
            member_tags=[0.0],
            length=1,
            prescale=1.0,
            num_summands=3,
            grid=finest / 2,
        )


@settings(max_examples=50, deadline=None)
@given(st.lists(st.binary(min_size=1, max_size=300), min_size=0, max_size=6))
def test_pack_unpack_round_trip(blobs: list[bytes]) -> None:
    packed = ckks.pack_ciphertexts(blobs)
    assert ckks.unpack_ciphertexts(packed) == blobs
    if packed:
        with pytest.raises(CkksMalformedError):
            ckks.unpack_ciphertexts(packed[:-1])


def test_tag_check_refuses_one_site_presented_as_sum(
    private_ctx: ts.Context, public_ctx: ts.Context
) -> None:
    n, k = 100, 3
    s = cp.choose_prescale(bound=1.0, num_summands=k)
    tags = [ckks.new_tag(num_summands=k) for _ in range(k)]
    rng = np.random.default_rng(4)
    uploads = [
        ckks.encrypt_block(public_ctx, rng.uniform(-1, 1, n), prescale=s, num_summands=k, tag=r)
        for r in tags
    ]

    release = _releaser(private_ctx, tags, length=n, prescale=s)

    with pytest.raises(CkksTagMismatchError):  # a single site's ciphertext as the 3-site sum
        release(ckks.serialize_ciphertexts(uploads[0]))
    with pytest.raises(CkksTagMismatchError):  # wrong member set: sites 0 and 1 only
        release(ckks.sum_ciphertexts(public_ctx, uploads[:2], length=n))
    with pytest.raises(CkksTagMismatchError):  # re-weighted: 2·c_0 + c_1
        release(ckks.sum_ciphertexts(public_ctx, [uploads[0], uploads[0], uploads[1]], length=n))
    assert release(ckks.sum_ciphertexts(public_ctx, uploads, length=n)).shape == (n,)


def test_sum_leaves_the_uploads_unchanged(private_ctx: ts.Context, public_ctx: ts.Context) -> None:
    n = 10
    uploads = [
        ckks.encrypt_block(public_ctx, np.full(n, float(i)), prescale=1.0, num_summands=3, tag=0.0)
        for i in range(3)
    ]
    before = [ckks.serialize_ciphertexts(u) for u in uploads]
    ckks.sum_ciphertexts(public_ctx, uploads, length=n)
    assert [ckks.serialize_ciphertexts(u) for u in uploads] == before


@settings(max_examples=100, deadline=None)
@given(st.floats(min_value=-1e5, max_value=1e5, allow_nan=False), st.integers(1, 10_000))
def test_block_tags_are_bound_to_their_position_and_within_the_tag(tag: float, index: int) -> None:
    assert ckks.block_tag(tag, 0) == tag
    value = ckks.block_tag(tag, index)
    assert value == ckks.block_tag(tag, index)  # the site and the decryptor derive the same
    assert abs(value) <= abs(tag)
    if abs(tag) >= 1.0:  # tags are drawn on [-2^17/K, 2^17/K] with 52 random bits
        assert value != ckks.block_tag(tag, index + 1)


def _seal_encrypt(public_ctx: ts.Context, slots: list[complex]) -> Any:
    """A ciphertext of arbitrary complex slots under the public key (what anyone holding the
    public context, the server included, can make), as a TenSEAL vector."""
    seal = ckks._sealapi()
    seal_ctx = public_ctx.seal_context().data
    plain, cipher = seal.Plaintext(), seal.Ciphertext(seal_ctx)
    seal.CKKSEncoder(seal_ctx).encode(slots, cp.GLOBAL_SCALE, plain)
    seal.Encryptor(seal_ctx, public_ctx.public_key().data).encrypt(plain, cipher)
    memory = ckks._SealFile()
    try:
        blob = ckks.vector_bytes(memory.save(cipher), size=cp.SLOT_COUNT, scale=cp.GLOBAL_SCALE)
    finally:
        memory.close()
    return ts.CKKSVector.load(public_ctx, blob)


def test_vector_bytes_is_tenseals_own_serialization(public_ctx: ts.Context) -> None:
    vec = ts.CKKSVector(public_ctx, [0.5] * cp.SLOT_COUNT, scale=cp.GLOBAL_SCALE)
    memory = ckks._SealFile()
    try:
        seal_bytes = memory.save(vec.ciphertext()[0])
    finally:
        memory.close()
    ours = ckks.vector_bytes(seal_bytes, size=cp.SLOT_COUNT, scale=cp.GLOBAL_SCALE)
    assert ours == vec.serialize()


def test_both_lanes_of_a_slot_carry_data_and_the_imaginary_tag_is_checked(
    private_ctx: ts.Context, public_ctx: ts.Context
) -> None:
    """Lane 2j is slot j's real part, lane 2j+1 its imaginary part (oracle: the slots as SEAL's
    own complex decoder returns them); a ciphertext added by the server that leaves the real tag
    lane alone but moves the imaginary one is refused."""
    n, k = cp.DATA_SLOTS_PER_CIPHERTEXT + 5, 2
    x = np.arange(n, dtype=np.float64) / n  # test data
    tags = [ckks.new_tag(num_summands=k) for _ in range(k)]
    uploads = [ckks.encrypt_block(public_ctx, x, prescale=1.0, num_summands=k, tag=r) for r in tags]
    assert len(uploads[0]) == 2
    lanes = ckks.decode_lanes(private_ctx, uploads[0][1])
    assert abs(lanes[0] - ckks.block_tag(tags[0], 2)) < 1e-4  # block 1's tags: lanes 2 and 3
    assert abs(lanes[1] - ckks.block_tag(tags[0], 3)) < 1e-4
    np.testing.assert_allclose(lanes[2:7], x[cp.DATA_SLOTS_PER_CIPHERTEXT :], atol=1e-4)
    assert np.all(np.abs(lanes[7:]) < 1e-4)  # padding
    total = ckks.sum_ciphertexts(public_ctx, uploads, length=n)

    release = _releaser(private_ctx, tags, length=n, prescale=1.0)

    out = release(total)
    assert np.max(np.abs(out - 2 * x)) <= cp.error_bound(
        prescale=1.0, num_summands=k, grid=cp.default_grid(prescale=1.0, num_summands=k)
    )
    shift = _seal_encrypt(public_ctx, [complex(0.0, 1.0)] + [0j] * (cp.SLOT_COUNT - 1))
    with pytest.raises(CkksTagMismatchError, match="tag lane 1 of ciphertext 0"):
        release([total[0] + shift, total[1]])
