"""The coordinator's durable state: SQLite (WAL) plus payload files (docs/architecture.md §8).

Tables: ``meta`` (schema version, federation id), ``enrolments``, ``rounds`` (stage, signed
plan, deadline), ``decisions`` (plan accept/refuse), ``uploads`` (digest, size, payload file),
``models`` (signed model bytes), ``reports`` (client reports) and ``audit_log`` (append-only,
hash-chained: ``hash_i = SHA-256(hash_{i-1} || canonical(time, event, detail))``).

The state folder and every folder under it are mode 0700; ``server.sqlite3`` (and so its
``-wal`` and ``-shm``, which SQLite creates with the database's mode) and every file are 0600.
Payloads live under ``<state_dir>/payloads/<round>/<site>/<sha256>.bin``, written
atomically BEFORE their row is committed, so a row always names a complete file. Every write is
one transaction; a killed server restarts from exactly the committed state.

Not thread-safe by itself: the coordinator serialises calls with its own lock.
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from afl.crypto.canonical import canonical_encode
from afl.crypto.pki import make_private_dir, write_private_file
from afl.server.errors import StateError

__all__ = ["SCHEMA_VERSION", "EnrolmentRow", "RoundRow", "Store", "UploadRow", "now_ms"]

SCHEMA_VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS enrolments (
    site_id TEXT PRIMARY KEY, identity_public_key BLOB NOT NULL, role TEXT NOT NULL,
    labelled_classes TEXT NOT NULL, backbone TEXT NOT NULL, feature_dim INTEGER NOT NULL,
    software_version TEXT NOT NULL, enrolled_ms INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS rounds (
    ordinal INTEGER PRIMARY KEY AUTOINCREMENT, round_id TEXT UNIQUE NOT NULL,
    number INTEGER NOT NULL, parent_round_id TEXT NOT NULL, stage INTEGER NOT NULL,
    participants TEXT NOT NULL, plan BLOB, plan_signature BLOB, deadline_ms INTEGER NOT NULL,
    abort_reason TEXT NOT NULL DEFAULT '', created_ms INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS decisions (
    round_id TEXT NOT NULL, site_id TEXT NOT NULL, accept INTEGER NOT NULL, reason TEXT NOT NULL,
    PRIMARY KEY (round_id, site_id));
CREATE TABLE IF NOT EXISTS uploads (
    round_id TEXT NOT NULL, site_id TEXT NOT NULL, release_name TEXT NOT NULL,
    sha256 BLOB NOT NULL, size INTEGER NOT NULL, path TEXT NOT NULL, received_ms INTEGER NOT NULL,
    PRIMARY KEY (round_id, site_id, release_name));
CREATE TABLE IF NOT EXISTS models (
    round_id TEXT PRIMARY KEY, model BLOB NOT NULL, signature BLOB NOT NULL,
    created_ms INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS reports (
    round_id TEXT NOT NULL, site_id TEXT NOT NULL, report BLOB NOT NULL,
    PRIMARY KEY (round_id, site_id));
CREATE TABLE IF NOT EXISTS audit_log (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, time_ms INTEGER NOT NULL, event TEXT NOT NULL,
    detail TEXT NOT NULL, prev_hash BLOB NOT NULL, hash BLOB NOT NULL);
"""


def now_ms() -> int:
    """Wall-clock Unix milliseconds."""
    return int(time.time() * 1000)


@dataclass(frozen=True)
class EnrolmentRow:
    site_id: str
    identity_public_key: bytes
    role: str
    labelled_classes: tuple[str, ...]
    backbone: str
    feature_dim: int


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


@dataclass(frozen=True)
class UploadRow:
    site_id: str
    release_name: str
    sha256: bytes
    size: int
    path: Path


