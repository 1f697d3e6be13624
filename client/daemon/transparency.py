"""This site as a witness of the federation log, and the rule that it acts on a plan only once
the log holds it under a quorum-cosigned checkpoint (docs/protocol.md §11a, M-192, M-193).

``state_dir/log-witness.json`` (written atomically BEFORE the cosignature leaves) holds the last
checkpoint this site cosigned, with the coordinator's signature. Before the site answers a plan:

1. it fetches the coordinator's newest checkpoint with, in the same answer (GetCheckpoint), the
   RFC 9162 consistency proof from the last checkpoint it cosigned and the inclusion proof of
   the statement it waits for; it checks the coordinator's signature, the federation and the
   consistency proof (:func:`afl.crypto.transparency.witness.witness_checkpoint`); then it
   records the new one and sends its cosignature (CosignCheckpoint, answered with the
   cosignatures the coordinator then holds on it);
2. it counts the cosignatures the coordinator holds on that checkpoint that verify under the
   roster's identity keys of the startup kit (never keys the coordinator sends);
3. once at least ``[policy] witness_quorum`` roster sites (default: a majority) cosigned it, it
   checks the plan's inclusion proof in it (the one the answer carries): the plan is a
   statement every quorum witness's log holds, so a coordinator that shows different plans to
   different sites needs a colluding quorum. It polls (the newest checkpoint each time) until then, up to the round's stage
   timeout, and refuses the plan with the reason after it.

Two checkpoints the coordinator signed that cannot both be views of one log (smaller, another
root for one size, a consistency proof that fails) are a split view: the site writes both to
``state_dir/log-evidence/`` and stops (:class:`SplitViewDetected`, one line naming both).
"""

from __future__ import annotations

import functools
import json
import logging
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any, NamedTuple

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from afl.client.config import ClientConfig
from afl.client.daemon.transport import DaemonError
from afl.client.payloads.stats import dump_json
from afl.client.policy.loghistory import logged_release_problem
from afl.client.policy.roster import kit_roster
from afl.crypto.identity.signatures import load_public_key_raw
from afl.crypto.transparency.checkpoint import (
    Checkpoint,
    CheckpointError,
    Cosignature,
    SignedCheckpoint,
    cosign,
    quorum_witnesses,
)
from afl.crypto.transparency.merkle import (
    MerkleProofError,
    leaf_hash,
    verify_inclusion,
)
from afl.crypto.transparency.statements import StatementError, decode_statement, plan_statement
from afl.crypto.transparency.tree import MerkleTree
from afl.crypto.transparency.witness import SplitViewError, WitnessError, witness_checkpoint
from afl.proto import wire
from afl.proto.v1 import common_pb2 as cpb
from afl.proto.v1 import coordinator_pb2 as pb

__all__ = [
    "EVIDENCE_DIR",
    "HOLD_MAX_S",
    "HOLD_MIN_S",
    "IDLE_WITNESS_S",
    "QUORUM_POLL_S",
    "WITNESS_STATE",
    "LogEvidence",
    "LogWitness",
    "SplitViewDetected",
    "checkpoint_from_json",
    "checkpoint_to_json",
    "majority",
]

log = logging.getLogger("afl.client")
WITNESS_STATE = "log-witness.json"
#: How often a site that waits for a round witnesses the newest checkpoint (seconds): often
#: enough that a plan over a minority of the roster gathers its quorum within a few polls, rarely
#: enough that hundreds of idle sites do not keep the coordinator busy with cosignatures.
IDLE_WITNESS_S = 5.0
#: The first wait for the quorum's cosignatures (seconds; it grows by half each poll, so a
#: quorum that forms within moments of this site's own cosignature is seen within moments, and
#: a long wait costs a few more small requests: ten in the first second, not six).
QUORUM_POLL_S = 0.01
#: The longest this site asks the coordinator to hold a GetCheckpoint answer (seconds; the
#: coordinator caps it at the same; docs/protocol.md §11a). A wait for a quorum or for a statement
#: to cosign asks for a held answer instead of sleeping, so it ends as the awaited cosignature or
#: statement is committed, not at the next poll.
HOLD_MAX_S = 2.0
#: The shortest hold a quorum wait asks for after its first step (seconds): a hold ends as the
#: quorum or a newer checkpoint is committed, so a longer one costs no latency, only fewer calls;
#: it is short enough that a wait told to stop (the site refused the plan meanwhile) ends soon.
HOLD_MIN_S = 0.1
EVIDENCE_DIR = "log-evidence"
Call = Callable[[str, Any], Any]


