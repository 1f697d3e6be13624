"""The coordinator's durable state: SQLite (WAL, ``synchronous = FULL``), payload files written
before their rows, and ``anchor.json`` outside the database so that a rolled-back, truncated or
damaged state is refused at start-up (:class:`StateError`), never silently started fresh. Every
write is one transaction; :meth:`Store.transaction` (re-entrant) makes a transition's state and
its hash-chained audit record one. Tables, files and the anchor: docs/architecture.md §8;
backups: docs/operations.md. A purge commits its intent before it erases (in the background for
the daemon's store: ``background_erase``), and :meth:`Store.sweep_payloads` erases what an
interrupted purge or upload left at start-up.
Not thread-safe by itself: the coordinator serialises calls (except :meth:`Store.stage_payload`
and :meth:`Store.discard_staged`, which touch only their own files, never the database).
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import secrets
import sqlite3
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from afl.core.erase import Eraser, erase_file
from afl.core.row_bounds import RowBounds
from afl.crypto.canonical import canonical_encode
from afl.crypto.identity.pki import fsync_dir, make_private_dir, write_private_file
from afl.crypto.transparency.merkle import leaf_hash, root_hash
from afl.crypto.transparency.statements import statement_bytes
from afl.crypto.transparency.tree import MerkleTree
from afl.proto.v1.coordinator_pb2 import (
    ROUND_STAGE_ADVERTISE_KEYS,
    ROUND_STAGE_CONSISTENCY_CHECK,
    SignedEvaluation,
    SignedModel,
)
from afl.server.errors import DiskFullError, StateError, StoppingError
from afl.server.logwait import LogChanges

__all__ = [
    "ANCHOR_NAME",
    "DB_NAME",
    "ENDED_RUN_STATES",
    "SCHEMA_VERSION",
    "EnrolmentRow",
    "EvidenceRow",
    "MessageRow",
    "RoundRow",
    "RunRow",
    "Store",
    "UploadRow",
    "backup_state",
    "kept_as_evidence",
    "now_ms",
]

SCHEMA_VERSION = 2
DB_NAME = "server.sqlite3"
ANCHOR_NAME = "anchor.json"
GENESIS = b"\x00" * 32

log = logging.getLogger("afl.server.store")

#: How long a purge's scrub waits for other connections' reads to end (Python's sqlite3
#: default busy timeout), and how long a retry of a pending one waits (it repeats each minute,
#: under the coordinator's lock).
SCRUB_WAIT_S = 5.0
RETRY_SCRUB_WAIT_S = 0.2

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS enrolments (
    site_id TEXT PRIMARY KEY, identity_public_key BLOB NOT NULL, role TEXT NOT NULL,
    labelled_classes TEXT NOT NULL, backbone TEXT NOT NULL, feature_dim INTEGER NOT NULL,
    software_version TEXT NOT NULL, enrolled_ms INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS runs (
    ordinal INTEGER PRIMARY KEY AUTOINCREMENT, run_id TEXT UNIQUE NOT NULL, name TEXT NOT NULL,
    settings TEXT NOT NULL, state TEXT NOT NULL, reason TEXT NOT NULL DEFAULT '',
    submitted_by TEXT NOT NULL, created_ms INTEGER NOT NULL, finished_ms INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS site_declarations (
    site_id TEXT PRIMARY KEY, declared TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS rounds (
    ordinal INTEGER PRIMARY KEY AUTOINCREMENT, round_id TEXT UNIQUE NOT NULL,
    number INTEGER NOT NULL, parent_round_id TEXT NOT NULL, stage INTEGER NOT NULL,
    participants TEXT NOT NULL, plan BLOB, plan_signature BLOB, deadline_ms INTEGER NOT NULL,
    abort_reason TEXT NOT NULL DEFAULT '', created_ms INTEGER NOT NULL,
    run_id TEXT NOT NULL DEFAULT '');
CREATE TABLE IF NOT EXISTS decisions (
    round_id TEXT NOT NULL, site_id TEXT NOT NULL, accept INTEGER NOT NULL, reason TEXT NOT NULL,
    signed BLOB, PRIMARY KEY (round_id, site_id));
CREATE TABLE IF NOT EXISTS evidence (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, round_id TEXT NOT NULL, stage INTEGER NOT NULL,
    site_id TEXT NOT NULL, kind TEXT NOT NULL, sha256 BLOB NOT NULL, data BLOB,
    kept_ms INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS uploads (
    round_id TEXT NOT NULL, site_id TEXT NOT NULL, release_name TEXT NOT NULL,
    sha256 BLOB NOT NULL, size INTEGER NOT NULL, path TEXT NOT NULL, received_ms INTEGER NOT NULL,
    purged INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (round_id, site_id, release_name));
CREATE TABLE IF NOT EXISTS messages (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, round_id TEXT NOT NULL, stage INTEGER NOT NULL,
    site_id TEXT NOT NULL, kind TEXT NOT NULL, data BLOB NOT NULL, received_ms INTEGER NOT NULL,
    UNIQUE (round_id, stage, site_id, kind));
CREATE TABLE IF NOT EXISTS models (
    round_id TEXT PRIMARY KEY, model BLOB NOT NULL, signature BLOB NOT NULL,
    created_ms INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS candidates (
    round_id TEXT PRIMARY KEY, model BLOB NOT NULL, signature BLOB NOT NULL,
    created_ms INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS evaluations (
    round_id TEXT PRIMARY KEY, evaluation BLOB NOT NULL, signature BLOB NOT NULL,
    created_ms INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS reports (
    round_id TEXT NOT NULL, site_id TEXT NOT NULL, report BLOB NOT NULL,
    PRIMARY KEY (round_id, site_id));
CREATE TABLE IF NOT EXISTS audit_log (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, time_ms INTEGER NOT NULL, event TEXT NOT NULL,
    detail TEXT NOT NULL, prev_hash BLOB NOT NULL, hash BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS fedlog (
    idx INTEGER PRIMARY KEY, kind TEXT NOT NULL, entry BLOB NOT NULL, leaf BLOB NOT NULL,
    time_ms INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS fedlog_leaf ON fedlog (leaf);
CREATE TRIGGER IF NOT EXISTS fedlog_no_update BEFORE UPDATE ON fedlog
    BEGIN SELECT RAISE(ABORT, 'the federation log is append-only'); END;
CREATE TRIGGER IF NOT EXISTS fedlog_no_delete BEFORE DELETE ON fedlog
    BEGIN SELECT RAISE(ABORT, 'the federation log is append-only'); END;
CREATE TABLE IF NOT EXISTS log_checkpoints (
    size INTEGER PRIMARY KEY, root BLOB NOT NULL, signature BLOB NOT NULL,
    time_ms INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS log_cosignatures (
    size INTEGER NOT NULL, witness TEXT NOT NULL, root BLOB NOT NULL, signature BLOB NOT NULL,
    time_ms INTEGER NOT NULL, PRIMARY KEY (size, witness));
"""

#: Run states: queued (submitted, waiting for the runs before it), active (its rounds are open),
#: published (its final round's model is published), aborted (no model; the reason says why).
RUN_STATES = ("queued", "active", "published", "aborted", "failed")  # failed: the gate
#: The states of a run that ended.
ENDED_RUN_STATES = ("published", "aborted", "failed")


def now_ms() -> int:
    """Wall-clock Unix milliseconds."""
    return int(time.time() * 1000)


def audit_hash(prev: bytes, *, time_ms: int, event: str, detail: str) -> bytes:
    """One link of the audit chain: ``hash_i = SHA-256(hash_{i-1} || canonical(time, event,
    detail))`` with ``hash_0`` all zeros (verified independently by :mod:`afl.ops.verify_log`)."""
    return hashlib.sha256(prev + canonical_encode([time_ms, event, detail])).digest()


@dataclass(frozen=True)
class EnrolmentRow:
    site_id: str
    identity_public_key: bytes
    role: str
    labelled_classes: tuple[str, ...]
    backbone: str
    feature_dim: int
    # Declared at enrolment (coordinator.proto EnrollRequest): power-of-two row bounds (None = not
    # declared), the weights digest and the random-init stamp.
    row_bounds: RowBounds | None = None
    weights_sha256: str = ""
    random_init: bool = False

    def declarations(self) -> dict[str, object]:
        """The declared fields as stored (JSON-ready)."""
        bounds = self.row_bounds
        return {
            "rows": bounds.rows if bounds else 0,
            "max_row_norm": bounds.max_row_norm if bounds else 0.0,
            "weights_sha256": self.weights_sha256,
            "random_init": self.random_init,
        }


@dataclass(frozen=True)
class RunRow:
    run_id: str
    name: str
    settings: dict[str, object]
    state: str
    reason: str
    submitted_by: str
    created_ms: int
    finished_ms: int


@dataclass(frozen=True)
class RoundRow:
    round_id: str
    number: int
    parent_round_id: str
    stage: int
    participants: tuple[str, ...]
    plan: bytes | None
    plan_signature: bytes | None
    deadline_ms: int
    abort_reason: str
    run_id: str = ""


@dataclass(frozen=True)
class UploadRow:
    site_id: str
    release_name: str
    sha256: bytes
    size: int
    path: Path


