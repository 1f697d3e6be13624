"""CKKS mode, wire-level crypto shared by server, sites and decryptor (docs/protocol.md §4.3).

Signed statements (Ed25519, :mod:`afl.crypto.signatures`, canonical field encoding):

* ``CKKS_CONTEXT_CONTEXT`` ("ckks-context"): the decryptor's announcement of its PUBLIC CKKS
  context, fields (round_id, context_sha256, cipher_public_key). ``round_id`` is "" for a
  federation-wide context (the decryptor keeps one key pair across rounds).
* ``DECRYPTION_CONTEXT`` ("decryption"): the decryptor's outcome of one decryption job, fields
  (round_id, release_name, status, result_sha256).

Aggregate tags travel sealed to the decryptor: the site draws an ephemeral X25519 key e, the key
is K = HKDF-SHA256(X25519(e, c_pk), salt = round_salt, info = (version, "ckks-tags", round_id,
"", sender, decryptor)) (:func:`afl.crypto.kdf.derive_key`) and the blob is AES-256-GCM with
associated data (version, "ckks-tags", sender, decryptor, round_id) (:mod:`afl.crypto.aead`).
The server routes the blob but cannot read it.
"""

from __future__ import annotations

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from afl.crypto import aead, kdf
from afl.crypto.canonical import DOMAIN_TAG, Field

__all__ = [
    "CKKS_CONTEXT_CONTEXT",
    "DECRYPTION_CONTEXT",
    "PURPOSE_CKKS_TAGS",
    "context_fields",
    "decryption_fields",
    "open_tags",
    "seal_tags",
]

CKKS_CONTEXT_CONTEXT = "ckks-context"
DECRYPTION_CONTEXT = "decryption"
PURPOSE_CKKS_TAGS = "ckks-tags"


def context_fields(
    *, round_id: str, context_sha256: bytes, cipher_public_key: bytes
) -> list[Field]:
    """Fields of the decryptor's signature on its public context announcement."""
    return [round_id, context_sha256, cipher_public_key]


def decryption_fields(
    *, round_id: str, release_name: str, status: int, result_sha256: bytes
) -> list[Field]:
    """Fields of the decryptor's signature on a decryption outcome."""
    return [round_id, release_name, int(status), result_sha256]


def _tag_key(
    shared: bytes, *, round_salt: bytes, round_id: str, sender: str, recipient: str
) -> bytes:
    return kdf.derive_key(
        shared_secret=shared,
        round_salt=round_salt,
        purpose=PURPOSE_CKKS_TAGS,
        round_id=round_id,
        release="",
        binding=(sender, recipient),
    )


def _associated(sender: str, recipient: str, round_id: str) -> tuple[Field, ...]:
    return (DOMAIN_TAG, PURPOSE_CKKS_TAGS, sender, recipient, round_id)


def seal_tags(
    plaintext: bytes,
    *,
    recipient_public_key: bytes,
    round_salt: bytes,
    round_id: str,
    sender: str,
    recipient: str,
) -> tuple[bytes, bytes]:
    """Seal ``plaintext`` (a serialized AggregateTags) to the decryptor.

    Returns (ephemeral X25519 public key, nonce || AES-256-GCM ciphertext || tag).
    """
    ephemeral = kdf.generate_agreement_key()
    shared = kdf.agree(ephemeral, recipient_public_key)
    key = _tag_key(
        shared, round_salt=round_salt, round_id=round_id, sender=sender, recipient=recipient
    )
    blob = aead.seal(key, plaintext, associated=_associated(sender, recipient, round_id))
    return kdf.public_key_bytes(ephemeral), blob


def open_tags(
    blob: bytes,
    *,
    sender_public_key: bytes,
    recipient_private_key: X25519PrivateKey,
    round_salt: bytes,
    round_id: str,
    sender: str,
    recipient: str,
) -> bytes:
    """Inverse of :func:`seal_tags` at the decryptor; ``DecryptionError`` if tampered/misbound."""
    shared = kdf.agree(recipient_private_key, sender_public_key)
    key = _tag_key(
        shared, round_salt=round_salt, round_id=round_id, sender=sender, recipient=recipient
    )
    return aead.open_sealed(key, blob, associated=_associated(sender, recipient, round_id))
