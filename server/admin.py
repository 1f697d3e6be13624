"""The Admin service's domain code: the runs of a federation for its operator
(proto/afl/proto/v1/admin.proto, docs/operations.md "Runs and the admin interface").

Transport-free like :class:`~afl.server.coordinator.Coordinator`: the servicer takes the caller's
admin name from its certificate (``afl-admin:<name>``), checks it against server.toml [admins],
and calls these methods; errors are :mod:`afl.server.errors` classes. Every call, read or write,
is an audit record "admin-call" (docs/protocol.md M-161): the admin's name, the RPC, the run and
what went out (the SHA-256 of a model or evaluation, the number of log records and their head).
The change a call makes is recorded with the admin's name in the change's own transaction
("run-submitted" by, "run-finished" reason "aborted by admin NAME"); the "admin-call" record
follows it. A call by a name not listed in [admins] is recorded as "admin-refused".
"""

from __future__ import annotations

import hashlib
import json
import tomllib
from collections.abc import Mapping
from typing import Any

from afl.proto.v1 import admin_pb2 as apb
from afl.proto.v1 import coordinator_pb2 as pb
from afl.server import toml_text
from afl.server.config import settings_table
from afl.server.coordinator import Coordinator
from afl.server.errors import ConfigError, InvalidRequestError, NotPermittedError, WrongStageError
from afl.server.runs import Run

__all__ = ["AdminRequests", "parse_run_settings"]

_MAX_LOG_RECORDS = 1000


