"""The model's proof in an export: the signed model was published by the federation, and the
federation's log says so under a checkpoint a quorum of the site's roster cosigned
(docs/protocol.md §11a, M-198, M-199; docs/operations.md §14).

An export folder (``afl export``) holds ``signed-model.pb`` and ``log-proof.json``::

    {"format": "afl-model-proof/1", "federation": F,
     "statement": hex(the log's "release" statement naming the model's SHA-256), "index": i,
     "checkpoint": {"federation", "size", "root", "signature"},     (the coordinator's)
     "inclusion_proof": [hex, ...],                                  (RFC 9162 PATH(i, D[size]))
     "cosignatures": [{"witness": site, "signature": hex}, ...]}

:func:`verify_export` (``afl-client predict`` and ``evaluate``, before any scoring) checks, with
nothing but the site's kit: the coordinator's signature on the model (the kit's server key), that
the TorchScript head is that model's W, that the statement is this federation's ``release`` of
that model's SHA-256 and round, that the coordinator signed the checkpoint, that the inclusion
proof puts the statement under its root, and that at least ``[policy] witness_quorum`` roster
sites of the kit (default: a majority; keys of the kit, never of the file) cosigned it. What it
cannot check without the backbone's weights file: that the traced backbone in ``model.ts`` is
the one the card names (``SHA256SUMS`` is written by the exporter; compare the card's
``weights_sha256`` with the weights file you hold).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from afl.client.config import ClientConfig
from afl.client.model.published import ModelFileError, PublishedModel, load_published_model
from afl.client.policy.roster import kit_roster
from afl.crypto.errors import CryptoError
from afl.crypto.identity.signatures import load_public_key_raw
from afl.crypto.transparency.checkpoint import (
    Checkpoint,
    Cosignature,
    SignedCheckpoint,
    quorum_witnesses,
    verify_checkpoint,
)
from afl.crypto.transparency.merkle import (
    MerkleProofError,
    inclusion_proof,
    leaf_hash,
    verify_inclusion,
)
from afl.crypto.transparency.statements import decode_statement

__all__ = [
    "PROOF_FILE",
    "PROOF_FORMAT",
    "SIGNED_MODEL_FILE",
    "ModelProof",
    "ModelProofError",
    "build_model_proof",
    "check_head",
    "kit_witnesses",
    "verify_export",
    "verify_model_proof",
]

PROOF_FORMAT = "afl-model-proof/1"
PROOF_FILE = "log-proof.json"
SIGNED_MODEL_FILE = "signed-model.pb"


class ModelProofError(ModelFileError):
    """A model that cannot be shown to be the federation's published model."""


@dataclass(frozen=True)
class ModelProof:
    """A model's ``release`` statement, its inclusion proof and the cosigned checkpoint."""

    federation: str
    statement: bytes
    index: int
    checkpoint: SignedCheckpoint
    path: tuple[bytes, ...]
    cosignatures: tuple[tuple[str, bytes], ...]  # (witness, signature) on ``checkpoint``

    def to_json(self) -> dict[str, object]:
        c = self.checkpoint.checkpoint
        return {
            "format": PROOF_FORMAT,
            "federation": self.federation,
            "statement": self.statement.hex(),
            "index": self.index,
            "checkpoint": {
                "federation": c.federation,
                "size": c.size,
                "root": c.root.hex(),
                "signature": self.checkpoint.signature.hex(),
            },
            "inclusion_proof": [h.hex() for h in self.path],
            "cosignatures": [{"witness": w, "signature": s.hex()} for w, s in self.cosignatures],
        }

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> ModelProof:
        try:
            if doc.get("format") != PROOF_FORMAT:
                raise ValueError(f"format {doc.get('format')!r}, not {PROOF_FORMAT!r}")
            cp = doc["checkpoint"]
            checkpoint = Checkpoint(
                str(cp["federation"]), int(cp["size"]), bytes.fromhex(str(cp["root"]))
            )
            return cls(
                federation=str(doc["federation"]),
                statement=bytes.fromhex(str(doc["statement"])),
                index=int(doc["index"]),
                checkpoint=SignedCheckpoint(checkpoint, bytes.fromhex(str(cp["signature"]))),
                path=tuple(bytes.fromhex(str(h)) for h in doc["inclusion_proof"]),
                cosignatures=tuple(
                    (str(c["witness"]), bytes.fromhex(str(c["signature"])))
                    for c in doc["cosignatures"]
                ),
            )
        except (KeyError, TypeError, ValueError, CryptoError) as exc:
            raise ModelProofError(f"the log proof is malformed ({exc})") from exc

    def save(self, path: str | os.PathLike[str]) -> Path:
        out = Path(path)
        out.write_text(json.dumps(self.to_json(), indent=2), encoding="utf-8")
        return out