class LogEvidence(DaemonError):
    """The coordinator's federation log contradicts what this site verified itself; the
    evidence is kept in ``state_dir/log-evidence/`` and the site stops."""


class SplitViewDetected(LogEvidence):
    """The coordinator signed two inconsistent checkpoints; both are kept as evidence."""


def majority(n: int) -> int:
    """More than half of ``n`` witnesses."""
    return n // 2 + 1


def checkpoint_to_json(signed: SignedCheckpoint) -> dict[str, object]:
    c = signed.checkpoint
    return {
        "federation": c.federation,
        "size": c.size,
        "root": c.root.hex(),
        "signature": signed.signature.hex(),
    }


def checkpoint_from_json(doc: Mapping[str, Any]) -> SignedCheckpoint:
    """A signed checkpoint as :func:`checkpoint_to_json` wrote it (ValueError when malformed)."""
    try:
        checkpoint = Checkpoint(
            str(doc["federation"]), int(doc["size"]), bytes.fromhex(str(doc["root"]))
        )
        return SignedCheckpoint(checkpoint, bytes.fromhex(str(doc["signature"])))
    except (KeyError, TypeError, CheckpointError) as exc:
        raise ValueError(f"not a signed checkpoint ({exc})") from exc


@functools.lru_cache(maxsize=4096)
def _statement(entry: bytes, federation: str) -> tuple[str, Mapping[str, object]]:
    """(kind, read-only fields) of a log entry, decoded once per process: the sites a host
    process runs read the same log (:class:`StatementError` is not cached)."""
    kind, fields = decode_statement(entry, federation=federation)
    return kind, MappingProxyType(fields)


class _Ask(NamedTuple):
    """What a witnessing step asks the checkpoint's answer to carry besides the consistency
    proof (:meth:`LogWitness.witness`)."""

    inclusion_leaf: bytes = b""
    also_leaf: bytes = b""
    with_entries: bool = False