@dataclass(frozen=True)
class MessageRow:
    """A protocol message a secure mode persisted before acknowledging it."""

    stage: int
    site_id: str
    kind: str
    data: bytes


@dataclass(frozen=True)
class EvidenceRow:
    """What a purge keeps of one protocol message: its digest, and its bytes when they are
    signatures and public keys only (:func:`kept_as_evidence`)."""

    stage: int
    site_id: str
    kind: str
    sha256: bytes
    data: bytes | None


#: Messages whose bytes outlive the payload purge as evidence: signed statements and public keys,
#: never statistics, masked or encrypted sums, or secret shares. A signed plan decision (its
#: sparse-graph commitment), the decryptor's signed outcome of a release (status and result
#: digest), and the masked-mode key adverts and consistency signatures. Every other message keeps
#: its SHA-256 only.
_KEPT_KINDS = ("plan-decision", "ckks-outcome:")
_KEPT_MASK_STAGES = (ROUND_STAGE_ADVERTISE_KEYS, ROUND_STAGE_CONSISTENCY_CHECK)


def kept_as_evidence(stage: int, kind: str) -> bool:
    """Whether a message of ``kind`` received at ``stage`` is kept whole by a purge."""
    if kind == "mask":
        return stage in _KEPT_MASK_STAGES
    return kind.startswith(_KEPT_KINDS)


def _enrolment_row(r: Sequence[Any]) -> EnrolmentRow:
    """An enrolment row of :data:`Store._ENROLMENT_QUERY` (the declarations are JSON)."""
    declared = json.loads(r[6]) if r[6] else {}
    bounds = RowBounds(int(declared.get("rows", 0)), float(declared.get("max_row_norm", 0)))
    return EnrolmentRow(
        r[0],
        bytes(r[1]),
        r[2],
        tuple(json.loads(r[3])),
        r[4],
        int(r[5]),
        row_bounds=bounds if bounds.valid else None,
        weights_sha256=str(declared.get("weights_sha256", "")),
        random_init=bool(declared.get("random_init", False)),
    )


def _enrolment_statement(row: EnrolmentRow) -> dict[str, object]:
    """The fields of a site's enrolment that the federation log records."""
    return {
        "site_id": row.site_id,
        "identity_public_key": row.identity_public_key.hex(),
        "role": row.role,
        "labelled_classes": list(row.labelled_classes),
        "backbone": row.backbone,
        "feature_dim": row.feature_dim,
    }


def _round_row(r: Sequence[Any]) -> RoundRow:
    """A round row of :data:`Store._ROUND_QUERY` (the participants are JSON)."""
    return RoundRow(
        r[0],
        int(r[1]),
        r[2],
        int(r[3]),
        tuple(json.loads(r[4])),
        None if r[5] is None else bytes(r[5]),
        None if r[6] is None else bytes(r[6]),
        int(r[7]),
        r[8],
        r[9],
    )


def _run_row(r: Sequence[Any]) -> RunRow:
    """A run row of :data:`Store._RUN_QUERY` (the settings are JSON)."""
    return RunRow(r[0], r[1], json.loads(r[2]), r[3], r[4], r[5], int(r[6]), int(r[7]))


class _ClosedConnection:
    """What :meth:`Store.close` leaves in place of the database: a gRPC handler still running
    after the server's grace period gets :class:`StoppingError` (UNAVAILABLE, which sites
    retry) from any use of it, not sqlite3's "Cannot operate on a closed database" as an
    internal error. Closing it again does nothing."""

    def close(self) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        raise StoppingError("the coordinator is stopping: its state store is closed; retry")


