"""Signed checkpoints of the federation log and the witnesses' cosignatures
(docs/protocol.md §11a; the shape of C2SP's tlog-checkpoint and tlog-cosignature).

A checkpoint names the federation, the log's size and its RFC 9162 root; the coordinator signs it
with its identity key. A witness (every site, and the decryptor) cosigns a checkpoint only after
checking a consistency proof from the last one it cosigned (:mod:`afl.crypto.transparency.witness`).
Both signatures are over the canonical encoding of every field, with their own context, so neither
can be replayed as the other or as any other signed statement of the protocol.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, MutableSet
from dataclasses import dataclass

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from afl.crypto.errors import CryptoError, SignatureError
from afl.crypto.identity.signatures import sign_fields, verify_fields
from afl.crypto.transparency.merkle import HASH_SIZE

__all__ = [
    "CHECKPOINT_CONTEXT",
    "COSIGNATURE_CONTEXT",
    "Checkpoint",
    "CheckpointError",
    "Cosignature",
    "SignedCheckpoint",
    "cosign",
    "quorum_witnesses",
    "sign_checkpoint",
    "verify_checkpoint",
    "verify_cosignature",
]

CHECKPOINT_CONTEXT = "log-checkpoint"
COSIGNATURE_CONTEXT = "log-cosignature"


class CheckpointError(CryptoError):
    """A checkpoint or cosignature is malformed, not signed by the key it names, or too few
    witnesses cosigned it."""


@dataclass(frozen=True)
class Checkpoint:
    """The log of ``federation`` has ``size`` entries and RFC 9162 root ``root``."""

    federation: str
    size: int
    root: bytes

    def __post_init__(self) -> None:
        if not self.federation:
            raise CheckpointError("a checkpoint names its federation")
        if self.size < 0:
            raise CheckpointError(f"a log size cannot be negative ({self.size})")
        if len(self.root) != HASH_SIZE:
            raise CheckpointError(f"a checkpoint root is {HASH_SIZE} bytes, not {len(self.root)}")

    def fields(self) -> tuple[str, int, bytes]:
        return (self.federation, self.size, self.root)

    def describe(self) -> str:
        """One line naming the checkpoint, for refusals and evidence."""
        return f"{self.federation} size {self.size} root {self.root.hex()[:16]}…"


@dataclass(frozen=True)
class SignedCheckpoint:
    """A checkpoint with the coordinator's Ed25519 signature."""

    checkpoint: Checkpoint
    signature: bytes


@dataclass(frozen=True)
class Cosignature:
    """Witness ``witness`` vouches that ``checkpoint`` is consistent with everything it saw."""

    witness: str
    checkpoint: Checkpoint
    signature: bytes


def sign_checkpoint(key: Ed25519PrivateKey, checkpoint: Checkpoint) -> SignedCheckpoint:
    """The coordinator's signature over the checkpoint."""
    signature = sign_fields(key, context=CHECKPOINT_CONTEXT, fields=checkpoint.fields())
    return SignedCheckpoint(checkpoint=checkpoint, signature=signature)


def verify_checkpoint(public: Ed25519PublicKey, signed: SignedCheckpoint) -> Checkpoint:
    """The checkpoint, once the coordinator's signature over it verifies."""
    try:
        verify_fields(
            public,
            signed.signature,
            context=CHECKPOINT_CONTEXT,
            fields=signed.checkpoint.fields(),
        )
    except SignatureError as exc:
        raise CheckpointError(
            f"checkpoint {signed.checkpoint.describe()} is not signed by the coordinator"
        ) from exc
    return signed.checkpoint


def _cosigned_fields(witness: str, checkpoint: Checkpoint) -> tuple[str, str, int, bytes]:
    return (witness, *checkpoint.fields())


def cosign(key: Ed25519PrivateKey, *, witness: str, checkpoint: Checkpoint) -> Cosignature:
    """Witness ``witness``'s cosignature (call only after the consistency check)."""
    signature = sign_fields(
        key, context=COSIGNATURE_CONTEXT, fields=_cosigned_fields(witness, checkpoint)
    )
    return Cosignature(witness=witness, checkpoint=checkpoint, signature=signature)


def verify_cosignature(public: Ed25519PublicKey, cosignature: Cosignature) -> None:
    """Raise :class:`CheckpointError` unless the named witness's key signed this checkpoint."""
    try:
        verify_fields(
            public,
            cosignature.signature,
            context=COSIGNATURE_CONTEXT,
            fields=_cosigned_fields(cosignature.witness, cosignature.checkpoint),
        )
    except SignatureError as exc:
        raise CheckpointError(
            f"cosignature of {cosignature.witness} on {cosignature.checkpoint.describe()} "
            "does not verify"
        ) from exc


def quorum_witnesses(
    checkpoint: Checkpoint,
    cosignatures: Iterable[Cosignature],
    *,
    witness_keys: Mapping[str, Ed25519PublicKey],
    quorum: int,
    stop_at_quorum: bool = False,
    verified: MutableSet[tuple[Cosignature, bytes]] | None = None,
) -> frozenset[str]:
    """The distinct roster witnesses whose valid cosignature is on exactly ``checkpoint``.

    Cosignatures by names outside ``witness_keys``, on another checkpoint or that do not verify
    are not counted. Raises :class:`CheckpointError` when fewer than ``quorum`` remain.

    The candidates are verified in a fixed order (by witness name, then signature), a witness
    no more once one of its cosignatures verified. With ``stop_at_quorum`` the verification
    stops as soon as ``quorum`` witnesses are counted, and those are returned (a quorum of valid
    witnesses, not necessarily every one). ``verified`` is the caller's cache of cosignatures
    that verified before, each with the raw public key it verified under: one found there with
    the same key is counted without verifying it again, and one that verifies now is added (a
    cosignature that fails is never added, so it is verified, and refused, each time).
    """
    if quorum < 1:
        raise CheckpointError(f"a witness quorum is at least 1, not {quorum}")
    candidates = sorted(
        {c for c in cosignatures if c.witness in witness_keys and c.checkpoint == checkpoint},
        key=lambda c: (c.witness, c.signature),
    )
    counted: set[str] = set()
    for cosignature in candidates:
        if cosignature.witness in counted:
            continue
        key = witness_keys[cosignature.witness]
        token = (cosignature, key.public_bytes_raw())
        if verified is None or token not in verified:
            try:
                verify_cosignature(key, cosignature)
            except CheckpointError:
                continue
            if verified is not None:
                verified.add(token)
        counted.add(cosignature.witness)
        if stop_at_quorum and len(counted) >= quorum:
            break
    if len(counted) < quorum:
        raise CheckpointError(
            f"checkpoint {checkpoint.describe()} is cosigned by {len(counted)} witness(es) "
            f"of the roster, the quorum is {quorum}"
        )
    return frozenset(counted)
