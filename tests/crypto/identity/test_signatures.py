"""Tests of afl.crypto.identity.signatures: Ed25519 sign/verify of canonical messages, serialization."""

from __future__ import annotations

import pytest
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
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


# RFC 8032 §7.1, TEST 1-3: (secret key, public key, message, signature).
RFC8032_VECTORS = (
    (
        "9d61b19deffd5a60ba844af492ec2cc44449c5697b326919703bac031cae7f60",
        "d75a980182b10ab7d54bfed3c964073a0ee172f3daa62325af021a68f707511a",
        "",
        "e5564300c360ac729086e2cc806e828a84877f1eb8e5d974d873e065224901555fb8821590a33bacc61e39701cf9b46bd25bf5f0595bbe24655141438e7a100b",
    ),
    (
        "4ccd089b28ff96da9db6c346ec114e0f5b8a319f35aba624da8cf6ed4fb8a6fb",
        "3d4017c3e843895a92b70aa74d1b7ebc9c982ccf2ec4968cc0cd55f12af4660c",
        "72",
        "92a009a9f0d4cab8720e820b5f642540a2b27b5416503f8fb3762223ebdb69da085ac1e43e15996e458f3613d0f11d8c387b2eaeb4302aeeb00d291612bb0c00",
    ),
    (
        "c5aa8df43f9f837bedb7442f31dcb7b166d38535076f094b85ce3a2e0b4458f7",
        "fc51cd8e6218a1a38da47ed00230f0580816ed13ba3303ac5deb911548908025",
        "af82",
        "6291d657deec24024827e69c3abe01a30ce548a284743a445e3680d7db5ac3ac18ff9b538d16f290ae67f760984dc6594a7c15e9716ed28dc027beceea1ec40a",
    ),
)
#: The order of Ed25519's prime-order subgroup.
GROUP_ORDER = 2**252 + 27742317777372353535851937790883648493


@pytest.mark.parametrize(("secret", "public", "message", "signature"), RFC8032_VECTORS)
def test_rfc8032_vectors(secret: str, public: str, message: str, signature: str) -> None:
    key = Ed25519PrivateKey.from_private_bytes(bytes.fromhex(secret))
    pub = load_public_key_raw(bytes.fromhex(public))
    assert public_key_to_raw(key) == bytes.fromhex(public)
    assert sign(key, bytes.fromhex(message)) == bytes.fromhex(signature)
    verify(pub, bytes.fromhex(signature), bytes.fromhex(message))
    with pytest.raises(SignatureError):
        verify(pub, bytes.fromhex(signature), bytes.fromhex(message) + b"\x00")


@settings(max_examples=60)
@given(
    message=st.binary(max_size=100),
    where=st.integers(min_value=0, max_value=63),
    flip=st.integers(min_value=0, max_value=255),
    tamper_message=st.booleans(),
)
def test_verify_agrees_with_openssl(
    message: bytes, where: int, flip: int, tamper_message: bool
) -> None:
    """The independent oracle: OpenSSL's verification (the ``cryptography`` package) accepts
    exactly what this module accepts, for honest and tampered signatures and messages."""
    sig = sign(KEY, message)
    if tamper_message:
        message = message + bytes([flip])
    else:
        sig = sig[:where] + bytes([sig[where] ^ flip]) + sig[where + 1 :]
    try:
        PUB.verify(sig, message)
        openssl = True
    except InvalidSignature:
        openssl = False
    try:
        verify(PUB, sig, message)
        ours = True
    except SignatureError:
        ours = False
    assert ours == openssl


def test_malleated_signature_refused() -> None:
    """S + L (the same point equation, a non-canonical scalar) does not verify."""
    message = b"plan"
    sig = sign(KEY, message)
    s = int.from_bytes(sig[32:], "little") + GROUP_ORDER
    assert s < 2**256
    with pytest.raises(SignatureError):
        verify(PUB, sig[:32] + s.to_bytes(32, "little"), message)


def test_small_order_public_key_refused() -> None:
    """The identity point as a public key with R = identity, S = 0 satisfies the cofactorless
    equation for every message. OpenSSL accepts that forgery; this module must not."""
    identity = bytes([1]) + bytes(31)
    pub = load_public_key_raw(identity)
    forged = identity + bytes(32)
    pub.verify(forged, b"any message at all")  # OpenSSL: no exception
    with pytest.raises(SignatureError):
        verify(pub, forged, b"any message at all")


def test_verify_needs_an_ed25519_key() -> None:
    """libsodium reads 32 bytes of whatever key it is handed: another key type is refused first."""
    other = X25519PrivateKey.generate().public_key()
    with pytest.raises(TypeError, match="Ed25519"):
        verify(other, sign(KEY, b"m"), b"m")  # type: ignore[arg-type]
