"""The coordinator's round state machine (docs/architecture.md §2).

    WAITING_FOR_PARTICIPANTS --all expected enrolled, or >= min_participants at the enrol
        deadline--> PLAN_REVIEW (signed plan published)
    PLAN_REVIEW --every participant accepted--> the mode's exchange stages (mode.begin)
        plaintext, ckks: UPLOAD;  mask: ADVERTISE_KEYS, SHARE_KEYS, UPLOAD, CONSISTENCY_CHECK, UNMASK
    exchange stages --mode.drive--> SOLVING --mode.sums available, solved--> PUBLISHED
    PUBLISHED (round 1, rounds = 2) --> round 2 opens in PLAN_REVIEW (same participants)

A refusal of the plan, or a deadline passing, ABORTS the round (nothing is released: a plan binds
one cohort) and, when at least ``min_participants`` sites remain (those that did not refuse;
after a timeout, those whose uploads are complete), opens a replacement round with them and a new
plan. A failed solve aborts the round with the reason. Every transition is committed to the
:class:`~afl.server.store.Store` first, then logged to the audit log, then announced as a round
event, so a restarted coordinator resumes the open round from SQLite; payloads already received
are kept, never re-requested.

The round's :class:`~afl.server.modes.AggregationMode` never changes stages itself: it returns a
:class:`~afl.server.modes.Transition` that :meth:`RoundMachine.apply` carries out. The machine is
the mode's :class:`~afl.server.modes.RoundContext`. Call every method with :attr:`lock` held.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable, Mapping

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from numpy.typing import NDArray

from afl.core.aggregation import AggregationError
from afl.proto.v1 import common_pb2 as cpb
from afl.proto.v1 import coordinator_pb2 as pb
from afl.proto.wire import stage_name
from afl.server.config import ServerConfig
from afl.server.dp_plan import apply_dp, audit_dp_plan, calibrate, dp_releases
from afl.server.dp_solve import solve_dp_run
from afl.server.errors import NotPermittedError, WrongStageError
from afl.server.modes import AggregationMode, Transition, complete_sites
from afl.server.observability import ServerMetrics
from afl.server.plan import (
    RoundView,
    audit_plan,
    build_plan,
    releases_from_plan,
    round1_releases,
    round2_releases,
    sign_plan,
)
from afl.server.solve import build_signed_model, solve_round_one, solve_round_two
from afl.server.store import RoundRow, Store, UploadRow

__all__ = ["RoundMachine", "RoundView", "Stage"]

log = logging.getLogger("afl.server.rounds")


class Stage:
    """RoundStage values every round shares (the modes add their exchange stages)."""

    WAITING = pb.ROUND_STAGE_WAITING_FOR_PARTICIPANTS
    PLAN_REVIEW = pb.ROUND_STAGE_PLAN_REVIEW
    UPLOAD = pb.ROUND_STAGE_UPLOAD
    SOLVING = pb.ROUND_STAGE_SOLVING
    PUBLISHED = pb.ROUND_STAGE_PUBLISHED
    ABORTED = pb.ROUND_STAGE_ABORTED


class RoundMachine:
    """Transitions of the round state machine; :class:`afl.server.coordinator.Coordinator`
    adds the requests."""

    def __init__(
        self,
        config: ServerConfig,
        store: Store,
        identity_key: Ed25519PrivateKey,
        *,
        mode: AggregationMode,
        metrics: ServerMetrics,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config, self.store, self._key = config, store, identity_key
        self.mode, self.metrics, self.clock = mode, metrics, clock
        self.lock = threading.Condition()
        self.events: list[pb.RoundEvent] = []
        with self.lock:
            if store.rounds():
                return
            self._new_round(
                number=1,
                parent="",
                participants=config.round.participants,
                timeout_s=config.round.enrol_timeout_s,
            )

    # --- RoundContext (what modes read) -------------------------------------------------------

    @property
    def stage_timeout_s(self) -> float:
        return self.config.round.upload_timeout_s

    def now_ms(self) -> int:
        return int(self.clock() * 1000)

    def decisions(self, round_id: str) -> dict[str, tuple[bool, str]]:
        return self.store.decisions(round_id)

    def uploads(self, round_id: str) -> dict[tuple[str, str], UploadRow]:
        return self.store.uploads(round_id)

    def read_payload(self, row: UploadRow) -> bytes:
        return self.store.read_payload(row)

    # --- reading -----------------------------------------------------------------------------

    def view(self, row: RoundRow) -> RoundView:
        releases = releases_from_plan(row.plan) if row.plan else []
        return RoundView(row, tuple(releases))

    def current(self) -> RoundView:
        return self.view(self.store.rounds()[-1])

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
        uploads = self.store.uploads(view.round_id)
        return pb.RoundStatus(
            round_id=view.round_id,
            round_number=view.row.number,
            stage=view.stage,  # type: ignore[arg-type]
            participants=list(view.row.participants),
            stage_deadline_unix_ms=view.row.deadline_ms,
            abort_reason=view.row.abort_reason,
            caller_accepted_plan=decisions.get(site_id, (False, ""))[0],
            caller_uploads_complete=sorted(r for (s, r) in uploads if s == site_id),
        )

    # --- transitions -------------------------------------------------------------------------

    def _new_round(
        self, *, number: int, parent: str, participants: tuple[str, ...], timeout_s: float
    ) -> RoundView:
        round_id = f"r{number}-{secrets.token_hex(8)}"
        self.store.create_round(
            round_id=round_id,
            number=number,
            parent_round_id=parent,
            stage=Stage.WAITING,
            participants=participants,
            deadline_ms=self.now_ms() + int(timeout_s * 1000),
        )
        self.store.audit(
            "round-created",
            {"round_id": round_id, "number": number, "participants": list(participants)},
        )
        log.info("round created", extra={"round_id": round_id, "number": number})
        self._emit(round_id)
        return self.find(round_id)

    def _emit(self, round_id: str) -> None:
        view = self.find(round_id)
        self.metrics.stage.set(view.stage)
        event = pb.RoundEvent(
            sequence=len(self.events) + 1,
            time_unix_ms=self.now_ms(),
            status=self.status(view, ""),
        )
        self.events.append(event)
        self.lock.notify_all()

    def _set_stage(
        self, view: RoundView, stage: int, *, reason: str = "", deadline_ms: int | None = None
    ) -> None:
        self.store.update_round(
            view.round_id,
            stage=stage,
            deadline_ms=view.row.deadline_ms if deadline_ms is None else deadline_ms,
            abort_reason=reason,
        )
        self.store.audit(
            "stage", {"round_id": view.round_id, "stage": stage_name(stage), "reason": reason}
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
        they are at least ``min_participants``."""
        self._set_stage(view, Stage.ABORTED, reason=reason)
        self.metrics.rounds.labels(outcome="aborted").inc()
        if replan_with is None:
            return
        if len(replan_with) >= self.config.round.min_participants:
            replacement = self._new_round(
                number=view.row.number,
                parent=view.row.parent_round_id,
                participants=replan_with,
                timeout_s=self.config.round.upload_timeout_s,
            )
            self._open(replacement, replan_with)
        else:
            log.warning(
                "round aborted; too few sites remain for a replacement round",
                extra={"round_id": view.round_id, "remaining": len(replan_with)},
            )

    def _open(self, view: RoundView, participants: tuple[str, ...]) -> None:
        """Publish the signed plan of a round over ``participants`` (or abort with the reason)."""
        settings = self.config.round
        coverage = {s: e.labelled_classes for s, e in self.store.enrolments().items()}
        dp = settings.dp
        if dp is not None:  # DP mode releases additive statistics (docs/protocol.md §7)
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
        calibration = None
        if dp is not None:
            try:
                calibration = calibrate(
                    releases,
                    dp,
                    participants=participants,
                    plaintext=self.mode.name == "plaintext",
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
            options = self.mode.plan_options(participants)
        except ValueError as exc:
            self._abort(view, f"the {self.mode.name} plan cannot be built: {exc}")
            return
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
        if calibration is not None:
            apply_dp(plan, calibration)
            try:
                self.mode.dp_encodings(plan)
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

    def _parent_plan(self, view: RoundView) -> cpb.ReleasePlan | None:
        """Round 1's signed plan, for round 2 of a run (None in round 1)."""
        if view.row.number == 1:
            return None
        parent = self.find(view.row.parent_round_id)
        return cpb.ReleasePlan.FromString(parent.row.plan or b"")

    def advance(self) -> None:
        """Apply every transition that is due."""
        for _ in range(16):  # transitions may chain (publish -> round 2 opens -> ...)
            before = self.current()
            self._step(before)
            if self.current().row == before.row:
                return

    def _step(self, view: RoundView) -> None:
        stage, now, settings = view.stage, self.now_ms(), self.config.round
        if stage == Stage.WAITING:
            expected = set(view.row.participants)
            enrolled = tuple(sorted(expected & set(self.store.enrolments())))
            if len(enrolled) == len(expected):
                self._open(view, enrolled)
            elif now >= view.row.deadline_ms:
                if len(enrolled) >= settings.min_participants:
                    self._open(view, enrolled)
                else:
                    self.store.update_round(
                        view.round_id,
                        stage=stage,
                        deadline_ms=now + int(settings.enrol_timeout_s * 1000),
                    )
        elif stage == Stage.PLAN_REVIEW:
            self._review(view, now)
        elif stage in self.mode.exchange_stages:
            transition = self.mode.drive(view, self)
            if transition is not None:
                self.apply(view, transition)
        elif stage == Stage.SOLVING:
            self._solve(view)

    def _review(self, view: RoundView, now: int) -> None:
        decisions = self.store.decisions(view.round_id)
        refused = sorted(s for s, (ok, _) in decisions.items() if not ok)
        if refused:
            reasons = "; ".join(f"{s}: {decisions[s][1]}" for s in refused)
            keep = tuple(s for s in view.row.participants if s not in refused)
            self._abort(view, f"plan refused by {reasons}", replan_with=keep)
        elif all(s in decisions for s in view.row.participants):
            self.apply(view, self.mode.begin(view, self))
        elif now >= view.row.deadline_ms:
            done = complete_sites(view, self)
            late = [s for s in view.row.participants if s not in done]
            self._abort(view, f"timed out waiting for {', '.join(late)}", replan_with=tuple(done))

    def sums(self, view: RoundView) -> Mapping[str, NDArray[np.float64]] | None:
        """The released sums of ``view`` (None while the mode still waits for them)."""
        return self.mode.sums(view, self)

    def _solve(self, view: RoundView) -> None:
        settings = self.config.round
        try:
            sums = self.sums(view)
            if sums is None:
                return  # e.g. CKKS: the decryptor has not answered every job yet
            if settings.dp is not None:
                first_round = None
                if view.row.number == 2:
                    first = self.find(view.row.parent_round_id)
                    first_sums = self.sums(first)
                    if first_sums is None:
                        raise AggregationError(f"round {first.round_id!r} has no released sums")
                    first_round = (first.row.plan or b"", first_sums)
                weights = solve_dp_run(
                    view.row.plan or b"",
                    sums,
                    parent=first_round,
                    classes=settings.classes,
                    gamma=settings.gamma,
                    refinement=settings.refinement,
                )
            elif view.row.number == 1:
                weights = solve_round_one(
                    view.releases,
                    sums,
                    classes=settings.classes,
                    participants=view.row.participants,
                    gram_scope=settings.gram_scope,
                    gamma=settings.gamma,
                )
            else:
                parent = self.find(view.row.parent_round_id)
                parent_sums = self.sums(parent)
                if parent_sums is None:
                    raise AggregationError(f"round {parent.round_id!r} has no released sums")
                weights = solve_round_two(
                    parent.releases,
                    parent_sums,
                    view.releases,
                    sums,
                    classes=settings.classes,
                    gamma=settings.gamma,
                    alpha=settings.refinement.alpha,
                )
        except AggregationError as exc:
            self._abort(view, f"solve failed: {exc}")
            return
        assert view.row.plan is not None
        signed = build_signed_model(
            weights,
            identity_key=self._key,
            federation_id=self.config.federation_id,
            round_id=view.round_id,
            round_number=view.row.number,
            classes=settings.classes,
            gamma=settings.gamma,
            backbone=settings.backbone,
            contributors=self.mode.contributors(view),
            plan_bytes=view.row.plan,
        )
        self.store.put_model(view.round_id, model=signed.model, signature=signed.signature)
        self._set_stage(view, Stage.PUBLISHED)
        self.metrics.rounds.labels(outcome="published").inc()
        if view.row.number == 1 and settings.rounds == 2:
            following = self._new_round(
                number=2,
                parent=view.round_id,
                participants=view.row.participants,
                timeout_s=settings.upload_timeout_s,
            )
            self._open(following, view.row.participants)
