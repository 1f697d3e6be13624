"""Ed25519 identity keys: generate, sign, verify, serialize (docs/protocol.md §3, §5).

Protocol messages are signed over a domain-separated canonical encoding

    m = canonical(DOMAIN_TAG, context, *fields)

(:mod:`afl.crypto.canonical`: typed, length-prefixed fields), so a signature made for one
message kind (``context``, e.g. ``"advertise-keys"``) or one field split never verifies as
another.
"""

from __future__ import annotations

from collections.abc import Sequence

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from nacl.bindings import crypto_sign_open
from nacl.exceptions import BadSignatureError

from afl.crypto.canonical import DOMAIN_TAG, Field, canonical_encode, canonical_encode_each
from afl.crypto.errors import KeyFormatError, SignatureError

__all__ = [
    "PUBLIC_KEY_BYTES",
    "SIGNATURE_BYTES",
    "generate_identity_key",
    "load_private_key_pem",
    "load_public_key_pem",
    "load_public_key_raw",
    "private_key_to_pem",
    "public_key_to_pem",
    "public_key_to_raw",
    "sign",
    "sign_fields",
    "signed_message",
    "signed_messages_each",
    "verify",
    "verify_fields",
]

PUBLIC_KEY_BYTES = 32
SIGNATURE_BYTES = 64


def generate_identity_key() -> Ed25519PrivateKey:
    """A fresh Ed25519 identity key (from the OS CSPRNG)."""
    return Ed25519PrivateKey.generate()


def sign(private_key: Ed25519PrivateKey, message: bytes) -> bytes:
    """64-byte Ed25519 signature of raw ``message`` bytes."""
    if not isinstance(message, bytes):
        raise TypeError(f"message must be bytes, got {type(message).__name__}")
    return private_key.sign(message)


def verify(public_key: Ed25519PublicKey, signature: bytes, message: bytes) -> None:
    """Return None if ``signature`` is valid for ``message``; raise :class:`SignatureError` if not.

    Verification is libsodium's (PyNaCl, ``crypto_sign_open``): about twice as fast as OpenSSL's
    on this project's machines, and a site checks O(K) signatures a round (docs/benchmarks.md
    §3c). libsodium is the stricter of the two: every signature an honest Ed25519 signer makes
    verifies, nothing OpenSSL refuses is accepted, and a small-order public key (which OpenSSL
    accepts with a forged signature on any message) verifies nothing
    (tests/crypto/identity/test_signatures.py: RFC 8032's vectors, OpenSSL as the oracle)."""
    if not isinstance(public_key, Ed25519PublicKey):  # libsodium reads 32 bytes of any key
        raise TypeError(f"public_key must be an Ed25519 key, got {type(public_key).__name__}")
    if not isinstance(signature, bytes) or len(signature) != SIGNATURE_BYTES:
        raise SignatureError(f"an Ed25519 signature must be {SIGNATURE_BYTES} bytes")
    if not isinstance(message, bytes):
        raise TypeError(f"message must be bytes, got {type(message).__name__}")
    try:
        crypto_sign_open(signature + message, public_key.public_bytes_raw())
    except BadSignatureError as exc:
        raise SignatureError("Ed25519 signature does not verify for this key and message") from exc


def signed_message(*, context: str, fields: Sequence[Field]) -> bytes:
    """The bytes actually signed: canonical(DOMAIN_TAG, context, *fields)."""
    if not isinstance(context, str) or not context:
        raise TypeError("context must be a non-empty str naming the message kind")
    return canonical_encode([DOMAIN_TAG, context, *fields])


def signed_messages_each(
    *, context: str, head: Sequence[Field], each: Sequence[Field], tail: Sequence[Field]
) -> list[bytes]:
    """``signed_message(context=context, fields=[*head, x, *tail])`` for each ``x`` of ``each``,
    the shared fields encoded once (:func:`afl.crypto.canonical.canonical_encode_each`)."""
    if not isinstance(context, str) or not context:
        raise TypeError("context must be a non-empty str naming the message kind")
    return canonical_encode_each([DOMAIN_TAG, context, *head], each, tail)


def sign_fields(private_key: Ed25519PrivateKey, *, context: str, fields: Sequence[Field]) -> bytes:
    """Sign the canonical encoding of a message tuple (see :func:`signed_message`)."""
    return sign(private_key, signed_message(context=context, fields=fields))


def verify_fields(
    public_key: Ed25519PublicKey, signature: bytes, *, context: str, fields: Sequence[Field]
) -> None:
    """Verify a :func:`sign_fields` signature; :class:`SignatureError` if it does not verify."""
    verify(public_key, signature, signed_message(context=context, fields=fields))


def public_key_to_raw(key: Ed25519PrivateKey | Ed25519PublicKey) -> bytes:
    """Raw 32-byte Ed25519 public key."""
    public = key.public_key() if isinstance(key, Ed25519PrivateKey) else key
    return public.public_bytes_raw()


def load_public_key_raw(raw: bytes) -> Ed25519PublicKey:
    """Load a raw 32-byte Ed25519 public key; :class:`KeyFormatError` if malformed."""
    if not isinstance(raw, bytes) or len(raw) != PUBLIC_KEY_BYTES:
        raise KeyFormatError(f"an Ed25519 public key must be exactly {PUBLIC_KEY_BYTES} bytes")
    try:
        return Ed25519PublicKey.from_public_bytes(raw)
    except ValueError as exc:
        raise KeyFormatError("invalid Ed25519 public key bytes") from exc


def public_key_to_pem(key: Ed25519PrivateKey | Ed25519PublicKey) -> bytes:
    """SubjectPublicKeyInfo PEM of the public key."""
    public = key.public_key() if isinstance(key, Ed25519PrivateKey) else key
    return public.public_bytes(
        encoding=serialization.Encoding.PEM,
        format=serialization.PublicFormat.SubjectPublicKeyInfo,
    )


def load_public_key_pem(data: bytes) -> Ed25519PublicKey:
    """Load a PEM public key; :class:`KeyFormatError` if malformed or not Ed25519."""
    try:
        key = serialization.load_pem_public_key(data)
    except (ValueError, TypeError) as exc:
        raise KeyFormatError("could not parse PEM public key") from exc
    if not isinstance(key, Ed25519PublicKey):
        raise KeyFormatError(f"expected an Ed25519 public key, got {type(key).__name__}")
    return key


def private_key_to_pem(key: Ed25519PrivateKey, *, password: bytes | None = None) -> bytes:
    """PKCS#8 PEM of the private key, encrypted with ``password`` when given."""
    encryption: serialization.KeySerializationEncryption = (
        serialization.BestAvailableEncryption(password)
        if password is not None
        else serialization.NoEncryption()
    )
    return key.private_bytes(
        encoding=serialization.Encoding.PEM,
        format=serialization.PrivateFormat.PKCS8,
        encryption_algorithm=encryption,
    )


def load_private_key_pem(data: bytes, *, password: bytes | None = None) -> Ed25519PrivateKey:
    """Load a PKCS#8 PEM private key; :class:`KeyFormatError` if malformed, wrong password or type."""
    try:
        key = serialization.load_pem_private_key(data, password=password)
    except (ValueError, TypeError) as exc:
        raise KeyFormatError(
            "could not load PEM private key (malformed or wrong password)"
        ) from exc
    if not isinstance(key, Ed25519PrivateKey):
        raise KeyFormatError(f"expected an Ed25519 private key, got {type(key).__name__}")
    return key
