"""Verification of afl-server's hash-chained audit log (docs/protocol.md §11), from the SQLite state
database or from a JSON-lines export.

The chain is the one :meth:`afl.server.store.Store.audit` writes:

    hash_0 = 0^{32},   hash_i = SHA-256(hash_{i-1} || canonical(time_ms_i, event_i, detail_i))

with ``canonical`` from :mod:`afl.crypto.canonical` and ``detail_i`` the exact JSON text stored
(``json.dumps(detail, sort_keys=True)``). Each record also stores ``prev_hash_i``, which must
equal ``hash_{i-1}``.

Walking the records in order, the FIRST bad record is classified as

* ``modified``: its stored hash is not the hash of its own content (content edited), or its
  content was edited and re-hashed, which shows as the next record's link pointing to a hash no
  record has while the sequence numbers stay consecutive;
* ``deleted``: its link points to a hash no record has and the sequence numbers have a gap (or,
  without sequence numbers, any unmatched link); a first record that does not start from the
  zero hash means the head of the log was cut;
* ``reordered``: its link points to the hash of a record that appears elsewhere in the file;
* ``truncated``: the chain is intact but no longer holds an anchor the operator recorded earlier
  (``expect_head``: a head hash printed by a previous run; ``expect_count``: the record count
  then; the log only grows, so both must still be found): the tail was cut or the chain
  re-hashed. Without an anchor, deleting the LAST records or recomputing every hash after a
  change cannot be detected from the log alone: anchor the head hash outside the server.

JSON-lines export (:func:`export_jsonl`): one object per record with ``seq``, ``time_ms``,
``event``, ``detail`` (the exact stored JSON text, a string), ``prev_hash`` and ``hash`` (hex).
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from afl.crypto.canonical import canonical_encode

__all__ = [
    "GENESIS",
    "ChainProblem",
    "ChainReport",
    "LogFormatError",
    "LogRecord",
    "chain_hash",
    "export_jsonl",
    "read_jsonl",
    "read_log",
    "read_sqlite",
    "verify_chain",
]

#: prev_hash of the first record.
GENESIS = b"\x00" * 32
SQLITE_MAGIC = b"SQLite format 3\x00"
STATE_DB_NAME = "server.sqlite3"

ProblemKind = Literal["modified", "deleted", "reordered", "truncated"]


class LogFormatError(ValueError):
    """The file is not an afl audit log (unreadable, wrong table, malformed line)."""


@dataclass(frozen=True)
class LogRecord:
    """One audit record as stored. ``seq`` is None when the source carries no numbering."""

    seq: int | None
    time_ms: int
    event: str
    detail: str
    prev_hash: bytes
    hash: bytes


@dataclass(frozen=True)
class ChainProblem:
    """The first bad record: its 1-based position in the file, its seq, kind and explanation."""

    kind: ProblemKind
    position: int
    seq: int | None
    message: str


@dataclass(frozen=True)
class ChainReport:
    """Outcome of :func:`verify_chain`; ``head`` is the last record's hash (anchor it)."""

    records: int
    head: bytes
    problem: ChainProblem | None

    @property
    def ok(self) -> bool:
        return self.problem is None

    def to_dict(self) -> dict[str, object]:
        problem = None
        if self.problem is not None:
            p = self.problem
            problem = {"kind": p.kind, "position": p.position, "seq": p.seq, "message": p.message}
        return {"ok": self.ok, "records": self.records, "head": self.head.hex(), "problem": problem}


def chain_hash(prev_hash: bytes, *, time_ms: int, event: str, detail: str) -> bytes:
    """hash_i = SHA-256(prev_hash || canonical(time_ms, event, detail)) (module docstring)."""
    return hashlib.sha256(prev_hash + canonical_encode([time_ms, event, detail])).digest()


# --- reading -------------------------------------------------------------------------------------


def read_sqlite(path: str | os.PathLike[str]) -> list[LogRecord]:
    """Records of the ``audit_log`` table of an afl-server state database, in ``seq`` order.

    Opened read-only; raises :class:`LogFormatError` when the file has no such table.
    """
    uri = Path(path).resolve().as_uri() + "?mode=ro"
    try:
        db = sqlite3.connect(uri, uri=True)
    except sqlite3.Error as exc:
        raise LogFormatError(f"{path}: cannot open the database: {exc}") from exc
    try:
        rows = db.execute(
            "SELECT seq, time_ms, event, detail, prev_hash, hash FROM audit_log ORDER BY seq"
        ).fetchall()
    except sqlite3.Error as exc:
        raise LogFormatError(f"{path}: not an afl-server state database ({exc})") from exc
    finally:
        db.close()
    return [
        LogRecord(int(r[0]), int(r[1]), str(r[2]), str(r[3]), bytes(r[4]), bytes(r[5]))
        for r in rows
    ]


def _hex_field(obj: dict[str, object], key: str, where: str) -> bytes:
    value = obj.get(key)
    try:
        raw = bytes.fromhex(value) if isinstance(value, str) else b""
    except ValueError:
        raw = b""
    if len(raw) != 32:
        raise LogFormatError(f"{where}: {key!r} must be 32 bytes in hex")
    return raw


