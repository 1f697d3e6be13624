"""`afl admin`: the operator's command for the runs of a federation (docs/operations.md "Runs and
the admin interface"). It talks to afl-server's Admin service over mutual TLS with an admin kit
(``admins/<name>/admin.toml`` from ``afl provision``).

    afl admin --config admin.toml submit RUN.toml [--name NAME]
    afl admin --config admin.toml ls
    afl admin --config admin.toml status RUN
    afl admin --config admin.toml abort RUN [--reason TEXT]
    afl admin --config admin.toml logs [RUN] [--after SEQ] [--json]
    afl admin --config admin.toml download-model RUN --out FILE
    afl admin --config admin.toml download-evaluation RUN --out DIR

RUN.toml holds the keys of server.toml's [round] table that differ for this run (classes,
aggregation, gram_scope, rounds, [dp] ...; with or without a [round] header). The downloaded
model is the SignedModel as the sites receive it, written only if its signature verifies with the
server identity key of the admin kit; so is a downloaded evaluation (a run with
``evaluate = true``: DIR receives ``<model round>.evaluation.json``, ``.calibration.json`` and
the signed bytes). Exit status: 0 done, 2 a refusal or a connection problem
(one line naming it).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from afl.crypto.errors import CryptoError
from afl.crypto.identity import signatures, signed_blobs
from afl.crypto.identity.pki import write_private_file
from afl.proto.v1 import admin_pb2 as apb
from afl.proto.v1 import admin_pb2_grpc
from afl.proto.v1 import coordinator_pb2 as pb

__all__ = ["AdminKit", "add_arguments", "connect", "load_admin_kit", "run", "sample_notice"]

INSECURE_ADMIN_HEADER = "x-afl-admin"


class AdminError(Exception):
    """A refusal or connection problem, said in one line."""


@dataclass(frozen=True)
class AdminKit:
    name: str
    federation_id: str
    server: str
    server_public_key: bytes
    ca_cert: Path
    cert: Path
    key: Path


def load_admin_kit(path: str | Path) -> AdminKit:
    """Read an admin.toml (paths relative to its folder); :class:`AdminError` names the problem."""
    source = Path(path)
    try:
        doc = tomllib.loads(source.read_text(encoding="utf-8"))
        admin, tls = doc["admin"], doc["tls"]
        base = source.resolve().parent
        return AdminKit(
            name=str(admin["name"]),
            federation_id=str(admin["federation_id"]),
            server=str(admin["server"]),
            server_public_key=bytes.fromhex(str(admin.get("server_public_key", ""))),
            ca_cert=base / str(tls["ca_cert"]),
            cert=base / str(tls["cert"]),
            key=base / str(tls["key"]),
        )
    except OSError as exc:
        raise AdminError(f"cannot read the admin kit {source}: {exc.strerror}") from exc
    except (tomllib.TOMLDecodeError, KeyError, ValueError, TypeError) as exc:
        raise AdminError(f"{source} is not an admin kit (admin.toml): {exc}") from exc


def connect(kit: AdminKit, *, insecure: bool = False) -> tuple[grpc.Channel, tuple[Any, ...]]:
    """A channel to the server's Admin service and the call metadata."""
    if insecure:
        return grpc.insecure_channel(kit.server), ((INSECURE_ADMIN_HEADER, kit.name),)
    try:
        credentials = grpc.ssl_channel_credentials(
            root_certificates=kit.ca_cert.read_bytes(),
            private_key=kit.key.read_bytes(),
            certificate_chain=kit.cert.read_bytes(),
        )
    except OSError as exc:
        raise AdminError(f"cannot read the admin kit's TLS files: {exc}") from exc
    return grpc.secure_channel(kit.server, credentials), ()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the `afl admin` options to ``parser``."""
    parser.add_argument("--config", required=True, help="admin.toml of an admin kit")
    parser.add_argument("--insecure", action="store_true", help="DEVELOPMENT ONLY: no TLS")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds per call")
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    p = sub.add_parser("submit", help="queue a run")
    p.add_argument("settings", help="RUN.toml: the [round] keys of this run")
    p.add_argument("--name", default="", help="a short name for the run")
    sub.add_parser("ls", help="every run with its state and model")
    p = sub.add_parser("status", help="one run with its rounds")
    p.add_argument("run_id")
    p = sub.add_parser("abort", help="abort a queued or active run")
    p.add_argument("run_id")
    p.add_argument("--reason", default="", help="recorded in the audit log")
    p = sub.add_parser("logs", help="audit-log records (of one run)")
    p.add_argument("run_id", nargs="?", default="")
    p.add_argument("--after", type=int, default=0, help="only records after this sequence")
    p.add_argument("--json", action="store_true", help="one JSON object per record")
    p = sub.add_parser("download-model", help="the signed model a run published")
    p.add_argument("run_id")
    p.add_argument("--out", required=True, help="file for the SignedModel bytes")
    p = sub.add_parser("download-evaluation", help="the signed evaluation a run published")
    p.add_argument("run_id")
    p.add_argument("--out", required=True, help="folder for the evaluation and calibration")


def _when(ms: int) -> str:
    if not ms:
        return "-"
    return dt.datetime.fromtimestamp(ms / 1000, dt.UTC).strftime("%Y-%m-%d %H:%M:%S")


def _summary(run: apb.RunInfo) -> str:
    model = (
        f"{run.model_round_id} sha256:{run.model_sha256.hex()[:16]}" if run.model_round_id else "-"
    )
    reason = f"  ({run.reason})" if run.reason else ""
    return (
        f"{run.run_id:<8} {run.state:<9} {run.aggregation:<9} {run.gram_scope:<9} "
        f"rounds={run.rounds} {run.name!r:<16} model={model}{reason}"
        + (f" evaluation={run.evaluation_round_id}" if run.evaluation_round_id else "")
    )


def _status(run: apb.RunInfo) -> str:
    lines = [
        _summary(run),
        f"  submitted by {run.submitted_by} at {_when(run.created_unix_ms)}, finished "
        f"{_when(run.finished_unix_ms)}; classes {', '.join(run.classes)}; dp {run.dp}",
    ]
    for r in run.round_history:
        stage = pb.RoundStage.Name(r.stage).removeprefix("ROUND_STAGE_")
        why = f": {r.abort_reason}" if r.abort_reason else ""
        lines.append(
            f"  round {r.round_number} {r.round_id} {stage} ({len(r.participants)} sites){why}"
        )
    return "\n".join(lines)


def _verified_model(kit: AdminKit, signed: pb.SignedModel) -> pb.Model:
    try:
        key = signatures.load_public_key_raw(kit.server_public_key)
        signed_blobs.verify_blob(
            key, context=signed_blobs.MODEL_CONTEXT, blob=signed.model, signature=signed.signature
        )
    except CryptoError as exc:
        raise AdminError("the model is not signed by the server identity key of the kit") from exc
    model = pb.Model.FromString(signed.model)
    if model.federation_id != kit.federation_id:
        raise AdminError(f"the model belongs to federation {model.federation_id!r}")
    return model


def _act(args: argparse.Namespace, kit: AdminKit, stub: Any, metadata: tuple[Any, ...]) -> None:
    call: dict[str, Any] = {"timeout": args.timeout, "metadata": metadata or None}
    if args.action == "submit":
        try:
            text = Path(args.settings).read_text(encoding="utf-8")
        except OSError as exc:
            raise AdminError(f"cannot read {args.settings}: {exc.strerror}") from exc
        run = stub.SubmitRun(apb.SubmitRunRequest(name=args.name, settings_toml=text), **call)
        print(f"submitted {run.run_id} ({run.state})")
    elif args.action == "ls":
        runs = stub.ListRuns(apb.ListRunsRequest(), **call).runs
        print("\n".join(_summary(r) for r in runs) if runs else "no runs")
    elif args.action == "status":
        print(_status(stub.GetRun(apb.RunRef(run_id=args.run_id), **call)))
    elif args.action == "abort":
        run = stub.AbortRun(apb.AbortRunRequest(run_id=args.run_id, reason=args.reason), **call)
        print(f"{run.run_id} {run.state}: {run.reason}")
    elif args.action == "logs":
        reply = stub.GetLogs(apb.LogRequest(run_id=args.run_id, after_seq=args.after), **call)
        for r in reply.records:
            if args.json:
                print(json.dumps({"seq": r.seq, "time_ms": r.time_unix_ms, "event": r.event,
                                  "detail": json.loads(r.detail_json), "hash": r.hash.hex()}))  # fmt: skip
            else:
                print(f"{r.seq:>6} {_when(r.time_unix_ms)} {r.event:<22} {r.detail_json}")
        print(f"log head {reply.head_hash.hex()} count {reply.count}", file=sys.stderr)
    elif args.action == "download-model":
        signed = stub.GetRunModel(apb.RunRef(run_id=args.run_id), **call)
        model = _verified_model(kit, signed)
        write_private_file(Path(args.out), signed.SerializeToString(), mode=0o644)
        print(
            f"wrote {args.out}: round {model.round_id}, {len(model.class_names)} classes, "
            f"signature verified"
        )
    elif args.action == "download-evaluation":
        # On demand: the other actions need none of the client's evaluation code.
        from afl.client.daemon.evaluation import save_evaluation
        from afl.client.daemon.verify import VerificationError, verify_evaluation

        signed_eval = stub.GetRunEvaluation(apb.RunRef(run_id=args.run_id), **call)
        try:
            key = signatures.load_public_key_raw(kit.server_public_key)
            evaluation = verify_evaluation(
                signed_eval, server_key=key, federation_id=kit.federation_id
            )
        except (CryptoError, VerificationError) as exc:
            raise AdminError(
                f"the evaluation does not verify with the kit's server key: {exc}"
            ) from exc
        files = save_evaluation(signed_eval, evaluation, Path(args.out))
        print(
            f"wrote {', '.join(sorted(files.values()))}: model {evaluation.model_round_id}, "
            f"{len(evaluation.members)} sites, signature verified"
        )
        print(sample_notice(json.loads(evaluation.evaluation_json or b"{}")))


def sample_notice(document: dict[str, Any]) -> str:
    """Which images a signed evaluation's figures come from, in words a reader cannot miss: the
    members that scored their training images (``in_sample``, from their signed acceptances,
    docs/protocol.md §6.1), or that every member scored held-out images, or that it is not
    known for every member."""
    flags = document.get("in_sample")
    flags = flags if isinstance(flags, dict) else {}
    inside = sorted(str(s) for s, v in flags.items() if v)
    members = [str(m) for m in document.get("members") or []]
    if inside:
        return (
            f"IN-SAMPLE FIGURES at {', '.join(inside)}: computed on the images the model was "
            "trained on; optimistic, NOT a measure of performance on new patients"
        )
    if members and all(m in flags for m in members):
        return "out-of-sample: every member scored held-out images ([data] holdout)"
    return (
        "NOT SHOWN TO BE OUT-OF-SAMPLE: the evaluation does not say for every member which "
        "images it scored"
    )


def run(args: argparse.Namespace) -> int:
    """Run one admin action; returns the exit code."""
    try:
        kit = load_admin_kit(args.config)
        channel, metadata = connect(kit, insecure=args.insecure)
        with channel:
            _act(args, kit, admin_pb2_grpc.AdminStub(channel), metadata)
    except AdminError as exc:
        print(f"afl admin: {exc}", file=sys.stderr)
        return 2
    except grpc.RpcError as exc:
        code = exc.code() if callable(getattr(exc, "code", None)) else None
        details = exc.details() if callable(getattr(exc, "details", None)) else str(exc)
        name = code.name if code is not None else "ERROR"
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            details = f"cannot reach the server at {kit.server}: {details}"
        print(f"afl admin: {name}: {details}", file=sys.stderr)
        return 2
    return 0
