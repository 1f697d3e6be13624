"""The audit bundle of a coordinator's state (docs/protocol.md §11, M-164; docs/compliance.md
"Access, audit and evidence"): what an external auditor verifies offline to answer "which
statistics were released to whom, in each run, and nothing else".

A bundle is a folder written by :func:`export_bundle` from the coordinator's state directory:

    manifest.json        federation id, the coordinator's identity public key, the roster's site
                         keys and roles, the runs exported, the audit anchor (count, head) and the
                         SHA-256 of every other file of the bundle
    manifest.sig         Ed25519 signature of manifest.json by the coordinator's identity key,
                         context "audit-export"
    audit.jsonl          the whole hash-chained audit log (:func:`afl.ops.verify_log.export_jsonl`)
    runs/<run>/run.json  the run's row (name, state, reason, submitter, settings)
    runs/<run>/<round>/plan.pb          the SignedReleasePlan as the sites received it
    runs/<run>/<round>/consents/<site>.pb  each site's signed PlanDecision (its consent)
    runs/<run>/<round>/evidence.json    what the payload purge kept of the protocol messages
                                        (digests; signed statements and public keys whole)
    runs/<run>/<round>/model.pb | evaluation.pb   the SignedModel / SignedEvaluation published

:func:`verify_bundle` checks, with nothing but the bundle (and, to pin it, the coordinator's key):
the manifest's signature, every file against the manifest (none added, none missing), the audit
chain through the anchored head (:func:`afl.ops.verify_log.verify_chain`), every plan, model and
evaluation signature, and every consent against its site's key and its round's plan. It then lists
per run and round exactly which releases were decoded (release name, digest of the decoded values,
contributors: records "sums-decoded", "mask-withheld", "ckks-decryption"), who received the model
or evaluation (records "model-read", "evaluation-read", admin "GetRunModel"/"GetRunEvaluation"),
who was refused, and what was deleted ("payloads-deleted"). Statistics are never in a bundle:
payloads, masked or encrypted sums and decoded values are not exported, only their digests.
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from afl.crypto.errors import CryptoError
from afl.crypto.identity.signed_blobs import (
    EVALUATION_CONTEXT,
    MODEL_CONTEXT,
    PLAN_CONTEXT,
    sign_blob,
    verify_blob,
    verify_plan_decision,
)
from afl.ops.verify_log import LogFormatError, LogRecord, export_jsonl, read_jsonl, verify_chain
from afl.proto.v1 import common_pb2 as cpb
from afl.proto.v1 import coordinator_pb2 as pb

__all__ = [
    "BUNDLE_CONTEXT",
    "BUNDLE_FORMAT",
    "BundleError",
    "BundleReport",
    "export_bundle",
    "verify_bundle",
]

#: Signature context of manifest.json.
BUNDLE_CONTEXT = "audit-export"
BUNDLE_FORMAT = "afl-audit-bundle/1"
MANIFEST, SIGNATURE, AUDIT = "manifest.json", "manifest.sig", "audit.jsonl"
#: Audit events that name what was decoded or decrypted, and who received what.
_READS = {"model-read": "model", "evaluation-read": "evaluation"}
_ADMIN_READS = {"GetRunModel": "model", "GetRunEvaluation": "evaluation"}


class BundleError(ValueError):
    """The state cannot be exported, or the bundle cannot be read (not tampering: unreadable)."""


# --- export --------------------------------------------------------------------------------------


def _rows(db: sqlite3.Connection, query: str, *params: object) -> list[tuple[Any, ...]]:
    return [tuple(r) for r in db.execute(query, params).fetchall()]


def _has_table(db: sqlite3.Connection, name: str) -> bool:
    found = db.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name=?", (name,))
    return found.fetchone() is not None


def _write(root: Path, relative: str, data: bytes, files: dict[str, str]) -> None:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    files[relative] = hashlib.sha256(data).hexdigest()


def export_bundle(
    state_dir: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    identity_key: Ed25519PrivateKey,
    sites: Mapping[str, tuple[bytes, str]],
    run_id: str = "",
) -> dict[str, Any]:
    """Write the bundle of ``run_id`` (every run when "") from ``state_dir`` into the new folder
    ``out``, signed with the coordinator's ``identity_key``; ``sites`` maps each roster site to
    (identity public key, role). Returns the manifest. :class:`BundleError` names a problem."""
    state, root = Path(state_dir), Path(out)
    database = state / "server.sqlite3"
    if not database.is_file():
        raise BundleError(f"{database} does not exist: not a coordinator state directory")
    if root.exists() and any(root.iterdir()):
        raise BundleError(f"{root} is not empty: export into a new folder")
    db = sqlite3.connect(database.resolve().as_uri() + "?mode=ro", uri=True)
    try:
        return _export(db, state, root, identity_key, sites, run_id)
    except sqlite3.Error as exc:
        raise BundleError(f"{database}: not a readable afl-server state ({exc})") from exc
    finally:
        db.close()


def _export(
    db: sqlite3.Connection,
    state: Path,
    root: Path,
    key: Ed25519PrivateKey,
    sites: Mapping[str, tuple[bytes, str]],
    run_id: str,
) -> dict[str, Any]:
    federation = dict(_rows(db, "SELECT key, value FROM meta")).get("federation_id", "")
    runs = _rows(
        db,
        "SELECT run_id, name, settings, state, reason, submitted_by, created_ms, finished_ms "
        "FROM runs ORDER BY ordinal",
    )
    if run_id:
        runs = [r for r in runs if r[0] == run_id]
        if not runs:
            raise BundleError(f"no run {run_id!r} in {state}")
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    files: dict[str, str] = {}
    with_evidence = _has_table(db, "evidence")
    signed_decisions = "signed" in {r[1] for r in db.execute("PRAGMA table_info(decisions)")}
    for run, name, settings, run_state, reason, by, created, finished in runs:
        doc = {
            "run_id": run,
            "name": name,
            "state": run_state,
            "reason": reason,
            "submitted_by": by,
            "created_unix_ms": created,
            "finished_unix_ms": finished,
            "settings": json.loads(settings),
        }
        _write(root, f"runs/{run}/run.json", _json(doc), files)
        for round_id, plan, plan_sig in _rows(
            db,
            "SELECT round_id, plan, plan_signature FROM rounds WHERE run_id = ? ORDER BY ordinal",
            run,
        ):
            base = f"runs/{run}/{round_id}"
            if plan is not None:
                signed = cpb.SignedReleasePlan(plan=bytes(plan), signature=bytes(plan_sig))
                _write(root, f"{base}/plan.pb", signed.SerializeToString(), files)
            if signed_decisions:
                for site, decision in _rows(
                    db,
                    "SELECT site_id, signed FROM decisions WHERE round_id = ? AND signed IS NOT "
                    "NULL ORDER BY site_id",
                    round_id,
                ):
                    _write(root, f"{base}/consents/{site}.pb", bytes(decision), files)
            for table, file_name, message in (
                ("models", "model.pb", pb.SignedModel),
                ("evaluations", "evaluation.pb", pb.SignedEvaluation),
            ):
                for blob, signature in _rows(
                    db, f"SELECT {table[:-1]}, signature FROM {table} WHERE round_id = ?", round_id
                ):
                    fields = {table[:-1]: bytes(blob), "signature": bytes(signature)}
                    _write(
                        root, f"{base}/{file_name}", message(**fields).SerializeToString(), files
                    )
            if with_evidence:
                kept = [
                    {
                        "stage": pb.RoundStage.Name(int(stage)),  # type: ignore[arg-type]
                        "site_id": site,
                        "kind": kind,
                        "sha256": bytes(digest).hex(),
                        **({} if data is None else {"data": bytes(data).hex()}),
                    }
                    for stage, site, kind, digest, data in _rows(
                        db,
                        "SELECT stage, site_id, kind, sha256, data FROM evidence WHERE "
                        "round_id = ? ORDER BY seq",
                        round_id,
                    )
                ]
                if kept:
                    _write(root, f"{base}/evidence.json", _json(kept), files)
    records = [
        LogRecord(int(r[0]), int(r[1]), str(r[2]), str(r[3]), bytes(r[4]), bytes(r[5]))
        for r in _rows(
            db, "SELECT seq, time_ms, event, detail, prev_hash, hash FROM audit_log ORDER BY seq"
        )
    ]
    export_jsonl(records, root / AUDIT)
    files[AUDIT] = hashlib.sha256((root / AUDIT).read_bytes()).hexdigest()
    manifest = {
        "format": BUNDLE_FORMAT,
        "federation_id": federation,
        "server_identity_public_key": key.public_key().public_bytes_raw().hex(),
        "sites": {
            s: {"identity_public_key": k.hex(), "role": role} for s, (k, role) in sites.items()
        },
        "runs": [r[0] for r in runs],
        "audit": {
            "count": len(records),
            "head": (records[-1].hash if records else b"\x00" * 32).hex(),
        },
        "files": dict(sorted(files.items())),
    }
    text = _json(manifest)
    (root / MANIFEST).write_bytes(text)
    (root / SIGNATURE).write_bytes(sign_blob(key, context=BUNDLE_CONTEXT, blob=text))
    return manifest


def _json(doc: object) -> bytes:
    return (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode()


# --- verification --------------------------------------------------------------------------------


@dataclass
class BundleReport:
    """The outcome of :func:`verify_bundle`: ``problems`` (empty: the bundle verifies) and, per
    run, what was decoded, who received what and what was deleted."""

    problems: list[str] = field(default_factory=list)
    federation_id: str = ""
    server_key: str = ""
    runs: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, object]:
        return {
            "ok": self.ok,
            "problems": self.problems,
            "federation_id": self.federation_id,
            "server_identity_public_key": self.server_key,
            "runs": self.runs,
        }


def _load_manifest(root: Path) -> tuple[bytes, dict[str, Any], bytes]:
    try:
        text = (root / MANIFEST).read_bytes()
        signature = (root / SIGNATURE).read_bytes()
    except OSError as exc:
        raise BundleError(f"{root}: not an audit bundle ({exc.strerror}: {exc.filename})") from exc
    try:
        manifest = json.loads(text)
        if manifest.get("format") != BUNDLE_FORMAT:
            raise ValueError(f"format {manifest.get('format')!r}, expected {BUNDLE_FORMAT!r}")
        bytes.fromhex(manifest["server_identity_public_key"])
        dict(manifest["files"]), dict(manifest["sites"]), list(manifest["runs"])
        int(manifest["audit"]["count"]), bytes.fromhex(manifest["audit"]["head"])
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise BundleError(f"{root / MANIFEST} is malformed ({exc})") from exc
    return text, manifest, signature


def verify_bundle(
    bundle: str | os.PathLike[str], *, server_key: bytes | None = None
) -> BundleReport:
    """Verify the bundle folder (module docstring). ``server_key``: the coordinator's identity
    public key as the auditor knows it (the federation's roster); without it, the manifest's key
    is used and must be compared by hand. :class:`BundleError` when it cannot be read at all."""
    root = Path(bundle)
    text, manifest, signature = _load_manifest(root)
    report = BundleReport(
        federation_id=str(manifest["federation_id"]),
        server_key=str(manifest["server_identity_public_key"]),
    )
    key = bytes.fromhex(report.server_key)
    if server_key is not None and server_key != key:
        report.problems.append(
            "the bundle names another coordinator key than the one given (--server-key)"
        )
    try:
        verify_blob(key, context=BUNDLE_CONTEXT, blob=text, signature=signature)
    except CryptoError:
        report.problems.append("manifest.json: the coordinator's signature does not verify")
    files: dict[str, str] = manifest["files"]
    present = {
        str(p.relative_to(root))
        for p in root.rglob("*")
        if p.is_file() and p.name not in (MANIFEST, SIGNATURE)
    }
    for extra in sorted(present - set(files)):
        report.problems.append(f"{extra}: a file the manifest does not list")
    for name, digest in sorted(files.items()):
        path = root / name
        if not path.is_file():
            report.problems.append(f"{name}: listed in the manifest but missing")
        elif hashlib.sha256(path.read_bytes()).hexdigest() != digest:
            report.problems.append(f"{name}: its SHA-256 differs from the manifest's")
    records = _audit(root, manifest, report)
    sites = {s: bytes.fromhex(v["identity_public_key"]) for s, v in manifest["sites"].items()}
    for run_id in manifest["runs"]:
        report.runs[run_id] = _run(root / "runs" / run_id, key, sites, report.problems)
    _attribute(records, report.runs)
    return report


def _audit(root: Path, manifest: Mapping[str, Any], report: BundleReport) -> list[LogRecord]:
    try:
        records = read_jsonl(root / AUDIT)
    except LogFormatError as exc:
        report.problems.append(f"{AUDIT}: {exc}")
        return []
    anchor = manifest["audit"]
    chain = verify_chain(
        records, expect_head=bytes.fromhex(anchor["head"]), expect_count=int(anchor["count"])
    )
    if chain.problem is not None:
        p = chain.problem
        report.problems.append(f"{AUDIT}: {p.kind} at record {p.position}: {p.message}")
    elif chain.records != int(anchor["count"]):
        report.problems.append(
            f"{AUDIT}: {chain.records} records, the manifest says {anchor['count']}"
        )
    return records


def _verify(problems: list[str], what: str, check: Any, *args: Any, **kwargs: Any) -> bool:
    try:
        check(*args, **kwargs)
    except CryptoError:
        problems.append(f"{what}: the signature does not verify")
        return False
    return True


def _run(
    folder: Path, key: bytes, sites: Mapping[str, bytes], problems: list[str]
) -> dict[str, Any]:
    run_id = folder.name
    try:
        info = json.loads((folder / "run.json").read_bytes())
    except (OSError, ValueError) as exc:
        problems.append(f"runs/{run_id}/run.json: unreadable ({exc})")
        info = {}
    rounds: dict[str, dict[str, Any]] = {}
    for round_dir in sorted(p for p in folder.iterdir() if p.is_dir()) if folder.is_dir() else []:
        rounds[round_dir.name] = _round(round_dir, key, sites, problems)
    return {
        "state": info.get("state", ""),
        "name": info.get("name", ""),
        "submitted_by": info.get("submitted_by", ""),
        "rounds": rounds,
        "recipients": [],
        "refused": [],
        "deletions": [],
    }


def _round(
    folder: Path, key: bytes, sites: Mapping[str, bytes], problems: list[str]
) -> dict[str, Any]:
    round_id, where = folder.name, f"{folder.parent.name}/{folder.name}"
    out: dict[str, Any] = {
        "participants": [],
        "planned_releases": [],
        "consents": {},
        "decoded": [],
        "withheld": {},
        "model_sha256": "",
        "evaluation_sha256": "",
    }
    plan_bytes = b""
    if (folder / "plan.pb").is_file():
        signed = cpb.SignedReleasePlan.FromString((folder / "plan.pb").read_bytes())
        plan_bytes = signed.plan
        if _verify(
            problems,
            f"{where}/plan.pb",
            verify_blob,
            key,
            context=PLAN_CONTEXT,
            blob=signed.plan,
            signature=signed.signature,
        ):
            plan = cpb.ReleasePlan.FromString(signed.plan)
            if plan.round_id != round_id:
                problems.append(f"{where}/plan.pb: the plan is of round {plan.round_id!r}")
            out["participants"] = list(plan.participants)
            out["planned_releases"] = [r.name for r in plan.releases]
    consents = folder / "consents"
    for path in sorted(consents.iterdir()) if consents.is_dir() else []:
        site = path.stem
        decision = pb.PlanDecision.FromString(path.read_bytes())
        what = f"{where}/consents/{path.name}"
        if site not in sites:
            problems.append(f"{what}: {site!r} is not in the roster")
            continue
        if (
            decision.round_id != round_id
            or decision.plan_sha256 != hashlib.sha256(plan_bytes).digest()
        ):
            problems.append(f"{what}: the decision names another round or plan")
            continue
        if _verify(
            problems,
            what,
            verify_plan_decision,
            sites[site],
            decision.signature,
            round_id=decision.round_id,
            accept=decision.accept,
            plan_sha256=decision.plan_sha256,
            graph_commitment=decision.graph_commitment,
            evaluation_rows=decision.evaluation_rows,
        ):
            out["consents"][site] = "accepted" if decision.accept else "refused"
    for name, message, context, attr in (
        ("model.pb", pb.SignedModel, MODEL_CONTEXT, "model"),
        ("evaluation.pb", pb.SignedEvaluation, EVALUATION_CONTEXT, "evaluation"),
    ):
        if (folder / name).is_file():
            signed_blob = message.FromString((folder / name).read_bytes())
            blob = getattr(signed_blob, attr)
            if _verify(
                problems,
                f"{where}/{name}",
                verify_blob,
                key,
                context=context,
                blob=blob,
                signature=signed_blob.signature,
            ):
                out[f"{attr}_sha256"] = hashlib.sha256(blob).hexdigest()
    return out


def _attribute(records: list[LogRecord], runs: dict[str, dict[str, Any]]) -> None:
    """Fill each run's decoded releases, recipients, refusals and deletions from the audit
    records (each record is attributed through its round or run id)."""
    round_run = {r: run for run, doc in runs.items() for r in doc["rounds"]}
    for record in records:
        try:
            detail = json.loads(record.detail)
        except ValueError:
            continue
        if not isinstance(detail, dict):
            continue
        round_id = str(detail.get("round_id", ""))
        run_id = round_run.get(round_id) or str(detail.get("run_id", ""))
        if run_id not in runs:
            continue
        run, at = runs[run_id], record.time_ms
        rnd = run["rounds"].get(round_id)
        event = record.event
        if event == "sums-decoded" and rnd is not None:
            for release in detail.get("releases", []):
                rnd["decoded"].append(
                    {**release, "contributors": detail.get("contributors", []), "at_ms": at}
                )
        elif event == "mask-withheld" and rnd is not None:
            rnd["withheld"] = detail.get("withheld", {})
            contributors = detail.get("contributors", {})
            for release in detail.get("decoded", []):
                who = contributors.get(release.get("release"), [])
                rnd["decoded"].append({**release, "contributors": who, "at_ms": at})
        elif event == "ckks-decryption" and rnd is not None:
            if detail.get("status") == "DECRYPTION_STATUS_DECRYPTED":
                rnd["decoded"].append(
                    {
                        "release": detail.get("release", ""),
                        "sha256": detail.get("result_sha256", ""),
                        "contributors": detail.get("members", []),
                        "at_ms": at,
                    }
                )
        elif event in _READS:
            run["recipients"].append(
                {
                    "who": detail.get("site_id", ""),
                    "role": "site",
                    "what": "candidate" if detail.get("candidate") else _READS[event],
                    "round_id": round_id,
                    "sha256": detail.get("sha256", ""),
                    "at_ms": at,
                }
            )
        elif event == "admin-call" and detail.get("rpc") in _ADMIN_READS:
            run["recipients"].append(
                {
                    "who": detail.get("admin", ""),
                    "role": "admin",
                    "what": _ADMIN_READS[str(detail["rpc"])],
                    "round_id": round_id,
                    "sha256": detail.get("sha256", ""),
                    "at_ms": at,
                }
            )
        elif event == "read-refused":
            run["refused"].append(
                {"who": detail.get("site_id", ""), "what": detail.get("what", ""), "at_ms": at}
            )
        elif event == "payloads-deleted":
            run["deletions"].append(
                {
                    "payloads": detail.get("payloads", []),
                    "messages": detail.get("messages", []),
                    "at_ms": at,
                }
            )
