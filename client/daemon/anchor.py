"""The site's DP ledger anchored in the federation log (docs/protocol.md §11a, M-195..M-197).

Every ledger entry (:mod:`afl.client.policy.ledger`) is also a `dp-release` statement of the
federation log: the entry's JSON (chain digest included) and the site's signature over it
(:func:`afl.crypto.transparency.statements.dp_release_signed_fields`). So the coordinator can
neither forge an entry nor change one, and the site can rebuild its ledger byte for byte from
the log.

* **Publish** (:meth:`LedgerAnchor.publish`): after the entry is written and before the first
  of its round's statistics leaves, the site sends the statement (``RecordDpRelease``),
  witnesses the newest checkpoint (consistent with the last one it cosigned) and checks the
  statement's inclusion proof in it. A coordinator that drops the statement gets no statistics.
  The daemon publishes in a background thread (:meth:`LedgerAnchor.start_publishing`) while the
  round's first messages go: in ``mask`` the key advert and the encrypted shares, which carry no
  statistic; every upload of statistics waits for it (``RoundSession.before_statistics``).
* **Reconcile** (:meth:`LedgerAnchor.reconcile`, at start-up after enrolment): the site reads the
  log up to the newest checkpoint it witnessed, checks the entries hash to that checkpoint's root,
  keeps its own `dp-release` statements whose signature verifies under its identity key, and
  compares them with the ledger (:func:`ledger_problem`). A ledger that is missing, shorter or
  different stops the daemon with one line naming the cause and the recovery command
  (:data:`REBUILD`); entries of the ledger the log lacks at its end (the site stopped between
  writing an entry and publishing it) are published again. While it runs, a plan is refused when
  the ledger no longer starts with what the log holds (a ledger deleted under a running daemon).
* **Rebuild** (``afl-client budget --rebuild-from-log``, :func:`logged_entries` against a
  checkpoint cosigned by ``[policy] witness_quorum`` roster sites, then
  :meth:`afl.client.policy.ledger.DpLedger.restore`).

Why the start-up check need not wait for a quorum: the site acts on no plan before the plan is
in a checkpoint a quorum cosigned that extends the checkpoint the site reconciled against
(M-193), and every release it published before was, by the same rule, in a checkpoint a quorum
cosigned before its next plan; a log without them needs a colluding quorum (the bound of §11a).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from afl.client.daemon.background import Background
from afl.client.daemon.transparency import Call, LogWitness
from afl.client.daemon.transport import DaemonError
from afl.client.policy.ledger import DpLedger, LedgerEntry, LedgerError
from afl.crypto.errors import CryptoError
from afl.crypto.identity.signatures import sign_fields, verify_fields
from afl.crypto.transparency.checkpoint import CheckpointError
from afl.crypto.transparency.merkle import MerkleProofError, leaf_hash
from afl.crypto.transparency.statements import (
    DP_RELEASE_CONTEXT,
    dp_release_signed_fields,
    dp_release_statement,
)
from afl.proto import wire
from afl.proto.v1 import coordinator_pb2 as pb

__all__ = [
    "REBUILD",
    "LedgerAnchor",
    "LedgerNotAnchored",
    "ledger_problem",
    "logged_entries",
    "rebuild_ledger",
    "release_statement",
]

#: The recovery command a refusal names.
REBUILD = "afl-client budget --rebuild-from-log --config {config}"


class LedgerNotAnchored(DaemonError):
    """The site's DP ledger does not match its releases in the federation log."""


def release_statement(
    key: Ed25519PrivateKey, *, federation: str, site: str, entry: LedgerEntry
) -> bytes:
    """The `dp-release` statement of ``entry``, signed by the site's identity ``key``."""
    doc = entry.to_json()
    signature = sign_fields(
        key,
        context=DP_RELEASE_CONTEXT,
        fields=dp_release_signed_fields(federation=federation, site=site, entry=doc),
    )
    return dp_release_statement(federation=federation, site=site, entry=doc, signature=signature)


def logged_entries(
    call: Call, witness: LogWitness, *, quorum_wait_s: float | None = None
) -> list[LedgerEntry]:
    """This site's ledger entries in the log, in order: the log up to the newest checkpoint the
    site witnessed (with ``quorum_wait_s``: the newest that ``[policy] witness_quorum`` roster
    sites cosigned, polling up to that long), its entries checked against the checkpoint's root,
    and of its `dp-release` statements those naming this site whose signature verifies under
    the site's identity key (another signature is the coordinator's forgery: refused)."""
    deadline, delay = time.monotonic() + (quorum_wait_s or 0.0), 0.05
    while True:
        answer = witness.witness(call, with_entries=quorum_wait_s is None)  # read below
        if quorum_wait_s is None:
            break
        try:
            witness.quorum_on(answer)
            break
        except (CheckpointError, wire.WireError) as exc:
            if time.monotonic() >= deadline:
                raise DaemonError(
                    f"no federation-log checkpoint cosigned by a quorum of {witness.quorum} "
                    f"roster sites after {quorum_wait_s:.0f} s ({exc}): retry when more sites "
                    "run"
                ) from exc
        time.sleep(delay)
        delay = min(delay * 1.5, 2.0)
    own_key = witness.roster[witness.site_id]
    mine: list[LedgerEntry] = []
    for index, (kind, fields) in enumerate(witness.statements(call, answer)):
        if kind != "dp-release" or fields.get("site") != witness.site_id:
            continue
        try:
            doc = fields["entry"]
            assert isinstance(doc, dict)
            verify_fields(
                own_key,
                bytes.fromhex(str(fields["signature"])),
                context=DP_RELEASE_CONTEXT,
                fields=dp_release_signed_fields(
                    federation=witness.federation_id, site=witness.site_id, entry=doc
                ),
            )
            mine.append(LedgerEntry.from_json(doc))
        except (AssertionError, CryptoError, KeyError, TypeError, ValueError) as exc:
            raise DaemonError(
                f"federation log entry {index} is a dp-release of this site that it did not "
                f"sign ({exc}): the coordinator forged it; keep the log as evidence"
            ) from exc
    for i, e in enumerate(mine, start=1):
        if e.seq != i:
            raise DaemonError(
                f"this site's dp-release statements in the federation log skip or repeat ledger "
                f"entry {i} (statement of entry {e.seq}): it signed two ledgers; keep both"
            )
    return mine


