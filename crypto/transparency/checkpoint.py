"""Signed checkpoints of the federation log and the witnesses' cosignatures
(docs/protocol.md §11a; the shape of C2SP's tlog-checkpoint and tlog-cosignature).

A checkpoint names the federation, the log's size and its RFC 9162 root; the coordinator signs it
with its identity key. A witness (every site, and the decryptor) cosigns a checkpoint only after
checking a consistency proof from the last one it cosigned (:mod:`afl.crypto.transparency.witness`).
Both signatures are over the canonical encoding of every field, with their own context, so neither
can be replayed as the other or as any other signed statement of the protocol.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
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
) -> frozenset[str]:
    """The distinct roster witnesses whose valid cosignature is on exactly ``checkpoint``.

    Cosignatures by names outside ``witness_keys``, on another checkpoint or that do not verify
    are not counted. Raises :class:`CheckpointError` when fewer than ``quorum`` remain.
    """
    if quorum < 1:
        raise CheckpointError(f"a witness quorum is at least 1, not {quorum}")
    counted: set[str] = set()
    for cosignature in cosignatures:
        key = witness_keys.get(cosignature.witness)
        if key is None or cosignature.checkpoint != checkpoint:
            continue
        try:
            verify_cosignature(key, cosignature)
        except CheckpointError:
            continue
        counted.add(cosignature.witness)
    if len(counted) < quorum:
        raise CheckpointError(
            f"checkpoint {checkpoint.describe()} is cosigned by {len(counted)} witness(es) "
            f"of the roster, the quorum is {quorum}"
        )
    return frozenset(counted)
