"""X25519 key agreement and HKDF-SHA256 key derivation with domain separation (docs/protocol.md §5).

Every derived key is

    K = HKDF-SHA256(IKM = X25519(sk_u, pk_v), salt = round_salt,
                    info = canonical(DOMAIN_TAG, purpose, round_id, release, *binding))

(RFC 5869; ``canonical`` is the injective field encoding of :mod:`afl.crypto.canonical`). The
salt is the round's public random nonce (published in the signed round config, see
:func:`new_round_salt`); ``info`` binds protocol version, round id, release name and purpose, so
a key derived for one round, release or use is unrelated to every other.

Purposes: ``pairwise-mask`` (the seed s_uv of the pairwise mask between u and v for one release;
symmetric in u, v) and ``share-encryption`` (the AES-GCM key for shares u → v; directional).
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from afl.crypto.canonical import DOMAIN_TAG, Field, canonical_encode
from afl.crypto.errors import KeyAgreementError, KeyFormatError

__all__ = [
    "KEY_BYTES",
    "MIN_SALT_BYTES",
    "PURPOSE_PAIRWISE_MASK",
    "PURPOSE_SHARE_ENCRYPTION",
    "ROUND_WIDE",
    "agree",
    "derive_key",
    "derive_pairwise_mask_seed",
    "derive_share_key",
    "generate_agreement_key",
    "load_agreement_private_key",
    "load_agreement_public_key",
    "new_round_salt",
    "private_key_bytes",
    "public_key_bytes",
]

KEY_BYTES = 32
MIN_SALT_BYTES = 16
PURPOSE_PAIRWISE_MASK = "pairwise-mask"
PURPOSE_SHARE_ENCRYPTION = "share-encryption"
#: ``release`` value for round-wide keys (share encryption is not tied to one release).
ROUND_WIDE = ""


def generate_agreement_key() -> X25519PrivateKey:
    """A fresh X25519 private key (from the OS CSPRNG)."""
    return X25519PrivateKey.generate()


def public_key_bytes(key: X25519PrivateKey | X25519PublicKey) -> bytes:
    """Raw 32-byte X25519 public key (of a private key, or of a public key)."""
    public = key.public_key() if isinstance(key, X25519PrivateKey) else key
    return public.public_bytes_raw()


def private_key_bytes(key: X25519PrivateKey) -> bytes:
    """Raw 32-byte X25519 private key (the secret Shamir-shared in ShareKeys)."""
    return key.private_bytes_raw()


def load_agreement_public_key(raw: bytes) -> X25519PublicKey:
    """Load a raw 32-byte X25519 public key; :class:`KeyFormatError` if malformed."""
    if not isinstance(raw, bytes) or len(raw) != KEY_BYTES:
        raise KeyFormatError("an X25519 public key must be exactly 32 bytes")
    return X25519PublicKey.from_public_bytes(raw)


def load_agreement_private_key(raw: bytes) -> X25519PrivateKey:
    """Load a raw 32-byte X25519 private key (e.g. one reconstructed from Shamir shares)."""
    if not isinstance(raw, bytes) or len(raw) != KEY_BYTES:
        raise KeyFormatError("an X25519 private key must be exactly 32 bytes")
    return X25519PrivateKey.from_private_bytes(raw)


def agree(private_key: X25519PrivateKey, peer_public: X25519PublicKey | bytes) -> bytes:
    """X25519(sk, pk_peer): the 32-byte shared secret (never used directly as a key).

    Raises:
        KeyAgreementError: the peer key is malformed or of low order (all-zero shared secret).
    """
    peer = peer_public
    if isinstance(peer, bytes):
        try:
            peer = load_agreement_public_key(peer)
        except KeyFormatError as exc:
            raise KeyAgreementError(str(exc)) from exc
    try:
        shared = private_key.exchange(peer)
    except ValueError as exc:
        raise KeyAgreementError("X25519 agreement failed: low-order or invalid peer key") from exc
    if shared == bytes(KEY_BYTES):
        raise KeyAgreementError("X25519 agreement gave the all-zero secret: low-order peer key")
    return shared


def new_round_salt() -> bytes:
    """A fresh 32-byte public random salt for one round (the server publishes it, signed)."""
    return secrets.token_bytes(32)


def _check_text(name: str, value: object, *, allow_empty: bool = False) -> str:
    if not isinstance(value, str):
        raise KeyAgreementError(f"{name} must be a str, got {type(value).__name__}")
    if not value and not allow_empty:
        raise KeyAgreementError(f"{name} must be non-empty")
    return value


def derive_key(
    *,
    shared_secret: bytes,
    round_salt: bytes,
    purpose: str,
    round_id: str,
    release: str,
    binding: Sequence[Field] = (),
    length: int = KEY_BYTES,
) -> bytes:
    """HKDF-SHA256 with salt = round_salt and info = canonical(version, purpose, round, release,
    *binding) (module docstring). ``binding`` adds further context (e.g. the two site ids).
    """
    if not isinstance(shared_secret, bytes) or len(shared_secret) < KEY_BYTES:
        raise KeyAgreementError("shared_secret must be at least 32 bytes")
    if not isinstance(round_salt, bytes) or len(round_salt) < MIN_SALT_BYTES:
        raise KeyAgreementError(f"round_salt must be at least {MIN_SALT_BYTES} random bytes")
    _check_text("purpose", purpose)
    _check_text("round_id", round_id)
    _check_text("release", release, allow_empty=True)
    info = canonical_encode([DOMAIN_TAG, purpose, round_id, release, *binding])
    hkdf = HKDF(algorithm=hashes.SHA256(), length=length, salt=round_salt, info=info)
    return hkdf.derive(shared_secret)


def derive_pairwise_mask_seed(
    *,
    shared_secret: bytes,
    site_a: str,
    site_b: str,
    round_id: str,
    round_salt: bytes,
    release: str,
) -> bytes:
    """Seed s_ab of the pairwise mask of sites a and b for one release (symmetric in a, b).

    Both sites (and the server after reconstructing a dropped site's key) derive the same seed;
    the pair is bound in sorted order.
    """
    _check_text("site_a", site_a)
    _check_text("site_b", site_b)
    if site_a == site_b:
        raise KeyAgreementError("a pairwise mask needs two distinct sites")
    _check_text("release", release)
    low, high = sorted((site_a, site_b))
    return derive_key(
        shared_secret=shared_secret,
        round_salt=round_salt,
        purpose=PURPOSE_PAIRWISE_MASK,
        round_id=round_id,
        release=release,
        binding=(low, high),
    )


def derive_share_key(
    *,
    shared_secret: bytes,
    sender: str,
    recipient: str,
    round_id: str,
    round_salt: bytes,
) -> bytes:
    """AES-256-GCM key for the Shamir shares ``sender`` → ``recipient`` in one round (directional).

    Round-wide: ``release`` is the empty string (shares of one round's keys serve every release).
    """
    _check_text("sender", sender)
    _check_text("recipient", recipient)
    if sender == recipient:
        raise KeyAgreementError("sender and recipient must differ")
    return derive_key(
        shared_secret=shared_secret,
        round_salt=round_salt,
        purpose=PURPOSE_SHARE_ENCRYPTION,
        round_id=round_id,
        release=ROUND_WIDE,
        binding=(sender, recipient),
    )
