"""Tests of afl.crypto.identity.signatures: Ed25519 sign/verify of canonical messages, serialization."""

from __future__ import annotations

import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    NoEncryption,
    PrivateFormat,
    PublicFormat,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from afl.crypto.errors import KeyFormatError, SignatureError
from afl.crypto.identity.signatures import (
    generate_identity_key,
    load_private_key_pem,
    load_public_key_pem,
    load_public_key_raw,
    private_key_to_pem,
    public_key_to_pem,
    public_key_to_raw,
    sign,
    sign_fields,
    signed_message,
    verify,
    verify_fields,
)

KEY = generate_identity_key()
PUB = KEY.public_key()


@settings(max_examples=30)
@given(st.binary(max_size=200))
def test_sign_verify_roundtrip_and_tamper(message: bytes) -> None:
    sig = sign(KEY, message)
    assert len(sig) == 64
    verify(PUB, sig, message)
    with pytest.raises(SignatureError, match="does not verify"):
        verify(PUB, sig, message + b"\x00")
    tampered = bytes([sig[0] ^ 1]) + sig[1:]
    with pytest.raises(SignatureError):
        verify(PUB, tampered, message)


def test_wrong_key_fails() -> None:
    sig = sign(KEY, b"hello")
    with pytest.raises(SignatureError):
        verify(generate_identity_key().public_key(), sig, b"hello")


def test_bad_signature_length() -> None:
    with pytest.raises(SignatureError, match="64 bytes"):
        verify(PUB, b"x" * 63, b"m")


def test_fields_signature_binds_context_and_split() -> None:
    sig = sign_fields(KEY, context="advertise-keys", fields=["site-1", "r1", b"\x01\x02"])
    verify_fields(PUB, sig, context="advertise-keys", fields=["site-1", "r1", b"\x01\x02"])
    with pytest.raises(SignatureError):
        verify_fields(PUB, sig, context="consistency-check", fields=["site-1", "r1", b"\x01\x02"])
    with pytest.raises(SignatureError):  # same concatenation, different split
        verify_fields(PUB, sig, context="advertise-keys", fields=["site-1r", "1", b"\x01\x02"])
    with pytest.raises(SignatureError):  # same text, different type
        verify_fields(PUB, sig, context="advertise-keys", fields=["site-1", "r1", "\x01\x02"])
    with pytest.raises(SignatureError):  # raw signature of the naive concatenation
        verify(PUB, sig, b"site-1r1\x01\x02")


@settings(max_examples=30)
@given(
    a=st.lists(st.text(max_size=4), max_size=4),
    b=st.lists(st.text(max_size=4), max_size=4),
)
def test_signed_message_injective_over_splits(a: list[str], b: list[str]) -> None:
    same = signed_message(context="c", fields=a) == signed_message(context="c", fields=b)
    assert same == (a == b)


def test_signed_message_requires_context() -> None:
    with pytest.raises(TypeError, match="context"):
        signed_message(context="", fields=[])


def test_raw_public_key_roundtrip() -> None:
    raw = public_key_to_raw(KEY)
    assert len(raw) == 32
    assert public_key_to_raw(PUB) == raw
    loaded = load_public_key_raw(raw)
    verify(loaded, sign(KEY, b"m"), b"m")
    with pytest.raises(KeyFormatError):
        load_public_key_raw(raw[:31])


def test_pem_roundtrips_with_and_without_password() -> None:
    for password in (None, b"correct horse"):
        pem = private_key_to_pem(KEY, password=password)
        assert pem.startswith(b"-----BEGIN")
        loaded = load_private_key_pem(pem, password=password)
        verify(PUB, sign(loaded, b"m"), b"m")
    pub = load_public_key_pem(public_key_to_pem(KEY))
    verify(pub, sign(KEY, b"m"), b"m")


def test_pem_errors() -> None:
    encrypted = private_key_to_pem(KEY, password=b"pw")
    with pytest.raises(KeyFormatError):
        load_private_key_pem(encrypted, password=b"wrong")
    with pytest.raises(KeyFormatError):
        load_private_key_pem(encrypted)
    with pytest.raises(KeyFormatError):
        load_private_key_pem(b"not a pem")
    with pytest.raises(KeyFormatError):
        load_public_key_pem(b"garbage")
    other = X25519PrivateKey.generate()
    other_priv = other.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption())
    other_pub = other.public_key().public_bytes(Encoding.PEM, PublicFormat.SubjectPublicKeyInfo)
    with pytest.raises(KeyFormatError, match="Ed25519"):
        load_private_key_pem(other_priv)
    with pytest.raises(KeyFormatError, match="Ed25519"):
        load_public_key_pem(other_pub)


def test_message_must_be_bytes() -> None:
    with pytest.raises(TypeError):
        sign(KEY, "text")  # type: ignore[arg-type]