def _record_from_json(obj: object, where: str) -> LogRecord:
    if not isinstance(obj, dict):
        raise LogFormatError(f"{where}: each line must be a JSON object")
    seq, time_ms, event, detail = (obj.get(k) for k in ("seq", "time_ms", "event", "detail"))
    if seq is not None and (isinstance(seq, bool) or not isinstance(seq, int)):
        raise LogFormatError(f"{where}: 'seq' must be an integer")
    if isinstance(time_ms, bool) or not isinstance(time_ms, int):
        raise LogFormatError(f"{where}: 'time_ms' must be an integer")
    if not isinstance(event, str) or not isinstance(detail, str):
        raise LogFormatError(
            f"{where}: 'event' and 'detail' (the stored JSON text) must be strings"
        )
    return LogRecord(
        seq,
        time_ms,
        event,
        detail,
        _hex_field(obj, "prev_hash", where),
        _hex_field(obj, "hash", where),
    )


def read_jsonl(path: str | os.PathLike[str]) -> list[LogRecord]:
    """Records of a JSON-lines export, in file order (blank lines are skipped)."""
    records: list[LogRecord] = []
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise LogFormatError(f"{path}: cannot read: {exc}") from exc
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise LogFormatError(f"{where}: not JSON ({exc.msg})") from exc
        records.append(_record_from_json(obj, where))
    return records


def read_log(path: str | os.PathLike[str]) -> list[LogRecord]:
    """Records from a state directory, a SQLite state database or a JSON-lines export."""
    source = Path(path)
    if source.is_dir():
        source = source / STATE_DB_NAME
    try:
        with source.open("rb") as handle:
            magic = handle.read(len(SQLITE_MAGIC))
    except OSError as exc:
        raise LogFormatError(f"{source}: cannot read: {exc.strerror}") from exc
    return read_sqlite(source) if magic == SQLITE_MAGIC else read_jsonl(source)


def export_jsonl(records: Iterable[LogRecord], out: str | os.PathLike[str]) -> int:
    """Write ``records`` as JSON lines (module docstring); returns the number written."""
    lines = [
        json.dumps(
            {
                "seq": r.seq,
                "time_ms": r.time_ms,
                "event": r.event,
                "detail": r.detail,
                "prev_hash": r.prev_hash.hex(),
                "hash": r.hash.hex(),
            },
            sort_keys=True,
        )
        for r in records
    ]
    Path(out).write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")
    return len(lines)


# --- verifying -----------------------------------------------------------------------------------


def _consecutive(a: LogRecord, b: LogRecord) -> bool | None:
    if a.seq is None or b.seq is None:
        return None
    return b.seq == a.seq + 1


def _broken_link(records: Sequence[LogRecord], i: int) -> ChainProblem:
    """Classify record i whose prev_hash is not the previous record's hash (module docstring)."""
    record = records[i]
    where = {r.hash: j for j, r in enumerate(records)}
    if record.prev_hash in where and where[record.prev_hash] != i - 1:
        j = where[record.prev_hash]
        return ChainProblem(
            "reordered",
            i + 1,
            record.seq,
            f"record {i + 1} chains from record {j + 1}, not from its predecessor",
        )
    if i == 0:
        return ChainProblem(
            "deleted", 1, record.seq, "the first record does not start the chain: its head is cut"
        )
    if _consecutive(records[i - 1], record) is True:
        return ChainProblem(
            "modified",
            i,
            records[i - 1].seq,
            f"record {i} was edited and re-hashed: record {i + 1} chains from a hash no record has",
        )
    return ChainProblem(
        "deleted",
        i + 1,
        record.seq,
        f"record(s) missing before record {i + 1}: it chains from a hash no record has",
    )


def verify_chain(
    records: Sequence[LogRecord],
    *,
    expect_head: bytes | None = None,
    expect_count: int | None = None,
) -> ChainReport:
    """Check every record's hash and link; report the first bad record (module docstring)."""
    prev = GENESIS
    for i, record in enumerate(records):
        if record.prev_hash != prev:
            return ChainReport(len(records), prev, _broken_link(records, i))
        want = chain_hash(
            record.prev_hash, time_ms=record.time_ms, event=record.event, detail=record.detail
        )
        if want != record.hash:
            problem = ChainProblem(
                "modified", i + 1, record.seq, f"record {i + 1}'s content does not match its hash"
            )
            return ChainReport(len(records), prev, problem)
        prev = record.hash
    return _check_anchor(records, prev, expect_head=expect_head, expect_count=expect_count)


def _check_anchor(
    records: Sequence[LogRecord],
    head: bytes,
    *,
    expect_head: bytes | None,
    expect_count: int | None,
) -> ChainReport:
    """An intact chain must still hold the anchor: at least ``expect_count`` records, and
    ``expect_head`` as the hash of record ``expect_count`` (or of any record when no count)."""
    n = len(records)
    if expect_count is not None and n < expect_count:
        message = f"{n} records, the anchor says at least {expect_count}: the tail was cut"
        return ChainReport(n, head, ChainProblem("truncated", n, None, message))
    if expect_head is not None:
        if expect_count is not None:
            found = expect_count >= 1 and records[expect_count - 1].hash == expect_head
        else:
            found = any(r.hash == expect_head for r in records)
        if not found:
            message = "the anchored head hash is not in the chain: tail cut or chain re-hashed"
            return ChainReport(n, head, ChainProblem("truncated", n, None, message))
    return ChainReport(n, head, None)
