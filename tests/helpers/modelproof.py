"""A federation log holding a model's release, signed and cosigned with real keys, and the
model's proof written into an export folder (tests of afl.client.model.proof)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from afl.client.model.proof import PROOF_FILE, ModelProof, build_model_proof
from afl.crypto.identity.signatures import load_private_key_pem
from afl.crypto.transparency.checkpoint import Checkpoint, cosign, sign_checkpoint
from afl.crypto.transparency.merkle import leaf_hash, root_hash
from afl.crypto.transparency.statements import statement_bytes


def site_keys(site_dirs: Mapping[str, Path]) -> dict[str, Ed25519PrivateKey]:
    """The identity keys of provisioned sites (their witness keys)."""
    return {
        s: load_private_key_pem((d / "identity.key").read_bytes()) for s, d in site_dirs.items()
    }


def release_proof(
    *,
    federation: str,
    coordinator: Ed25519PrivateKey,
    model_sha256: str,
    round_id: str,
    witnesses: Mapping[str, Ed25519PrivateKey],
) -> ModelProof:
    """A log of five statements (an enrolment, the round's plan, its release of the model, one
    later plan, another release) whose only checkpoint every witness cosigned; the proof of the
    model from it."""
    entries = [
        statement_bytes(federation=federation, kind="enrolment", fields={"site_id": "site-1"}),
        statement_bytes(federation=federation, kind="plan", fields={"round_id": round_id}),
        statement_bytes(
            federation=federation,
            kind="release",
            fields={"round_id": round_id, "model_sha256": model_sha256, "survivors": []},
        ),
        statement_bytes(federation=federation, kind="plan", fields={"round_id": "r9-later"}),
        statement_bytes(
            federation=federation,
            kind="release",
            fields={"round_id": "r9-later", "model_sha256": "ab" * 32, "survivors": []},
        ),
    ]
    checkpoint = Checkpoint(federation, len(entries), root_hash([leaf_hash(e) for e in entries]))
    signed = sign_checkpoint(coordinator, checkpoint)
    cosignatures = [
        (checkpoint.size, w, checkpoint.root, cosign(k, witness=w, checkpoint=checkpoint).signature)
        for w, k in witnesses.items()
    ]
    return build_model_proof(
        federation=federation,
        model_sha256=model_sha256,
        entries=entries,
        checkpoints=[(checkpoint.size, checkpoint.root, signed.signature)],
        cosignatures=cosignatures,
    )


def write_proof(folder: Path, proof: ModelProof) -> Path:
    return proof.save(folder / PROOF_FILE)
