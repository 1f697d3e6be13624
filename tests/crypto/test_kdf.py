"""Tests of afl.crypto.kdf: X25519 agreement and HKDF-SHA256 with salt and domain-separated info."""

from __future__ import annotations

import hashlib
import hmac
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from afl.crypto.canonical import DOMAIN_TAG, canonical_encode
from afl.crypto.errors import KeyAgreementError, KeyFormatError
from afl.crypto.kdf import (
    PURPOSE_PAIRWISE_MASK,
    PURPOSE_SHARE_ENCRYPTION,
    agree,
    derive_key,
    derive_pairwise_mask_seed,
    derive_share_key,
    generate_agreement_key,
    load_agreement_private_key,
    load_agreement_public_key,
    new_round_salt,
    private_key_bytes,
    public_key_bytes,
)

SALT = bytes(range(32))


def _hkdf_oracle(ikm: bytes, salt: bytes, info: bytes, length: int = 32) -> bytes:
    """RFC 5869 HKDF-SHA256 from stdlib hmac (independent of cryptography's HKDF)."""
    prk = hmac.new(salt, ikm, hashlib.sha256).digest()
    okm, block, i = b"", b"", 1
    while len(okm) < length:
        block = hmac.new(prk, block + info + bytes([i]), hashlib.sha256).digest()
        okm += block
        i += 1
    return okm[:length]


def test_rfc5869_oracle_self_check() -> None:
    """RFC 5869 appendix A.1 test vector, to validate the oracle itself."""
    ikm = bytes.fromhex("0b" * 22)
    salt = bytes.fromhex("000102030405060708090a0b0c")
    info = bytes.fromhex("f0f1f2f3f4f5f6f7f8f9")
    okm = _hkdf_oracle(ikm, salt, info, 42)
    assert okm.hex().startswith("3cb25f25faacd57a90434f64d0362f2a2d2d0a90cf1a5a4c5db02d56ecc4c5bf")


def test_agreement_is_symmetric() -> None:
    a, b = generate_agreement_key(), generate_agreement_key()
    s_ab = agree(a, public_key_bytes(b))
    s_ba = agree(b, a.public_key())
    assert s_ab == s_ba
    assert len(s_ab) == 32
    assert agree(a, public_key_bytes(generate_agreement_key())) != s_ab


def test_reconstructed_private_key_agrees_identically() -> None:
    """The server recomputes a dropped site's pairwise secrets from its raw private key bytes."""
    a, b = generate_agreement_key(), generate_agreement_key()
    a2 = load_agreement_private_key(private_key_bytes(a))
    assert public_key_bytes(a2) == public_key_bytes(a)
    assert agree(a2, public_key_bytes(b)) == agree(a, public_key_bytes(b))


def test_low_order_and_malformed_public_keys_rejected() -> None:
    a = generate_agreement_key()
    with pytest.raises(KeyAgreementError):
        agree(a, bytes(32))  # the identity point: all-zero shared secret
    with pytest.raises(KeyAgreementError, match="32 bytes"):
        agree(a, bytes(31))
    with pytest.raises(KeyFormatError):
        load_agreement_public_key(b"x" * 33)
    with pytest.raises(KeyFormatError):
        load_agreement_private_key(b"x" * 31)


@settings(max_examples=40)
@given(
    ikm=st.binary(min_size=32, max_size=64),
    salt=st.binary(min_size=16, max_size=64),
    round_id=st.text(min_size=1, max_size=10),
    release=st.text(max_size=10),
    purpose=st.text(min_size=1, max_size=10),
)
def test_derive_key_matches_rfc5869_oracle(
    ikm: bytes, salt: bytes, round_id: str, release: str, purpose: str
) -> None:
    got = derive_key(
        shared_secret=ikm, round_salt=salt, purpose=purpose, round_id=round_id, release=release
    )
    info = canonical_encode([DOMAIN_TAG, purpose, round_id, release])
    assert got == _hkdf_oracle(ikm, salt, info)


def _seed(**overrides: object) -> bytes:
    kwargs: dict[str, object] = {
        "shared_secret": b"s" * 32,
        "site_a": "site-1",
        "site_b": "site-2",
        "round_id": "r1",
        "round_salt": SALT,
        "release": "gram",
    }
    kwargs.update(overrides)
    return derive_pairwise_mask_seed(**kwargs)  # type: ignore[arg-type]


def test_pairwise_seed_is_symmetric_between_the_two_sites() -> None:
    a, b = generate_agreement_key(), generate_agreement_key()
    seed_a = _seed(shared_secret=agree(a, b.public_key()), site_a="A", site_b="B")
    seed_b = _seed(shared_secret=agree(b, a.public_key()), site_a="B", site_b="A")
    assert seed_a == seed_b
    assert len(seed_a) == 32


@pytest.mark.parametrize(
    "change",
    [
        {"round_id": "r2"},
        {"release": "b_c0"},
        {"round_salt": bytes(32)},
        {"shared_secret": b"t" * 32},
        {"site_b": "site-3"},
    ],
)
def test_pairwise_seed_domain_separation(change: dict[str, object]) -> None:
    assert _seed(**change) != _seed()


def test_share_key_is_directional_and_differs_from_mask_seed() -> None:
    secret = os.urandom(32)
    k_uv = derive_share_key(
        shared_secret=secret, sender="u", recipient="v", round_id="r1", round_salt=SALT
    )
    k_vu = derive_share_key(
        shared_secret=secret, sender="v", recipient="u", round_id="r1", round_salt=SALT
    )
    assert k_uv != k_vu
    assert len(k_uv) == 32
    mask = derive_pairwise_mask_seed(
        shared_secret=secret, site_a="u", site_b="v", round_id="r1", round_salt=SALT, release="x"
    )
    assert k_uv != mask
    # The purpose string is what separates them: same fields, different purpose, different key.
    a = derive_key(
        shared_secret=secret,
        round_salt=SALT,
        purpose=PURPOSE_PAIRWISE_MASK,
        round_id="r1",
        release="",
        binding=("u", "v"),
    )
    b = derive_key(
        shared_secret=secret,
        round_salt=SALT,
        purpose=PURPOSE_SHARE_ENCRYPTION,
        round_id="r1",
        release="",
        binding=("u", "v"),
    )
    assert a != b
    assert b == k_uv


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"round_salt": b"short"}, "round_salt"),
        ({"round_salt": "x" * 32}, "round_salt"),
        ({"shared_secret": b"x" * 16}, "shared_secret"),
        ({"round_id": ""}, "round_id"),
        ({"release": ""}, "release"),
        ({"site_b": "site-1"}, "distinct"),
        ({"site_a": 3}, "site_a"),
    ],
)
def test_bad_kdf_inputs_raise(change: dict[str, object], match: str) -> None:
    with pytest.raises(KeyAgreementError, match=match):
        _seed(**change)


def test_share_key_rejects_self_pair() -> None:
    with pytest.raises(KeyAgreementError, match="differ"):
        derive_share_key(
            shared_secret=b"s" * 32, sender="u", recipient="u", round_id="r", round_salt=SALT
        )


def test_round_salt_is_fresh_and_long_enough() -> None:
    a, b = new_round_salt(), new_round_salt()
    assert len(a) == 32
    assert a != b
