"""CKKS mode, wire-level crypto shared by server, sites and decryptor (docs/protocol.md §4.3).

Signed statements (Ed25519, :mod:`afl.crypto.identity.signatures`, canonical field encoding):

* ``CKKS_CONTEXT_CONTEXT`` ("ckks-context"): the decryptor's announcement of its PUBLIC CKKS
  context, fields (round_id, context_sha256, cipher_public_key). ``round_id`` is "" for a
  federation-wide context (the decryptor keeps one key pair across rounds).
* ``DECRYPTION_CONTEXT`` ("decryption"): the decryptor's outcome of one decryption job, fields
  (federation_id, round_id, plan_sha256, release_name, status, result_sha256).

Aggregate tags travel sealed to the decryptor AND signed by the sending site
(:class:`TagBinding`, :func:`seal_tags`, :func:`open_tags`). The site draws an ephemeral X25519
key e; the key is K = HKDF-SHA256(X25519(e, c_pk), salt = round_salt, info = (version,
"ckks-tags", round_id, "", sender, decryptor)) (:func:`afl.crypto.kdf.derive_key`) and the blob
is AES-256-GCM with associated data (version, "ckks-tags", sender, decryptor, round_id)
(:mod:`afl.crypto.aead`). The ephemeral key authenticates nobody (anyone, the coordinator
included, can seal a blob to the decryptor), so the site also signs the envelope with its
Ed25519 identity key:

* ``TAGS_CONTEXT`` ("ckks-tags"): fields (federation_id, round_id, plan_sha256, sender,
  decryptor, decryptor's X25519 key c_pk, ephemeral public key, SHA-256 of the blob).

:func:`open_tags` verifies that signature with the sender's identity key from the decryptor's
startup kit BEFORE decrypting, so a tag "from" a site opens only if that site sealed it, for this
federation, round, plan (hence its releases) and this decryptor key. Encrypt-then-sign is sound
here: the signer is the only party that knows e, and the signature binds e and the blob.
The server routes the blob but can neither read nor forge it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from afl.crypto import aead, kdf
from afl.crypto.canonical import DOMAIN_TAG, Field
from afl.crypto.errors import KeyAgreementError
from afl.crypto.identity.signatures import sign_fields, verify_fields

__all__ = [
    "CKKS_CONTEXT_CONTEXT",
    "DECRYPTION_CONTEXT",
    "PURPOSE_CKKS_TAGS",
    "TAGS_CONTEXT",
    "SealedTags",
    "TagBinding",
    "context_fields",
    "decryption_fields",
    "open_tags",
    "seal_tags",
    "tag_signature_fields",
    "verify_sealed_tags",
]

CKKS_CONTEXT_CONTEXT = "ckks-context"
DECRYPTION_CONTEXT = "decryption"
PURPOSE_CKKS_TAGS = "ckks-tags"
#: Signature context of a site's sealed aggregate tags (same word as the HKDF purpose; the two
#: never meet: one is signed, the other is key-derivation info).
TAGS_CONTEXT = "ckks-tags"


def context_fields(
    *, round_id: str, context_sha256: bytes, cipher_public_key: bytes
) -> list[Field]:
    """Fields of the decryptor's signature on its public context announcement."""
    return [round_id, context_sha256, cipher_public_key]


def decryption_fields(
    *,
    federation_id: str,
    round_id: str,
    plan_sha256: bytes,
    release_name: str,
    status: int,
    result_sha256: bytes,
) -> list[Field]:
    """Fields of the decryptor's signature on a decryption outcome: the federation, the round
    and the SHA-256 of its signed plan (which fixes the run and the releases), the release, the
    outcome and the result's digest."""
    return [federation_id, round_id, plan_sha256, release_name, int(status), result_sha256]


