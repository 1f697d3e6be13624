"""The coordinator's federation-log RPCs answered in process by a real
:class:`afl.server.transparency.FederationLog` on a real store, for tests whose coordinator is a
stand-in (the site's :class:`~afl.client.daemon.transparency.LogWitness` calls them)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from afl.client.daemon.transparency import LogWitness
from afl.client.daemon.transport import DaemonError
from afl.client.policy.loghistory import release_fields
from afl.crypto.identity.signatures import public_key_to_raw
from afl.crypto.transparency.statements import decode_statement
from afl.proto.v1 import common_pb2 as cpb
from afl.proto.v1 import coordinator_pb2 as pb
from afl.server.errors import InvalidRequestError, WrongStageError
from afl.server.store import EnrolmentRow, Store
from afl.server.transparency import FederationLog, cosigned_to_proto

__all__ = ["LOG_RPCS", "LogService", "site_witness"]

LOG_RPCS = frozenset(
    {
        "GetCheckpoint",
        "GetConsistencyProof",
        "GetInclusionProof",
        "CosignCheckpoint",
        "GetLogEntries",
        "RecordDpRelease",
        "RecordOpening",
        "RecordDecrypting",
    }
)


def site_witness(
    state: Path,
    *,
    federation: str,
    site: str,
    keys: Mapping[str, Ed25519PrivateKey],
    coordinator: Ed25519PrivateKey,
    quorum: int = 0,
) -> LogWitness:
    """``site``'s witness of ``coordinator``'s log, its state in ``state``, the roster the
    public keys of ``keys`` (every site's identity key)."""
    return LogWitness(
        state,
        site_id=site,
        federation_id=federation,
        key=keys[site],
        coordinator_key=coordinator.public_key(),
        roster={s: public_key_to_raw(k) for s, k in keys.items()},
        quorum=quorum,
    )


def _no_masked_round(round_id: str) -> Sequence[str]:
    raise WrongStageError(f"round {round_id!r} is not in a masked exchange")


def _not_solving(round_id: str) -> bytes:
    raise WrongStageError(f"round {round_id!r} is not a CKKS round being decrypted")


class LogService:
    """The log RPCs (no transport); ``offer`` replaces the checkpoint answer to a request (a
    lying coordinator), ``on_cosign`` sees each cosignature before it is kept."""

    def __init__(self, state: Path, *, key: Ed25519PrivateKey, federation_id: str) -> None:
        self.store = Store(state, federation_id=federation_id)
        self.log = FederationLog(self.store, key=key, federation_id=federation_id)
        self.cosigned: list[str] = []
        self.on_cosign: Callable[[pb.LogCosignature], None] = lambda request: None
        self.offer: Callable[[pb.CheckpointRequest], pb.CosignedLogCheckpoint] | None = None
        #: The site whose certificate the RPCs come with (RecordDpRelease, RecordOpening check it).
        self.caller = "site-1"
        #: A masked round's survivors (RecordOpening checks an opening states them).
        self.survivors_of: Callable[[str], Sequence[str]] = _no_masked_round
        #: The plan digest of a CKKS round its decryptor may decrypt (RecordDecrypting checks it).
        self.solving: Callable[[str], bytes] = _not_solving
        #: Rewrites each GetLogEntries answer, and the statements a checkpoint answer carries
        #: (a coordinator that serves other statements).
        self.serve_entries: Callable[[pb.LogEntries], pb.LogEntries] = lambda answer: answer

    def enrol(self, site_id: str, identity_public_key: bytes, *, role: str = "participant") -> None:
        row = EnrolmentRow(site_id, identity_public_key, role, ("a",), "bb", 4)
        self.store.put_enrolment(row, software_version="test")

    def publish_plan(self, round_id: str, plan: bytes) -> bytes:
        """Log the plan of ``round_id`` as the coordinator does when it opens a round; its
        SHA-256."""
        if self.store.round(round_id) is None:
            self.store.create_round(
                round_id=round_id, run_id="run-1", number=1, parent_round_id="", stage=1,
                participants=[], deadline_ms=0,
            )  # fmt: skip
        self.store.update_round(round_id, stage=2, deadline_ms=0, plan=plan, plan_signature=b"s")
        return hashlib.sha256(plan).digest()

    def publish_release(self, round_id: str, plan: bytes, *, survivors: Sequence[str]) -> None:
        """Log the `release` statement of ``round_id`` (the signed ``plan``'s releases over
        ``survivors``) once, as the coordinator does when it publishes the round's model."""
        if any(
            kind == "release" and decode_statement(entry, federation=self.log.federation_id)[1].get("round_id") == round_id
            for _, kind, entry, _ in self.store.log_entries(0, self.store.log_size())
        ):  # fmt: skip
            return
        fields = release_fields(cpb.ReleasePlan.FromString(plan), survivors=survivors)
        self.store.append_log("release", {**fields, "round_id": round_id, "run_id": "run-1"})

    def _entries(self, start: int, end: int) -> pb.LogEntries:
        rows = self.log.entries(start, end)
        answer = pb.LogEntries(
            entries=[pb.LogEntry(index=i, kind=k, statement=e) for i, k, e, _ in rows]
        )
        return self.serve_entries(answer)

    def call(self, what: str, request: Any) -> Any:
        if what == "GetCheckpoint":
            if self.offer is not None:
                return self.offer(request)
            answer = self.log.answer(request)
            if request.with_entries:  # as the coordinator adds them (served as GetLogEntries')
                start, size = int(request.entries_from), int(answer.checkpoint.size)
                answer.entries.extend(self._entries(start, size).entries if start < size else [])
            return answer
        if what == "GetConsistencyProof":
            return pb.LogProof(hashes=self.log.consistency(request.old_size, request.new_size))
        if what == "GetInclusionProof":
            try:
                index, path = self.log.inclusion(
                    leaf=request.leaf_hash, index=request.index, size=request.size
                )
            except InvalidRequestError as exc:  # as the site's RPC client raises it
                raise DaemonError(str(exc)) from exc
            return pb.LogProof(index=index, hashes=path)
        if what == "GetLogEntries":
            return self._entries(int(request.start), int(request.end))
        if what == "CosignCheckpoint":
            self.on_cosign(request)
            found = self.log.cosign(
                request.witness, size=request.size, root=request.root, signature=request.signature
            )
            self.cosigned.append(request.witness)
            return cosigned_to_proto(found)
        if what == "RecordDpRelease":
            return pb.LogProof(index=self.log.record_dp_release(self.caller, request.statement))
        if what == "RecordOpening":
            index = self.log.record_opening(
                self.caller, request.statement, survivors_of=self.survivors_of
            )
            return pb.LogProof(index=index)
        if what == "RecordDecrypting":
            index = self.log.record_decrypting(self.caller, request.statement, solving=self.solving)
            return pb.LogProof(index=index)
        raise AssertionError(f"not a log RPC: {what}")
