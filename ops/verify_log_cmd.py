"""`afl verify-log FILE`: check the hash chain of afl-server's audit log (docs/protocol.md §11).

    afl verify-log FILE [--expect-head HEX] [--expect-count N] [--export OUT.jsonl] [--json]

FILE is the server's state directory, its ``server.sqlite3`` (opened read-only) or a JSON-lines
export (:func:`afl.ops.verify_log.export_jsonl`). The first bad record is reported as modified,
deleted, reordered or truncated (:mod:`afl.ops.verify_log`). ``--expect-head``/``--expect-count``
are an anchor printed by an earlier run (keep it off the server); with them, a cut tail or a
re-hashed chain is detected too. ``--export`` writes the records read as JSON lines (for archiving
or handing to a reviewer), before verifying. Without ``--expect-head``, the anchor afl-server keeps
beside its database (``anchor.json``: audit count and head, written after every commit) is used
when present, so a database rolled back by a deleted WAL is reported as truncated.

Exit status: 0 the chain verifies, 1 tampering found, 2 the file cannot be read as an audit log.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from afl.ops.verify_log import LogFormatError, export_jsonl, read_log, verify_chain

__all__ = ["add_arguments", "hex32", "run"]


def hex32(text: str) -> bytes:
    """An argparse type: 32 bytes given as 64 hex digits (a SHA-256, an Ed25519 public key)."""
    try:
        raw = bytes.fromhex(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError("must be 64 hex digits") from exc
    if len(raw) != 32:
        raise argparse.ArgumentTypeError("must be 64 hex digits (32 bytes)")
    return raw


def _count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError("must be >= 0")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the `afl verify-log` options to ``parser``."""
    parser.add_argument(
        "file", metavar="FILE", help="state dir, server.sqlite3, or a JSON-lines export"
    )
    parser.add_argument(
        "--expect-head",
        type=hex32,
        default=None,
        metavar="HEX",
        help="head hash recorded earlier (from a previous verify-log); must still be in the chain",
    )
    parser.add_argument(
        "--expect-count",
        type=_count,
        default=None,
        metavar="N",
        help="record count recorded with --expect-head; the log must hold at least N records",
    )
    parser.add_argument("--export", default=None, metavar="OUT", help="write the log as JSON lines")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def _server_anchor(path: Path) -> tuple[bytes, int] | None:
    """(head, count) from the anchor.json beside a state database, if there is one."""
    folder = path if path.is_dir() else path.parent
    anchor = folder / "anchor.json"
    if not anchor.is_file() or (path.is_file() and path.name != "server.sqlite3"):
        return None
    try:
        doc = json.loads(anchor.read_text(encoding="utf-8"))
        return bytes.fromhex(doc["audit_head"]), int(doc["audit_count"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise LogFormatError(f"{anchor} is malformed: {exc}") from exc


def run(args: argparse.Namespace) -> int:
    """Verify ``args.file``; print the report. Returns the process exit code."""
    try:
        records = read_log(args.file)
        _server_anchor(Path(args.file))
    except LogFormatError as exc:
        print(f"afl verify-log: error: {exc}", file=sys.stderr)
        return 2
    if args.export:
        written = export_jsonl(records, args.export)
        print(f"exported {written} records to {args.export}", file=sys.stderr)
    expect_head, expect_count = args.expect_head, args.expect_count
    anchor = _server_anchor(Path(args.file)) if expect_head is None else None
    if anchor is not None:
        expect_head, expect_count = anchor
        print(f"using the server's anchor.json ({expect_count} records)", file=sys.stderr)
    report = verify_chain(records, expect_head=expect_head, expect_count=expect_count)
    if args.json:
        print(json.dumps(report.to_dict(), sort_keys=True))
    elif report.problem is None:
        print(f"OK: {report.records} records, chain intact")
        print(f"head {report.head.hex()} count {report.records}  (record this anchor elsewhere)")
    else:
        p = report.problem
        seq = "" if p.seq is None else f" (seq {p.seq})"
        print(f"TAMPERED: {p.kind} at record {p.position}{seq}: {p.message}")
    return 0 if report.ok else 1
