"""Tests of afl.crypto.aead: AES-256-GCM share encryption bound to (sender, recipient, round)."""

from __future__ import annotations

import os

import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from hypothesis import given, settings
from hypothesis import strategies as st

from afl.crypto.aead import (
    NONCE_BYTES,
    TAG_BYTES,
    decrypt_share,
    encrypt_share,
    open_sealed,
    seal,
    share_associated_data,
)
from afl.crypto.canonical import canonical_encode
from afl.crypto.errors import DecryptionError, InvalidSeedError

KEY = os.urandom(32)
BIND = {"sender": "site-1", "recipient": "site-2", "round_id": "r7"}


@settings(max_examples=30)
@given(st.binary(max_size=300))
def test_roundtrip(plaintext: bytes) -> None:
    blob = encrypt_share(key=KEY, plaintext=plaintext, **BIND)
    assert len(blob) == NONCE_BYTES + len(plaintext) + TAG_BYTES
    assert decrypt_share(key=KEY, blob=blob, **BIND) == plaintext


def test_matches_plain_aesgcm_with_canonical_ad() -> None:
    """Oracle: cryptography's AESGCM with the documented associated data opens our blob."""
    blob = encrypt_share(key=KEY, plaintext=b"share", **BIND)
    ad = canonical_encode(share_associated_data(**BIND))
    assert AESGCM(KEY).decrypt(blob[:NONCE_BYTES], blob[NONCE_BYTES:], ad) == b"share"


@settings(max_examples=30)
@given(pos=st.integers(0, NONCE_BYTES + 20 + TAG_BYTES - 1), bit=st.integers(0, 7))
def test_any_bit_flip_is_detected(pos: int, bit: int) -> None:
    blob = bytearray(encrypt_share(key=KEY, plaintext=b"x" * 20, **BIND))
    blob[pos] ^= 1 << bit
    with pytest.raises(DecryptionError, match="authentication failed"):
        decrypt_share(key=KEY, blob=bytes(blob), **BIND)


@pytest.mark.parametrize(
    "change",
    [
        {"sender": "site-3"},
        {"recipient": "site-3"},
        {"round_id": "r8"},
        {"sender": "site-2", "recipient": "site-1"},  # reflected back to the sender
    ],
)
def test_binding_mismatch_is_detected(change: dict[str, str]) -> None:
    blob = encrypt_share(key=KEY, plaintext=b"secret share", **BIND)
    with pytest.raises(DecryptionError):
        decrypt_share(key=KEY, blob=blob, **{**BIND, **change})


def test_wrong_key_truncated_blob_and_bad_key() -> None:
    blob = encrypt_share(key=KEY, plaintext=b"p", **BIND)
    with pytest.raises(DecryptionError):
        decrypt_share(key=os.urandom(32), blob=blob, **BIND)
    with pytest.raises(DecryptionError, match="too short"):
        decrypt_share(key=KEY, blob=blob[: NONCE_BYTES + TAG_BYTES - 1], **BIND)
    with pytest.raises(DecryptionError):
        decrypt_share(key=KEY, blob=blob[:-1], **BIND)
    with pytest.raises(InvalidSeedError, match="32 bytes"):
        encrypt_share(key=KEY[:16], plaintext=b"p", **BIND)


def test_nonces_are_fresh() -> None:
    a = encrypt_share(key=KEY, plaintext=b"same", **BIND)
    b = encrypt_share(key=KEY, plaintext=b"same", **BIND)
    assert a[:NONCE_BYTES] != b[:NONCE_BYTES]
    assert a != b


def test_generic_seal_binds_associated_fields() -> None:
    blob = seal(KEY, b"payload", associated=["a", "bc"])
    assert open_sealed(KEY, blob, associated=["a", "bc"]) == b"payload"
    with pytest.raises(DecryptionError):
        open_sealed(KEY, blob, associated=["ab", "c"])


def test_empty_binding_fields_rejected() -> None:
    with pytest.raises(TypeError, match="sender"):
        encrypt_share(key=KEY, plaintext=b"p", sender="", recipient="b", round_id="r")