def ledger_problem(local: Sequence[LedgerEntry], logged: Sequence[LedgerEntry]) -> str:
    """Why ledger ``local`` does not account for the releases ``logged`` ("" when ``local``
    starts with them; entries after them are the ones not yet published)."""
    if not local and logged:
        return f"the DP ledger is missing: the federation log holds {len(logged)} release(s) of it"
    for mine, theirs in zip(local, logged, strict=False):
        if mine.to_json() != theirs.to_json():
            return (
                f"the DP ledger differs from the federation log at entry {mine.seq} (round "
                f"{theirs.round_id} in the log)"
            )
    if len(local) < len(logged):
        return (
            f"the DP ledger is shorter than the federation log: {len(local)} entries, the log "
            f"holds {len(logged)}"
        )
    return ""


class LedgerAnchor:
    """The ledger of one site and its `dp-release` statements (module docstring)."""

    def __init__(
        self, ledger: DpLedger, witness: LogWitness, *, key: Ed25519PrivateKey, config: str
    ) -> None:
        self.ledger, self.witness, self.key = ledger, witness, key
        self.rebuild = REBUILD.format(config=config)
        self.logged: list[dict[str, Any]] = []  # what the log holds of the ledger (as JSON)
        #: The witness's acknowledged-restore count when :meth:`reconcile` last ran (-1: never).
        self.reconciled_at = -1

    def _refusal(self, problem: str) -> str:
        return f"{problem}; the site must not account a fresh budget: run `{self.rebuild}`"

    def reconcile(self, call: Call) -> None:
        """The start-up check (module docstring); :class:`LedgerNotAnchored` with the cause."""
        try:
            local = self.ledger.entries()
        except LedgerError as exc:
            raise LedgerNotAnchored(self._refusal(str(exc))) from exc
        logged = logged_entries(call, self.witness)
        problem = ledger_problem(local, logged)
        if problem:
            raise LedgerNotAnchored(self._refusal(problem))
        self.logged = [e.to_json() for e in logged]
        self.reconciled_at = self.witness.acknowledged
        for entry in local[len(logged) :]:
            self.publish(call, entry)

    def reconcile_after_restore(self, call: Call) -> None:
        """Reconcile again when the coordinator's operator acknowledged a restore since the last
        time (:meth:`LogWitness.restore_acknowledged`): the restored log may have lost this
        site's latest statements, which :meth:`publish` would otherwise take as logged; those
        are published again (and a log that now holds something else stops the site)."""
        if self.reconciled_at != self.witness.acknowledged:
            self.reconcile(call)

    def problem(self) -> str:
        """Why the site must not act on a plan now ("" when the ledger still starts with what
        the log holds of it)."""
        try:
            local = [e.to_json() for e in self.ledger.entries()]
        except LedgerError as exc:
            return self._refusal(str(exc))
        if local[: len(self.logged)] != self.logged:
            return self._refusal(
                f"the DP ledger no longer holds the {len(self.logged)} release(s) the federation "
                "log holds of it"
            )
        return ""

    def publish(self, call: Call, entry: LedgerEntry) -> None:
        """Log ``entry``'s statement and check its inclusion in the newest checkpoint this site
        witnessed; :class:`DaemonError` when the log does not hold it (then nothing is sent)."""
        doc = entry.to_json()
        if doc in self.logged:
            return
        statement = release_statement(
            self.key, federation=self.witness.federation_id, site=self.witness.site_id, entry=entry
        )
        call("RecordDpRelease", pb.DpRelease(statement=statement))
        leaf = leaf_hash(statement)
        answer = self.witness.witness(call, inclusion_leaf=leaf)
        try:
            self.witness.check_inclusion(leaf, answer)
        except (MerkleProofError, DaemonError) as exc:
            raise DaemonError(
                f"the federation log does not hold this site's dp-release of round "
                f"{entry.round_id} ({exc}): nothing is uploaded"
            ) from exc
        self.logged.append(doc)

    def start_publishing(self, call: Call, entry: LedgerEntry) -> Background[None]:
        """:meth:`publish` in a background thread; the caller waits for it before the first of
        its round's statistics leaves (module docstring)."""
        return Background(lambda: self.publish(call, entry), name=f"ledger-{entry.round_id}")


def rebuild_ledger(
    call: Call, witness: LogWitness, ledger: DpLedger, *, quorum_wait_s: float
) -> list[LedgerEntry]:
    """Rebuild ``ledger`` from this site's verified `dp-release` statements (the log up to a
    checkpoint cosigned by a quorum); the entries it now holds. The entries the folder holds
    must be the first of them (:class:`LedgerError` otherwise: move the folder aside)."""
    logged = logged_entries(call, witness, quorum_wait_s=quorum_wait_s)
    ledger.restore(logged)
    return ledger.entries()