class Store:
    """SQLite state of one federation in ``state_dir`` (created if missing)."""

    def __init__(self, state_dir: Path, *, federation_id: str) -> None:
        self.state_dir = make_private_dir(state_dir)
        path = self.state_dir / "server.sqlite3"
        # SQLite creates -wal and -shm with the database file's mode: create it 0600 first.
        os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))
        for name in (path.name, f"{path.name}-wal", f"{path.name}-shm"):
            if (self.state_dir / name).is_file():
                os.chmod(self.state_dir / name, 0o600)
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(_SCHEMA)
        self._check_meta(federation_id)

    def close(self) -> None:
        """Close the database (pending transactions are already committed)."""
        self._db.close()

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield self._db
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    def _check_meta(self, federation_id: str) -> None:
        rows = dict(self._db.execute("SELECT key, value FROM meta").fetchall())
        if not rows:
            with self._tx() as db:
                db.execute("INSERT INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
                db.execute("INSERT INTO meta VALUES ('federation_id', ?)", (federation_id,))
            return
        if rows.get("schema_version") != str(SCHEMA_VERSION):
            raise StateError(
                f"{self.state_dir}: state schema version {rows.get('schema_version')!r}, this "
                f"afl-server needs {SCHEMA_VERSION}"
            )
        if rows.get("federation_id") != federation_id:
            raise StateError(
                f"{self.state_dir} holds the state of federation {rows.get('federation_id')!r}, "
                f"not {federation_id!r}: use another state_dir"
            )

    # --- enrolment ---------------------------------------------------------------------------

    def put_enrolment(self, row: EnrolmentRow, *, software_version: str) -> None:
        with self._tx() as db:
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

    def enrolments(self) -> dict[str, EnrolmentRow]:
        rows = self._db.execute(
            "SELECT site_id, identity_public_key, role, labelled_classes, backbone, feature_dim "
            "FROM enrolments"
        ).fetchall()
        return {
            r[0]: EnrolmentRow(r[0], bytes(r[1]), r[2], tuple(json.loads(r[3])), r[4], int(r[5]))
            for r in rows
        }

    # --- rounds ------------------------------------------------------------------------------

    def create_round(
        self,
        *,
        round_id: str,
        number: int,
        parent_round_id: str,
        stage: int,
        participants: Sequence[str],
        deadline_ms: int,
    ) -> None:
        with self._tx() as db:
            db.execute(
                "INSERT INTO rounds (round_id, number, parent_round_id, stage, participants, "
                "deadline_ms, created_ms) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (
                    round_id,
                    number,
                    parent_round_id,
                    stage,
                    json.dumps(list(participants)),
                    deadline_ms,
                    now_ms(),
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

    def rounds(self) -> list[RoundRow]:
        """Every round, oldest first."""
        rows = self._db.execute(
            "SELECT round_id, number, parent_round_id, stage, participants, plan, plan_signature, "
            "deadline_ms, abort_reason FROM rounds ORDER BY ordinal"
        ).fetchall()
        return [
            RoundRow(
                r[0],
                int(r[1]),
                r[2],
                int(r[3]),
                tuple(json.loads(r[4])),
                None if r[5] is None else bytes(r[5]),
                None if r[6] is None else bytes(r[6]),
                int(r[7]),
                r[8],
            )
            for r in rows
        ]

    # --- decisions and uploads ---------------------------------------------------------------

    def put_decision(self, round_id: str, site_id: str, *, accept: bool, reason: str) -> None:
        with self._tx() as db:
            db.execute(
                "INSERT OR REPLACE INTO decisions VALUES (?, ?, ?, ?)",
                (round_id, site_id, int(accept), reason),
            )

    def decisions(self, round_id: str) -> dict[str, tuple[bool, str]]:
        rows = self._db.execute(
            "SELECT site_id, accept, reason FROM decisions WHERE round_id = ?", (round_id,)
        ).fetchall()
        return {r[0]: (bool(r[1]), r[2]) for r in rows}

    def put_upload(
        self, round_id: str, site_id: str, release_name: str, *, data: bytes, sha256: bytes
    ) -> UploadRow:
        """Write the payload file, then commit its row (the caller checked for duplicates)."""
        folder = make_private_dir(self.state_dir / "payloads" / round_id / site_id)
        path = write_private_file(folder / f"{sha256.hex()}.bin", data)
        with self._tx() as db:
            db.execute(
                "INSERT INTO uploads VALUES (?, ?, ?, ?, ?, ?, ?)",
                (round_id, site_id, release_name, sha256, len(data), str(path), now_ms()),
            )
        return UploadRow(site_id, release_name, sha256, len(data), path)

    def uploads(self, round_id: str) -> dict[tuple[str, str], UploadRow]:
        """(site, release) -> upload row, for one round."""
        rows = self._db.execute(
            "SELECT site_id, release_name, sha256, size, path FROM uploads WHERE round_id = ?",
            (round_id,),
        ).fetchall()
        return {
            (r[0], r[1]): UploadRow(r[0], r[1], bytes(r[2]), int(r[3]), Path(r[4])) for r in rows
        }

    @staticmethod
    def read_payload(row: UploadRow) -> bytes:
        """The stored payload; :class:`StateError` if the file no longer matches its digest."""
        data = row.path.read_bytes()
        if hashlib.sha256(data).digest() != row.sha256:
            raise StateError(f"payload file {row.path} does not match its recorded digest")
        return data

    # --- models, reports, audit --------------------------------------------------------------

    def put_model(self, round_id: str, *, model: bytes, signature: bytes) -> None:
        with self._tx() as db:
            db.execute(
                "INSERT OR REPLACE INTO models VALUES (?, ?, ?, ?)",
                (round_id, model, signature, now_ms()),
            )

    def model(self, round_id: str | None = None) -> tuple[str, bytes, bytes] | None:
        """(round id, model bytes, signature) of ``round_id``, or the latest when None."""
        select = "SELECT round_id, model, signature FROM models"
        if round_id:
            row = self._db.execute(f"{select} WHERE round_id = ?", (round_id,)).fetchone()
        else:
            row = self._db.execute(f"{select} ORDER BY created_ms DESC, rowid DESC").fetchone()
        return None if row is None else (row[0], bytes(row[1]), bytes(row[2]))

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

    def audit(self, event: str, detail: dict[str, object]) -> None:
        """Append to the hash-chained audit log (never statistics or key material)."""
        with self._tx() as db:
            self._append_audit(db, event, detail)

    @staticmethod
    def _append_audit(db: sqlite3.Connection, event: str, detail: dict[str, object]) -> None:
        """One audit record, inside the caller's transaction."""
        last = db.execute("SELECT hash FROM audit_log ORDER BY seq DESC LIMIT 1").fetchone()
        prev = bytes(last[0]) if last else b"\x00" * 32
        stamp = now_ms()
        text = json.dumps(detail, sort_keys=True)
        digest = hashlib.sha256(prev + canonical_encode([stamp, event, text])).digest()
        db.execute(
            "INSERT INTO audit_log (time_ms, event, detail, prev_hash, hash) "
            "VALUES (?, ?, ?, ?, ?)",
            (stamp, event, text, prev, digest),
        )

    def audit_entries(self) -> list[tuple[int, str, dict[str, object], bytes, bytes]]:
        """(time, event, detail, prev hash, hash) in order."""
        rows = self._db.execute(
            "SELECT time_ms, event, detail, prev_hash, hash FROM audit_log ORDER BY seq"
        ).fetchall()
        return [(int(r[0]), r[1], json.loads(r[2]), bytes(r[3]), bytes(r[4])) for r in rows]

    def verify_audit_chain(self) -> bool:
        """True iff every entry's hash chains from its predecessor."""
        prev = b"\x00" * 32
        for stamp, event, detail, prev_hash, digest in self.audit_entries():
            text = json.dumps(detail, sort_keys=True)
            want = hashlib.sha256(prev + canonical_encode([stamp, event, text])).digest()
            if prev_hash != prev or digest != want:
                return False
            prev = digest
        return True
