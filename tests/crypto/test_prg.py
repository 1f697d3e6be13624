"""Tests of afl.crypto.prg: AES-256-CTR expansion of a full 32-byte seed."""

from __future__ import annotations

import hashlib
import os
from typing import Any

import numpy as np
import pytest
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from hypothesis import given, settings
from hypothesis import strategies as st

from afl.crypto.canonical import canonical_encode
from afl.crypto.errors import InvalidSeedError
from afl.crypto.prg import CHUNK_WORDS, SEED_BYTES, add_stream, check_seed, expand_seed

seeds = st.binary(min_size=32, max_size=32)


def _oracle(seed: bytes, n_words: int, context: tuple[str, ...]) -> np.ndarray:
    """CTR mode rebuilt from single-block AES-ECB encryptions of the counter blocks."""
    iv = hashlib.sha256(b"afl-prg" + canonical_encode(context)).digest()[:8]
    ecb = Cipher(algorithms.AES(seed), modes.ECB()).encryptor()
    n_blocks = (8 * n_words + 15) // 16
    blocks = b"".join(ecb.update(iv + i.to_bytes(8, "big")) for i in range(n_blocks))
    return np.frombuffer(blocks[: 8 * n_words], dtype="<u8").astype(np.uint64)


@settings(max_examples=30)
@given(seed=seeds, n=st.integers(0, 70), ctx=st.lists(st.text(max_size=5), max_size=3))
def test_matches_independent_ecb_oracle(seed: bytes, n: int, ctx: list[str]) -> None:
    out = expand_seed(seed, n_words=n, context=ctx)
    assert out.dtype == np.uint64
    assert out.shape == (n,)
    np.testing.assert_array_equal(out, _oracle(seed, n, tuple(ctx)))


@settings(max_examples=30)
@given(seed=seeds, n=st.integers(1, 50), m=st.integers(0, 50))
def test_deterministic_and_prefix_consistent(seed: bytes, n: int, m: int) -> None:
    a = expand_seed(seed, n_words=n + m, context=("r",))
    b = expand_seed(seed, n_words=n, context=("r",))
    np.testing.assert_array_equal(a[:n], b)
    np.testing.assert_array_equal(b, expand_seed(seed, n_words=n, context=("r",)))


@given(a=seeds, b=seeds)
def test_different_seeds_give_different_streams(a: bytes, b: bytes) -> None:
    same = np.array_equal(expand_seed(a, n_words=4), expand_seed(b, n_words=4))
    assert same == (a == b)


def test_context_separates_streams() -> None:
    seed = os.urandom(32)
    a = expand_seed(seed, n_words=64, context=("round-1", "gram"))
    b = expand_seed(seed, n_words=64, context=("round-1", "b"))
    c = expand_seed(seed, n_words=64, context=("round-1gram",))
    assert not np.array_equal(a, b)
    assert not np.array_equal(a, c)
    assert len(set(a.tolist()) & set(b.tolist())) == 0


def test_every_seed_byte_matters() -> None:
    """No folding of the seed to fewer bits: flipping any single byte changes the stream."""
    seed = bytearray(os.urandom(32))
    ref = expand_seed(bytes(seed), n_words=2)
    for i in range(SEED_BYTES):
        flipped = bytearray(seed)
        flipped[i] ^= 0x01
        assert not np.array_equal(expand_seed(bytes(flipped), n_words=2), ref), i


def test_output_bits_are_balanced() -> None:
    out = expand_seed(bytes(range(32)), n_words=50_000)
    bits = np.unpackbits(out.view(np.uint8)).reshape(-1, 64)
    freq = bits.mean(axis=0)
    sigma = 0.5 / np.sqrt(out.size)
    assert np.all(np.abs(freq - 0.5) < 6 * sigma)


@pytest.mark.parametrize("bad", [b"", b"x" * 16, b"x" * 31, b"x" * 33, b"x" * 64])
def test_rejects_wrong_length(bad: bytes) -> None:
    with pytest.raises(InvalidSeedError, match="exactly 32 bytes"):
        expand_seed(bad, n_words=4)


@pytest.mark.parametrize("bad", ["x" * 32, bytearray(32), 12345, None])
def test_rejects_non_bytes(bad: object) -> None:
    with pytest.raises(InvalidSeedError, match="must be bytes"):
        check_seed(bad)


def test_rejects_bad_lengths_and_allows_empty() -> None:
    seed = os.urandom(32)
    with pytest.raises(ValueError, match="n_words"):
        expand_seed(seed, n_words=-1)
    with pytest.raises(ValueError, match="n_words"):
        expand_seed(seed, n_words=2.0)  # type: ignore[arg-type]
    assert expand_seed(seed, n_words=0).shape == (0,)


def test_output_is_writable_copy() -> None:
    out = expand_seed(os.urandom(32), n_words=8)
    out += np.uint64(1)  # must not raise (not a read-only view of the cipher buffer)


@settings(max_examples=12, deadline=None)
@given(
    seed=seeds,
    n=st.sampled_from([1, 3, CHUNK_WORDS - 1, CHUNK_WORDS, CHUNK_WORDS + 1, 2 * CHUNK_WORDS + 7]),
    subtract=st.booleans(),
    base_seed=st.integers(0, 2**32 - 1),
)
def test_add_stream_adds_the_oracle_s_words_across_chunk_boundaries(
    seed: bytes, n: int, subtract: bool, base_seed: int
) -> None:
    """The stream added (or subtracted) chunk by chunk is the CTR keystream of the ECB oracle:
    the counter runs on across chunks as in one call, mod 2^64."""
    base = np.random.default_rng(base_seed).integers(0, 2**64, size=n, dtype=np.uint64)
    stream = _oracle(seed, n, ("r", "x"))
    out = base.copy()
    assert add_stream(seed, out=out, context=("r", "x"), subtract=subtract) is out
    want = np.subtract(base, stream) if subtract else np.add(base, stream)
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(expand_seed(seed, n_words=n, context=("r", "x")), stream)


def test_add_stream_refuses_what_it_cannot_add_into_in_place() -> None:
    seed = os.urandom(32)
    read_only = np.zeros(4, dtype=np.uint64)
    read_only.flags.writeable = False
    bad_arrays: list[Any] = [
        np.zeros(4, dtype=np.int64),
        np.zeros((2, 2), dtype=np.uint64),
        np.zeros(8, dtype=np.uint64)[::2],
        read_only,
    ]
    for bad in bad_arrays:
        with pytest.raises(ValueError, match="out must be"):
            add_stream(seed, out=bad)
    with pytest.raises(InvalidSeedError):
        add_stream(b"short", out=np.zeros(4, dtype=np.uint64))
    empty = np.zeros(0, dtype=np.uint64)
    assert add_stream(seed, out=empty) is empty
