"""A witness of the federation log: cosign a checkpoint only when it extends the last one cosigned
(docs/protocol.md §11a; the rule of C2SP's tlog-witness).

The witness is transport- and storage-free: it is given its last cosigned checkpoint, a new signed
checkpoint and a consistency proof, and either returns its cosignature and the new state, or raises
:class:`SplitViewError` carrying both signed checkpoints as evidence. The caller persists the new
state before it sends the cosignature, and the evidence before it stops.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from afl.crypto.errors import CryptoError
from afl.crypto.transparency.checkpoint import (
    CheckpointError,
    Cosignature,
    SignedCheckpoint,
    cosign,
    verify_checkpoint,
)
from afl.crypto.transparency.merkle import MerkleProofError, verify_consistency

__all__ = ["SplitViewError", "WitnessError", "witness_checkpoint"]


class WitnessError(CryptoError):
    """The new checkpoint cannot be cosigned (bad signature, other federation)."""


@dataclass
class SplitViewError(WitnessError):
    """Two checkpoints signed by the coordinator that cannot both be views of one log."""

    previous: SignedCheckpoint
    offered: SignedCheckpoint
    reason: str

    def __str__(self) -> str:
        return (
            f"the coordinator signed two inconsistent checkpoints: "
            f"{self.previous.checkpoint.describe()} and {self.offered.checkpoint.describe()} "
            f"({self.reason}); this site stops and keeps both as evidence"
        )


def witness_checkpoint(
    *,
    witness: str,
    key: Ed25519PrivateKey,
    coordinator_key: Ed25519PublicKey,
    federation: str,
    previous: SignedCheckpoint | None,
    offered: SignedCheckpoint,
    proof: Sequence[bytes],
) -> Cosignature:
    """Cosign ``offered`` if it is signed by the coordinator, names ``federation`` and extends
    ``previous`` (the last checkpoint this witness cosigned; None for its first).

    Raises:
        WitnessError: the offered checkpoint is not the coordinator's or names another federation.
        SplitViewError: it is the coordinator's but inconsistent with ``previous`` (smaller, a
            different root at the same size, or a consistency proof that does not verify).
    """
    try:
        checkpoint = verify_checkpoint(coordinator_key, offered)
    except CheckpointError as exc:
        raise WitnessError(str(exc)) from exc
    if checkpoint.federation != federation:
        raise WitnessError(
            f"checkpoint of federation {checkpoint.federation!r}, this witness is in {federation!r}"
        )
    if previous is not None:
        old = previous.checkpoint
        if checkpoint.size < old.size:
            raise SplitViewError(previous, offered, "the log shrank")
        if checkpoint.size == old.size:
            if checkpoint.root != old.root:
                raise SplitViewError(previous, offered, "two roots for one size")
        elif old.size > 0:
            try:
                verify_consistency(
                    old_size=old.size,
                    new_size=checkpoint.size,
                    old_root=old.root,
                    new_root=checkpoint.root,
                    proof=proof,
                )
            except MerkleProofError as exc:
                raise SplitViewError(previous, offered, str(exc)) from exc
    return cosign(key, witness=witness, checkpoint=checkpoint)