@dataclass(frozen=True)
class TagBinding:
    """What a site's sealed tags are bound to: the federation, the round and its signed plan
    (``plan_sha256`` = SHA-256 of the plan bytes, which fix the releases and the salt), the
    sender, the decryptor's site id and its X25519 tag key ``recipient_key`` (raw 32 bytes)."""

    federation_id: str
    round_id: str
    round_salt: bytes
    plan_sha256: bytes
    sender: str
    recipient: str
    recipient_key: bytes


@dataclass(frozen=True)
class SealedTags:
    """The envelope: ephemeral X25519 public key, nonce || AES-256-GCM blob, site signature."""

    ephemeral_public_key: bytes
    blob: bytes
    signature: bytes


def tag_signature_fields(
    binding: TagBinding, *, ephemeral_public_key: bytes, blob: bytes
) -> list[Field]:
    """Fields of a site's signature on its sealed tags (context :data:`TAGS_CONTEXT`)."""
    return [
        binding.federation_id,
        binding.round_id,
        binding.plan_sha256,
        binding.sender,
        binding.recipient,
        binding.recipient_key,
        ephemeral_public_key,
        hashlib.sha256(blob).digest(),
    ]


def _tag_key(shared: bytes, binding: TagBinding) -> bytes:
    return kdf.derive_key(
        shared_secret=shared,
        round_salt=binding.round_salt,
        purpose=PURPOSE_CKKS_TAGS,
        round_id=binding.round_id,
        release="",
        binding=(binding.sender, binding.recipient),
    )


def _associated(binding: TagBinding) -> tuple[Field, ...]:
    return (DOMAIN_TAG, PURPOSE_CKKS_TAGS, binding.sender, binding.recipient, binding.round_id)


def seal_tags(
    plaintext: bytes, *, binding: TagBinding, identity_key: Ed25519PrivateKey
) -> SealedTags:
    """Seal ``plaintext`` (a serialized AggregateTags) to the decryptor's ``recipient_key`` and
    sign the envelope with the sender's identity key (module docstring)."""
    ephemeral = kdf.generate_agreement_key()
    key = _tag_key(kdf.agree(ephemeral, binding.recipient_key), binding)
    blob = aead.seal(key, plaintext, associated=_associated(binding))
    ephemeral_public = kdf.public_key_bytes(ephemeral)
    signature = sign_fields(
        identity_key,
        context=TAGS_CONTEXT,
        fields=tag_signature_fields(binding, ephemeral_public_key=ephemeral_public, blob=blob),
    )
    return SealedTags(ephemeral_public, blob, signature)


def verify_sealed_tags(
    sealed: SealedTags, *, binding: TagBinding, sender_identity: Ed25519PublicKey
) -> None:
    """``SignatureError`` unless the sender signed this envelope for ``binding`` (the check
    :func:`open_tags` makes first; the coordinator makes it too, to refuse a bad envelope early)."""
    verify_fields(
        sender_identity,
        sealed.signature,
        context=TAGS_CONTEXT,
        fields=tag_signature_fields(
            binding, ephemeral_public_key=sealed.ephemeral_public_key, blob=sealed.blob
        ),
    )


def open_tags(
    sealed: SealedTags,
    *,
    binding: TagBinding,
    sender_identity: Ed25519PublicKey,
    recipient_private_key: X25519PrivateKey,
) -> bytes:
    """Inverse of :func:`seal_tags` at the decryptor: verify the sender's signature (its
    identity key from the startup kit), then decrypt. ``SignatureError`` when the sender did
    not seal these tags for this binding, ``KeyAgreementError`` when ``binding.recipient_key``
    is not this decryptor's key, ``DecryptionError`` when the blob is tampered or misbound."""
    if kdf.public_key_bytes(recipient_private_key) != binding.recipient_key:
        raise KeyAgreementError("the tags are bound to another decryptor key than this one")
    verify_sealed_tags(sealed, binding=binding, sender_identity=sender_identity)
    key = _tag_key(kdf.agree(recipient_private_key, sealed.ephemeral_public_key), binding)
    return aead.open_sealed(key, sealed.blob, associated=_associated(binding))
