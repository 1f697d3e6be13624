"""The coordinator's runs and their round state machine (docs/architecture.md §2).

A federation hosts many RUNS, one after another: each has its own settings (the keys of
server.toml's [round] table) and its own aggregation mode instance. The server creates the first
run from server.toml at its first start; later runs are submitted by an admin
(:meth:`RoundMachine.submit_run`) and queue. The oldest queued run becomes ACTIVE when no run is;
it ends PUBLISHED (its final round's model is stored) or ABORTED (a round aborted without a
replacement, or an admin aborted it), and the next queued run starts.

Rounds of the active run:

    WAITING_FOR_PARTICIPANTS --the run's expected sites enrolled (sites whose declared backbone or
        d differ from the run's are left out, with a note), or >= min_participants at the enrol
        deadline--> PLAN_REVIEW (signed plan published)
    PLAN_REVIEW --every participant accepted--> the mode's exchange stages (mode.begin)
        plaintext, ckks: UPLOAD;  mask: ADVERTISE_KEYS, SHARE_KEYS, UPLOAD, CONSISTENCY_CHECK, UNMASK
    exchange stages --mode.drive--> SOLVING --mode.sums available, solved--> PUBLISHED
    PUBLISHED (round 1, rounds = 2) --> round 2 opens in PLAN_REVIEW (same participants)
    PUBLISHED (final round, evaluate = true) --> the evaluation round (number rounds + 1) opens
        in PLAN_REVIEW over the model's contributors; its SOLVING publishes the signed
        evaluation instead of a model (:mod:`afl.server.solve.evaluation`)
    SOLVING (final round, [round.gate]) --> VALIDATING (the model signed as a candidate, not
        published) and the evaluation round scores the candidate; its SOLVING decides the gate
        (:mod:`afl.server.solve.gate`): the final round ends PUBLISHED (the model signed and
        stored) or ABORTED, and the run PUBLISHED or FAILED with the gate's reason

A refusal of the plan ABORTS the round and, when at least ``min_participants`` sites remain,
opens a replacement round with them and a new plan; at the plan deadline, sites that never
answered are dropped the same way (the replacement round has the sites that accepted); an
exchange stage's deadline is the mode's to handle. A failed solve aborts the round with the
reason. Every transition is committed to the :class:`~afl.server.store.Store` first, then logged
to the audit log, then announced as a round event, so a restarted coordinator resumes the open
round; the secure modes rebuild their state from the store's message journal.

The round's :class:`~afl.server.modes.base.AggregationMode` never changes stages itself: it returns a
:class:`~afl.server.modes.base.Transition` that :meth:`RoundMachine.apply` carries out. The machine is
the modes' :class:`~afl.server.modes.base.RoundContext`. Call every method with :attr:`lock` held.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from numpy.typing import NDArray

from afl.core.aggregation import AggregationError
from afl.core.row_bounds import RowBounds
from afl.crypto.identity.signed_blobs import CANDIDATE_CONTEXT, MODEL_CONTEXT, sign_blob
from afl.proto.v1 import common_pb2 as cpb
from afl.proto.v1 import coordinator_pb2 as pb
from afl.proto.wire import stage_name
from afl.server.config import (
    RoundSettings,
    ServerConfig,
    merged_run_table,
    run_settings,
    settings_table,
)
from afl.server.daemon.observability import ServerMetrics
from afl.server.errors import NotPermittedError, WrongStageError
from afl.server.modes.base import AggregationMode, ModeEnvironment, Transition
from afl.server.modes.ckks_context import CkksContexts
from afl.server.modes.registry import mode_for
from afl.server.plan.dp import apply_dp, audit_dp_plan, calibrate, dp_releases
from afl.server.plan.history import (
    ReleasedRound,
    history_exposures,
    history_refusal,
    released_history,
)
from afl.server.plan.release import (
    PlannedRelease,
    RoundView,
    audit_plan,
    build_plan,
    releases_from_plan,
    round1_releases,
    round2_releases,
    sign_plan,
)
from afl.server.solve.dp import solve_dp_run
from afl.server.solve.evaluation import (
    build_signed_evaluation,
    earlier_evaluations,
    evaluation_releases,
    evaluation_result,
    published_detail,
)
from afl.server.solve.gate import GateVerdict, gate_verdict
from afl.server.solve.model import (
    SOLVE_ERRORS,
    build_signed_model,
    require_finite,
    solve_round_one,
    solve_round_two,
)
from afl.server.store import (
    ENDED_RUN_STATES,
    EnrolmentRow,
    MessageRow,
    RoundRow,
    RunRow,
    Store,
    UploadRow,
)

__all__ = ["RoundMachine", "RoundView", "Run", "Stage"]

log = logging.getLogger("afl.server.rounds")
_DAY_MS = 86_400_000


class Stage:
    """RoundStage values every round shares (the modes add their exchange stages)."""

    WAITING = pb.ROUND_STAGE_WAITING_FOR_PARTICIPANTS
    PLAN_REVIEW = pb.ROUND_STAGE_PLAN_REVIEW
    UPLOAD = pb.ROUND_STAGE_UPLOAD
    SOLVING = pb.ROUND_STAGE_SOLVING
    PUBLISHED = pb.ROUND_STAGE_PUBLISHED
    ABORTED = pb.ROUND_STAGE_ABORTED
    VALIDATING = pb.ROUND_STAGE_VALIDATING
    FINAL = (pb.ROUND_STAGE_PUBLISHED, pb.ROUND_STAGE_ABORTED)


@dataclass
class Run:
    """A run: its stored row, its validated settings and its aggregation mode."""

    row: RunRow
    settings: RoundSettings
    mode: AggregationMode

    @property
    def run_id(self) -> str:
        return self.row.run_id


#: Statistic kinds that are a function of a site's data alone, so every run releases the same
#: per-site values (round 2's pseudo-label vectors depend on the run's model, evaluations on theirs).
_DATA_KINDS = frozenset({cpb.STATISTIC_KIND_GRAM, cpb.STATISTIC_KIND_CLASS_VECTOR})


class RoundMachine:
    """Runs and the transitions of their rounds; :class:`afl.server.coordinator.Coordinator`
    adds the requests."""

    def __init__(
        self,
        config: ServerConfig,
        store: Store,
        identity_key: Ed25519PrivateKey,
        *,
        metrics: ServerMetrics,
        ckks_contexts: CkksContexts | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config, self.store, self._key = config, store, identity_key
        self.metrics, self.clock = metrics, clock
        self.ckks_contexts = ckks_contexts or CkksContexts.from_config(config)
        self.lock = threading.Condition()
        self.events: list[pb.RoundEvent] = []
        self.notes: dict[str, str] = {}  # site -> why it takes no part in the current round
        self._runs: dict[str, Run] = {}
        self._next_purge_ms = 0
        with self.lock:
            self._bootstrap()
            self._activate_next()

    # --- RoundContext (what modes read and journal) -------------------------------------------

    def now_ms(self) -> int:
        return int(self.clock() * 1000)

    def decisions(self, round_id: str) -> dict[str, tuple[bool, str]]:
        return self.store.decisions(round_id)

    def uploads(self, round_id: str) -> dict[tuple[str, str], UploadRow]:
        return self.store.uploads(round_id)

    def site_uploads(self, round_id: str, site_id: str) -> dict[str, UploadRow]:
        return self.store.site_uploads(round_id, site_id)

    def read_payload(self, row: UploadRow) -> bytes:
        return self.store.read_payload(row)

    def put_message(
        self, round_id: str, *, stage: int, site_id: str, kind: str, data: bytes
    ) -> None:
        self.store.put_message(round_id, stage=stage, site_id=site_id, kind=kind, data=data)

    def messages(self, round_id: str) -> list[MessageRow]:
        return self.store.messages(round_id)

    def row_bounds(self, site_id: str) -> RowBounds | None:
        enrolment = self.store.enrolment(site_id)
        return None if enrolment is None else enrolment.row_bounds

    # --- runs --------------------------------------------------------------------------------

    def _bootstrap(self) -> None:
        """The first start creates the run of server.toml's [round] (and gives it the rounds of
        a state folder written before runs existed)."""
        if self.store.runs():
            return
        legacy = bool(self.store.rounds())
        table = settings_table(self.config.round)
        run_id = self._submit("initial", table, submitted_by="server.toml")
        if legacy:
            self.store.attach_rounds(run_id)
            self.store.update_run(run_id, state="active")
            self._settle(run_id)

    def run(self, run_id: str) -> Run:
        """A run with its settings and mode (built once per process)."""
        cached = self._runs.get(run_id)
        rows = {r.run_id: r for r in self.store.runs()}
        if run_id not in rows:
            raise WrongStageError(f"no run {run_id!r} on this server")
        row = rows[run_id]
        if cached is not None:
            cached.row = row
            return cached
        settings = run_settings(row.settings, source=f"run {run_id}", sites=self.config.sites)
        env = ModeEnvironment(self.config, settings, self.ckks_contexts)
        run = self._runs[run_id] = Run(row, settings, mode_for(env))
        return run

    def run_of(self, view: RoundView) -> Run:
        return self.run(view.row.run_id)

    def mode_of(self, view: RoundView) -> AggregationMode:
        return self.run_of(view).mode

    def active_run(self) -> Run | None:
        active = [r for r in self.store.runs() if r.state == "active"]
        return self.run(active[0].run_id) if active else None

    def _submit(self, name: str, table: Mapping[str, Any], *, submitted_by: str) -> str:
        settings = run_settings(table, source=f"run {name!r}", sites=self.config.sites)
        number = len(self.store.runs()) + 1
        run_id = f"run-{number}"
        self.store.create_run(
            run_id=run_id, name=name or run_id, settings=dict(table), submitted_by=submitted_by
        )
        self.store.audit(
            "run-submitted",
            {
                "run_id": run_id,
                "name": name or run_id,
                "by": submitted_by,
                "aggregation": settings.aggregation,
                "gram_scope": settings.gram_scope,
                "rounds": settings.rounds,
                "dp": settings.dp is not None,
            },
        )
        return run_id

    def submit_run(self, name: str, overrides: Mapping[str, Any], *, submitted_by: str) -> Run:
        """Queue a run whose settings are server.toml's [round] updated with ``overrides``;
        :class:`ConfigError` names a bad key."""
        table = merged_run_table(self.config.round, overrides)
        run_id = self._submit(name, table, submitted_by=submitted_by)
        self._activate_next()
        self.advance()
        return self.run(run_id)

    def abort_run(self, run_id: str, *, reason: str, by: str) -> Run:
        """Abort a queued or active run (its open round releases nothing)."""
        run = self.run(run_id)
        if run.row.state in ENDED_RUN_STATES:
            raise WrongStageError(f"run {run_id!r} already ended ({run.row.state})")
        why = f"aborted by admin {by}: {reason}" if reason else f"aborted by admin {by}"
        if run.row.state == "queued":
            self._finish_run(run_id, "aborted", why)
            return self.run(run_id)
        rounds = self.store.rounds(run_id)
        if rounds and rounds[-1].stage not in Stage.FINAL:
            self._abort(self.view(rounds[-1]), why)  # finishes the run (no replacement)
        else:
            self._finish_run(run_id, "aborted", why)
        self.advance()
        return self.run(run_id)

    def _activate_next(self) -> None:
        runs = self.store.runs()
        if any(r.state == "active" for r in runs):
            return
        queued = [r for r in runs if r.state == "queued"]
        if not queued:
            return
        run = self.run(queued[0].run_id)
        self.store.update_run(run.run_id, state="active")
        self.store.audit("run-started", {"run_id": run.run_id})
        log.info("run started", extra={"run_id": run.run_id})
        self._new_round(
            run,
            number=1,
            parent="",
            participants=run.settings.participants,
            timeout_s=run.settings.enrol_timeout_s,
        )

    def _settle(self, run_id: str) -> None:
        """Finish a migrated run whose last round already ended."""
        rounds = self.store.rounds(run_id)
        if not rounds or rounds[-1].stage not in Stage.FINAL:
            return
        last = rounds[-1]
        settings = self.run(run_id).settings
        if last.stage == Stage.PUBLISHED and last.number == settings.rounds:
            self._finish_run(run_id, "published", "")
        elif last.stage == Stage.ABORTED:
            self._finish_run(run_id, "aborted", last.abort_reason)

    def _finish_run(self, run_id: str, state: str, reason: str) -> None:
        self.store.update_run(run_id, state=state, reason=reason, at_ms=self.now_ms())
        model = self.run_model(run_id)
        self.store.audit(
            "run-finished",
            {
                "run_id": run_id,
                "state": state,
                "reason": reason,
                "model_round_id": model[0] if model else "",
                "model_sha256": hashlib.sha256(model[1]).hexdigest() if model else "",
            },
        )
        log.info("run finished", extra={"run_id": run_id, "state": state, "reason": reason})
        run = self.run(run_id)
        for row in self.store.rounds(run_id):
            run.mode.forget(row.round_id)
        if self.config.payload_retention_days <= 0:
            self._purge(run_id)
        self._activate_next()

    def _purge(self, run_id: str) -> None:
        deleted = self.store.purge_payloads([r.round_id for r in self.store.rounds(run_id)])
        if deleted:
            self.store.audit("payloads-deleted", {"run_id": run_id, "files": deleted})

    def purge_due(self) -> None:
        """Delete the payloads of runs that ended more than ``payload_days`` ago (retention)."""
        now = self.now_ms()
        if now < self._next_purge_ms:
            return
        self._next_purge_ms = now + 60_000
        keep_ms = self.config.payload_retention_days * _DAY_MS
        for row in self.store.runs():
            if row.state in ENDED_RUN_STATES and row.finished_ms + keep_ms <= now:
                self._purge(row.run_id)

    def run_model(self, run_id: str) -> tuple[str, bytes, bytes] | None:
        """(round id, model bytes, signature) of the run's final published round, if any."""
        last = self.run(run_id).settings.rounds
        rounds = self.store.rounds(run_id)
        published = [r for r in rounds if r.stage == Stage.PUBLISHED and r.number <= last]
        return self.store.model(published[-1].round_id) if published else None

    def run_evaluation(self, run_id: str) -> tuple[str, bytes, bytes] | None:
        """(round id, Evaluation bytes, signature) of the run's published evaluation, if any."""
        last = self.run(run_id).settings.rounds
        rounds = self.store.rounds(run_id)
        published = [r for r in rounds if r.stage == Stage.PUBLISHED and r.number > last]
        found = self.store.evaluation(published[-1].round_id) if published else None
        return None if found is None else (published[-1].round_id, *found)

    # --- reading -----------------------------------------------------------------------------

    def view(self, row: RoundRow) -> RoundView:
        releases = releases_from_plan(row.plan) if row.plan else []
        return RoundView(row, tuple(releases))

    def current(self) -> RoundView:
        """The open round of the active run, or the last round when no run is active."""
        active = self.active_run()
        rounds = self.store.rounds(active.run_id) if active is not None else self.store.rounds()
        if not rounds:
            rounds = self.store.rounds()
        if not rounds:
            raise WrongStageError("no round has been created yet")
        return self.view(rounds[-1])

    def find(self, round_id: str) -> RoundView:
        """The round ``round_id`` (the current round for ""; requests that must name a round
        pass ``round_id or "-"``, which matches none)."""
        if not round_id:
            return self.current()
        for row in self.store.rounds():
            if row.round_id == round_id:
                return self.view(row)
        raise WrongStageError(f"no round {round_id!r} on this server")

    def require_participant(self, view: RoundView, site_id: str) -> None:
        if site_id not in view.row.participants:
            raise NotPermittedError(
                f"site {site_id!r} is not a participant of round {view.round_id!r}"
            )

    def status(self, view: RoundView, site_id: str) -> pb.RoundStatus:
        decisions = self.store.decisions(view.round_id)
        uploads = self.store.site_uploads(view.round_id, site_id)
        return pb.RoundStatus(
            round_id=view.round_id,
            round_number=view.row.number,
            stage=view.stage,  # type: ignore[arg-type]
            participants=list(view.row.participants),
            stage_deadline_unix_ms=view.row.deadline_ms,
            abort_reason=view.row.abort_reason,
            caller_accepted_plan=decisions.get(site_id, (False, ""))[0],
            caller_uploads_complete=sorted(uploads),
            run_id=view.row.run_id,
        )

    # --- transitions -------------------------------------------------------------------------

    def _new_round(
        self,
        run: Run,
        *,
        number: int,
        parent: str,
        participants: tuple[str, ...],
        timeout_s: float,
    ) -> RoundView:
        prefix = "e" if number > run.settings.rounds else "r"  # e: the evaluation round
        round_id = f"{prefix}{number}-{secrets.token_hex(8)}"
        self.store.create_round(
            round_id=round_id,
            run_id=run.run_id,
            number=number,
            parent_round_id=parent,
            stage=Stage.WAITING,
            participants=participants,
            deadline_ms=self.now_ms() + int(timeout_s * 1000),
        )
        self.store.audit(
            "round-created",
            {
                "round_id": round_id,
                "run_id": run.run_id,
                "number": number,
                "participants": list(participants),
            },
        )
        log.info("round created", extra={"round_id": round_id, "number": number})
        self._emit(round_id)
        return self.find(round_id)

    def _emit(self, round_id: str) -> None:
        view = self.find(round_id)
        self.metrics.set_stage(view.stage)
        event = pb.RoundEvent(
            sequence=len(self.events) + 1,
            time_unix_ms=self.now_ms(),
            status=self.status(view, ""),
        )
        self.events.append(event)
        self.lock.notify_all()

    def _set_stage(
        self,
        view: RoundView,
        stage: int,
        *,
        reason: str = "",
        deadline_ms: int | None = None,
        detail: Mapping[str, object] | None = None,
    ) -> None:
        self.store.update_round(
            view.round_id,
            stage=stage,
            deadline_ms=view.row.deadline_ms if deadline_ms is None else deadline_ms,
            abort_reason=reason,
        )
        self.store.audit(
            "stage",
            {
                "round_id": view.round_id,
                "stage": stage_name(stage),
                "reason": reason,
                **(detail or {}),
            },
        )
        log.info(
            "round stage",
            extra={"round_id": view.round_id, "stage": stage_name(stage), "reason": reason},
        )
        self._emit(view.round_id)

    def apply(self, view: RoundView, transition: Transition) -> None:
        """Carry out a transition a mode (or this machine) decided on."""
        if transition.stage == Stage.ABORTED:
            self._abort(view, transition.reason, replan_with=transition.replan_with)
            return
        deadline = None
        if transition.timeout_s is not None:
            deadline = self.now_ms() + int(transition.timeout_s * 1000)
        self._set_stage(view, transition.stage, reason=transition.reason, deadline_ms=deadline)

    def _abort(
        self, view: RoundView, reason: str, *, replan_with: tuple[str, ...] | None = None
    ) -> None:
        """ABORT ``view``; with ``replan_with``, open a replacement round with those sites when
        they are at least ``min_participants``; otherwise the run ends aborted."""
        run = self.run_of(view)
        self._set_stage(view, Stage.ABORTED, reason=reason)
        self.metrics.rounds.labels(outcome="aborted").inc()
        run.mode.forget(view.round_id)
        gated = self._gated(view, run)
        needed = run.settings.min_participants
        if gated and run.settings.gate is not None:  # the gate's own rule ([round.gate] min_sites)
            needed = run.settings.gate.min_sites
        if replan_with is not None and len(replan_with) >= needed:
            replacement = self._new_round(
                run,
                number=view.row.number,
                parent=view.row.parent_round_id,
                participants=replan_with,
                timeout_s=run.settings.upload_timeout_s,
            )
            self._open(replacement, replan_with)
            return
        if replan_with is not None:
            log.warning(
                "round aborted; too few sites remain for a replacement round",
                extra={"round_id": view.round_id, "remaining": len(replan_with)},
            )
        if gated:  # the candidate was never published: the gate could not decide
            admin = reason.startswith("aborted by admin")
            why = reason if admin else f"validation gate could not score the candidate: {reason}"
            self._end_candidate(view, run, None, why, state="aborted" if admin else "failed")
        elif view.row.number > run.settings.rounds:  # the evaluation round: the model stays
            self._finish_run(run.run_id, "published", f"evaluation aborted: {reason}")
        else:
            self._finish_run(run.run_id, "aborted", reason)

    def _open(self, view: RoundView, participants: tuple[str, ...]) -> None:
        """Publish the signed plan of a round over ``participants`` (or abort with the reason)."""
        run = self.run_of(view)
        settings, mode = run.settings, run.mode
        enrolments = self.store.enrolments()
        coverage = {s: e.labelled_classes for s, e in enrolments.items()}
        declared = {s: e.row_bounds for s, e in enrolments.items() if e.row_bounds is not None}
        dp = settings.dp
        evaluation = view.row.number > settings.rounds
        if evaluation:  # the run's evaluation round (afl.server.solve.evaluation)
            evaluated = self._evaluated_model(view)
            releases = evaluation_releases(
                classes=settings.classes,
                participants=participants,
                model_sha256=hashlib.sha256(evaluated).digest(),
            )
            history = earlier_evaluations(
                [(r.round_id, self.view(r).releases) for r in self.store.rounds()
                 if r.stage == Stage.PUBLISHED],
                exclude=view.round_id,
            )  # fmt: skip
            report = audit_plan(releases, participants, history=history)
        elif dp is not None:  # DP mode releases additive statistics (docs/protocol.md §7)
            releases = dp_releases(
                classes=settings.classes,
                participants=participants,
                coverage=coverage,
                gram_scope=settings.gram_scope,
                d=settings.feature_dim,
                round_number=view.row.number,
                need_global_gram=settings.rounds == 2,
            )
            report = audit_dp_plan(releases, participants)
        elif view.row.number == 1:
            releases = round1_releases(
                classes=settings.classes,
                participants=participants,
                coverage=coverage,
                gram_scope=settings.gram_scope,
                d=settings.feature_dim,
                need_global_gram=settings.rounds == 2,
            )
            report = audit_plan(releases, participants)
        else:
            releases = round2_releases(
                classes=settings.classes, participants=participants, d=settings.feature_dim
            )
            report = audit_plan(releases, participants)
        self.store.audit("plan-audit", {"round_id": view.round_id, **report.to_dict()})
        if not evaluation and dp is None and self._exposes_history(view, releases, participants):
            return
        calibration = None
        if dp is not None:
            try:
                calibration = calibrate(
                    releases,
                    dp,
                    participants=participants,
                    plaintext=mode.name == "plaintext",
                    run_rounds=settings.rounds,
                    classes=settings.classes,
                    parent=self._parent_plan(view),
                )
            except ValueError as exc:
                self._abort(view, f"DP calibration failed: {exc}")
                return
            self.store.audit("dp-budget", {"round_id": view.round_id, **calibration.to_audit()})
            if not report.passed:  # every site's epsilon <= the target: DP covers the exposure
                self.store.audit("dp-covers-audit", {"round_id": view.round_id})
        if evaluation and not report.passed and not settings.operator_override:
            self._abort(
                view,
                "the evaluation plan, with the federation's earlier evaluations, fails the "
                "leakage audit (docs/protocol.md §6.1); set operator_override with a reason",
            )
            return
        if (
            settings.gram_scope == "per-class"
            and not report.passed
            and not settings.operator_override
            and calibration is None
        ):
            self._abort(
                view,
                "the per-class release plan fails the leakage audit (docs/protocol.md §6); set "
                "operator_override with a reason, or use gram_scope = 'global'",
            )
            return
        try:
            options = mode.plan_options(participants, declared=declared)
            plan = build_plan(
                federation_id=self.config.federation_id,
                round_id=view.round_id,
                round_number=view.row.number,
                participants=participants,
                gram_scope=settings.gram_scope,
                releases=releases,
                operator_override=settings.operator_override and not report.passed,
                override_reason=settings.override_reason if not report.passed else "",
                options=options,
            )
        except ValueError as exc:
            self._abort(view, f"the {mode.name} plan cannot be built: {exc}")
            return
        plan.run_id = run.run_id
        if calibration is not None:
            apply_dp(plan, calibration)
            try:
                mode.dp_encodings(plan, declared=declared)
            except ValueError as exc:
                self._abort(view, f"DP encoding failed: {exc}")
                return
        signed = sign_plan(plan, self._key)
        self.store.update_round(
            view.round_id,
            stage=Stage.PLAN_REVIEW,
            deadline_ms=self.now_ms() + int(settings.upload_timeout_s * 1000),
            participants=participants,
            plan=signed.plan,
            plan_signature=signed.signature,
        )
        self.store.audit(
            "plan-published", {"round_id": view.round_id, "releases": [r.name for r in releases]}
        )
        self._emit(view.round_id)

    def released_history(
        self, *, exclude_round: str = ""
    ) -> list[tuple[str, list[PlannedRelease]]]:
        """Every published training round's data releases (Gram, class vectors: the statistics
        of a site's data that every run sums alike), cut to the model's contributors; a gated
        round's too, whatever the gate decided (its sums were released to solve the candidate)."""
        released: list[ReleasedRound] = []
        for row in self.store.rounds():
            if not row.plan or row.round_id == exclude_round:
                continue
            model = self.store.model(row.round_id) if row.stage == Stage.PUBLISHED else None
            solved = model[1] if model is not None else None
            if solved is None and (candidate := self.store.candidate(row.round_id)) is not None:
                solved = candidate[0]
            releases = [r for r in self.view(row).releases if r.kind in _DATA_KINDS]
            if not releases or solved is None:
                continue
            contributors = tuple(pb.Model.FromString(solved).contributors)
            released.append(ReleasedRound(row.round_id, row.run_id, releases, contributors))
        return released_history(released)

    def exposes_history(
        self, view: RoundView, releases: Sequence[PlannedRelease], members: Sequence[str]
    ) -> str:
        """The refusal (one line) when ``releases`` over ``members``, differenced with what the
        federation already released, expose any site; "" when they do not (M-124)."""
        history = self.released_history(exclude_round=view.round_id)
        if not history:
            return ""
        summed = frozenset(members)
        releases = [
            replace(r, members=tuple(m for m in r.members if m in summed)) for r in releases
        ]
        report, exposed = history_exposures(releases, members, history=history)
        if not exposed:
            return ""
        self.store.audit(
            "plan-audit-history",
            {"round_id": view.round_id, "members": list(members), **report.to_dict()},
        )
        return history_refusal(exposed, round_id=view.round_id)

    def _exposes_history(
        self, view: RoundView, releases: Sequence[PlannedRelease], participants: Sequence[str]
    ) -> bool:
        reason = self.exposes_history(view, releases, participants)
        if reason:
            self._abort(view, reason)
        return bool(reason)

    def _parent_plan(self, view: RoundView) -> cpb.ReleasePlan | None:
        """Round 1's signed plan, for round 2 of a run (None in round 1)."""
        if view.row.number == 1:
            return None
        parent = self.find(view.row.parent_round_id)
        return cpb.ReleasePlan.FromString(parent.row.plan or b"")

    def advance(self) -> None:
        """Apply every transition that is due."""
        for _ in range(32):  # transitions chain (publish -> round 2 opens; a run ends -> next)
            before = self.current()
            self._step(before)
            if self.current().row == before.row:
                break
        if self.config.payload_retention_days > 0:
            self.purge_due()

    def _step(self, view: RoundView) -> None:
        if view.stage in Stage.FINAL or not view.row.run_id:
            return
        run = self.run_of(view)
        stage, now = view.stage, self.now_ms()
        if stage == Stage.WAITING:
            self._wait(view, run, now)
        elif stage == Stage.PLAN_REVIEW:
            self._review(view, run, now)
        elif stage in run.mode.exchange_stages:
            transition = run.mode.drive(view, self)
            if transition is not None:
                self.apply(view, transition)
        elif stage == Stage.SOLVING:
            self._solve(view, run)

    def _eligible(self, run: Run, enrolment: EnrolmentRow) -> str:
        """Why an enrolled site cannot take part in ``run`` ("" if it can): its declared
        backbone or d differ from the run's, its features come from a random-init backbone and
        the run is no test ([round] allow_random_init), they come from other weights than the
        run pins ([round] backbone_sha256), or the run plans per class and the site did not
        disclose the classes it labels."""
        s = run.settings
        if s.gram_scope == "per-class" and not enrolment.labelled_classes:
            return (
                f"run {run.run_id} plans per class (gram_scope = 'per-class') and needs the "
                "classes each site labels; this site disclosed none: set [policy] "
                "disclose_coverage = true in its client.toml (docs/protocol.md §6)"
            )
        if enrolment.random_init and not s.allow_random_init:
            return (
                f"run {run.run_id} refuses features of a RANDOM-INIT backbone (test features); "
                "re-extract with the federation's weights, or the run must set allow_random_init"
            )
        digest = enrolment.weights_sha256.lower()
        if s.backbone_sha256 and digest != s.backbone_sha256 and not enrolment.random_init:
            return (
                f"run {run.run_id} pins weights sha256 {s.backbone_sha256} ([round] "
                f"backbone_sha256), the site declared {digest or 'no digest'}"
            )
        if s.backbone and enrolment.backbone and enrolment.backbone != s.backbone:
            return (
                f"run {run.run_id} needs features from {s.backbone!r}, the site declared "
                f"{enrolment.backbone!r}"
            )
        if enrolment.feature_dim and enrolment.feature_dim != s.feature_dim:
            return (
                f"run {run.run_id} needs d = {s.feature_dim}, the site declared "
                f"d = {enrolment.feature_dim}"
            )
        return ""

    def _wait(self, view: RoundView, run: Run, now: int) -> None:
        enrolments = self.store.enrolments()
        expected = set(view.row.participants)
        notes = {
            s: why
            for s in sorted(expected & set(enrolments))
            if (why := self._eligible(run, enrolments[s]))
        }
        for site, why in notes.items():
            if self.notes.get(site) != why:
                self.store.audit(
                    "site-left-out", {"round_id": view.round_id, "site_id": site, "reason": why}
                )
                log.warning("site left out", extra={"site_id": site, "reason": why})
        self.notes = notes
        expected -= set(notes)
        ready = tuple(sorted(expected & set(enrolments)))
        if ready and len(ready) == len(expected):
            self._open(view, ready)
        elif now >= view.row.deadline_ms:
            if len(ready) >= run.settings.min_participants:
                self._open(view, ready)
            else:
                self.store.update_round(
                    view.round_id,
                    stage=view.stage,
                    deadline_ms=now + int(run.settings.enrol_timeout_s * 1000),
                )

    def _review(self, view: RoundView, run: Run, now: int) -> None:
        decisions = self.store.decisions(view.round_id)
        participants = view.row.participants
        refused = sorted(s for s, (ok, _) in decisions.items() if not ok)
        if refused:
            reasons = "; ".join(f"{s}: {decisions[s][1]}" for s in refused)
            keep = tuple(s for s in participants if s not in refused)
            self._abort(view, f"plan refused by {reasons}", replan_with=keep)
        elif all(s in decisions for s in participants):
            self.apply(view, run.mode.begin(view, self))
        elif now >= view.row.deadline_ms:
            silent = [s for s in participants if s not in decisions]
            accepted = tuple(s for s in participants if s in decisions)
            self._abort(
                view,
                f"timed out waiting for the plan decision of {', '.join(silent)}",
                replan_with=accepted,
            )

    def sums(self, view: RoundView) -> Mapping[str, NDArray[np.float64]] | None:
        """The released sums of ``view`` (None while the mode still waits for them)."""
        return self.mode_of(view).sums(view, self)

    def _solve(self, view: RoundView, run: Run) -> None:
        settings = run.settings
        if view.row.number > settings.rounds:
            self._publish_evaluation(view, run)
            return
        try:
            sums = self.sums(view)
            if sums is None:
                return  # e.g. CKKS: the decryptor has not answered every job yet
            require_finite(sums, what="the sum of release")
            weights = self._weights(view, settings, sums)
            require_finite({"W": weights}, what="the solved model")
        except SOLVE_ERRORS as exc:  # no value crashes the coordinator (docs/protocol.md §9)
            log.error("solve failed", extra={"round_id": view.round_id, "reason": str(exc)})
            self._abort(view, f"solve failed: {exc}")
            return
        assert view.row.plan is not None
        gated = settings.gate is not None and view.row.number == settings.rounds
        signed = build_signed_model(
            weights,
            identity_key=self._key,
            federation_id=self.config.federation_id,
            round_id=view.round_id,
            round_number=view.row.number,
            classes=settings.classes,
            gamma=settings.gamma,
            backbone=settings.backbone,
            contributors=run.mode.contributors(view),
            plan_bytes=view.row.plan,
            context=CANDIDATE_CONTEXT if gated else MODEL_CONTEXT,
        )
        if gated:  # not published: the gate's evaluation round scores it first
            digest = self.store.put_candidate(
                view.round_id, model=signed.model, signature=signed.signature
            )
            self._set_stage(view, Stage.VALIDATING, detail={"candidate_sha256": digest})
            sites = tuple(sorted(run.mode.contributors(view)))
            gate = self._new_round(
                run,
                number=view.row.number + 1,
                parent=view.round_id,
                participants=sites,
                timeout_s=settings.upload_timeout_s,
            )
            self._open(gate, sites)
            return
        digest = self.store.put_model(view.round_id, model=signed.model, signature=signed.signature)
        self._set_stage(view, Stage.PUBLISHED, detail={"model_sha256": digest})
        self.metrics.rounds.labels(outcome="published").inc()
        if view.row.number < settings.rounds + int(settings.evaluate):  # round 2, or evaluation
            sites = view.row.participants
            if view.row.number == settings.rounds:  # evaluated by the model's contributors
                sites = tuple(sorted(run.mode.contributors(view)))
            following = self._new_round(
                run,
                number=view.row.number + 1,
                parent=view.round_id,
                participants=sites,
                timeout_s=settings.upload_timeout_s,
            )
            self._open(following, sites)
        else:
            self._finish_run(run.run_id, "published", "")

    def _publish_evaluation(self, view: RoundView, run: Run) -> None:
        """The evaluation round's SOLVING: the pooled documents from the released sums, signed
        and stored beside the state before the round is PUBLISHED (:mod:`afl.server.solve.evaluation`)."""
        settings, parent = run.settings, view.row.parent_round_id
        try:
            sums = self.sums(view)
            if sums is None:
                return  # e.g. CKKS: the decryptor has not answered every job yet
            require_finite(sums, what="the sum of release")
            members = tuple(sorted(run.mode.contributors(view)))  # known once the sums are
            result = evaluation_result(
                view.releases,
                sums,
                members=members,
                calibration=settings.eval_calibration,
                context={"run_id": run.run_id, "round_id": view.round_id, "model_round_id": parent},
            )
        except SOLVE_ERRORS as exc:  # no value crashes the coordinator (docs/protocol.md §9)
            log.error("evaluation failed", extra={"round_id": view.round_id, "reason": str(exc)})
            self._abort(view, f"evaluation failed: {exc}")
            return
        verdict = None
        if settings.gate is not None and self._gated(view, run):
            verdict = gate_verdict(result.stats, members=len(members), settings=settings.gate)
            result.evaluation["gate"] = verdict.to_json()  # every scoring site receives it
        signed = build_signed_evaluation(
            result,
            identity_key=self._key,
            federation_id=self.config.federation_id,
            run_id=run.run_id,
            round_id=view.round_id,
            model_round_id=parent,
            members=members,
            plan_bytes=view.row.plan or b"",
        )
        self.store.put_evaluation(
            view.round_id, evaluation=signed.evaluation, signature=signed.signature
        )
        if verdict is not None:  # the model's round ends first: a restart here decides again
            self._end_candidate(view, run, verdict, verdict.reason())
        self._set_stage(view, Stage.PUBLISHED, detail=published_detail(signed))
        self.metrics.rounds.labels(outcome="published").inc()
        if verdict is None:
            self._finish_run(run.run_id, "published", "")
        else:
            reason = verdict.reason()
            self._finish_run(run.run_id, "published" if verdict.passed else "failed", reason)

    # --- the validation gate (afl.server.solve.gate) -------------------------------------------

    def _gated(self, view: RoundView, run: Run) -> bool:
        """Whether ``view`` is the evaluation round of a run's validation gate."""
        return run.settings.gate is not None and view.row.number == run.settings.rounds + 1

    def _evaluated_model(self, view: RoundView) -> bytes:
        """The ``Model`` bytes an evaluation round scores: the published model of its parent
        round, or (the gate) the parent's candidate."""
        parent = view.row.parent_round_id
        model = self.store.model(parent)
        if model is not None:
            return model[1]
        candidate = self.store.candidate(parent)
        assert candidate is not None, "an evaluation round follows a model or a candidate"
        return candidate[0]

    def _end_candidate(
        self,
        view: RoundView,
        run: Run,
        verdict: GateVerdict | None,
        reason: str,
        *,
        state: str = "failed",
    ) -> None:
        """Decide the candidate of the gate round ``view``'s parent: publish it (``verdict``
        passed: the same ``Model`` bytes signed with context "model") or ABORT its round with
        ``reason``, recording the gate's figures in the audit log; a run that ends without a
        verdict finishes here (with ``state``)."""
        parent = self.find(view.row.parent_round_id)
        detail = verdict.to_json() if verdict is not None else {"passed": False, "reason": reason}
        if parent.stage in Stage.FINAL:  # decided before a restart
            return
        self.store.audit("gate", {"round_id": parent.round_id, "gate_round_id": view.round_id,
                                  **detail})  # fmt: skip
        if verdict is not None and verdict.passed:
            candidate = self.store.candidate(parent.round_id)
            assert candidate is not None
            model = candidate[0]
            signature = sign_blob(self._key, context=MODEL_CONTEXT, blob=model)
            digest = self.store.put_model(parent.round_id, model=model, signature=signature)
            self._set_stage(parent, Stage.PUBLISHED, detail={"model_sha256": digest, "gate": True})
            self.metrics.rounds.labels(outcome="published").inc()
            return
        log.error("validation gate failed", extra={"round_id": parent.round_id, "reason": reason})
        self._set_stage(parent, Stage.ABORTED, reason=reason)
        self.metrics.rounds.labels(outcome="aborted").inc()
        if verdict is None:
            self._finish_run(run.run_id, state, reason)

    def _weights(
        self,
        view: RoundView,
        settings: RoundSettings,
        sums: Mapping[str, NDArray[np.float64]],
    ) -> NDArray[np.float64]:
        if settings.dp is not None:
            first_round = None
            if view.row.number == 2:
                first = self.find(view.row.parent_round_id)
                first_sums = self.sums(first)
                if first_sums is None:
                    raise AggregationError(f"round {first.round_id!r} has no released sums")
                first_round = (first.row.plan or b"", first_sums)
            return solve_dp_run(
                view.row.plan or b"",
                sums,
                parent=first_round,
                classes=settings.classes,
                gamma=settings.gamma,
                refinement=settings.refinement,
            )
        if view.row.number == 1:
            return solve_round_one(
                view.releases,
                sums,
                classes=settings.classes,
                participants=view.row.participants,
                gram_scope=settings.gram_scope,
                gamma=settings.gamma,
            )
        parent = self.find(view.row.parent_round_id)
        parent_sums = self.sums(parent)
        if parent_sums is None:
            raise AggregationError(f"round {parent.round_id!r} has no released sums")
        return solve_round_two(
            parent.releases,
            parent_sums,
            view.releases,
            sums,
            classes=settings.classes,
            gamma=settings.gamma,
            alpha=settings.refinement.alpha,
        )
