"""AES-256-GCM encryption of Shamir share payloads (ShareKeys stage; docs/protocol.md §4.2, §5).

    blob = nonce (12 random bytes) || AES-256-GCM_K(nonce, plaintext, AD)

with associated data AD = canonical(DOMAIN_TAG, "share", sender, recipient, round_id), so
a ciphertext only opens for the (sender, recipient, round) it was made for; replaying it to
another recipient, as from another sender or in another round, fails authentication. K comes
from :func:`afl.crypto.kdf.derive_share_key`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from afl.crypto.canonical import DOMAIN_TAG, Field, canonical_encode
from afl.crypto.errors import DecryptionError, InvalidSeedError

__all__ = [
    "AEAD_KEY_BYTES",
    "NONCE_BYTES",
    "TAG_BYTES",
    "decrypt_share",
    "encrypt_share",
    "open_sealed",
    "seal",
    "share_associated_data",
]

AEAD_KEY_BYTES = 32
NONCE_BYTES = 12
TAG_BYTES = 16


def _check_key(key: object) -> bytes:
    if not isinstance(key, bytes) or len(key) != AEAD_KEY_BYTES:
        raise InvalidSeedError(f"an AES-256-GCM key must be exactly {AEAD_KEY_BYTES} bytes")
    return key


def seal(key: bytes, plaintext: bytes, *, associated: Sequence[Field]) -> bytes:
    """nonce || AES-256-GCM(plaintext) with AD = canonical(associated); fresh random nonce."""
    aes = AESGCM(_check_key(key))
    nonce = os.urandom(NONCE_BYTES)
    return nonce + aes.encrypt(nonce, plaintext, canonical_encode(associated))


def open_sealed(key: bytes, blob: bytes, *, associated: Sequence[Field]) -> bytes:
    """Inverse of :func:`seal`; :class:`DecryptionError` on any authentication failure."""
    aes = AESGCM(_check_key(key))
    if not isinstance(blob, bytes) or len(blob) < NONCE_BYTES + TAG_BYTES:
        raise DecryptionError("ciphertext too short to hold a nonce and an authentication tag")
    try:
        return aes.decrypt(blob[:NONCE_BYTES], blob[NONCE_BYTES:], canonical_encode(associated))
    except InvalidTag as exc:
        raise DecryptionError(
            "AES-GCM authentication failed: wrong key, tampered ciphertext, or mismatched "
            "sender/recipient/round binding"
        ) from exc


def share_associated_data(*, sender: str, recipient: str, round_id: str) -> tuple[Field, ...]:
    """The AD fields binding a share ciphertext to (sender, recipient, round)."""
    for name, value in (("sender", sender), ("recipient", recipient), ("round_id", round_id)):
        if not isinstance(value, str) or not value:
            raise TypeError(f"{name} must be a non-empty str")
    return (DOMAIN_TAG, "share", sender, recipient, round_id)


def encrypt_share(
    *, key: bytes, plaintext: bytes, sender: str, recipient: str, round_id: str
) -> bytes:
    """Encrypt a share payload from ``sender`` to ``recipient`` for ``round_id``."""
    ad = share_associated_data(sender=sender, recipient=recipient, round_id=round_id)
    return seal(key, plaintext, associated=ad)


def decrypt_share(*, key: bytes, blob: bytes, sender: str, recipient: str, round_id: str) -> bytes:
    """Decrypt a share payload; :class:`DecryptionError` if tampered or bound to other parties."""
    ad = share_associated_data(sender=sender, recipient=recipient, round_id=round_id)
    return open_sealed(key, blob, associated=ad)