def parse_run_settings(text: str) -> dict[str, Any]:
    """The keys of a submitted run: a TOML document holding the keys of a [round] table, at the
    top level or under a [round] header."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise InvalidRequestError(f"the run's settings are not valid TOML: {exc}") from exc
    if set(doc) == {"round"} and isinstance(doc["round"], dict):
        return dict(doc["round"])
    return dict(doc)


class AdminRequests:
    """The Admin RPCs over one :class:`Coordinator` (module docstring)."""

    def __init__(self, coordinator: Coordinator) -> None:
        self.coordinator = coordinator
        self.machine = coordinator.machine

    def require_admin(self, name: str, rpc: str) -> None:
        if name not in self.coordinator.config.admins:
            with self.coordinator.lock:
                self.coordinator.store.audit("admin-refused", {"admin": name, "rpc": rpc})
            raise NotPermittedError(
                f"admin {name!r} is not listed in server.toml [admins] names"
                if self.coordinator.config.admins
                else "server.toml lists no [admins] names: the Admin service is closed"
            )

    def _record(self, admin: str, rpc: str, **detail: object) -> None:
        """The "admin-call" audit record of one call (call with the lock held)."""
        self.coordinator.store.audit("admin-call", {"admin": admin, "rpc": rpc, **detail})

    def _info(self, run: Run) -> apb.RunInfo:
        row, settings = run.row, run.settings
        rounds = self.coordinator.store.rounds(run.run_id)
        model = self.machine.runs.published(run.run_id)
        evaluation = self.machine.runs.published(run.run_id, evaluation=True)
        return apb.RunInfo(
            run_id=row.run_id,
            name=row.name,
            state=row.state,
            reason=row.reason,
            submitted_by=row.submitted_by,
            created_unix_ms=row.created_ms,
            finished_unix_ms=row.finished_ms,
            aggregation=settings.aggregation,
            gram_scope=settings.gram_scope,
            rounds=settings.rounds,
            classes=list(settings.classes),
            dp=settings.dp is not None,
            round_history=[
                apb.RoundSummary(
                    round_id=r.round_id,
                    round_number=r.number,
                    stage=r.stage,  # type: ignore[arg-type]
                    participants=list(r.participants),
                    abort_reason=r.abort_reason,
                )
                for r in rounds
            ],
            model_round_id=model[0] if model else "",
            model_sha256=hashlib.sha256(model[1]).digest() if model else b"",
            settings_toml=toml_text.dumps({"round": settings_table(settings)}),
            evaluation_round_id=evaluation[0] if evaluation else "",
            evaluation_sha256=hashlib.sha256(evaluation[1]).digest() if evaluation else b"",
        )

    def submit(self, admin: str, request: apb.SubmitRunRequest) -> apb.RunInfo:
        self.require_admin(admin, "SubmitRun")
        overrides = parse_run_settings(request.settings_toml)
        with self.coordinator.lock:
            try:
                run = self.machine.submit_run(request.name, overrides, submitted_by=admin)
            except ConfigError as exc:
                raise InvalidRequestError(str(exc)) from exc
            settings = request.settings_toml.encode()
            self._record(
                admin,
                "SubmitRun",
                run_id=run.run_id,
                settings_sha256=hashlib.sha256(settings).hexdigest(),
            )
            return self._info(run)

    def list(self, admin: str) -> apb.RunList:
        self.require_admin(admin, "ListRuns")
        with self.coordinator.lock:
            runs = [self.machine.run(r.run_id) for r in self.coordinator.store.runs()]
            listed = apb.RunList(runs=[self._info(run) for run in runs])
            self._record(admin, "ListRuns", runs=[run.run_id for run in runs])
            return listed

    def get(self, admin: str, run_id: str) -> apb.RunInfo:
        self.require_admin(admin, "GetRun")
        with self.coordinator.lock:
            info = self._info(self.machine.run(run_id))
            self._record(admin, "GetRun", run_id=run_id)
            return info

    def abort(self, admin: str, request: apb.AbortRunRequest) -> apb.RunInfo:
        self.require_admin(admin, "AbortRun")
        with self.coordinator.lock:
            run = self.machine.abort_run(request.run_id, reason=request.reason[:300], by=admin)
            self._record(admin, "AbortRun", run_id=run.run_id, reason=request.reason[:300])
            return self._info(run)

    def logs(self, admin: str, request: apb.LogRequest) -> apb.LogRecords:
        self.require_admin(admin, "GetLogs")
        limit = min(request.limit or _MAX_LOG_RECORDS, _MAX_LOG_RECORDS)
        store = self.coordinator.store
        with self.coordinator.lock:
            wanted = self._run_filter(request.run_id)
            records: list[apb.LogRecord] = []
            after = int(request.after_seq)
            while len(records) < limit:
                batch = store.audit_records(after_seq=after, limit=limit)
                if not batch:
                    break
                for seq, stamp, event, detail, prev, digest in batch:
                    after = seq
                    if wanted is None or _names_run(json.loads(detail), wanted):
                        records.append(
                            apb.LogRecord(
                                seq=seq,
                                time_unix_ms=stamp,
                                event=event,
                                detail_json=detail,
                                prev_hash=prev,
                                hash=digest,
                            )
                        )
                        if len(records) == limit:
                            break
            self._record(
                admin,
                "GetLogs",
                run_id=request.run_id,
                after_seq=int(request.after_seq),
                records=len(records),
                last_seq=records[-1].seq if records else 0,
            )
            anchor = store.anchor()  # the log's count and head, this call's record included
            return apb.LogRecords(
                records=records,
                count=int(str(anchor["audit_count"])),
                head_hash=bytes.fromhex(str(anchor["audit_head"])),
            )

    def _run_filter(self, run_id: str) -> set[str] | None:
        """The run id and its round ids, or None for every record."""
        if not run_id:
            return None
        self.machine.run(run_id)  # WrongStageError for an unknown run
        return {run_id, *(r.round_id for r in self.coordinator.store.rounds(run_id))}

    def _published(self, admin: str, run_id: str, rpc: str) -> tuple[str, bytes, bytes]:
        """(round id, signed bytes, signature) of the run's model or (GetRunEvaluation) its
        evaluation, recorded as sent to ``admin``."""
        self.require_admin(admin, rpc)
        evaluation = rpc == "GetRunEvaluation"
        with self.coordinator.lock:
            self.machine.run(run_id)
            found = self.machine.runs.published(run_id, evaluation=evaluation)
            if found is None:
                raise WrongStageError(
                    f"run {run_id!r} has published no evaluation (its settings need "
                    "evaluate = true)"
                    if evaluation
                    else f"run {run_id!r} has published no model"
                )
            digest = hashlib.sha256(found[1]).hexdigest()
            self._record(admin, rpc, run_id=run_id, round_id=found[0], sha256=digest)
        return found

    def model(self, admin: str, run_id: str) -> pb.SignedModel:
        _, model, signature = self._published(admin, run_id, "GetRunModel")
        return pb.SignedModel(model=model, signature=signature)

    def evaluation(self, admin: str, run_id: str) -> pb.SignedEvaluation:
        _, evaluation, signature = self._published(admin, run_id, "GetRunEvaluation")
        return pb.SignedEvaluation(evaluation=evaluation, signature=signature)


def _names_run(detail: Mapping[str, object], wanted: set[str]) -> bool:
    return detail.get("run_id") in wanted or detail.get("round_id") in wanted