class LogWitness:
    """The site's witness state and its plan rule (module docstring)."""

    def __init__(
        self,
        state_dir: Path,
        *,
        site_id: str,
        federation_id: str,
        key: Ed25519PrivateKey,
        coordinator_key: Ed25519PublicKey,
        roster: Mapping[str, bytes],
        quorum: int = 0,
        hold_max_s: float = HOLD_MAX_S,
    ) -> None:
        self.path = Path(state_dir) / WITNESS_STATE
        #: The longest a held GetCheckpoint may take (under the site's RPC deadline).
        self.hold_max_s = hold_max_s
        self.evidence_dir = Path(state_dir) / EVIDENCE_DIR
        self.site_id, self.federation_id = site_id, federation_id
        self.key, self.coordinator_key = key, coordinator_key
        self.roster = {s: load_public_key_raw(k) for s, k in roster.items()}
        self.quorum = quorum or majority(len(self.roster))
        if self.quorum > len(self.roster):
            raise DaemonError(
                f"[policy] witness_quorum = {quorum} is more than the {len(self.roster)} sites of "
                "the roster: lower it (0 = a majority)"
            )
        self.last: SignedCheckpoint | None = None
        self.acknowledged = 0
        #: Bumped whenever ``last`` changes (a cosignature, an acknowledged restore): a held
        #: answer asked for under another value is stale.
        self._changes = 0
        self._entries: list[bytes] = []  # a prefix of the log whose leaves gave a cosigned root
        self._tree = MerkleTree()  # their leaf hashes: a root of any size costs O(log² n)
        self._decoded: list[tuple[str, Mapping[str, object]]] = []  # its first statements
        #: Cosignatures on ``_verified_on`` that verified (with the key), for :meth:`quorum_on`.
        self._verified_on: Checkpoint | None = None
        self._verified: set[tuple[Cosignature, bytes]] = set()
        #: This site's cosignature of ``last``, kept but not yet sent (:meth:`flush`).
        self._unsent: pb.LogCosignature | None = None
        # The daemon logs a round's DP-ledger statement in a background thread while its main
        # thread may witness on a status answer: one witnessing step at a time (an RLock:
        # a step that witnesses calls back in).
        self._lock = threading.RLock()
        if self.path.is_file():
            try:
                doc = json.loads(self.path.read_text(encoding="utf-8"))
                self.acknowledged = int(doc.get("acknowledged", 0))
                if doc.get("checkpoint"):
                    self.last = checkpoint_from_json(doc["checkpoint"])
            except (OSError, ValueError) as exc:
                raise DaemonError(
                    f"{self.path} is unreadable ({exc}): restore it from the site's backup"
                ) from exc

    @classmethod
    def for_site(cls, config: ClientConfig, key: Ed25519PrivateKey) -> LogWitness:
        """The witness of the site (or decryptor) ``config`` describes: its state folder, its
        kit's coordinator key and roster (``[peers]`` and itself), its ``witness_quorum``."""
        return cls(
            config.state_dir,
            site_id=config.site_id,
            federation_id=config.federation_id,
            key=key,
            coordinator_key=load_public_key_raw(config.server_public_key),
            roster=kit_roster(config),
            quorum=config.policy.witness_quorum,
            hold_max_s=min(HOLD_MAX_S, config.timing.rpc_timeout_s / 2),
        )

    def _save(self) -> None:
        doc: dict[str, object] = {"acknowledged": self.acknowledged}
        if self.last is not None:
            doc["checkpoint"] = checkpoint_to_json(self.last)
        dump_json(self.path, doc)

    def restore_acknowledged(self, count: int) -> None:
        """The coordinator's operator acknowledged restore ``count`` (M-142): the log may be
        shorter than what this site cosigned; keep the last checkpoint as evidence and witness
        the restored log from scratch."""
        with self._lock:
            self._restore_acknowledged(count)

    def _restore_acknowledged(self, count: int) -> None:
        if count <= self.acknowledged:
            return
        if self.last is not None:
            self._evidence(
                f"restore-{count}",
                {"reason": f"the coordinator's operator acknowledged restore {count}",
                 "last_cosigned": checkpoint_to_json(self.last)},
            )  # fmt: skip
        self.acknowledged, self.last, self._unsent = count, None, None
        # the restored log may be shorter, or other past its first statements: read it afresh
        self._entries, self._decoded, self._tree = [], [], MerkleTree()
        self._changes += 1
        self._save()

    def _evidence(self, name: str, doc: Mapping[str, object]) -> Path:
        self.evidence_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        path = self.evidence_dir / f"{name}.json"
        dump_json(path, dict(doc))
        return path

    def witness(
        self,
        call: Call,
        *,
        inclusion_leaf: bytes = b"",
        also_leaf: bytes = b"",
        hold_s: float = 0.0,
        wait_cosignatures: int = 0,
        wait_grown_past: int = 0,
        with_entries: bool = False,
    ) -> pb.CosignedLogCheckpoint:
        """Fetch the newest checkpoint, cosign it if it extends the last one (module docstring,
        step 1); the answer, with the coordinator's cosignatures (and the inclusion proofs of
        the statements with leaf hashes ``inclusion_leaf`` and ``also_leaf`` when the checkpoint
        holds them, for :meth:`check_inclusion` and :meth:`prove_included`).
        :class:`SplitViewDetected` when it does not extend it, after the evidence is written.
        With ``hold_s`` the coordinator holds its answer up to that long (at most
        :attr:`hold_max_s`) until the checkpoint has ``wait_cosignatures`` or the log grew past
        ``wait_grown_past`` statements; the call is held outside this witness's lock, and its
        answer is asked for again should another step cosign meanwhile. ``with_entries``: the
        answer also carries the log's statements past those this witness holds, which
        :meth:`statements` on that answer then reads instead of GetLogEntries."""
        ask = _Ask(inclusion_leaf, also_leaf, with_entries)
        if hold_s <= 0 or not (wait_cosignatures or wait_grown_past):
            with self._lock:
                return self._witness(call, ask)
        with self._lock:
            changes = self._changes
            request = self._request(
                ask,
                wait_ms=max(1, int(min(hold_s, self.hold_max_s) * 1000)),
                wait_cosignatures=wait_cosignatures,
                wait_grown_past=wait_grown_past,
            )
        held: pb.CosignedLogCheckpoint = call("GetCheckpoint", request)
        with self._lock:  # a step that cosigned (or a restore) meanwhile made the answer stale
            return self._witness(call, ask, held if self._changes == changes else None)

    def _request(self, ask: _Ask, **wait: int) -> pb.CheckpointRequest:
        """One call (under the lock): the checkpoint, the consistency proof from the last one
        this site cosigned, the inclusion proofs ``ask`` names and, asked for, the log's
        statements past those this witness holds (docs/protocol.md §11a)."""
        return pb.CheckpointRequest(
            consistency_from=self.last.checkpoint.size if self.last is not None else 0,
            inclusion_leaf=ask.inclusion_leaf,
            also_leaf=ask.also_leaf,
            with_entries=ask.with_entries,
            entries_from=len(self._entries) if ask.with_entries else 0,
            **wait,
        )

    def _witness(
        self,
        call: Call,
        ask: _Ask,
        answer: pb.CosignedLogCheckpoint | None = None,
        *,
        defer: bool = False,
    ) -> pb.CosignedLogCheckpoint:
        self._flush(call)  # a deferred cosignature goes before any later step's
        previous = self.last
        if answer is None:
            answer = call("GetCheckpoint", self._request(ask))
        try:
            offered = wire.checkpoint_from_proto(answer.checkpoint)
        except wire.WireError as exc:
            raise DaemonError(f"the coordinator's log checkpoint is malformed: {exc}") from exc
        if previous is not None and previous.checkpoint == offered.checkpoint:
            # Cosigned already; sent again when the coordinator holds none of this site's on it
            # (one lost to a crash after it was kept, or to a failed send: the same bytes, as
            # Ed25519 signs deterministically).
            if all(c.witness != self.site_id for c in answer.cosignatures):
                again = cosign(self.key, witness=self.site_id, checkpoint=offered.checkpoint)
                self._send(call, wire.cosignature_to_proto(again), answer)
            return answer
        proof: list[bytes] = []
        if previous is not None and 0 < previous.checkpoint.size < offered.checkpoint.size:
            proof = list(answer.consistency)  # a wrong one is a split view (witness_checkpoint)
            if not proof:  # as an unanswered GetConsistencyProof was: refused, not cosigned
                raise DaemonError(
                    f"the coordinator's log checkpoint of size {offered.checkpoint.size} came "
                    f"without the consistency proof from size {previous.checkpoint.size} this "
                    "site cosigned: refused"
                )
        try:
            cosignature = witness_checkpoint(
                witness=self.site_id,
                key=self.key,
                coordinator_key=self.coordinator_key,
                federation=self.federation_id,
                previous=previous,
                offered=offered,
                proof=proof,
            )
        except SplitViewError as exc:
            a, b = exc.previous.checkpoint, exc.offered.checkpoint
            path = self._evidence(
                f"split-view-{a.size}-{a.root.hex()[:12]}-{b.size}-{b.root.hex()[:12]}",
                {
                    "reason": exc.reason,
                    "cosigned": checkpoint_to_json(exc.previous),
                    "offered": checkpoint_to_json(exc.offered),
                    "consistency_proof": [h.hex() for h in proof],
                },
            )
            raise SplitViewDetected(f"{exc}: {path}") from exc
        except WitnessError as exc:
            raise DaemonError(f"the coordinator's log checkpoint is refused: {exc}") from exc
        self.last = offered
        self._changes += 1
        self._save()  # before the cosignature leaves
        mine = wire.cosignature_to_proto(cosignature)
        if defer:  # sent by flush(), or before the next witnessing step
            self._unsent = mine
            return answer
        self._send(call, mine, answer)
        return answer

    def _send(
        self, call: Call, mine: pb.LogCosignature, answer: pb.CosignedLogCheckpoint | None = None
    ) -> None:
        """Send this site's cosignature ``mine``; with ``answer`` (the checkpoint's), count it
        there with the cosignatures the coordinator then holds."""
        now: pb.CosignedLogCheckpoint = call("CosignCheckpoint", mine)
        log.info("site=%s cosigned log checkpoint of size %d", self.site_id, mine.size)
        if answer is None:
            return
        if now.checkpoint == answer.checkpoint:  # the cosignatures it holds now: no extra poll
            del answer.cosignatures[:]
            answer.cosignatures.extend(now.cosignatures)
        if mine not in answer.cosignatures:  # counted at once, as the coordinator now holds it
            answer.cosignatures.append(mine)

    def flush(self, call: Call) -> None:
        """Send the cosignature a step deferred (:meth:`check_release`), if any. A failure to
        send it raises (:class:`DaemonError`); the next witnessing step that finds that
        checkpoint without this site's cosignature sends it again."""
        with self._lock:
            self._flush(call)

    def _flush(self, call: Call) -> None:
        mine, self._unsent = self._unsent, None
        if mine is not None:
            self._send(call, mine)

    def quorum_on(self, answer: pb.CosignedLogCheckpoint) -> frozenset[str]:
        """A quorum of roster witnesses whose cosignature on the answer's checkpoint verifies
        (this site's own counted once sent); :class:`CheckpointError` below the quorum. The
        cosignatures are verified in a fixed order until the quorum is reached; those that
        verified on this checkpoint before are not verified again (the next poll of a quorum
        wait verifies only what is new)."""
        checkpoint = wire.checkpoint_from_proto(answer.checkpoint).checkpoint
        cosignatures = [
            wire.cosignature_from_proto(c, federation=self.federation_id)
            for c in answer.cosignatures
        ]
        with self._lock:
            if self._verified_on != checkpoint:  # keep the cache to one checkpoint: K entries
                self._verified_on, self._verified = checkpoint, set()
            return quorum_witnesses(
                checkpoint,
                cosignatures,
                witness_keys=self.roster,
                quorum=self.quorum,
                stop_at_quorum=True,
                verified=self._verified,
            )

    def cosigned_by(
        self,
        call: Call,
        witness: str,
        *,
        covering: int,
        wait_s: float,
        poll_s: float,
        max_poll_s: float,
    ) -> int:
        """The size of the log's newest checkpoint once ``witness`` (a roster party: its key
        from the kit) has cosigned it and it holds at least ``covering`` statements; 0 when that
        does not happen within ``wait_s``. Each poll witnesses the newest checkpoint, so the one
        returned extends every checkpoint this site cosigned: ``witness``'s own chain of
        checkpoints then holds this site's view of the log's first ``covering`` statements."""
        key = self.roster.get(witness)
        if key is None:
            return 0
        deadline, delay = time.monotonic() + wait_s, poll_s
        while True:
            answer = self.witness(call)
            try:
                signed = wire.checkpoint_from_proto(answer.checkpoint).checkpoint
                if signed.size >= covering:
                    cosignatures = [
                        wire.cosignature_from_proto(c, federation=self.federation_id)
                        for c in answer.cosignatures
                    ]
                    quorum_witnesses(signed, cosignatures, witness_keys={witness: key}, quorum=1)
                    return signed.size
            except (CheckpointError, wire.WireError):
                pass
            if time.monotonic() >= deadline:
                return 0
            time.sleep(delay)
            delay = min(delay * 1.5, max_poll_s)

    @staticmethod
    def check_inclusion(leaf: bytes, answer: pb.CosignedLogCheckpoint) -> None:
        """Verify the RFC 9162 inclusion proof of the statement with leaf hash ``leaf`` in the
        answer's checkpoint, as the answer carries it (asked for with :meth:`witness`'s
        ``inclusion_leaf``): :class:`MerkleProofError` when it does not verify,
        :class:`DaemonError` when the answer carries none (the checkpoint does not hold it)."""
        if not answer.HasField("inclusion"):
            raise DaemonError(
                f"the coordinator answered no inclusion proof in the log checkpoint of size "
                f"{answer.checkpoint.size}"
            )
        LogWitness._verify_proof(leaf, answer.inclusion, answer)

    @staticmethod
    def _verify_proof(leaf: bytes, proof: pb.LogProof, answer: pb.CosignedLogCheckpoint) -> None:
        """RFC 9162: ``proof`` proves the statement with leaf hash ``leaf`` is in the answer's
        checkpoint (:class:`MerkleProofError` otherwise)."""
        verify_inclusion(
            leaf=leaf,
            index=int(proof.index),
            tree_size=int(answer.checkpoint.size),
            proof=list(proof.hashes),
            root=bytes(answer.checkpoint.root),
        )

    def prove_included(
        self, call: Call, statement: bytes, answer: pb.CosignedLogCheckpoint, *, also: bool = False
    ) -> None:
        """Verify the RFC 9162 inclusion proof of ``statement`` in the answer's checkpoint (one
        this site verified, for instance its quorum): with ``also``, the proof the answer
        carries (``statement`` was the ``also`` of :meth:`quorum_problem`), else, or when it
        carries none, one asked for with GetInclusionProof; :class:`DaemonError` naming the
        cause when the checkpoint does not hold it or the proof does not verify."""
        leaf = leaf_hash(statement)
        proof: pb.LogProof = (
            answer.also_inclusion
            if also and answer.HasField("also_inclusion")
            else call(
                "GetInclusionProof",
                pb.InclusionProofRequest(leaf_hash=leaf, size=int(answer.checkpoint.size)),
            )
        )
        try:
            self._verify_proof(leaf, proof, answer)
        except MerkleProofError as exc:
            raise DaemonError(f"its inclusion proof does not verify: {exc}") from exc

    def plan_problem(
        self,
        call: Call,
        *,
        round_id: str,
        plan_sha256: bytes,
        wait_s: float,
        poll_s: float,
        max_poll_s: float,
        stop: threading.Event | None = None,
        with_entries: bool = False,
    ) -> tuple[str, pb.CosignedLogCheckpoint | None]:
        """Why this site must not act on the plan ("" once its inclusion proof verifies in a
        checkpoint cosigned by a quorum of the roster; module docstring, steps 1-3), and that
        checkpoint (None until then). ``stop`` set ends the wait before the next witnessing
        step (the site refused the plan meanwhile); ``with_entries``: as
        :meth:`quorum_problem`'s."""
        statement = plan_statement(
            federation=self.federation_id, round_id=round_id, plan_sha256=plan_sha256
        )
        return self.quorum_problem(
            call,
            statement=statement,
            what="the plan",
            wait_s=wait_s,
            poll_s=poll_s,
            max_poll_s=max_poll_s,
            stop=stop,
            with_entries=with_entries,
        )

    def quorum_problem(
        self,
        call: Call,
        *,
        statement: bytes,
        what: str,
        wait_s: float,
        poll_s: float,
        max_poll_s: float,
        stop: threading.Event | None = None,
        with_entries: bool = False,
        also: bytes = b"",
    ) -> tuple[str, pb.CosignedLogCheckpoint | None]:
        """Why ``statement`` (``what``, for the message) is not yet in a checkpoint cosigned by
        a quorum of the roster ("" once it is, polling from ``poll_s`` up to ``wait_s``), and
        that checkpoint (None until then). Each poll witnesses (cosigns) the newest checkpoint;
        after the first, the coordinator holds a poll's answer until the checkpoint has a
        quorum's count of cosignatures or a newer checkpoint exists, for the back-off's delay
        and at least :data:`HOLD_MIN_S` (a coordinator that answers at once is waited out here,
        as it was polled before). The quorum may gather on the first checkpoint this wait found
        the statement in while the newest has fewer cosignatures (sites that found their quorum
        there stopped polling), so that one is asked for again when the newest lacks the
        quorum. ``with_entries``: the first answer that holds the statement carries the log's
        statements (:meth:`witness`), and so does the checkpoint returned, for the caller's
        :meth:`statements` (those it lacks past them are fetched then). ``also``: a statement
        whose inclusion proof every answer carries too (``also_inclusion``, as the checkpoint
        returned does when it holds it), for the caller's :meth:`prove_included`."""
        leaf = leaf_hash(statement)
        deadline, delay, why = time.monotonic() + wait_s, poll_s, "before it began"
        held: pb.CosignedLogCheckpoint | None = None  # the first checkpoint that holds it
        # The first step answers at once (this site's cosignature first); each later one spans
        # the back-off's delay (at least HOLD_MIN_S), held at the coordinator for as much of it
        # as may be held, and the rest waited out here.
        hold_s, span_s, size, followed = 0.0, 0.0, 0, False
        while True:
            if stop is not None and stop.is_set():
                return f"the log check of {what} was stopped: {why}", None
            asked, seen = time.monotonic(), size
            answer = self.witness(
                call,
                inclusion_leaf=leaf,
                hold_s=hold_s,
                wait_cosignatures=self.quorum,
                wait_grown_past=seen,  # a newer checkpoint to cosign ends the hold too
                with_entries=with_entries and held is None,
                also_leaf=leaf_hash(also) if also else b"",
            )
            size = int(answer.checkpoint.size)
            try:
                if held is None:
                    self.check_inclusion(leaf, answer)
                    held = answer
                found, why = self._quorum_among(call, answer, held)
                if found is not None:
                    if found.checkpoint != held.checkpoint:  # the newest: its own proof
                        self.check_inclusion(leaf, found)
                    if found is not held:  # the statements the first answer carried
                        found.entries.extend(held.entries)
                    if (
                        found.checkpoint == held.checkpoint
                        and held.HasField("also_inclusion")
                        and not found.HasField("also_inclusion")
                    ):
                        found.also_inclusion.CopyFrom(held.also_inclusion)  # asked for by size
                    return "", found
            except (CheckpointError, MerkleProofError, wire.WireError) as exc:
                why = str(exc)
            except DaemonError as exc:  # not in this checkpoint yet
                why = f"{what} is not in log checkpoint size {size} ({exc})"
            now = time.monotonic()
            if now >= deadline:
                return (
                    f"{what} is not in a federation-log checkpoint cosigned by a quorum of "
                    f"{self.quorum} roster sites after {wait_s:.0f} s: {why}"
                ), None
            # A newer checkpoint ended the hold: cosign it at once, but not twice in a row (a
            # log that keeps growing is cosigned at most twice a step, as when it was polled).
            # Otherwise what the coordinator did not hold is waited out here (its count of
            # cosignatures may include some this site does not count: it would answer at once).
            followed = size > seen > 0 and not followed
            rest = 0.0 if followed else span_s - (now - asked)
            if rest > 0:
                if stop is not None:
                    stop.wait(rest)
                else:
                    time.sleep(rest)
            # A held call cannot be interrupted: a wait that may be stopped holds briefly.
            longest = self.hold_max_s if stop is None else min(HOLD_MIN_S, self.hold_max_s)
            span_s = max(delay, HOLD_MIN_S)
            hold_s = min(span_s, longest, deadline - time.monotonic())
            delay = min(delay * 1.5, max_poll_s)

    def _quorum_among(
        self, call: Call, newest: pb.CosignedLogCheckpoint, held: pb.CosignedLogCheckpoint
    ) -> tuple[pb.CosignedLogCheckpoint | None, str]:
        """``newest`` if a quorum cosigned it, else ``held`` (fetched again with the
        cosignatures it has now) if a quorum cosigned that, else None and why not."""
        try:
            self.quorum_on(newest)
            return newest, ""
        except CheckpointError as exc:
            why = str(exc)
            if newest.checkpoint == held.checkpoint:
                return None, why
        again: pb.CosignedLogCheckpoint = call(
            "GetCheckpoint", pb.CheckpointRequest(size=int(held.checkpoint.size))
        )
        if again.checkpoint != held.checkpoint:
            raise DaemonError(
                f"the coordinator served another checkpoint of size {held.checkpoint.size} "
                "than the one this site cosigned"
            )
        try:
            self.quorum_on(again)
        except CheckpointError:
            return None, why
        return again, ""

    def check_release(
        self, call: Call, plan: cpb.ReleasePlan, *, survivors: Collection[str] | None
    ) -> None:
        """Witness the newest checkpoint and check the log's `release` statement of ``plan``'s
        published round against the plan and the survivors this site signed
        (:func:`afl.client.policy.loghistory.logged_release_problem`, M-230);
        :class:`LogEvidence` naming the difference and the evidence file otherwise. The site's
        cosignature of that checkpoint (M-198: an export of the model finds it cosigned) is
        kept, not sent: nothing of the check waits for it, and :meth:`flush` (after the round's
        model is kept) or the next witnessing step sends it."""
        with self._lock:
            answer = self._witness(call, _Ask(with_entries=True), defer=True)
        problem = logged_release_problem(plan, self.statements(call, answer), survivors=survivors)
        if problem:
            path = self._evidence(
                f"release-{plan.round_id}",
                {
                    "reason": problem,
                    "checkpoint": checkpoint_to_json(wire.checkpoint_from_proto(answer.checkpoint)),
                    "plan_round_id": plan.round_id,
                    "survivors_signed": sorted(survivors) if survivors is not None else None,
                },
            )
            raise LogEvidence(f"{problem}: {path}")

    def statements(
        self, call: Call, answer: pb.CosignedLogCheckpoint
    ) -> list[tuple[str, Mapping[str, object]]]:
        """(kind, fields) of every statement of the log at ``answer``'s checkpoint (one this site
        witnessed): those past the prefix it verified before, taken from the answer (asked for
        with :meth:`witness`'s ``with_entries``) and fetched with GetLogEntries where the answer
        stops, and verified: the leaf hashes of ALL entries must give the checkpoint's root,
        and each entry must be a statement of this federation (:class:`DaemonError`
        otherwise, naming the cause). The fields are read-only views, decoded once per entry
        (the same bytes decode the same)."""
        with self._lock:
            return self._statements(call, answer)

    def _statements(
        self, call: Call, answer: pb.CosignedLogCheckpoint
    ) -> list[tuple[str, Mapping[str, object]]]:
        size, root = int(answer.checkpoint.size), bytes(answer.checkpoint.root)
        new: list[bytes] = []  # past the verified prefix
        # those the answer carries past that prefix (the witness that asked may since have
        # verified some of them), then the rest with GetLogEntries
        self._served(
            [e for e in answer.entries if int(e.index) >= len(self._entries)], new, size=size
        )
        while len(self._entries) + len(new) < size:
            start = len(self._entries) + len(new)
            got = list(call("GetLogEntries", pb.LogEntriesRequest(start=start, end=size)).entries)
            if not got:
                raise DaemonError(f"the coordinator served no log entry from index {start}")
            self._served(got, new, size=size)
        self._tree.extend(leaf_hash(e) for e in new)
        try:
            if self._tree.root(size) != root:
                raise DaemonError(
                    f"the log entries the coordinator served do not hash to the root of the "
                    f"cosigned checkpoint of size {size}"
                )
            try:
                decoded = [_statement(e, self.federation_id) for e in new]
            except StatementError as exc:
                raise DaemonError(
                    f"the federation log holds an entry that is not ours: {exc}"
                ) from exc
        except DaemonError:  # nothing of this answer is kept; the next call fetches afresh
            self._entries, self._decoded, self._tree = [], [], MerkleTree()
            raise
        self._entries.extend(new)
        self._decoded.extend(decoded)
        return self._decoded[:size]

    def _served(self, served: Sequence[pb.LogEntry], new: list[bytes], *, size: int) -> None:
        """Append the statements the coordinator ``served`` to ``new`` (those past the verified
        prefix, before the checkpoint of ``size``), each at the index it must have."""
        for entry in served:
            at = len(self._entries) + len(new)
            if int(entry.index) != at or at >= size:
                raise DaemonError(
                    f"the coordinator served log entry {entry.index} where entry {at} of "
                    f"{size} was asked for"
                )
            new.append(bytes(entry.statement))
