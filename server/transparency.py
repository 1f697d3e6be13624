"""The federation log at the coordinator (docs/protocol.md §11a): signed checkpoints, RFC 9162
proofs, and the witnesses' cosignatures.

The statements are appended by the store in the transaction of the state change they record
(:meth:`afl.server.store.Store.append_log`: enrolments and key changes, runs submitted and ended,
every signed plan, every release with its survivors and digests, aborted rounds). This module
serves them: :meth:`FederationLog.checkpoint` signs the log's current size when it grew (the
checkpoint is recorded before it is served, so the store refuses a later, shorter log), and
returns it with the cosignatures the sites sent for it; :meth:`FederationLog.cosign` keeps a
site's cosignature once it verifies under the site's enrolled identity key on a checkpoint this
coordinator signed. Sites poll until a quorum cosigned a checkpoint that holds the plan they are
asked to act on; every site that polls cosigns the newest checkpoint, so the quorum gathers on it
without a coordinator-side round of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from afl.crypto.errors import CryptoError
from afl.crypto.identity.signatures import load_public_key_raw, verify_fields
from afl.crypto.identity.signed_blobs import blob_sha256
from afl.crypto.transparency.checkpoint import (
    Checkpoint,
    Cosignature,
    SignedCheckpoint,
    sign_checkpoint,
    verify_cosignature,
)
from afl.crypto.transparency.merkle import MerkleProofError, leaf_hash
from afl.crypto.transparency.statements import (
    DECRYPTING_CONTEXT,
    DP_RELEASE_CONTEXT,
    OPENING_CONTEXT,
    StatementError,
    decode_statement,
    decrypting_signed_fields,
    dp_release_signed_fields,
    opened_release_statement,
    opening_signed_fields,
    plan_statement,
    release_sha256,
)
from afl.proto import wire
from afl.proto.v1 import common_pb2 as cpb
from afl.proto.v1 import coordinator_pb2 as pb
from afl.server.errors import InvalidRequestError, NotPermittedError, WrongStageError
from afl.server.store import Store

__all__ = ["MAX_ENTRIES", "CosignedCheckpoint", "FederationLog", "cosigned_to_proto"]

#: The most statements one GetLogEntries answer carries.
MAX_ENTRIES = 1000


@dataclass(frozen=True)
class CosignedCheckpoint:
    """A signed checkpoint and the witnesses' cosignatures on it."""

    signed: SignedCheckpoint
    cosignatures: tuple[Cosignature, ...]


def cosigned_to_proto(
    found: CosignedCheckpoint,
    *,
    consistency: Sequence[bytes] = (),
    inclusion: tuple[int, Sequence[bytes]] | None = None,
    also_inclusion: tuple[int, Sequence[bytes]] | None = None,
) -> pb.CosignedLogCheckpoint:
    """The GetCheckpoint answer: ``found`` with the proofs asked for (none by default)."""
    answer = pb.CosignedLogCheckpoint(
        checkpoint=wire.checkpoint_to_proto(found.signed),
        cosignatures=[wire.cosignature_to_proto(c) for c in found.cosignatures],
        consistency=consistency,
    )
    for proof, field in ((inclusion, answer.inclusion), (also_inclusion, answer.also_inclusion)):
        if proof is not None:
            field.CopyFrom(pb.LogProof(index=proof[0], hashes=proof[1]))
    return answer


def log_entry_to_proto(row: tuple[int, str, bytes, int]) -> pb.LogEntry:
    """One committed statement (:meth:`FederationLog.entries`' row) as GetLogEntries and a
    checkpoint answer carry it."""
    index, kind, statement, stamp = row
    return pb.LogEntry(index=index, kind=kind, statement=statement, time_unix_ms=stamp)