class Store:
    """SQLite state of one federation in ``state_dir`` (created if missing and unanchored)."""

    @property
    def federation_id(self) -> str:
        """The federation this state belongs to."""
        return self._federation_id

    def __init__(
        self,
        state_dir: Path,
        *,
        federation_id: str,
        read_only: bool = False,
        background_erase: bool = False,
    ) -> None:
        """``read_only`` (`afl-server status`): open an existing state without writing to it or
        checking its anchor, even while the server runs; :class:`StateError` when there is none.
        ``background_erase`` (the daemon's store): a purge's payload files are erased by an
        :class:`afl.core.erase.Eraser` thread once its intent is committed, so the caller (the
        coordinator, under its lock, announcing the round that ended the run) does not wait for
        the disk; :meth:`close` waits for it."""
        self.state_dir, self.read_only = Path(state_dir), read_only
        self._eraser = Eraser(name="afl-payload-eraser") if background_erase else None
        # A connection of its own for reading committed log statements without the caller's
        # lock (committed_log_entries), opened at its first use.
        self._reader: sqlite3.Connection | None = None
        self._reader_lock = threading.Lock()
        #: How long :meth:`scrub` waits for other connections' reads to end; whether the last
        #: scrub could not empty the WAL (done again by :meth:`retry_erasures`).
        self.scrub_wait_s = SCRUB_WAIT_S
        self.scrub_pending = False
        self._federation_id, self._depth = federation_id, 0
        self._tree = MerkleTree()  # the committed leaf hashes of the federation log, in order
        #: The log's committed size and recent cosigners, for held GetCheckpoint calls; what
        #: the open transaction adds to them is told once it commits.
        self.log_changes = LogChanges()
        self._log_grown_to = 0  # the log's size after the open transaction's appends (0: none)
        self._cosigned_pending: list[tuple[int, str]] = []
        self.path = self.state_dir / DB_NAME
        self.anchor_path = self.state_dir / ANCHOR_NAME
        if read_only:
            if not self.path.is_file():
                raise StateError(f"{self.state_dir}: no server state yet (afl-server never ran)")
            self._db = sqlite3.connect(self.path.resolve().as_uri() + "?mode=ro", uri=True)
            self._check_meta(federation_id)
            return
        make_private_dir(self.state_dir)
        anchor = self._read_anchor()
        if anchor is not None and not self.path.exists():
            raise StateError(
                f"{self.path} is missing but {self.anchor_path} records "
                f"{anchor['commits']} commits of federation {anchor['federation_id']!r}: restore "
                "the state folder from a backup (docs/operations.md), or move the folder away to "
                "start a new federation"
            )
        for name in (DB_NAME, f"{DB_NAME}-wal", f"{DB_NAME}-shm"):  # tighten older states
            if (self.state_dir / name).is_file():
                os.chmod(self.state_dir / name, 0o600)
        previous = os.umask(0o077)  # the database, its WAL and shm are created 0600
        try:
            self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            # Deleted rows (purged messages) are overwritten, not left in free pages.
            self._db.execute("PRAGMA secure_delete=ON")
            self._check_integrity()
            self._db.executescript(_SCHEMA)
            if "signed" not in self._columns("decisions"):  # a state from before consents
                self._db.execute("ALTER TABLE decisions ADD COLUMN signed BLOB")
        except sqlite3.DatabaseError as exc:
            raise StateError(f"{self.path} is not a readable afl state database ({exc})") from exc
        finally:
            os.umask(previous)
        self._check_meta(federation_id)
        self._check_anchor(anchor, federation_id)
        self._check_log()
        self._check_payloads()
        self._write_anchor()
        self.log_changes.committed(size=self.log_size())

    def close(self) -> None:
        """Erase what purges handed to the background (``background_erase``), then close the
        database (pending transactions are already committed); later calls raise
        :class:`StoppingError`."""
        if self._eraser is not None:
            self._eraser.close()
        with self._reader_lock:
            if self._reader is not None:
                self._reader.close()
            self._reader = cast(sqlite3.Connection, _ClosedConnection())
        self._db.close()
        self._db = cast(sqlite3.Connection, _ClosedConnection())
        self.log_changes.close()

    # --- integrity ---------------------------------------------------------------------------

    def _check_integrity(self) -> None:
        row = self._db.execute("PRAGMA quick_check").fetchone()
        if row is None or row[0] != "ok":
            raise StateError(
                f"{self.path} fails SQLite's integrity check: {row[0] if row else '?'}"
            )

    def _read_anchor(self) -> dict[str, object] | None:
        try:
            text = self.anchor_path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StateError(f"cannot read {self.anchor_path}: {exc.strerror}") from exc
        try:
            anchor = json.loads(text)
            int(anchor["commits"]), int(anchor["audit_count"]), bytes.fromhex(anchor["audit_head"])
            str(anchor["federation_id"])
        except (ValueError, KeyError, TypeError) as exc:
            raise StateError(f"{self.anchor_path} is malformed ({exc})") from exc
        if not isinstance(anchor, dict):
            raise StateError(f"{self.anchor_path} is malformed")
        return anchor

    def _commits(self) -> int:
        row = self._db.execute("SELECT value FROM meta WHERE key = 'commits'").fetchone()
        return int(row[0]) if row else 0

    def _audit_tail(self) -> tuple[int, bytes]:
        """(seq, hash) of the last audit record: the log only grows and ``seq`` counts from 1
        (AUTOINCREMENT, rolled back with its transaction), so ``seq`` is the record count."""
        row = self._db.execute(
            "SELECT seq, hash FROM audit_log ORDER BY seq DESC LIMIT 1"
        ).fetchone()
        return (int(row[0]), bytes(row[1])) if row else (0, GENESIS)

    def _check_anchor(self, anchor: Mapping[str, object] | None, federation_id: str) -> None:
        """The database holds at least the anchored commits, and the audit log is one valid hash
        chain through the anchored head (read once)."""
        if anchor is None:
            return
        if anchor["federation_id"] != federation_id:
            raise StateError(
                f"{self.anchor_path} belongs to federation {anchor['federation_id']!r}, not "
                f"{federation_id!r}: use another state_dir"
            )
        commits = self._commits()
        want = int(str(anchor["commits"]))
        if commits < want:
            raise StateError(
                f"{self.path} holds {commits} commits but {self.anchor_path} records {want}: the "
                "database was rolled back (a deleted or truncated WAL, or an older copy); restore "
                "the whole state folder from one backup (docs/operations.md)"
            )
        count = int(str(anchor["audit_count"]))
        head = bytes.fromhex(str(anchor["audit_head"]))
        valid, found = self._walk_audit_chain(at_seq=count)
        if found != head:
            raise StateError(
                f"the audit log in {self.path} does not pass through the head recorded in "
                f"{self.anchor_path} ({count} records): it was truncated or rewritten"
            )
        if not valid:
            raise StateError(f"the audit log in {self.path} is not a valid hash chain")
        logged = int(str(anchor.get("log_size", 0)))
        if self.log_size() < logged:
            raise StateError(
                f"the federation log in {self.path} holds {self.log_size()} statements but "
                f"{self.anchor_path} records {logged}: a log never shrinks; restore the whole "
                "state folder from one backup (docs/operations.md)"
            )

    def _check_log(self) -> None:
        """Every stored leaf hashes its statement, and the log holds at least the last signed
        checkpoint, whose root is the root of that many leaves (a log never shrinks or changes
        under a checkpoint the coordinator signed)."""
        rows = self._db.execute("SELECT idx, entry, leaf FROM fedlog ORDER BY idx").fetchall()
        for position, (idx, entry, leaf) in enumerate(rows):
            if int(idx) != position or leaf_hash(bytes(entry)) != bytes(leaf):
                raise StateError(
                    f"the federation log in {self.path} is damaged at statement {position}: "
                    "restore the state folder from a backup (docs/operations.md)"
                )
        last = self.log_checkpoint()
        if last is None:
            return
        size, root, _ = last
        if len(rows) < size:
            raise StateError(
                f"the federation log in {self.path} holds {len(rows)} statements, fewer than its "
                f"last signed checkpoint ({size}): a log never shrinks; restore the whole state "
                "folder from one backup (docs/operations.md)"
            )
        if root_hash([bytes(r[2]) for r in rows[:size]]) != root:
            raise StateError(
                f"the first {size} statements of the federation log in {self.path} do not have "
                "the root of its signed checkpoint: the log was rewritten"
            )

    def _check_payloads(self) -> None:
        rows = self._db.execute("SELECT path, size FROM uploads WHERE purged = 0").fetchall()
        for path_text, size in rows:
            path = self._payload_path(path_text)
            try:
                actual = path.stat().st_size
            except FileNotFoundError:
                raise StateError(
                    f"payload file {path} is missing (its upload is recorded in {self.path}); "
                    "restore the state folder from a backup (docs/operations.md)"
                ) from None
            if actual != int(size):
                raise StateError(
                    f"payload file {path} holds {actual} bytes, {size} were stored; restore the "
                    "state folder from a backup (docs/operations.md)"
                )

    def _write_anchor(self, commits: int | None = None) -> None:
        """Write the anchor: ``commits`` (read from meta when None), the last audit record."""
        count, head = self._audit_tail()
        anchor = {
            "federation_id": self._federation_id,
            "commits": self._commits() if commits is None else commits,
            "audit_count": count,
            "audit_head": head.hex(),
            "log_size": self.log_size(),
        }
        write_private_file(self.anchor_path, (json.dumps(anchor, sort_keys=True) + "\n").encode())

    def anchor(self) -> dict[str, object]:
        """The anchor as last written (commits, audit count and head)."""
        anchor = self._read_anchor()
        assert anchor is not None
        return anchor

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """One transaction (re-entrant): every write inside it, the audit records included,
        commits together with one commit-counter increment and one anchor write, or none does.
        A transition writes its state and its audit record in one ``with store.transaction():``."""
        if self._depth:  # nested: a savepoint, so a failing inner block undoes only itself
            self._depth += 1
            savepoint = f"nested_{self._depth}"
            try:  # the depth is restored whatever fails, SQLite's own statements included
                self._db.execute(f"SAVEPOINT {savepoint}")
                grown_to, kept = self._log_grown_to, len(self._cosigned_pending)
                try:
                    yield self._db
                except BaseException:
                    self._db.execute(f"ROLLBACK TO {savepoint}")
                    self._log_grown_to = grown_to  # what the inner block told of is undone too
                    del self._cosigned_pending[kept:]
                    raise
                finally:
                    self._db.execute(f"RELEASE {savepoint}")
            finally:
                self._depth -= 1
            return
        self._db.execute("BEGIN IMMEDIATE")
        self._depth = 1
        self._log_grown_to, self._cosigned_pending = 0, []
        try:
            yield self._db
            commits = self._db.execute(
                "INSERT INTO meta VALUES ('commits', '1') ON CONFLICT(key) DO UPDATE SET "
                "value = CAST(value AS INTEGER) + 1 RETURNING value"
            ).fetchall()[0][0]
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        finally:
            self._depth = 0
        self._db.execute("COMMIT")
        size, cosigned = self._log_grown_to, self._cosigned_pending
        self._log_grown_to, self._cosigned_pending = 0, []
        if size or cosigned:  # told once committed, whatever the anchor's write does
            self.log_changes.committed(size=size, cosigned=cosigned)
        self._write_anchor(int(commits))

    _tx = transaction

    @property
    def in_transaction(self) -> bool:
        """Whether a :meth:`transaction` is open (a new one would be a savepoint of it)."""
        return self._depth > 0

    def _check_meta(self, federation_id: str) -> None:
        rows = dict(self._db.execute("SELECT key, value FROM meta").fetchall())
        if not rows and self.read_only:
            raise StateError(f"{self.state_dir}: the state database is empty")
        if not rows:
            with self._tx() as db:
                db.execute("INSERT INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
                db.execute("INSERT INTO meta VALUES ('federation_id', ?)", (federation_id,))
            return
        if rows.get("federation_id") != federation_id:
            raise StateError(
                f"{self.state_dir} holds the state of federation {rows.get('federation_id')!r}, "
                f"not {federation_id!r}: use another state_dir"
            )
        version = rows.get("schema_version")
        if version == "1" and not self.read_only:
            self._migrate_from_v1()
        elif version != str(SCHEMA_VERSION):
            raise StateError(
                f"{self.state_dir}: state schema version {version!r}, this afl-server needs "
                f"{SCHEMA_VERSION}"
            )

    def _migrate_from_v1(self) -> None:
        """Schema 1 (one run per state folder) -> 2: the existing rounds become run ``run-1``
        with the settings of server.toml's [round] as recorded by the daemon on first use."""
        columns = {r[1] for r in self._db.execute("PRAGMA table_info(rounds)")}
        upload_columns = {r[1] for r in self._db.execute("PRAGMA table_info(uploads)")}
        with self._tx() as db:
            if "run_id" not in columns:
                db.execute("ALTER TABLE rounds ADD COLUMN run_id TEXT NOT NULL DEFAULT ''")
            if "purged" not in upload_columns:
                db.execute("ALTER TABLE uploads ADD COLUMN purged INTEGER NOT NULL DEFAULT 0")
            db.execute(
                "UPDATE meta SET value = ? WHERE key = 'schema_version'", (str(SCHEMA_VERSION),)
            )

    # --- restores ----------------------------------------------------------------------------

    def restores_acknowledged(self) -> int:
        """How many restores from an older backup the operator acknowledged (GetStatus tells the
        sites; docs/protocol.md M-142)."""
        row = self._db.execute(
            "SELECT value FROM meta WHERE key = 'restores_acknowledged'"
        ).fetchone()
        return int(row[0]) if row else 0

    def acknowledge_restore(self, *, by: str, reason: str, aborted_runs: Sequence[str]) -> int:
        """Count the operator's confirmation that this state was restored from an older backup
        and append its "restore-acknowledged" audit record (who, why, the runs aborted for it),
        in ONE transaction; returns the new count."""
        count = self.restores_acknowledged() + 1
        with self._tx() as db:
            db.execute(
                "INSERT INTO meta VALUES ('restores_acknowledged', ?) ON CONFLICT(key) DO UPDATE "
                "SET value = excluded.value",
                (str(count),),
            )
            self._append_audit(
                db,
                "restore-acknowledged",
                {"by": by, "reason": reason, "count": count, "aborted_runs": list(aborted_runs)},
            )
        return count

    # --- enrolment ---------------------------------------------------------------------------

    def put_enrolment(self, row: EnrolmentRow, *, software_version: str) -> None:
        """Store a site's enrolment; a new or changed one (identity key: a key rotation, role,
        classes, features) is a federation-log statement of the same transaction."""
        before = self.enrolment(row.site_id)
        with self._tx() as db:
            if before is None or _enrolment_statement(before) != _enrolment_statement(row):
                fields = _enrolment_statement(row)
                if before is not None and before.identity_public_key != row.identity_public_key:
                    fields["previous_identity_public_key"] = before.identity_public_key.hex()
                self.append_log("enrolment", fields)
            db.execute(
                "INSERT OR REPLACE INTO enrolments VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    row.site_id,
                    row.identity_public_key,
                    row.role,
                    json.dumps(list(row.labelled_classes)),
                    row.backbone,
                    row.feature_dim,
                    software_version,
                    now_ms(),
                ),
            )
            db.execute(
                "INSERT OR REPLACE INTO site_declarations VALUES (?, ?)",
                (row.site_id, json.dumps(row.declarations(), sort_keys=True)),
            )

    _ENROLMENT_QUERY = (
        "SELECT e.site_id, identity_public_key, role, labelled_classes, backbone, "
        "feature_dim, d.declared FROM enrolments e "
        "LEFT JOIN site_declarations d ON d.site_id = e.site_id"
    )

    def enrolments(self) -> dict[str, EnrolmentRow]:
        rows = self._db.execute(self._ENROLMENT_QUERY).fetchall()
        return {r[0]: _enrolment_row(r) for r in rows}

    def enrolment(self, site_id: str) -> EnrolmentRow | None:
        """One site's enrolment (a request's check costs one row, not the whole table)."""
        row = self._db.execute(
            self._ENROLMENT_QUERY + " WHERE e.site_id = ?", (site_id,)
        ).fetchone()
        return None if row is None else _enrolment_row(row)

    # --- runs --------------------------------------------------------------------------------

    def create_run(
        self, *, run_id: str, name: str, settings: Mapping[str, object], submitted_by: str
    ) -> None:
        with self._tx() as db:
            db.execute(
                "INSERT INTO runs (run_id, name, settings, state, submitted_by, created_ms) "
                "VALUES (?, ?, ?, 'queued', ?, ?)",
                (run_id, name, json.dumps(dict(settings), sort_keys=True), submitted_by, now_ms()),
            )
            settings_text = json.dumps(dict(settings), sort_keys=True).encode()
            self.append_log(
                "run-submitted",
                {
                    "run_id": run_id,
                    "name": name,
                    "submitted_by": submitted_by,
                    "settings_sha256": hashlib.sha256(settings_text).hexdigest(),
                },
            )

    def update_run(
        self, run_id: str, *, state: str, reason: str = "", at_ms: int | None = None
    ) -> None:
        """Set a run's state; ``at_ms`` (default: now) is its finishing time when it ended."""
        if state not in RUN_STATES:
            raise ValueError(f"unknown run state {state!r}")
        finished = (now_ms() if at_ms is None else at_ms) if state in ENDED_RUN_STATES else 0
        with self._tx() as db:
            db.execute(
                "UPDATE runs SET state = ?, reason = ?, finished_ms = ? WHERE run_id = ?",
                (state, reason, finished, run_id),
            )
            if state in ENDED_RUN_STATES:
                self.append_log("run-ended", {"run_id": run_id, "state": state, "reason": reason})

    _RUN_QUERY = (
        "SELECT run_id, name, settings, state, reason, submitted_by, created_ms, finished_ms "
        "FROM runs"
    )

    def runs(self, *, state: str | None = None) -> list[RunRow]:
        """Every run (in ``state``, when given), oldest first."""
        where, params = ("", ()) if state is None else (" WHERE state = ?", (state,))
        rows = self._db.execute(f"{self._RUN_QUERY}{where} ORDER BY ordinal", params).fetchall()
        return [_run_row(r) for r in rows]

    def run_ids(self, *, state: str) -> list[str]:
        """The ids of the runs in ``state``, oldest first (their settings are not read)."""
        rows = self._db.execute(
            "SELECT run_id FROM runs WHERE state = ? ORDER BY ordinal", (state,)
        ).fetchall()
        return [str(r[0]) for r in rows]

    def run_status(self, run_id: str) -> tuple[str, str, int] | None:
        """(state, reason, finished_ms) of a run: what changes after it is submitted (its
        settings never do)."""
        row = self._db.execute(
            "SELECT state, reason, finished_ms FROM runs WHERE run_id = ?", (run_id,)
        ).fetchone()
        return None if row is None else (row[0], row[1], int(row[2]))

    def run_row(self, run_id: str) -> RunRow | None:
        """One run's row (a request about one run reads one row, not the table)."""
        row = self._db.execute(f"{self._RUN_QUERY} WHERE run_id = ?", (run_id,)).fetchone()
        return None if row is None else _run_row(row)

    def run_count(self) -> int:
        return int(self._db.execute("SELECT COUNT(*) FROM runs").fetchone()[0])

    def attach_rounds(self, run_id: str) -> None:
        """Give rounds without a run (a migrated schema-1 state) to ``run_id``."""
        with self._tx() as db:
            db.execute("UPDATE rounds SET run_id = ? WHERE run_id = ''", (run_id,))

    # --- rounds ------------------------------------------------------------------------------

    def create_round(
        self,
        *,
        round_id: str,
        run_id: str,
        number: int,
        parent_round_id: str,
        stage: int,
        participants: Sequence[str],
        deadline_ms: int,
    ) -> None:
        with self._tx() as db:
            db.execute(
                "INSERT INTO rounds (round_id, number, parent_round_id, stage, participants, "
                "deadline_ms, created_ms, run_id) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    round_id,
                    number,
                    parent_round_id,
                    stage,
                    json.dumps(list(participants)),
                    deadline_ms,
                    now_ms(),
                    run_id,
                ),
            )

    def update_round(
        self,
        round_id: str,
        *,
        stage: int,
        deadline_ms: int,
        participants: Sequence[str] | None = None,
        plan: bytes | None = None,
        plan_signature: bytes | None = None,
        abort_reason: str = "",
    ) -> None:
        with self._tx() as db:
            db.execute(
                "UPDATE rounds SET stage = ?, deadline_ms = ?, abort_reason = ? WHERE round_id = ?",
                (stage, deadline_ms, abort_reason, round_id),
            )
            if participants is not None:
                db.execute(
                    "UPDATE rounds SET participants = ? WHERE round_id = ?",
                    (json.dumps(list(participants)), round_id),
                )
            if plan is not None:
                db.execute(
                    "UPDATE rounds SET plan = ?, plan_signature = ? WHERE round_id = ?",
                    (plan, plan_signature, round_id),
                )
                self.append_log(
                    "plan",
                    {"round_id": round_id, "plan_sha256": hashlib.sha256(plan).hexdigest()},
                )

    _ROUND_QUERY = (
        "SELECT round_id, number, parent_round_id, stage, participants, plan, plan_signature, "
        "deadline_ms, abort_reason, run_id FROM rounds"
    )

    def rounds(self, run_id: str | None = None) -> list[RoundRow]:
        """Every round (of ``run_id``, when given), oldest first."""
        where, params = ("", ()) if run_id is None else (" WHERE run_id = ?", (run_id,))
        rows = self._db.execute(f"{self._ROUND_QUERY}{where} ORDER BY ordinal", params).fetchall()
        return [_round_row(r) for r in rows]

    def round(self, round_id: str) -> RoundRow | None:
        """One round's row."""
        row = self._db.execute(f"{self._ROUND_QUERY} WHERE round_id = ?", (round_id,)).fetchone()
        return None if row is None else _round_row(row)

    # --- decisions, uploads and messages -----------------------------------------------------

    def put_decision(
        self,
        round_id: str,
        site_id: str,
        *,
        accept: bool,
        reason: str,
        signed: bytes | None = None,
        audit: Mapping[str, object] | None = None,
    ) -> None:
        """Record a site's plan decision with the signed ``PlanDecision`` as received (the
        consent, kept after the payloads are purged) and, given ``audit``, its "plan-decision"
        record (``audit`` plus the decision's SHA-256) in ONE transaction."""
        with self._tx() as db:
            db.execute(
                "INSERT OR REPLACE INTO decisions (round_id, site_id, accept, reason, signed) "
                "VALUES (?, ?, ?, ?, ?)",
                (round_id, site_id, int(accept), reason, signed),
            )
            if audit is not None:
                digest = {"sha256": hashlib.sha256(signed).hexdigest()} if signed else {}
                self._append_audit(db, "plan-decision", {**audit, **digest})

    def decisions(self, round_id: str) -> dict[str, tuple[bool, str]]:
        rows = self._db.execute(
            "SELECT site_id, accept, reason FROM decisions WHERE round_id = ?", (round_id,)
        ).fetchall()
        return {r[0]: (bool(r[1]), r[2]) for r in rows}

    def decision(self, round_id: str, site_id: str) -> tuple[bool, str] | None:
        """(accept, reason) of one site's decision on ``round_id``'s plan (None: none yet); what
        a request about that site reads, instead of every site's rows."""
        row = self._db.execute(
            "SELECT accept, reason FROM decisions WHERE round_id = ? AND site_id = ?",
            (round_id, site_id),
        ).fetchone()
        return None if row is None else (bool(row[0]), row[1])

    def signed_decisions(self, round_id: str) -> dict[str, bytes]:
        """site -> the signed ``PlanDecision`` it sent for ``round_id`` (decisions recorded
        before signatures were kept have none)."""
        if "signed" not in self._columns("decisions"):
            return {}
        rows = self._db.execute(
            "SELECT site_id, signed FROM decisions WHERE round_id = ? AND signed IS NOT NULL "
            "ORDER BY site_id",
            (round_id,),
        ).fetchall()
        return {r[0]: bytes(r[1]) for r in rows}

    def _columns(self, table: str) -> set[str]:
        return {str(r[1]) for r in self._db.execute(f"PRAGMA table_info({table})")}

    def evidence(self, round_id: str) -> list[EvidenceRow]:
        """The protocol evidence kept of a round's purged messages, in the order received."""
        if "evidence" not in {
            r[0] for r in self._db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
        }:
            return []
        rows = self._db.execute(
            "SELECT stage, site_id, kind, sha256, data FROM evidence WHERE round_id = ? "
            "ORDER BY seq",
            (round_id,),
        ).fetchall()
        return [
            EvidenceRow(int(r[0]), r[1], r[2], bytes(r[3]), None if r[4] is None else bytes(r[4]))
            for r in rows
        ]

    def stage_payload(self, round_id: str, site_id: str, *, data: bytes, sha256: bytes) -> Path:
        """Write an upload's payload file under a name of its own (``.<sha256>.<random>.staged``
        beside where :meth:`put_upload` will keep it), before any lock is taken: the file and
        its fsync are the upload's slow part. Hand it to :meth:`put_upload` (``staged``) or to
        :meth:`discard_staged`; one a crash leaves behind is erased at the next start
        (:meth:`sweep_payloads`: no row names it). :class:`DiskFullError` when the disk is full."""
        folder = self._payload_folder(round_id, site_id)
        name = f".{sha256.hex()}.{secrets.token_hex(8)}.staged"
        created = not folder.is_dir()
        staged = self._write_payload(folder, name, data)
        if created:  # the folders it created: durable before any row names a file in them
            with suppress(OSError):
                for parent in (folder.parent, folder.parent.parent):
                    fsync_dir(parent)
        return staged

    def _payload_folder(self, round_id: str, site_id: str) -> Path:
        """Where ``site_id``'s payload files of ``round_id`` are kept (and staged)."""
        return self.state_dir / "payloads" / round_id / site_id

    def discard_staged(self, staged: Path) -> None:
        """Erase a staged payload file that no row will name (the upload was refused)."""
        _erase(staged)

    def _write_payload(self, folder: Path, name: str, data: bytes) -> Path:
        def write() -> Path:
            make_private_dir(folder)
            return write_private_file(folder / name, data)

        try:
            try:
                return write()
            except FileNotFoundError:  # the eraser tidied the emptied folder away meanwhile
                return write()
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise DiskFullError(
                    f"the coordinator's disk is full ({self.state_dir}): the upload was not "
                    "stored; the operator must free space"
                ) from exc
            raise

    def put_upload(
        self,
        round_id: str,
        site_id: str,
        release_name: str,
        *,
        data: bytes,
        sha256: bytes,
        audit: Mapping[str, object] | None = None,
        staged: Path | None = None,
    ) -> UploadRow:
        """Write the payload file (or move the ``staged`` one, :meth:`stage_payload`, into its
        place: a rename), then commit its row (the caller checked for duplicates) and, given
        ``audit``, its ``upload`` audit record in the same transaction (one commit and one anchor
        write per upload, not two). :class:`DiskFullError` when the disk is full (nothing is
        committed)."""
        folder = self._payload_folder(round_id, site_id)
        name = f"{sha256.hex()}.bin"
        path = self._write_payload(folder, name, data) if staged is None else folder / name
        relative = str(path.relative_to(self.state_dir))
        try:
            if staged is not None:
                os.replace(staged, path)
                fsync_dir(folder)  # the rename is durable before the row that names it
            with self._tx() as db:
                db.execute(
                    "INSERT INTO uploads (round_id, site_id, release_name, sha256, size, path, "
                    "received_ms) VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (round_id, site_id, release_name, sha256, len(data), relative, now_ms()),
                )
                if audit is not None:
                    self._append_audit(db, "upload", dict(audit))
        except BaseException:  # no row names the file: it goes (unless another row names it)
            with suppress(sqlite3.Error):
                if not self._db.execute(
                    "SELECT 1 FROM uploads WHERE path = ? LIMIT 1", (relative,)
                ).fetchone():
                    _erase(path)
            raise
        return UploadRow(site_id, release_name, sha256, len(data), path)

    def uploads(self, round_id: str) -> dict[tuple[str, str], UploadRow]:
        """(site, release) -> upload row, for one round, oldest first."""
        rows = self._db.execute(
            "SELECT site_id, release_name, sha256, size, path FROM uploads WHERE round_id = ? "
            "ORDER BY received_ms",
            (round_id,),
        ).fetchall()
        return {
            (r[0], r[1]): UploadRow(r[0], r[1], bytes(r[2]), int(r[3]), self._payload_path(r[4]))
            for r in rows
        }

    def site_uploads(self, round_id: str, site_id: str) -> dict[str, UploadRow]:
        """release -> upload row of one site in one round (what a request about that site reads,
        instead of every site's rows)."""
        rows = self._db.execute(
            "SELECT release_name, sha256, size, path FROM uploads WHERE round_id = ? AND "
            "site_id = ? ORDER BY received_ms",
            (round_id, site_id),
        ).fetchall()
        return {
            r[0]: UploadRow(site_id, r[0], bytes(r[1]), int(r[2]), self._payload_path(r[3]))
            for r in rows
        }

    def _payload_path(self, stored: str) -> Path:
        """Payload paths are stored relative to the state folder (older states: absolute)."""
        path = Path(stored)
        return path if path.is_absolute() else self.state_dir / path

    @staticmethod
    def read_payload(row: UploadRow) -> bytes:
        """The stored payload; :class:`StateError` if the file is gone or no longer matches its
        digest (the caller aborts the round with the reason)."""
        try:
            data = row.path.read_bytes()
        except OSError as exc:
            raise StateError(f"payload file {row.path} cannot be read: {exc.strerror}") from exc
        if hashlib.sha256(data).digest() != row.sha256:
            raise StateError(f"payload file {row.path} does not match its recorded digest")
        return data

    def purge_payloads(
        self, round_ids: Sequence[str], *, audit: Mapping[str, object] | None = None
    ) -> int:
        """Delete the payload files of ``round_ids`` (retention); their rows stay, marked purged.
        Returns the number of files deleted.

        Record the intent, then delete: ``purged = 1`` for every row of ``round_ids``, the
        deletion of their messages (each leaving its evidence: digest, and for
        :func:`kept_as_evidence` messages the signed bytes, never statistics) and, given
        ``audit`` and anything to delete, the "payloads-deleted" record naming the digest of every
        file and message deleted, are committed in one transaction, then the files are erased
        (overwritten and unlinked; with ``background_erase`` by the eraser thread, after this
        returns). A crash between the two leaves files whose rows say purged;
        :meth:`sweep_payloads` erases them at the next start-up, so no statistic outlives its
        purge (docs/protocol.md M-140)."""
        assert not self._depth, "a purge commits its intent before it erases: never nested"
        paths: list[str] = []
        files: list[dict[str, object]] = []
        messages: list[dict[str, object]] = []
        with self._tx() as db:  # the intent for every round at once: a kill leaves no round out
            for round_id in round_ids:
                for path_text, site, release, sha in db.execute(
                    "SELECT path, site_id, release_name, sha256 FROM uploads WHERE round_id = ? "
                    "AND purged = 0",
                    (round_id,),
                ).fetchall():
                    paths.append(path_text)
                    files.append(
                        {
                            "round_id": round_id,
                            "site_id": site,
                            "release": release,
                            "sha256": bytes(sha).hex(),
                        }
                    )
                for stage, site, kind, data in db.execute(
                    "SELECT stage, site_id, kind, data FROM messages WHERE round_id = ? "
                    "ORDER BY seq",
                    (round_id,),
                ).fetchall():
                    digest = hashlib.sha256(bytes(data)).digest()
                    kept = bytes(data) if kept_as_evidence(int(stage), kind) else None
                    db.execute(
                        "INSERT INTO evidence (round_id, stage, site_id, kind, sha256, data, "
                        "kept_ms) VALUES (?, ?, ?, ?, ?, ?, ?)",
                        (round_id, int(stage), site, kind, digest, kept, now_ms()),
                    )
                    messages.append(
                        {
                            "round_id": round_id,
                            "site_id": site,
                            "kind": kind,
                            "sha256": digest.hex(),
                        }
                    )
                db.execute("UPDATE uploads SET purged = 1 WHERE round_id = ?", (round_id,))
                db.execute("DELETE FROM messages WHERE round_id = ?", (round_id,))
            if audit is not None and (files or messages):
                self._append_audit(
                    db,
                    "payloads-deleted",
                    {**audit, "files": len(files), "payloads": files, "messages": messages},
                )
        erased = [self._payload_path(p) for p in paths]
        folders = [self.state_dir / "payloads" / round_id for round_id in round_ids]

        def tidy() -> None:
            for folder in folders:
                _remove_empty_folders(folder)

        if self._eraser is not None and erased:
            self._eraser.submit(erased, then=tidy)
        elif erased:
            for path in erased:
                _erase(path)
            tidy()
        if paths or messages:  # a purge with nothing to delete (retention re-checks) costs nothing
            self.scrub()
        return len(paths)

    def retry_erasures(self) -> int:
        """Hand the payload files the background eraser could not erase over again (the
        retention tick, every minute); how many. A pending :meth:`scrub` is finished too (its
        last checkpoint only, waiting briefly: VACUUM's pages are already in the WAL)."""
        if self.scrub_pending and not self._depth:
            try:
                self._finish_scrub(wait_s=RETRY_SCRUB_WAIT_S)
            except sqlite3.Error as exc:  # a damaged database shows at its next transaction
                log.warning("%s: a pending scrub failed again (%s)", self.path, exc)
        return self._eraser.retry_failed() if self._eraser is not None else 0

    def drain_erasures(self, timeout_s: float | None = None) -> bool:
        """Wait until the payload files purges handed to the background are erased (at most
        ``timeout_s``); whether they are (True without ``background_erase``)."""
        return self._eraser is None or self._eraser.drain(timeout_s)

    def scrub(self) -> bool:
        """Leave no deleted row's bytes in the database files (M-175): ``secure_delete`` (on
        since open) zeroes freed cells; the WAL, which still holds the pages as they were, is
        checkpointed and truncated, and VACUUM rewrites the database without free pages. Runs
        after every purge (outside any transaction). Whether it is done: another process that
        reads the state meanwhile (``afl-server status``) can keep the last checkpoint from
        completing for longer than :attr:`scrub_wait_s`; then the scrub is pending, logged,
        and finished at a later :meth:`retry_erasures` (the retention tick, every minute)."""
        assert not self._depth, "scrub runs after a purge's transaction, never inside one"
        with self._reader_lock:  # no read of committed_log_entries holds the WAL meanwhile
            self._db.execute("PRAGMA wal_checkpoint(PASSIVE)")  # what it can, without waiting
            self._db.execute("VACUUM")
        return self._finish_scrub(wait_s=self.scrub_wait_s)

    def _finish_scrub(self, *, wait_s: float) -> bool:
        """A scrub's last step: the WAL checkpointed and truncated, waiting up to ``wait_s``
        for other connections' reads; whether it is done (:attr:`scrub_pending` otherwise)."""
        with self._reader_lock:
            before = int(self._db.execute("PRAGMA busy_timeout").fetchone()[0])
            self._db.execute(f"PRAGMA busy_timeout = {int(wait_s * 1000)}")
            try:
                busy = bool(self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0])
            finally:
                self._db.execute(f"PRAGMA busy_timeout = {before}")
        if busy and not self.scrub_pending:
            log.warning(
                "%s: another connection kept the database's write-ahead log from being emptied "
                "after a deletion (docs/protocol.md M-175); the scrub is finished within a "
                "minute of that connection's read ending",
                self.path,
            )
        elif self.scrub_pending and not busy:
            log.info("%s: the pending scrub is finished: the write-ahead log is empty", self.path)
        self.scrub_pending = busy
        return not busy

    def purge_site(self, site_id: str, *, by: str, reason: str) -> dict[str, object]:
        """Offboarding (docs/operations.md §10.1, M-176): delete everything the coordinator holds
        FROM ``site_id`` — its unpurged payload files, its protocol messages, its reports and its
        declared row bounds and coverage — and record what was deleted, by digest, in one
        "site-offboarded" audit record committed with the deletions; then erase the files and
        :meth:`scrub` the database. Its enrolment, its plan decisions and every audit record stay
        (the audit chain is append-only). Returns the audit record's detail."""
        assert not self._depth, "a purge commits its intent before it erases: never nested"
        with self._tx() as db:
            uploads = db.execute(
                "SELECT round_id, release_name, sha256, path FROM uploads WHERE site_id = ? AND "
                "purged = 0 ORDER BY round_id, release_name",
                (site_id,),
            ).fetchall()
            messages = db.execute(
                "SELECT round_id, stage, kind, data FROM messages WHERE site_id = ? ORDER BY seq",
                (site_id,),
            ).fetchall()
            reports = db.execute(
                "SELECT round_id, report FROM reports WHERE site_id = ? ORDER BY round_id",
                (site_id,),
            ).fetchall()
            declared = db.execute(
                "SELECT declared FROM site_declarations WHERE site_id = ?", (site_id,)
            ).fetchone()
            db.execute("UPDATE uploads SET purged = 1 WHERE site_id = ?", (site_id,))
            for table in ("messages", "reports", "site_declarations"):
                db.execute(f"DELETE FROM {table} WHERE site_id = ?", (site_id,))
            detail: dict[str, object] = {
                "site_id": site_id,
                "by": by,
                "reason": reason,
                "payloads": [
                    {"round_id": r[0], "release": r[1], "sha256": bytes(r[2]).hex()}
                    for r in uploads
                ],
                "messages": [
                    {"round_id": r[0], "stage": int(r[1]), "kind": r[2], "sha256": _hex(r[3])}
                    for r in messages
                ],
                "reports": [{"round_id": r[0], "sha256": _hex(r[1])} for r in reports],
                "declarations_sha256": None if declared is None else _hex(declared[0].encode()),
                "kept": "enrolment, plan decisions and audit records (the audit chain)",
            }
            self._append_audit(db, "site-offboarded", detail)
        for row in uploads:
            _erase(self._payload_path(row[3]))
        for folder in (self.state_dir / "payloads").glob(f"*/{site_id}"):
            _remove_empty_folders(folder)
        self.scrub()
        return detail

    def purge_reports(self, round_ids: Sequence[str], *, reason: str) -> list[dict[str, str]]:
        """Retention of the sites' round reports (``[retention] reports_days``, M-174): delete
        the ``reports`` rows of ``round_ids`` and record each (round, site, SHA-256) in one
        "reports-deleted" audit record committed with the deletion, then :meth:`scrub`. The
        "client-report" audit records that named them stay (the chain is append-only). Returns
        what was deleted ([] and no record when there was nothing)."""
        assert not self._depth, "a purge scrubs after its transaction: never nested"
        deleted: list[dict[str, str]] = []
        with self._tx() as db:
            for round_id in round_ids:
                rows = db.execute(
                    "SELECT site_id, report FROM reports WHERE round_id = ? ORDER BY site_id",
                    (round_id,),
                ).fetchall()
                deleted += [
                    {"round_id": round_id, "site_id": r[0], "sha256": _hex(r[1])} for r in rows
                ]
                db.execute("DELETE FROM reports WHERE round_id = ?", (round_id,))
            if deleted:
                self._append_audit(db, "reports-deleted", {"reports": deleted, "reason": reason})
        if deleted:
            self.scrub()
        return deleted

    def sweep_payloads(self) -> list[str]:
        """Erase every file under ``payloads/`` that no unpurged upload row names: files of a
        purge interrupted between its record and its erasure, and files of an upload interrupted
        before its row was committed (its ``.staged`` file, and ``.tmp`` leftovers). Appends one
        "payloads-swept" audit record listing what was removed (paths relative to the state
        folder: round, site and SHA-256) when anything was; returns that list. afl-server runs it
        at every start, with its port bound (so no other server writes to the folder); never
        call it beside a running server (its in-flight uploads have files before rows)."""
        root = self.state_dir / "payloads"
        if not root.is_dir():
            return []
        kept = {
            self._payload_path(r[0]).resolve()
            for r in self._db.execute("SELECT path FROM uploads WHERE purged = 0").fetchall()
        }
        removed = sorted(
            str(path.relative_to(self.state_dir))
            for path in root.rglob("*")
            if (path.is_file() or path.is_symlink()) and path.resolve() not in kept
        )
        if not removed:
            return []
        purged = {
            r[0] for r in self._db.execute("SELECT path FROM uploads WHERE purged = 1").fetchall()
        }
        for name in removed:  # overwritten before unlinked, as a purge does (M-175)
            _erase(self.state_dir / name)
        for folder in sorted(root.iterdir()):
            if folder.is_dir():
                _remove_empty_folders(folder)
        with self._tx() as db:
            self._append_audit(
                db,
                "payloads-swept",
                {
                    "removed": removed,
                    "purged_rows": sum(name in purged for name in removed),
                    "reason": "files left by an interrupted purge or upload",
                },
            )
        return removed

    def put_message(
        self, round_id: str, *, stage: int, site_id: str, kind: str, data: bytes
    ) -> None:
        """Persist one protocol message (before it is acknowledged). A second message of the same
        (round, stage, site, kind) must equal the first: :class:`ValueError` otherwise."""
        existing = self._db.execute(
            "SELECT data FROM messages WHERE round_id = ? AND stage = ? AND site_id = ? AND "
            "kind = ?",
            (round_id, stage, site_id, kind),
        ).fetchone()
        if existing is not None:
            if bytes(existing[0]) != data:
                raise ValueError(f"a different {kind} message of {site_id} is already stored")
            return
        with self._tx() as db:
            db.execute(
                "INSERT INTO messages (round_id, stage, site_id, kind, data, received_ms) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (round_id, stage, site_id, kind, data, now_ms()),
            )

    def messages(self, round_id: str) -> list[MessageRow]:
        """The persisted protocol messages of a round, in the order they were received."""
        rows = self._db.execute(
            "SELECT stage, site_id, kind, data FROM messages WHERE round_id = ? ORDER BY seq",
            (round_id,),
        ).fetchall()
        return [MessageRow(int(r[0]), r[1], r[2], bytes(r[3])) for r in rows]

    # --- models, reports, audit --------------------------------------------------------------

    def model_path(self, round_id: str) -> Path:
        """``<state_dir>/models/<round>.signed-model.pb``: the SignedModel, as sites receive it."""
        return self.state_dir / "models" / f"{round_id}.signed-model.pb"

    def _put_signed(
        self, table: str, path: Path, file_bytes: bytes, *, round_id: str, blob: bytes, sig: bytes
    ) -> str:
        """Write ``file_bytes`` to ``path`` atomically, then commit the row (round id, blob,
        signature) of ``table``; returns the SHA-256 (hex) of ``blob``."""
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        write_private_file(path, file_bytes)
        with self._tx() as db:
            db.execute(
                f"INSERT OR REPLACE INTO {table} VALUES (?, ?, ?, ?)",
                (round_id, blob, sig, now_ms()),
            )
        return hashlib.sha256(blob).hexdigest()

    def put_model(self, round_id: str, *, model: bytes, signature: bytes) -> str:
        """Write the signed model file atomically, then commit its row; returns the SHA-256 (hex)
        of the ``Model`` bytes, the digest every site records for its verified copy."""
        signed = SignedModel(model=model, signature=signature).SerializeToString()
        path = self.model_path(round_id)
        return self._put_signed(
            "models", path, signed, round_id=round_id, blob=model, sig=signature
        )

    def put_candidate(self, round_id: str, *, model: bytes, signature: bytes) -> str:
        """Commit the candidate of a gated round (signed with context "candidate-model"; a row
        only, no file: it is not published, docs/protocol.md §6.2); the SHA-256 (hex) of
        ``model``."""
        with self._tx() as db:
            db.execute(
                "INSERT OR REPLACE INTO candidates VALUES (?, ?, ?, ?)",
                (round_id, model, signature, now_ms()),
            )
        return hashlib.sha256(model).hexdigest()

    def candidate(self, round_id: str) -> tuple[bytes, bytes] | None:
        """(model bytes, candidate signature) of a gated round, if it has one."""
        row = self._db.execute(
            "SELECT model, signature FROM candidates WHERE round_id = ?", (round_id,)
        ).fetchone()
        return None if row is None else (bytes(row[0]), bytes(row[1]))

    def model(self, round_id: str | None = None) -> tuple[str, bytes, bytes] | None:
        """(round id, model bytes, signature) of ``round_id``, or the latest when None."""
        select = "SELECT round_id, model, signature FROM models"
        if round_id:
            row = self._db.execute(f"{select} WHERE round_id = ?", (round_id,)).fetchone()
        else:
            row = self._db.execute(f"{select} ORDER BY created_ms DESC, rowid DESC").fetchone()
        return None if row is None else (row[0], bytes(row[1]), bytes(row[2]))

    def evaluation_path(self, round_id: str) -> Path:
        """``<state_dir>/evaluations/<round>.signed-evaluation.pb``: the SignedEvaluation."""
        return self.state_dir / "evaluations" / f"{round_id}.signed-evaluation.pb"

    def put_evaluation(self, round_id: str, *, evaluation: bytes, signature: bytes) -> str:
        """Write the signed evaluation file atomically, then commit its row (a retry after a
        restart replaces both); returns the SHA-256 (hex) of the ``Evaluation`` bytes."""
        signed = SignedEvaluation(evaluation=evaluation, signature=signature).SerializeToString()
        path = self.evaluation_path(round_id)
        return self._put_signed(
            "evaluations", path, signed, round_id=round_id, blob=evaluation, sig=signature
        )

    def evaluation(self, round_id: str) -> tuple[bytes, bytes] | None:
        """(Evaluation bytes, signature) of the evaluation round ``round_id``."""
        row = self._db.execute(
            "SELECT evaluation, signature FROM evaluations WHERE round_id = ?", (round_id,)
        ).fetchone()
        return None if row is None else (bytes(row[0]), bytes(row[1]))

    def put_report(
        self, round_id: str, site_id: str, report: bytes, *, audit: dict[str, object]
    ) -> None:
        """Store a site's report of a round and append its "client-report" audit record
        (``audit`` plus the report's SHA-256, and the digest of the report it replaces) in ONE
        transaction; the same report again changes nothing."""
        digest = hashlib.sha256(report).hexdigest()
        with self._tx() as db:
            row = db.execute(
                "SELECT report FROM reports WHERE round_id = ? AND site_id = ?", (round_id, site_id)
            ).fetchone()
            if row is not None and bytes(row[0]) == report:
                return
            detail = {**audit, "sha256": digest}
            if row is not None:
                detail["replaces"] = hashlib.sha256(bytes(row[0])).hexdigest()
            db.execute(
                "INSERT OR REPLACE INTO reports VALUES (?, ?, ?)", (round_id, site_id, report)
            )
            self._append_audit(db, "client-report", detail)

    def reports(self, round_id: str) -> dict[str, bytes]:
        rows = self._db.execute(
            "SELECT site_id, report FROM reports WHERE round_id = ?", (round_id,)
        ).fetchall()
        return {r[0]: bytes(r[1]) for r in rows}

    # --- the federation log (docs/protocol.md §11a; afl.server.transparency) ------------------

    def append_log(self, kind: str, fields: Mapping[str, object]) -> int:
        """Append one statement to the federation log; its index. Call it inside the
        transaction of the state change it records (re-entrant), so both commit or neither."""
        entry = statement_bytes(federation=self._federation_id, kind=kind, fields=fields)
        with self._tx() as db:
            idx = int(db.execute("SELECT COUNT(*) FROM fedlog").fetchone()[0])
            db.execute(
                "INSERT INTO fedlog VALUES (?, ?, ?, ?, ?)",
                (idx, kind, entry, leaf_hash(entry), now_ms()),
            )
            self._log_grown_to = idx + 1
        return idx

    def log_size(self) -> int:
        """The number of statements in the federation log (inside a transaction: its own too)."""
        return int(self._db.execute("SELECT COUNT(*) FROM fedlog").fetchone()[0])

    def log_tree(self) -> MerkleTree:
        """The federation log's Merkle tree (its roots and proofs cost O(log² n), not O(n):
        :class:`afl.crypto.transparency.tree.MerkleTree`), committed statements kept in memory
        and grown from the database. Inside a transaction with statements of its own, a tree
        of its whole view (built afresh, not kept: the transaction may roll back)."""
        rows = self._db.execute(
            "SELECT leaf FROM fedlog WHERE idx >= ? ORDER BY idx", (len(self._tree),)
        ).fetchall()
        if not rows:
            return self._tree
        if self._depth:
            return MerkleTree([*self._tree.leaves, *(bytes(r[0]) for r in rows)])
        self._tree.extend(bytes(r[0]) for r in rows)
        return self._tree

    def log_entries(self, start: int, end: int) -> list[tuple[int, str, bytes, int]]:
        """(index, kind, statement bytes, time) of the statements ``start`` <= index < ``end``."""
        rows = self._db.execute(
            "SELECT idx, kind, entry, time_ms FROM fedlog WHERE idx >= ? AND idx < ? ORDER BY idx",
            (start, end),
        ).fetchall()
        return [(int(r[0]), r[1], bytes(r[2]), int(r[3])) for r in rows]

    def committed_log_entries(self, start: int, end: int) -> list[tuple[int, str, bytes, int]]:
        """As :meth:`log_entries`, over a read-only connection of its own that sees committed
        statements only, so its caller holds no lock and waits for no writer (WAL): the log is
        append-only, and a committed statement never changes. Thread-safe."""
        with self._reader_lock:
            if self._reader is None:
                self._reader = sqlite3.connect(
                    self.path.resolve().as_uri() + "?mode=ro", uri=True, check_same_thread=False
                )
            rows = self._reader.execute(
                "SELECT idx, kind, entry, time_ms FROM fedlog WHERE idx >= ? AND idx < ? "
                "ORDER BY idx",
                (start, end),
            ).fetchall()
        return [(int(r[0]), r[1], bytes(r[2]), int(r[3])) for r in rows]

    def log_statements(self, kind: str) -> list[bytes]:
        """The statement bytes of every entry of ``kind``, in log order."""
        rows = self._db.execute(
            "SELECT entry FROM fedlog WHERE kind = ? ORDER BY idx", (kind,)
        ).fetchall()
        return [bytes(r[0]) for r in rows]

    def log_index(self, leaf: bytes) -> int | None:
        """The index of the first statement whose leaf hash is ``leaf``."""
        row = self._db.execute(
            "SELECT idx FROM fedlog WHERE leaf = ? ORDER BY idx LIMIT 1", (leaf,)
        ).fetchone()
        return None if row is None else int(row[0])

    def put_log_checkpoint(self, *, size: int, root: bytes, signature: bytes) -> None:
        """Record a checkpoint the coordinator signed (the log may never shrink below it)."""
        with self._tx() as db:
            db.execute(
                "INSERT OR IGNORE INTO log_checkpoints VALUES (?, ?, ?, ?)",
                (size, root, signature, now_ms()),
            )

    def log_checkpoint(self, size: int | None = None) -> tuple[int, bytes, bytes] | None:
        """(size, root, signature) of the signed checkpoint of ``size`` (the latest when None)."""
        query = "SELECT size, root, signature FROM log_checkpoints"
        if size is None:
            row = self._db.execute(f"{query} ORDER BY size DESC LIMIT 1").fetchone()
        else:
            row = self._db.execute(f"{query} WHERE size = ?", (size,)).fetchone()
        return None if row is None else (int(row[0]), bytes(row[1]), bytes(row[2]))

    def log_checkpoints(self) -> list[tuple[int, bytes, bytes]]:
        """(size, root, signature) of every signed checkpoint, by size."""
        rows = self._db.execute(
            "SELECT size, root, signature FROM log_checkpoints ORDER BY size"
        ).fetchall()
        return [(int(r[0]), bytes(r[1]), bytes(r[2])) for r in rows]

    def put_log_cosignature(
        self, *, size: int, root: bytes, witness: str, signature: bytes
    ) -> None:
        """Keep a witness's (verified) cosignature of the checkpoint of ``size``."""
        with self._tx() as db:
            db.execute(
                "INSERT OR REPLACE INTO log_cosignatures VALUES (?, ?, ?, ?, ?)",
                (size, witness, root, signature, now_ms()),
            )
            self._cosigned_pending.append((size, witness))

    def log_cosignatures(self, size: int) -> list[tuple[str, bytes, bytes]]:
        """(witness, root, signature) of every cosignature on the checkpoint of ``size``."""
        rows = self._db.execute(
            "SELECT witness, root, signature FROM log_cosignatures WHERE size = ? ORDER BY witness",
            (size,),
        ).fetchall()
        return [(r[0], bytes(r[1]), bytes(r[2])) for r in rows]

    def audit(self, event: str, detail: Mapping[str, object]) -> None:
        """Append to the hash-chained audit log (never statistics or key material)."""
        with self._tx() as db:
            self._append_audit(db, event, dict(detail))

    @staticmethod
    def _append_audit(db: sqlite3.Connection, event: str, detail: dict[str, object]) -> None:
        """One audit record, inside the caller's transaction."""
        last = db.execute("SELECT hash FROM audit_log ORDER BY seq DESC LIMIT 1").fetchone()
        prev = bytes(last[0]) if last else GENESIS
        stamp = now_ms()
        text = json.dumps(detail, sort_keys=True)
        digest = audit_hash(prev, time_ms=stamp, event=event, detail=text)
        db.execute(
            "INSERT INTO audit_log (time_ms, event, detail, prev_hash, hash) "
            "VALUES (?, ?, ?, ?, ?)",
            (stamp, event, text, prev, digest),
        )

    def audit_records(
        self, *, after_seq: int = 0, limit: int | None = None
    ) -> list[tuple[int, int, str, str, bytes, bytes]]:
        """(seq, time, event, detail JSON text, prev hash, hash) of the records after
        ``after_seq``, oldest first."""
        query = (
            "SELECT seq, time_ms, event, detail, prev_hash, hash FROM audit_log WHERE seq > ? "
            "ORDER BY seq"
        )
        params: tuple[int, ...] = (after_seq,)
        if limit is not None:
            query += " LIMIT ?"
            params = (after_seq, limit)
        rows = self._db.execute(query, params).fetchall()
        return [(int(r[0]), int(r[1]), r[2], r[3], bytes(r[4]), bytes(r[5])) for r in rows]

    def audit_entries(self) -> list[tuple[int, str, dict[str, object], bytes, bytes]]:
        """(time, event, detail, prev hash, hash) in order."""
        rows = self._db.execute(
            "SELECT time_ms, event, detail, prev_hash, hash FROM audit_log ORDER BY seq"
        ).fetchall()
        return [(int(r[0]), r[1], json.loads(r[2]), bytes(r[3]), bytes(r[4])) for r in rows]

    def verify_audit_chain(self) -> bool:
        """True iff every entry's hash chains from its predecessor."""
        return self._walk_audit_chain()[0]

    def _walk_audit_chain(self, *, at_seq: int = 0) -> tuple[bool, bytes | None]:
        """(whether every record chains from its predecessor, the hash of record ``at_seq``:
        the zero hash for 0, None when there is no such record), in one read of the log."""
        valid, prev, found = True, GENESIS, GENESIS if at_seq == 0 else None
        rows = self._db.execute(
            "SELECT seq, time_ms, event, detail, prev_hash, hash FROM audit_log ORDER BY seq"
        )
        for seq, stamp, event, text, prev_hash, digest in rows:
            want = audit_hash(prev, time_ms=int(stamp), event=event, detail=text)
            valid = valid and bytes(prev_hash) == prev and bytes(digest) == want
            prev = bytes(digest)
            if int(seq) == at_seq:
                found = prev
        return valid, found