def build_model_proof(
    *,
    federation: str,
    model_sha256: str,
    entries: Sequence[bytes],
    checkpoints: Sequence[tuple[int, bytes, bytes]],
    cosignatures: Sequence[tuple[int, str, bytes, bytes]],
) -> ModelProof:
    """The proof of the published model ``model_sha256`` from a federation log (its statements
    in order, its signed checkpoints (size, root, signature), their cosignatures (size, witness,
    root, signature)): the ``release`` statement naming it, in the checkpoint holding it with the
    most cosignatures (the newest among equals)."""
    index = _release_index(federation, model_sha256, entries)
    best: tuple[int, int, bytes, bytes] | None = None  # (count, size, root, signature)
    for size, root, signature in checkpoints:
        if size <= index:
            continue
        count = len({w for s, w, r, _ in cosignatures if s == size and r == root})
        if best is None or (count, size) >= (best[0], best[1]):
            best = (count, size, root, signature)
    if best is None:
        raise ModelProofError(
            f"no signed checkpoint of the federation log holds the release of model "
            f"{model_sha256[:16]}… yet: wait for the next checkpoint and export again"
        )
    _, size, root, signature = best
    leaves = [leaf_hash(e) for e in entries[:size]]
    return ModelProof(
        federation=federation,
        statement=entries[index],
        index=index,
        checkpoint=SignedCheckpoint(Checkpoint(federation, size, root), signature),
        path=tuple(inclusion_proof(leaves, index)),
        cosignatures=tuple(
            sorted((w, sig) for s, w, r, sig in cosignatures if s == size and r == root)
        ),
    )


def _release_index(federation: str, model_sha256: str, entries: Sequence[bytes]) -> int:
    for i, entry in enumerate(entries):
        try:
            kind, fields = decode_statement(entry, federation=federation)
        except CryptoError:
            continue
        if kind == "release" and fields.get("model_sha256") == model_sha256:
            return i
    raise ModelProofError(
        f"the federation log of {federation!r} has no release of model {model_sha256[:16]}…: "
        "it was not published by this federation"
    )


def kit_witnesses(config: ClientConfig) -> tuple[dict[str, bytes], int]:
    """The roster of the site's kit (``[peers]`` and itself) and its witness quorum."""
    roster = kit_roster(config)
    quorum = config.policy.witness_quorum or len(roster) // 2 + 1
    return roster, quorum


def verify_model_proof(
    proof: ModelProof,
    *,
    published: PublishedModel,
    coordinator_key: bytes,
    federation: str,
    roster: Mapping[str, bytes],
    quorum: int,
) -> frozenset[str]:
    """The roster witnesses who cosigned the checkpoint under which the log holds the release of
    ``published`` (module docstring); :class:`ModelProofError` naming the first check that
    fails."""
    model = published.model
    try:
        kind, fields = decode_statement(proof.statement, federation=federation)
    except CryptoError as exc:
        raise ModelProofError(f"the log proof's statement is refused: {exc}") from exc
    if kind != "release" or fields.get("model_sha256") != published.model_sha256:
        raise ModelProofError(
            f"the log proof's statement is not the release of model "
            f"{published.model_sha256[:16]}… (it is a {kind!r} statement)"
        )
    if fields.get("round_id") != model.round_id:
        raise ModelProofError(
            f"the log's release names round {fields.get('round_id')!r}, the model round "
            f"{model.round_id!r}"
        )
    signed = proof.checkpoint
    if signed.checkpoint.federation != federation:
        raise ModelProofError(f"the log checkpoint is of {signed.checkpoint.federation!r}")
    try:
        checkpoint = verify_checkpoint(load_public_key_raw(coordinator_key), signed)
        verify_inclusion(
            leaf=leaf_hash(proof.statement),
            index=proof.index,
            tree_size=checkpoint.size,
            proof=list(proof.path),
            root=checkpoint.root,
        )
        keys = {s: load_public_key_raw(k) for s, k in roster.items()}
        return quorum_witnesses(
            checkpoint,
            [Cosignature(w, checkpoint, sig) for w, sig in proof.cosignatures],
            witness_keys=keys,
            quorum=quorum,
        )
    except (CryptoError, MerkleProofError) as exc:
        raise ModelProofError(f"the model's log proof is refused: {exc}") from exc


def verify_export(
    folder: str | os.PathLike[str], config: ClientConfig
) -> tuple[PublishedModel, frozenset[str]]:
    """The signed model of an export folder (or of the folder holding ``signed-model.pb``) and
    the witnesses of its log proof, once everything verifies with the site's kit."""
    root = Path(folder)
    if root.is_file():
        root = root.parent
    signed_file, proof_file = root / SIGNED_MODEL_FILE, root / PROOF_FILE
    if not signed_file.is_file() or not proof_file.is_file():
        missing = SIGNED_MODEL_FILE if not signed_file.is_file() else PROOF_FILE
        raise ModelProofError(
            f"{root} is not an export of this federation (no {missing}): use a model exported "
            "by `afl export` with its log proof, or pass --unverified-model to score it anyway"
        )
    published = load_published_model(
        signed_file,
        server_public_key=config.server_public_key,
        federation_id=config.federation_id,
    )
    try:
        doc = json.loads(proof_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelProofError(f"cannot read {proof_file}: {exc}") from exc
    roster, quorum = kit_witnesses(config)
    witnesses = verify_model_proof(
        ModelProof.from_json(doc),
        published=published,
        coordinator_key=config.server_public_key,
        federation=config.federation_id,
        roster=roster,
        quorum=quorum,
    )
    return published, witnesses


def check_head(module: Any, published: PublishedModel) -> None:
    """The TorchScript classifier's head must be the signed model's W, bit for bit."""
    weights = getattr(module, "weights", None)
    head = None if weights is None else np.asarray(weights.detach().cpu().numpy())
    if head is None or head.shape != published.weights.shape:
        raise ModelProofError("the exported classifier's head is not the signed model's W")
    if not np.array_equal(head, published.weights):
        raise ModelProofError(
            f"the exported classifier's head differs from the signed model "
            f"{published.model_sha256[:16]}…: the export was altered"
        )
