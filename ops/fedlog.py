"""`afl log`: the federation log (docs/protocol.md §11a) for operators and reviewers, offline.

    afl log export --config server.toml --out LOG.json
    afl log show LOG.json [--json]
    afl log verify LOG.json [--quorum N] [--checkpoint FILE ...]
    afl log prove LOG.json (--index N | --round ROUND_ID) [--size S]

``export`` reads the coordinator's state read-only (it may run beside afl-server) and writes one
JSON file: the federation id, the coordinator's identity public key and every roster site's (from
server.toml), every statement (canonical bytes, kind, time), every signed checkpoint and every
cosignature. A reviewer is handed that file and checks it with the other commands, which need
nothing else; compare the keys in it with the roster fingerprint published out of band.

``verify``: every statement is a canonical statement of the federation; every checkpoint is
signed by the coordinator's key and its root is the RFC 9162 root of that many statements;
consecutive checkpoints are consistent (an RFC 9162 consistency proof, built from the statements
and checked by the RFC's algorithm); every cosignature verifies under its witness's roster key,
and each checkpoint's count of witnesses is reported against the quorum (default: a majority of
the roster). ``--checkpoint`` adds checkpoints held elsewhere (a site's ``log-witness.json``, or
a ``log-evidence/split-view-*.json`` with two): each must be signed by the coordinator and be a
checkpoint of this log. Exit status: 0 everything verifies, 1 something does not (each failure is
one line), 2 a file cannot be read.

``prove``: the RFC 9162 inclusion proof of one statement (by index, or the plan of a round) in
the checkpoint of size S (default: the newest), verified against its signed root.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["FORMAT", "LogExport", "add_arguments", "export_state", "read_export", "run"]

FORMAT = "afl-federation-log/1"


class LogFileError(ValueError):
    """An export or checkpoint file that cannot be read (exit status 2)."""


@dataclass(frozen=True)
class LogExport:
    """An exported federation log (module docstring)."""

    federation: str
    coordinator_key: bytes
    roster: Mapping[str, bytes]
    entries: Sequence[tuple[str, bytes, int]]  # (kind, statement, time ms), in order
    checkpoints: Sequence[tuple[int, bytes, bytes]]  # (size, root, signature), by size
    cosignatures: Sequence[tuple[int, str, bytes, bytes]]  # (size, witness, root, signature)

    def to_json(self) -> dict[str, object]:
        return {
            "format": FORMAT,
            "federation": self.federation,
            "coordinator_public_key": self.coordinator_key.hex(),
            "roster": {s: k.hex() for s, k in sorted(self.roster.items())},
            "entries": [
                {"index": i, "kind": kind, "statement": entry.hex(), "time_unix_ms": stamp}
                for i, (kind, entry, stamp) in enumerate(self.entries)
            ],
            "checkpoints": [
                {"size": size, "root": root.hex(), "signature": sig.hex()}
                for size, root, sig in self.checkpoints
            ],
            "cosignatures": [
                {"size": size, "witness": w, "root": root.hex(), "signature": sig.hex()}
                for size, w, root, sig in self.cosignatures
            ],
        }


def export_state(config_path: Path) -> LogExport:
    """The federation log of the coordinator configured by ``config_path`` (read-only)."""
    from afl.server.config import load_config
    from afl.server.store import Store

    config = load_config(config_path)
    store = Store(config.state_dir, federation_id=config.federation_id, read_only=True)
    try:
        size = store.log_size()
        entries = [(kind, entry, stamp) for _, kind, entry, stamp in store.log_entries(0, size)]
        checkpoints = store.log_checkpoints()
        cosignatures = [
            (s, w, root, sig)
            for s, _, _ in checkpoints
            for w, root, sig in store.log_cosignatures(s)
        ]
    finally:
        store.close()
    return LogExport(
        federation=config.federation_id,
        coordinator_key=config.identity_public_key,
        roster={s: e.identity_public_key for s, e in config.sites.items()},
        entries=entries,
        checkpoints=checkpoints,
        cosignatures=cosignatures,
    )


def read_export(path: Path) -> LogExport:
    """An export written by ``afl log export``; :class:`LogFileError` when it is not one."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        if doc.get("format") != FORMAT:
            raise ValueError(f"format {doc.get('format')!r}, not {FORMAT!r}")
        return LogExport(
            federation=str(doc["federation"]),
            coordinator_key=bytes.fromhex(doc["coordinator_public_key"]),
            roster={str(s): bytes.fromhex(k) for s, k in doc["roster"].items()},
            entries=[
                (str(e["kind"]), bytes.fromhex(e["statement"]), int(e["time_unix_ms"]))
                for e in doc["entries"]
            ],
            checkpoints=[
                (int(c["size"]), bytes.fromhex(c["root"]), bytes.fromhex(c["signature"]))
                for c in doc["checkpoints"]
            ],
            cosignatures=[
                (
                    int(c["size"]),
                    str(c["witness"]),
                    bytes.fromhex(c["root"]),
                    bytes.fromhex(c["signature"]),
                )
                for c in doc["cosignatures"]
            ],
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise LogFileError(f"{path} is not a federation log export ({exc})") from exc


def _checkpoint_files(path: Path) -> list[dict[str, Any]]:
    """The signed checkpoints in a site's log-witness.json or a split-view evidence file."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        found = [doc[k] for k in ("checkpoint", "cosigned", "offered", "last_cosigned") if k in doc]
    except (OSError, ValueError, AttributeError) as exc:
        raise LogFileError(f"{path} cannot be read as JSON ({exc})") from exc
    if not found:
        raise LogFileError(f"{path} holds no signed checkpoint")
    return found


def verify(log: LogExport, *, quorum: int = 0, extra: Sequence[Path] = ()) -> list[str]:
    """Every failure as one line (module docstring, ``verify``); empty when all verifies. Also
    prints one line per checkpoint."""
    from afl.crypto.identity.signatures import load_public_key_raw
    from afl.crypto.transparency.checkpoint import (
        Checkpoint,
        CheckpointError,
        Cosignature,
        SignedCheckpoint,
        verify_checkpoint,
        verify_cosignature,
    )
    from afl.crypto.transparency.merkle import MerkleProofError, leaf_hash, verify_consistency
    from afl.crypto.transparency.statements import StatementError, decode_statement
    from afl.crypto.transparency.tree import MerkleTree

    problems: list[str] = []
    coordinator = load_public_key_raw(log.coordinator_key)
    keys = {s: load_public_key_raw(k) for s, k in log.roster.items()}
    need = quorum or len(keys) // 2 + 1
    tree = MerkleTree(leaf_hash(entry) for _, entry, _ in log.entries)  # O(log² n) a checkpoint
    cosigned: dict[int, list[tuple[str, bytes, bytes]]] = {}
    for c_size, witness, c_root, c_sig in log.cosignatures:
        cosigned.setdefault(c_size, []).append((witness, c_root, c_sig))
    for i, (kind, entry, _) in enumerate(log.entries):
        try:
            decoded, _ = decode_statement(entry, federation=log.federation)
            if decoded != kind:
                problems.append(f"statement {i}: recorded as {kind}, its bytes say {decoded}")
        except StatementError as exc:
            problems.append(f"statement {i}: {exc}")
    previous: Checkpoint | None = None
    for size, root, signature in log.checkpoints:
        try:
            checkpoint = verify_checkpoint(
                coordinator, SignedCheckpoint(Checkpoint(log.federation, size, root), signature)
            )
        except CheckpointError as exc:
            problems.append(str(exc))
            continue
        if size > len(tree) or tree.root(size) != root:
            problems.append(f"checkpoint {checkpoint.describe()} is not a root of these statements")
            continue
        if previous is not None and previous.size > 0:
            try:
                verify_consistency(
                    old_size=previous.size,
                    new_size=size,
                    old_root=previous.root,
                    new_root=root,
                    proof=tree.consistency_proof(previous.size, size),
                )
            except MerkleProofError as exc:
                problems.append(
                    f"checkpoints {previous.describe()} and {checkpoint.describe()}: {exc}"
                )
        previous = checkpoint
        witnesses = set()
        for witness, c_root, c_sig in cosigned.get(size, ()):
            if witness not in keys:
                continue
            try:
                verify_cosignature(
                    keys[witness],
                    Cosignature(witness, Checkpoint(log.federation, size, c_root), c_sig),
                )
            except CheckpointError as exc:
                problems.append(str(exc))
                continue
            if c_root == root:
                witnesses.add(witness)
        mark = "quorum" if len(witnesses) >= need else "below quorum"
        names = ", ".join(sorted(witnesses)) or "none"
        print(
            f"checkpoint size {size} root {root.hex()[:16]}: signed by the coordinator; "
            f"cosigned by {len(witnesses)}/{len(keys)} ({mark} {need}): {names}"
        )
    for path in extra:
        for doc in _checkpoint_files(path):
            try:
                signed = SignedCheckpoint(
                    Checkpoint(
                        str(doc["federation"]), int(doc["size"]), bytes.fromhex(doc["root"])
                    ),
                    bytes.fromhex(doc["signature"]),
                )
                cp = verify_checkpoint(coordinator, signed)
            except (CheckpointError, KeyError, ValueError, TypeError) as exc:
                problems.append(f"{path}: {exc}")
                continue
            if cp.size > len(tree) or tree.root(cp.size) != cp.root:
                problems.append(
                    f"{path}: checkpoint {cp.describe()} is signed by the coordinator but is not "
                    "a checkpoint of this log (a split view)"
                )
            else:
                print(f"{path}: checkpoint {cp.describe()} is a checkpoint of this log")
    return problems


def prove(log: LogExport, *, index: int | None, round_id: str, size: int) -> list[str]:
    """Lines describing the inclusion proof; raises LogFileError when there is nothing to
    prove and ValueError (via MerkleProofError) when it does not verify."""
    from afl.crypto.transparency.merkle import inclusion_proof, leaf_hash, verify_inclusion
    from afl.crypto.transparency.statements import decode_statement

    if index is None:
        for i, (kind, entry, _) in enumerate(log.entries):
            if (
                kind == "plan"
                and decode_statement(entry, federation=log.federation)[1].get("round_id")
                == round_id
            ):
                index = i
                break
        else:
            raise LogFileError(f"the log holds no plan of round {round_id!r}")
    signed = {s: (root, sig) for s, root, sig in log.checkpoints}
    size = size or max(signed, default=0)
    if size not in signed:
        raise LogFileError(f"the export holds no signed checkpoint of size {size}")
    if not 0 <= index < size:
        raise LogFileError(f"statement {index} is not in the checkpoint of size {size}")
    leaves = [leaf_hash(entry) for _, entry, _ in log.entries]
    path = inclusion_proof(leaves[:size], index)
    verify_inclusion(
        leaf=leaves[index], index=index, tree_size=size, proof=path, root=signed[size][0]
    )
    kind, fields = decode_statement(log.entries[index][1], federation=log.federation)
    return [
        f"statement {index} ({kind} {json.dumps(fields, sort_keys=True)})",
        f"is in checkpoint size {size} root {signed[size][0].hex()}",
        f"leaf {leaves[index].hex()}",
        *[f"path {h.hex()}" for h in path],
        "inclusion proof verifies (RFC 9162 §2.1.3.2)",
    ]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the `afl log` subcommands to ``parser``."""
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    p = sub.add_parser("export", help="write the coordinator's federation log to a JSON file")
    p.add_argument("--config", required=True, type=Path, help="the coordinator's server.toml")
    p.add_argument("--out", required=True, type=Path, help="the export file to write")
    p = sub.add_parser("show", help="list the statements, checkpoints and cosigners")
    p.add_argument("file", type=Path, help="an export of `afl log export`")
    p.add_argument("--json", action="store_true", help="print the export as JSON")
    p = sub.add_parser("verify", help="check signatures, roots, consistency and cosignatures")
    p.add_argument("file", type=Path, help="an export of `afl log export`")
    p.add_argument("--quorum", type=int, default=0, help="witness quorum (0: a majority)")
    p.add_argument(
        "--checkpoint",
        type=Path,
        action="append",
        default=[],
        help="a site's log-witness.json or log-evidence file to check against the log",
    )
    p = sub.add_parser("prove", help="the inclusion proof of one statement")
    p.add_argument("file", type=Path, help="an export of `afl log export`")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--index", type=int, help="the statement's index")
    which.add_argument("--round", default="", help="the round whose signed plan to prove")
    p.add_argument("--size", type=int, default=0, help="checkpoint size (default: the newest)")


def run(args: argparse.Namespace) -> int:
    from afl.server.errors import StateError

    try:
        if args.action == "export":
            log = export_state(args.config)
            args.out.write_text(json.dumps(log.to_json(), indent=1) + "\n", encoding="utf-8")
            print(
                f"federation log of {log.federation}: {len(log.entries)} statements, "
                f"{len(log.checkpoints)} checkpoints written to {args.out}"
            )
            return 0
        log = read_export(args.file)
        if args.action == "show":
            return _show(log, as_json=args.json)
        if args.action == "verify":
            problems = verify(log, quorum=args.quorum, extra=args.checkpoint)
            for line in problems:
                print(f"FAILED: {line}")
            if not problems:
                print(f"federation log of {log.federation}: {len(log.entries)} statements verify")
            return 1 if problems else 0
        for line in prove(log, index=args.index, round_id=args.round, size=args.size):
            print(line)
        return 0
    except (LogFileError, StateError) as exc:
        print(f"afl log: error: {exc}")
        return 2
    except ValueError as exc:  # a proof that does not verify
        print(f"afl log: FAILED: {exc}")
        return 1


def _show(log: LogExport, *, as_json: bool) -> int:
    if as_json:
        print(json.dumps(log.to_json(), indent=1))
        return 0
    import time

    from afl.crypto.transparency.statements import StatementError, decode_statement

    print(f"federation {log.federation}: {len(log.entries)} statements")
    for i, (kind, entry, stamp) in enumerate(log.entries):
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(stamp / 1000))
        try:
            fields = decode_statement(entry, federation=log.federation)[1]
            text = " ".join(f"{k}={v}" for k, v in sorted(fields.items()))
        except StatementError as exc:
            text = f"UNREADABLE ({exc})"
        print(f"{i:6d}  {when}  {kind:14s} {text[:160]}")
    for size, root, _ in log.checkpoints:
        cosigners = sorted(w for s, w, r, _ in log.cosignatures if s == size and r == root)
        print(
            f"checkpoint size {size} root {root.hex()[:16]}  cosigned by {', '.join(cosigners) or 'none'}"
        )
    return 0