class FederationLog:
    """The coordinator's view of its federation log (module docstring). Not thread-safe: the
    coordinator calls it with its lock held (but for :meth:`entries`)."""

    def __init__(self, store: Store, *, key: Ed25519PrivateKey, federation_id: str) -> None:
        self.store, self._key, self.federation_id = store, key, federation_id
        self._decoded: dict[bytes, dict[str, object]] = {}  # dp-release statement -> fields

    def checkpoint(self) -> CosignedCheckpoint:
        """The newest signed checkpoint (signed now, and recorded, if the log grew) with its
        cosignatures."""
        size = self.store.log_size()
        last = self.store.log_checkpoint()
        if last is None or last[0] < size:
            root = self.store.log_tree().root(size)
            signed = sign_checkpoint(self._key, Checkpoint(self.federation_id, size, root))
            self.store.put_log_checkpoint(size=size, root=root, signature=signed.signature)
            last = (size, root, signed.signature)
        return self.cosigned(last[0])

    def signed(self, size: int) -> SignedCheckpoint:
        """The checkpoint of ``size`` this coordinator signed; :class:`WrongStageError` if none."""
        row = self.store.log_checkpoint(size)
        if row is None:
            raise WrongStageError(f"no signed checkpoint of the federation log has size {size}")
        return SignedCheckpoint(Checkpoint(self.federation_id, row[0], row[1]), row[2])

    def cosigned(self, size: int) -> CosignedCheckpoint:
        signed = self.signed(size)
        cosignatures = tuple(
            Cosignature(witness, signed.checkpoint, signature)
            for witness, root, signature in self.store.log_cosignatures(size)
            if root == signed.checkpoint.root
        )
        return CosignedCheckpoint(signed, cosignatures)

    def cosign(
        self, site_id: str, *, size: int, root: bytes, signature: bytes
    ) -> CosignedCheckpoint:
        """Keep ``site_id``'s cosignature of the checkpoint (size, root); that checkpoint with
        the cosignatures it now has."""
        signed = self.signed(size)
        if root != signed.checkpoint.root:
            raise InvalidRequestError(
                f"the cosigned root of size {size} is not the root this coordinator signed"
            )
        enrolment = self.store.enrolment(site_id)
        if enrolment is None:
            raise NotPermittedError(f"site {site_id!r} has not enrolled; call Enroll first")
        cosignature = Cosignature(site_id, signed.checkpoint, signature)
        try:
            verify_cosignature(load_public_key_raw(enrolment.identity_public_key), cosignature)
        except CryptoError as exc:
            raise NotPermittedError(str(exc)) from exc
        self.store.put_log_cosignature(size=size, root=root, witness=site_id, signature=signature)
        return self.cosigned(size)

    def _site_statement(
        self, site_id: str, statement: bytes, *, kind: str, fields: frozenset[str]
    ) -> dict[str, object]:
        """The fields of ``site_id``'s statement ``kind``, which must have exactly ``fields``,
        name the caller as its site and carry a hex signature (verified by the caller of this)."""
        try:
            found, decoded = decode_statement(statement, federation=self.federation_id)
        except StatementError as exc:
            raise InvalidRequestError(str(exc)) from exc
        if found != kind or set(decoded) != fields or not isinstance(decoded["signature"], str):
            raise InvalidRequestError(f"a {found!r} statement is not a well-formed {kind}")
        if decoded["site"] != site_id:
            raise NotPermittedError(
                f"a {kind} names site {decoded['site']!r}, the caller is {site_id!r}"
            )
        return decoded

    def _verify_site(
        self, site_id: str, signature: object, *, context: str, fields: tuple[str, ...]
    ) -> None:
        """``signature`` (hex) must verify under ``site_id``'s enrolled identity key."""
        enrolment = self.store.enrolment(site_id)
        if enrolment is None:
            raise NotPermittedError(f"site {site_id!r} has not enrolled; call Enroll first")
        try:
            verify_fields(
                load_public_key_raw(enrolment.identity_public_key),
                bytes.fromhex(str(signature)),
                context=context,
                fields=fields,
            )
        except (CryptoError, ValueError) as exc:
            raise NotPermittedError(f"the {context} signature does not verify: {exc}") from exc

    def record_dp_release(self, site_id: str, statement: bytes) -> int:
        """Append ``site_id``'s `dp-release` statement (its signed DP-ledger entry) once; its
        index. The statement must name the caller and carry a signature that verifies under the
        caller's enrolled identity key (docs/protocol.md M-195)."""
        fields = self._site_statement(
            site_id, statement, kind="dp-release", fields=frozenset({"site", "entry", "signature"})
        )
        entry = fields["entry"]
        if not isinstance(entry, dict):
            raise InvalidRequestError("a dp-release statement carries no ledger entry")
        self._verify_site(
            site_id,
            fields["signature"],
            context=DP_RELEASE_CONTEXT,
            fields=dp_release_signed_fields(
                federation=self.federation_id, site=site_id, entry=entry
            ),
        )
        found = self.store.log_index(leaf_hash(statement))
        if found is not None:
            return found
        self._check_release_bound(site_id, entry)
        return self.store.append_log("dp-release", fields)

    def record_opening(
        self,
        site_id: str,
        statement: bytes,
        *,
        survivors_of: Callable[[str], Sequence[str]],
    ) -> int:
        """Append ``site_id``'s `opening` statement once, after the round's `opened-release`
        statement (once per round); the opening's index (docs/protocol.md M-232). It must name
        the caller, verify under the caller's enrolled identity key, name the round's current
        plan (in the log), and sign the digest of exactly that plan's releases over exactly the
        round's survivors, ``survivors_of(round id)`` (a masked round's survivor list in its
        consistency check and unmask stages, a CKKS round's participants in its upload stage;
        it raises :class:`WrongStageError` otherwise, or for a caller that is not a
        participant): a site adds to every site's audit only the release of a round it is
        unmasking or uploading to, as it is. The release itself is the coordinator's to log,
        built from the plan and the survivors; the opening carries only its digest."""
        fields = self._site_statement(
            site_id,
            statement,
            kind="opening",
            fields=frozenset(
                {"site", "round_id", "plan_sha256", "mode", "release_sha256", "signature"}
            ),
        )
        round_id, digest = fields["round_id"], fields["plan_sha256"]
        mode, opened = fields["mode"], fields["release_sha256"]
        if (
            not isinstance(round_id, str)
            or not isinstance(digest, str)
            or not isinstance(mode, str)
            or not isinstance(opened, str)
        ):
            raise InvalidRequestError(
                "an opening statement carries no round, plan digest, mode or release digest"
            )
        plan_sha256 = _hex_digest(digest, "an opening's plan digest")
        signed_release = _hex_digest(opened, "an opening's release digest")
        self._verify_site(
            site_id,
            fields["signature"],
            context=OPENING_CONTEXT,
            fields=opening_signed_fields(
                federation=self.federation_id,
                site=site_id,
                round_id=round_id,
                plan_sha256=plan_sha256,
                mode=mode,
                release_sha256=signed_release,
            ),
        )
        planned = plan_statement(
            federation=self.federation_id, round_id=round_id, plan_sha256=plan_sha256
        )
        row = self.store.round(round_id)
        if (
            self.store.log_index(leaf_hash(planned)) is None
            or row is None
            or row.plan is None
            or blob_sha256(row.plan) != plan_sha256
        ):
            raise WrongStageError(
                f"the federation log holds no plan of round {round_id[:64]!r} with the digest "
                "the opening names (or it is no longer the round's plan)"
            )
        plan = cpb.ReleasePlan.FromString(row.plan)
        try:
            planned_mode = wire.opening_mode(plan)
        except wire.WireError as exc:
            raise WrongStageError(str(exc)) from exc
        if mode != planned_mode:
            raise NotPermittedError(
                f"an opening of {site_id} states mode {mode[:16]!r}; round {round_id} runs "
                f"{planned_mode}"
            )
        actual = sorted(survivors_of(round_id))
        if site_id not in actual:
            raise NotPermittedError(f"site {site_id} is not among round {round_id}'s survivors")
        release = wire.release_statement_fields(
            round_id=plan.round_id,
            run_id=plan.run_id,
            survivors=actual,
            releases=[(r.name, r.kind, r.class_names, r.member_site_ids) for r in plan.releases],
        )
        if release_sha256(release) != signed_release:
            raise NotPermittedError(
                f"an opening of {site_id} misstates round {round_id}: the release it signs is "
                f"not the plan's releases over the round's survivors {actual}"
            )
        body = opened_release_statement(federation=self.federation_id, release=release)
        with self.store.transaction():
            if self.store.log_index(leaf_hash(body)) is None:
                self.store.append_log("opened-release", release)
            found = self.store.log_index(leaf_hash(statement))
            return found if found is not None else self.store.append_log("opening", fields)

    def record_decrypting(
        self, site_id: str, statement: bytes, *, solving: Callable[[str], bytes]
    ) -> int:
        """Append the decryptor's `decrypting` statement once; its index (docs/protocol.md
        M-235). It must name the caller and verify under the caller's enrolled identity key,
        and name the plan ``solving(round id)`` answers: the SHA-256 of the current plan of a
        CKKS round in its solving stage whose caller is the federation's decryptor (it raises
        otherwise). The plan must be in the log."""
        fields = self._site_statement(
            site_id,
            statement,
            kind="decrypting",
            fields=frozenset({"site", "round_id", "plan_sha256", "signature"}),
        )
        round_id, digest = fields["round_id"], fields["plan_sha256"]
        if not isinstance(round_id, str) or not isinstance(digest, str):
            raise InvalidRequestError("a decrypting statement carries no round or plan digest")
        plan_sha256 = _hex_digest(digest, "a decrypting statement's plan digest")
        self._verify_site(
            site_id,
            fields["signature"],
            context=DECRYPTING_CONTEXT,
            fields=decrypting_signed_fields(
                federation=self.federation_id,
                decryptor=site_id,
                round_id=round_id,
                plan_sha256=plan_sha256,
            ),
        )
        planned = plan_statement(
            federation=self.federation_id, round_id=round_id, plan_sha256=plan_sha256
        )
        if solving(round_id) != plan_sha256 or self.store.log_index(leaf_hash(planned)) is None:
            raise WrongStageError(
                f"round {round_id!r}'s current plan in the log is not the one the decrypting "
                "statement names"
            )
        found = self.store.log_index(leaf_hash(statement))
        if found is not None:
            return found
        return self.store.append_log("decrypting", fields)

    def _check_release_bound(self, site_id: str, entry: dict[str, object]) -> None:
        """A site's ledger holds one entry per round, numbered 1, 2, ...
        (:mod:`afl.client.policy.ledger`): so the log takes a dp-release with the next number and
        not for a round already logged for the site. It does not require the round's plan to be
        in this coordinator's store: a site carries its spend over to a coordinator that lost or
        restored its state (M-196), and an extra entry only over-counts the site's own budget.
        Residual: a site may append entries of made-up rounds; each is a signed entry of its own
        ledger (it spends its own budget) and the log records who sent it."""
        round_id = str(entry.get("round_id", ""))
        logged = [
            self._dp_fields(statement) for statement in self.store.log_statements("dp-release")
        ]
        mine = [f["entry"] for f in logged if f.get("site") == site_id]
        if any(isinstance(e, dict) and e.get("round_id") == round_id for e in mine):
            raise NotPermittedError(
                f"the log already holds a dp-release of {site_id} for round {round_id!r}: a "
                "ledger has one entry per round"
            )
        if entry.get("seq") != len(mine) + 1:
            raise NotPermittedError(
                f"a dp-release of {site_id} is ledger entry {entry.get('seq')!r}; the log holds "
                f"{len(mine)} of its entries, so the next is {len(mine) + 1}"
            )

    def _dp_fields(self, statement: bytes) -> dict[str, object]:
        """The fields of a logged `dp-release` statement, decoded once per statement (each
        dp-release checks the site's earlier ones: decoding all of them each time made the
        K sites' statements of a round O(K²) work under the coordinator's lock)."""
        fields = self._decoded.get(statement)
        if fields is None:
            fields = self._decoded[statement] = decode_statement(
                statement, federation=self.federation_id
            )[1]
        return fields

    def consistency(self, old_size: int, new_size: int) -> list[bytes]:
        """RFC 9162 PROOF(old_size, D[new_size]) between two sizes this log has had."""
        if not 0 < old_size <= new_size <= self.store.log_size():
            raise InvalidRequestError(
                f"no consistency proof from size {old_size} to size {new_size} (the log has "
                f"{self.store.log_size()} statements)"
            )
        return self.store.log_tree().consistency_proof(old_size, new_size)

    def inclusion(self, *, leaf: bytes, index: int, size: int) -> tuple[int, list[bytes]]:
        """(index, RFC 9162 PATH) of a statement in the tree of ``size``: by its leaf hash when
        ``leaf`` is given, else at ``index``."""
        if leaf:
            found = self.store.log_index(leaf)
            if found is None:
                raise InvalidRequestError("no statement of the federation log has that leaf hash")
            index = found
        if not 0 < size <= self.store.log_size():
            raise InvalidRequestError(f"the log has no tree of size {size}")
        try:
            return index, self.store.log_tree().inclusion_proof(index, size)
        except MerkleProofError as exc:
            raise InvalidRequestError(str(exc)) from exc

    def answer(self, request: pb.CheckpointRequest) -> pb.CosignedLogCheckpoint:
        """The GetCheckpoint answer to a witnessing site (one call per witnessing step): the
        newest checkpoint (``request.size`` 0) or that of ``request.size``, its cosignatures and
        the proofs :meth:`proofs` gives for it (for ``inclusion_leaf`` and ``also_leaf``). A
        newest checkpoint smaller than ``consistency_from`` comes without a consistency proof
        (none exists; the site keeps the smaller checkpoint as evidence)."""
        size, since = int(request.size), int(request.consistency_from)
        found = self.cosigned(size) if size else self.checkpoint()
        signed_size = found.signed.checkpoint.size
        consistency, (inclusion, also) = self.proofs(
            signed_size,
            consistency_from=since if size else min(since, signed_size),
            inclusion_leaves=(bytes(request.inclusion_leaf), bytes(request.also_leaf)),
        )
        return cosigned_to_proto(
            found, consistency=consistency, inclusion=inclusion, also_inclusion=also
        )

    def proofs(
        self, size: int, *, consistency_from: int, inclusion_leaves: Sequence[bytes]
    ) -> tuple[list[bytes], list[tuple[int, list[bytes]] | None]]:
        """What a witnessing site asks for with the checkpoint of ``size`` (it signed it): the
        consistency proof from ``consistency_from`` (empty unless 0 < it < ``size``) and, for
        each of ``inclusion_leaves``, the (index, PATH) of the statement with that leaf hash in
        that tree (None when the leaf is empty or the first ``size`` statements do not hold it).
        :class:`InvalidRequestError` naming both sizes when ``consistency_from`` > ``size``."""
        if consistency_from > size:
            raise InvalidRequestError(
                f"no consistency proof from size {consistency_from} to the checkpoint of size "
                f"{size}: the older size is larger"
            )
        tree = self.store.log_tree()
        consistency = (
            tree.consistency_proof(consistency_from, size) if 0 < consistency_from < size else []
        )
        found: list[tuple[int, list[bytes]] | None] = []
        for leaf in inclusion_leaves:
            index = self.store.log_index(leaf) if leaf else None
            found.append(
                None
                if index is None or index >= size
                else (index, tree.inclusion_proof(index, size))
            )
        return consistency, found

    def entries(self, start: int, end: int) -> list[tuple[int, str, bytes, int]]:
        """Committed statements ``start`` <= index < ``end`` (at most :data:`MAX_ENTRIES`), read
        without the coordinator's lock (:meth:`afl.server.store.Store.committed_log_entries`):
        the only method of this class that its caller need not hold the lock for."""
        if start < 0 or end < start:
            raise InvalidRequestError(f"no log entries from {start} to {end}")
        return self.store.committed_log_entries(start, min(end, start + MAX_ENTRIES))


def _hex_digest(value: str, what: str) -> bytes:
    """``value`` (a statement's SHA-256 field) as bytes: 64 lower-case hex digits, the only
    form a party signs and an audit matches; :class:`InvalidRequestError` naming ``what``."""
    try:
        digest = bytes.fromhex(value)
    except ValueError as exc:
        raise InvalidRequestError(f"{what} is not hex: {exc}") from exc
    if len(digest) != 32 or digest.hex() != value:
        raise InvalidRequestError(f"{what} is not a SHA-256 in lower-case hex")
    return digest