def _hex(data: bytes) -> str:
    return hashlib.sha256(bytes(data)).hexdigest()


def _erase(path: Path) -> None:
    """Overwrite and unlink a payload file (gone already: nothing to do)."""
    with suppress(FileNotFoundError):
        erase_file(path)


def _remove_empty_folders(folder: Path) -> None:
    """Remove ``folder`` and its sub-folders that hold no file (deepest first); one that an
    upload staging into it (or another tidy) changed meanwhile is left as it is."""
    if not folder.is_dir():
        return
    for sub in [
        *sorted(folder.rglob("*"), key=lambda p: len(p.parts), reverse=True),
        folder,
    ]:
        try:
            if sub.is_dir() and not any(sub.iterdir()):
                sub.rmdir()
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT):
                raise


def backup_state(state_dir: Path, destination: Path) -> dict[str, object]:
    """A consistent copy of a (possibly running) server's state folder in ``destination``: an
    online SQLite backup of the database, the payload files its rows name, the CKKS context, and
    an anchor computed from the COPY (so the copy is self-consistent even if the server committed
    meanwhile), and the signed model and evaluation files. Returns that anchor. :class:`StateError` names what
    went wrong."""
    source = Path(state_dir)
    destination = Path(destination)
    if not (source / DB_NAME).is_file():
        raise StateError(f"{source / DB_NAME} does not exist: nothing to back up")
    if destination.exists() and any(destination.iterdir()):
        raise StateError(f"{destination} is not empty: back up into a new folder")
    destination.mkdir(parents=True, exist_ok=True, mode=0o700)
    previous = os.umask(0o077)
    try:
        src = sqlite3.connect(f"file:{source / DB_NAME}?mode=ro", uri=True)
        target = sqlite3.connect(destination / DB_NAME)
        try:
            src.backup(target)
            target.execute("PRAGMA journal_mode=DELETE")
        finally:
            src.close()
        rows = target.execute("SELECT path FROM uploads WHERE purged = 0").fetchall()
        fed = target.execute("SELECT value FROM meta WHERE key = 'federation_id'").fetchone()
        commits = target.execute("SELECT value FROM meta WHERE key = 'commits'").fetchone()
        tail = target.execute("SELECT hash FROM audit_log ORDER BY seq DESC LIMIT 1").fetchone()
        count = target.execute("SELECT COUNT(*) FROM audit_log").fetchone()[0]
        relocated = []
        for (path_text,) in rows:
            path = Path(path_text) if Path(path_text).is_absolute() else source / path_text
            try:
                relative = path.relative_to(source)
            except ValueError as exc:
                raise StateError(f"payload file {path} lies outside {source}") from exc
            out = destination / relative
            out.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            try:
                write_private_file(out, path.read_bytes())
            except FileNotFoundError as exc:
                raise StateError(
                    f"payload file {path} disappeared during the backup (the server deleted it "
                    "after its run ended): run the backup again"
                ) from exc
            relocated.append((str(relative), path_text))
        with target:
            target.executemany("UPDATE uploads SET path = ? WHERE path = ?", relocated)
        target.close()
    finally:
        os.umask(previous)
    for sub in ("ckks", "models", "evaluations"):  # the CKKS context; signed models, evaluations
        folder = source / sub
        if folder.is_dir():
            for path in folder.iterdir():
                if path.is_file() and not path.name.endswith(".tmp"):
                    (destination / sub).mkdir(exist_ok=True, mode=0o700)
                    write_private_file(destination / sub / path.name, path.read_bytes())
    anchor = {
        "federation_id": fed[0] if fed else "",
        "commits": int(commits[0]) if commits else 0,
        "audit_count": int(count),
        "audit_head": (bytes(tail[0]) if tail else GENESIS).hex(),
    }
    write_private_file(
        destination / ANCHOR_NAME, (json.dumps(anchor, sort_keys=True) + "\n").encode()
    )
    return anchor
