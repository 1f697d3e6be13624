"""The coordinator's round state machine (issue 4, design §5, §9).

    WAITING_FOR_PARTICIPANTS --all expected enrolled, or >= min_participants at the enrol
        deadline--> PLAN_REVIEW (signed plan published)
    PLAN_REVIEW --every participant accepted--> UPLOAD
    UPLOAD --every member's upload of every release stored--> SOLVING --> PUBLISHED
    PUBLISHED (round 1, rounds = 2) --> round 2 opens in PLAN_REVIEW (same participants)

A refusal, or the upload deadline passing, ABORTS the round (nothing is released: a plan binds
one cohort) and, when at least ``min_participants`` sites remain (those that did not refuse;
after a timeout, those that completed), opens a replacement round with them and a new plan.
Sites that accepted may upload while others are still reviewing. Every transition is committed
to the :class:`~afl.server.store.Store` first, so a restarted coordinator resumes the open
round from SQLite; payloads already received are kept, never re-requested.

All public methods take the caller's site id (from its certificate) and serialise on one lock.
The aggregation mode is a strategy object (:mod:`afl.server.modes`).
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from numpy.typing import NDArray

from afl.core.aggregation import AggregationError
from afl.proto.v1 import coordinator_pb2 as pb
from afl.server.config import ServerConfig
from afl.server.dp_plan import apply_dp, audit_dp_plan, calibrate, dp_releases
from afl.server.dp_solve import solve_dp_round
from afl.server.errors import NotPermittedError, WrongStageError
from afl.server.modes import AggregationStrategy
from afl.server.observability import ServerMetrics
from afl.server.plan import (
    PlannedRelease,
    audit_plan,
    build_plan,
    releases_from_plan,
    round1_releases,
    round2_releases,
    sign_plan,
)
from afl.server.solve import build_signed_model, solve_round_one, solve_round_two
from afl.server.store import RoundRow, Store

__all__ = ["RoundMachine", "RoundView", "Stage", "stage_name"]

log = logging.getLogger("afl.server.rounds")


def stage_name(stage: int) -> str:
    """Name of a RoundStage value, e.g. "ROUND_STAGE_UPLOAD"."""
    return pb.RoundStage.Name(stage)  # type: ignore[arg-type]


class Stage:
    """RoundStage values used by the plaintext mode."""

    WAITING = pb.ROUND_STAGE_WAITING_FOR_PARTICIPANTS
    PLAN_REVIEW = pb.ROUND_STAGE_PLAN_REVIEW
    UPLOAD = pb.ROUND_STAGE_UPLOAD
    SOLVING = pb.ROUND_STAGE_SOLVING
    PUBLISHED = pb.ROUND_STAGE_PUBLISHED
    ABORTED = pb.ROUND_STAGE_ABORTED
    ACCEPTING_UPLOADS = (pb.ROUND_STAGE_PLAN_REVIEW, pb.ROUND_STAGE_UPLOAD)


@dataclass(frozen=True)
class RoundView:
    """A round row plus the releases of its plan (empty before the plan exists)."""

    row: RoundRow
    releases: tuple[PlannedRelease, ...]

    @property
    def round_id(self) -> str:
        return self.row.round_id


class RoundMachine:
    """Transitions of the round state machine; :class:`Coordinator` adds the requests."""

    def __init__(
        self,
        config: ServerConfig,
        store: Store,
        identity_key: Ed25519PrivateKey,
        *,
        strategy: AggregationStrategy,
        metrics: ServerMetrics,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config, self.store, self._key = config, store, identity_key
        self.strategy, self.metrics, self.clock = strategy, metrics, clock
        self.lock = threading.Condition()
        self.events: list[pb.RoundEvent] = []
        with self.lock:
            if store.rounds():
                return
            self._new_round(
                number=1,
                parent="",
                stage=Stage.WAITING,
                participants=config.round.participants,
                timeout_s=config.round.enrol_timeout_s,
            )

    # --- reading -----------------------------------------------------------------------------

    def now_ms(self) -> int:
        return int(self.clock() * 1000)

    def view(self, row: RoundRow) -> RoundView:
        releases = releases_from_plan(row.plan) if row.plan else []
        return RoundView(row, tuple(releases))

    def current(self) -> RoundView:
        return self.view(self.store.rounds()[-1])

    def find(self, round_id: str) -> RoundView:
        if not round_id:
            return self.current()
        for row in self.store.rounds():
            if row.round_id == round_id:
                return self.view(row)
        raise WrongStageError(f"no round {round_id!r} on this server")

    def status(self, view: RoundView, site_id: str) -> pb.RoundStatus:
        decisions = self.store.decisions(view.round_id)
        uploads = self.store.uploads(view.round_id)
        return pb.RoundStatus(
            round_id=view.round_id,
            round_number=view.row.number,
            stage=view.row.stage,  # type: ignore[arg-type]
            participants=list(view.row.participants),
            stage_deadline_unix_ms=view.row.deadline_ms,
            abort_reason=view.row.abort_reason,
            caller_accepted_plan=decisions.get(site_id, (False, ""))[0],
            caller_uploads_complete=sorted(r for (s, r) in uploads if s == site_id),
        )

    # --- transitions -------------------------------------------------------------------------

    def _new_round(
        self,
        *,
        number: int,
        parent: str,
        stage: int,
        participants: tuple[str, ...],
        timeout_s: float,
    ) -> str:
        round_id = f"r{number}-{secrets.token_hex(8)}"
        deadline = self.now_ms() + int(timeout_s * 1000)
        self.store.create_round(
            round_id=round_id,
            number=number,
            parent_round_id=parent,
            stage=stage,
            participants=participants,
            deadline_ms=deadline,
        )
        self.store.audit(
            "round-created",
            {"round_id": round_id, "number": number, "participants": list(participants)},
        )
        log.info("round created", extra={"round_id": round_id, "number": number})
        self._emit(round_id)
        return round_id

    def _emit(self, round_id: str) -> None:
        view = self.find(round_id)
        self.metrics.stage.set(view.row.stage)
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
            "stage",
            {"round_id": view.round_id, "stage": stage_name(stage), "reason": reason},
        )
        log.info(
            "round stage",
            extra={
                "round_id": view.round_id,
                "stage": stage_name(stage),
                "reason": reason,
            },
        )
        self._emit(view.round_id)

    def _open(self, view: RoundView, participants: tuple[str, ...]) -> None:
        """Publish the signed plan of a round over ``participants``."""
        settings = self.config.round
        if view.row.number == 1:
            coverage = {s: e.labelled_classes for s, e in self.store.enrolments().items()}
            releases = round1_releases(
                classes=settings.classes,
                participants=participants,
                coverage=coverage,
                gram_scope=settings.gram_scope,
                d=settings.feature_dim,
                need_global_gram=settings.rounds == 2,
            )
        else:
            releases = round2_releases(
                classes=settings.classes, participants=participants, d=settings.feature_dim
            )
        dp = settings.dp if view.row.number == 1 else None
        if dp is not None:  # DP mode releases additive statistics (design §8, dp_plan)
            releases = dp_releases(
                classes=settings.classes,
                participants=participants,
                coverage=coverage,
                gram_scope=settings.gram_scope,
                d=settings.feature_dim,
            )
            report = audit_dp_plan(releases, participants)
        else:
            report = audit_plan(releases, participants)
        self.store.audit("plan-audit", {"round_id": view.round_id, **report.to_dict()})
        calibration = None
        if dp is not None:
            try:
                calibration = calibrate(
                    releases,
                    dp,
                    participants=participants,
                    plaintext=self.strategy.name == "plaintext",
                )
            except ValueError as exc:
                self._set_stage(view, Stage.ABORTED, reason=f"DP calibration failed: {exc}")
                self.metrics.rounds.labels(outcome="aborted").inc()
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
            self._set_stage(
                view,
                Stage.ABORTED,
                reason=(
                    "the per-class release plan fails the leakage audit (design §5); set "
                    "operator_override with a reason, or use gram_scope = 'global'"
                ),
            )
            self.metrics.rounds.labels(outcome="aborted").inc()
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
            **self._mode_hook("plan_options", participants, default={}),
        )
        if calibration is not None:
            apply_dp(plan, calibration)
            try:  # MASK: fixed-point bounds of the noised statistics (afl.server.dp_mask)
                self._mode_hook("dp_encodings", plan, default=None)
            except ValueError as exc:
                self._set_stage(view, Stage.ABORTED, reason=f"DP encoding failed: {exc}")
                self.metrics.rounds.labels(outcome="aborted").inc()
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

    def _abort_and_replan(self, view: RoundView, reason: str, keep: tuple[str, ...]) -> None:
        self._set_stage(view, Stage.ABORTED, reason=reason)
        self.metrics.rounds.labels(outcome="aborted").inc()
        if len(keep) >= self.config.round.min_participants:
            new_id = self._new_round(
                number=view.row.number,
                parent=view.row.parent_round_id,
                stage=Stage.WAITING,
                participants=keep,
                timeout_s=self.config.round.upload_timeout_s,
            )
            self._open(self.find(new_id), keep)
        else:
            log.warning(
                "round aborted; too few sites remain for a replacement round",
                extra={"round_id": view.round_id, "remaining": len(keep)},
            )

    def advance(self) -> None:
        """Apply every transition that is due (call with the lock held)."""
        for _ in range(8):  # a few transitions may chain (publish -> round 2 opens)
            before = self.current()
            self._step(before)
            after = self.current()
            if after.row == before.row:
                return

    def _step(self, view: RoundView) -> None:
        stage, now, settings = view.row.stage, self.now_ms(), self.config.round
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
            return
        if self._mode_hook("drive", self, view, default=False):
            return  # the mode ran its own stages (e.g. MASK's key exchange, design §6)
        if stage in Stage.ACCEPTING_UPLOADS:
            decisions = self.store.decisions(view.round_id)
            refused = sorted(s for s, (ok, _) in decisions.items() if not ok)
            if refused:
                reasons = "; ".join(f"{s}: {decisions[s][1]}" for s in refused)
                keep = tuple(s for s in view.row.participants if s not in refused)
                self._abort_and_replan(view, f"plan refused by {reasons}", keep)
                return
            accepted = [s for s in view.row.participants if s in decisions]
            done = self._complete_sites(view)
            if len(accepted) == len(view.row.participants):
                if stage == Stage.PLAN_REVIEW:
                    self._set_stage(view, Stage.UPLOAD)
                    return
                if len(done) == len(view.row.participants):
                    self._set_stage(view, Stage.SOLVING)
                    return
            if now >= view.row.deadline_ms:
                late = [s for s in view.row.participants if s not in done]
                self._abort_and_replan(
                    view, f"timed out waiting for {', '.join(late)}", tuple(done)
                )
            return
        if stage == Stage.SOLVING:
            self._solve(view)

    def _complete_sites(self, view: RoundView) -> list[str]:
        uploaded = set(self.store.uploads(view.round_id))
        return [
            s
            for s in view.row.participants
            if all((s, r.name) in uploaded for r in view.releases if s in r.members)
        ]

    def _mode_hook(self, name: str, *args: Any, default: Any) -> Any:
        """Call the strategy's optional hook ``name`` (modes with their own stages define
        ``plan_options``, ``drive``, ``decoded_sums``, ``contributors``); else ``default``."""
        hook = getattr(self.strategy, name, None)
        return default if hook is None else hook(*args)

    def sums(self, view: RoundView) -> dict[str, NDArray[np.float64]]:
        decoded = self._mode_hook("decoded_sums", view, default=None)
        if decoded is not None:
            return dict(decoded)
        uploads = self.store.uploads(view.round_id)
        out: dict[str, NDArray[np.float64]] = {}
        for release in view.releases:
            payloads: Mapping[str, bytes] = {
                s: self.store.read_payload(uploads[(s, release.name)]) for s in release.members
            }
            out[release.name] = self.strategy.release_sum(release, payloads)
        return out

    def _solve(self, view: RoundView) -> None:
        settings = self.config.round
        try:
            if view.row.number == 1 and settings.dp is not None:
                weights = solve_dp_round(
                    view.releases, self.sums(view), classes=settings.classes, gamma=settings.gamma
                )
            elif view.row.number == 1:
                weights = solve_round_one(
                    view.releases,
                    self.sums(view),
                    classes=settings.classes,
                    participants=view.row.participants,
                    gram_scope=settings.gram_scope,
                    gamma=settings.gamma,
                )
            else:
                parent = self.find(view.row.parent_round_id)
                weights = solve_round_two(
                    parent.releases,
                    self.sums(parent),
                    view.releases,
                    self.sums(view),
                    classes=settings.classes,
                    gamma=settings.gamma,
                    alpha=settings.refinement.alpha,
                )
        except AggregationError as exc:
            self._set_stage(view, Stage.ABORTED, reason=f"solve failed: {exc}")
            self.metrics.rounds.labels(outcome="aborted").inc()
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
            contributors=self._mode_hook("contributors", view, default=view.row.participants),
            plan_bytes=view.row.plan,
        )
        self.store.put_model(view.round_id, model=signed.model, signature=signed.signature)
        self._set_stage(view, Stage.PUBLISHED)
        self.metrics.rounds.labels(outcome="published").inc()
        if view.row.number == 1 and settings.rounds == 2:
            new_id = self._new_round(
                number=2,
                parent=view.round_id,
                stage=Stage.WAITING,
                participants=view.row.participants,
                timeout_s=settings.upload_timeout_s,
            )
            self._open(self.find(new_id), view.row.participants)

    def require_participant(self, view: RoundView, site_id: str) -> None:
        if site_id not in view.row.participants:
            raise NotPermittedError(
                f"site {site_id!r} is not a participant of round {view.round_id!r}"
            )
