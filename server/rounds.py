"""The round machine: the stages of the active run's rounds and the transitions between them
(docs/architecture.md §2, "The life of a round at the coordinator"). It only moves stages: the
run queue is :mod:`afl.server.runs`, opening a plan :mod:`afl.server.plan.open`, solving
:mod:`afl.server.solve.publish`, and each mode's exchange stages :mod:`afl.server.modes`, whose
:class:`~afl.server.modes.base.Transition` :meth:`RoundMachine.apply` carries out. Every
transition commits its state and its audit record in ONE :meth:`Store.transaction`, then
announces a round event, so a restarted coordinator resumes the open round. The machine is the
modes' :class:`~afl.server.modes.base.RoundContext`; call every method with :attr:`lock` held.

Under a validation gate ([round.gate], :mod:`afl.server.solve.gate`) the final round stores a
candidate and waits in VALIDATING while the evaluation round scores it; that round publishes
the candidate or ABORTS its round, and the run ends PUBLISHED or FAILED with the gate's reason.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from numpy.typing import NDArray

from afl.crypto.transparency.statements import roster_digest, roster_fields, roster_statement
from afl.proto.v1 import coordinator_pb2 as pb
from afl.proto.wire import release_statement_fields, stage_name
from afl.server.config import ServerConfig, merged_run_table
from afl.server.daemon.observability import ServerMetrics
from afl.server.errors import NotPermittedError, WrongStageError
from afl.server.events import RoundEvents
from afl.server.modes.base import (
    DECISION_JOURNAL_KIND,
    AggregationMode,
    Transition,
    decoded_releases,
)
from afl.server.modes.ckks_context import CkksContexts
from afl.server.modes.context import StoreContext
from afl.server.plan.open import open_plan
from afl.server.plan.release import RoundView, releases_from_plan
from afl.server.runs import Run, Runs
from afl.server.solve.gate import GateVerdict
from afl.server.solve.publish import Publication, SolveFailed, Solver
from afl.server.store import ENDED_RUN_STATES, RoundRow, Store

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
    VALIDATING = pb.ROUND_STAGE_VALIDATING
    FINAL = (pb.ROUND_STAGE_PUBLISHED, pb.ROUND_STAGE_ABORTED)


class RoundMachine(StoreContext):
    """The transitions of the active run's rounds; :class:`afl.server.coordinator.Coordinator`
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
        self.runs = Runs(config, store, self.ckks_contexts)
        self.solver = Solver(identity_key, config.federation_id, self)
        self.lock = threading.Condition()
        self.announcer = RoundEvents(store, self.lock, metrics, self.now_ms)
        self.events = self.announcer.events  # what WatchRound streams
        self.notes: dict[str, str] = {}  # site -> why it takes no part in the current round
        #: Sums this coordinator decoded (:meth:`sums`, a mode's ``note_decoded``): an abort
        #: after that still logs their release (:meth:`_log_stage`). A restart re-decodes first.
        self.decoded = {}
        keys = {s: e.identity_public_key for s, e in config.sites.items()}
        self.roster_sha256 = roster_digest(federation=config.federation_id, keys=keys)
        with self.lock:
            self._log_roster(keys)
            self.runs.bootstrap()
            self._activate_next()

    def _log_roster(self, keys: dict[str, bytes]) -> None:
        """Append the roster to the federation log unless its newest roster statement is this
        one (M-220): every roster change is a statement every witness sees."""
        entry = roster_statement(federation=self.config.federation_id, keys=keys)
        logged = [e for _, kind, e, _ in self.store.log_entries(0, self.store.log_size())
                  if kind == "roster"]  # fmt: skip
        if logged and logged[-1] == entry:
            return
        with self.store.transaction():
            fields = roster_fields(federation=self.config.federation_id, keys=keys)
            self.store.append_log("roster", fields)
            self.store.audit("roster", {"roster_sha256": self.roster_sha256.hex()})

    # --- runs (afl.server.runs) --------------------------------------------------------------

    def run(self, run_id: str) -> Run:
        return self.runs.get(run_id)

    def run_of(self, view: RoundView) -> Run:
        return self.runs.get(view.row.run_id)

    def mode_of(self, view: RoundView) -> AggregationMode:
        return self.run_of(view).mode

    def active_run(self) -> Run | None:
        return self.runs.active()

    def submit_run(self, name: str, overrides: Mapping[str, Any], *, submitted_by: str) -> Run:
        """Queue a run whose settings are server.toml's [round] updated with ``overrides``;
        :class:`ConfigError` names a bad key."""
        table = merged_run_table(self.config.round, overrides)
        run_id = self.runs.submit(name, table, by=submitted_by)
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
        """Start the oldest queued run when none is active: its round 1 waits for its sites."""
        run = self.runs.next_queued()
        if run is None:
            return
        with self.announcer.transition():  # a run is never active without its round 1
            self.runs.start(run)
            self._new_round(
                run,
                number=1,
                parent="",
                participants=run.settings.participants,
                timeout_s=run.settings.enrol_timeout_s,
            )

    def _finish_run(self, run_id: str, state: str, reason: str) -> None:
        self.runs.finish(run_id, state, reason, at_ms=self.now_ms())
        self._activate_next()

    # --- reading -----------------------------------------------------------------------------

    def view(self, row: RoundRow) -> RoundView:
        releases = releases_from_plan(row.plan) if row.plan else []
        return RoundView(row, tuple(releases))

    def current(self) -> RoundView:
        """The open round of the active run, or the last round when no run is active."""
        active = self.active_run()
        rounds = self.store.rounds(active.run_id) if active is not None else []
        rounds = rounds or self.store.rounds()
        if not rounds:
            raise WrongStageError("no round has been created yet")
        return self.view(rounds[-1])

    def find(self, round_id: str) -> RoundView:
        """The round ``round_id`` (the current round for ""; requests that must name a round
        pass ``round_id or "-"``, which matches none)."""
        if not round_id:
            return self.current()
        row = self.store.round(round_id)
        if row is None:
            raise WrongStageError(f"no round {round_id!r} on this server")
        return self.view(row)

    def sums(self, view: RoundView) -> Mapping[str, NDArray[np.float64]] | None:
        """The released sums of ``view`` (None while the mode still waits for them); when they
        are there, the "sums-decoded" audit record names each release and the SHA-256 of its
        decoded values, and the sites they contain (docs/protocol.md M-163)."""
        mode = self.mode_of(view)
        sums = mode.sums(view, self)
        if sums is not None:
            self.note_decoded(view.round_id, dict.fromkeys(sums, mode.contributors(view)))
            self.store.audit(
                "sums-decoded",
                {
                    "round_id": view.round_id,
                    "releases": decoded_releases(sums),
                    "contributors": sorted(mode.contributors(view)),
                },
            )
        return sums

    def evaluation_rows(self, round_id: str) -> dict[str, str]:
        """Each site's ``evaluation_rows`` from its journaled, signed acceptance of the plan."""
        out = {}
        for message in self.store.messages(round_id):
            if message.kind == DECISION_JOURNAL_KIND:
                out[message.site_id] = pb.PlanDecision.FromString(message.data).evaluation_rows
        return out

    def require_participant(self, view: RoundView, site_id: str) -> None:
        if site_id not in view.row.participants:
            raise NotPermittedError(
                f"site {site_id!r} is not a participant of round {view.round_id!r}"
            )

    def status(self, view: RoundView, site_id: str) -> pb.RoundStatus:
        decision = self.store.decision(view.round_id, site_id)
        uploads = self.store.site_uploads(view.round_id, site_id)
        return pb.RoundStatus(
            round_id=view.round_id,
            round_number=view.row.number,
            stage=view.stage,  # type: ignore[arg-type]
            participants=list(view.row.participants),
            stage_deadline_unix_ms=view.row.deadline_ms,
            abort_reason=view.row.abort_reason,
            caller_accepted_plan=decision is not None and decision[0],
            caller_uploads_complete=sorted(uploads),
            run_id=view.row.run_id,
        )

    # --- transitions -------------------------------------------------------------------------

    def advance(self) -> None:
        """Apply every transition that is due."""
        for _ in range(32):  # transitions chain (publish -> round 2 opens; a run ends -> next)
            before = self.current()
            self._step(before)
            if self.current().row == before.row:
                break
        self.runs.retry_erasures(self.now_ms())
        if self.config.payload_retention_days > 0 or self.config.report_retention_days:
            self.runs.purge_due(self.now_ms())

    def _step(self, view: RoundView) -> None:
        if not view.row.run_id:
            return
        run = self.run_of(view)
        stage, now = view.stage, self.now_ms()
        if stage in Stage.FINAL:
            if run.row.state == "active":
                self._close(view, run)
        elif stage == Stage.VALIDATING:  # the gate round opens
            self._close(view, run)
        elif stage == Stage.WAITING:
            self._wait(view, run, now)
        elif stage == Stage.PLAN_REVIEW:
            self._review(view, run, now)
        elif stage in run.mode.exchange_stages:
            transition = run.mode.drive(view, self)
            if transition is not None:
                self.apply(view, transition)
        elif stage == Stage.SOLVING:
            self._solve(view, run)

    def apply(self, view: RoundView, transition: Transition) -> None:
        """Carry out a transition a mode (or this machine) decided on."""
        if transition.stage == Stage.ABORTED:
            self._abort(view, transition.reason, replan_with=transition.replan_with)
            return
        deadline = None
        if transition.timeout_s is not None:
            deadline = self.now_ms() + int(transition.timeout_s * 1000)
        self._set_stage(view, transition.stage, reason=transition.reason, deadline_ms=deadline)

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
        with self.announcer.transition():
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
            self._emit(round_id)
        log.info("round created", extra={"round_id": round_id, "number": number})
        return self.find(round_id)

    def _emit(self, round_id: str) -> None:
        self.announcer.emit(self.status(self.find(round_id), ""))

    def _set_stage(
        self,
        view: RoundView,
        stage: int,
        *,
        reason: str = "",
        deadline_ms: int | None = None,
        publication: Publication | None = None,
    ) -> None:
        """Move ``view`` to ``stage``; a PUBLISHED round's ``publication`` is stored in the same
        transaction and its digests go into the stage record."""
        with self.announcer.transition():
            detail = publication.store(self.store) if publication is not None else {}
            self.store.update_round(
                view.round_id,
                stage=stage,
                deadline_ms=view.row.deadline_ms if deadline_ms is None else deadline_ms,
                abort_reason=reason,
            )
            self.store.audit(
                "stage",
                {"round_id": view.round_id, "stage": stage_name(stage), "reason": reason, **detail},
            )
            self._log_stage(view, stage, reason=reason, detail=detail)
            self._emit(view.round_id)
        log.info(
            "round stage",
            extra={"round_id": view.round_id, "stage": stage_name(stage), "reason": reason},
        )

    def _log_stage(
        self, view: RoundView, stage: int, *, reason: str, detail: dict[str, object]
    ) -> None:
        """The federation-log statement of a round's end (inside its transition): a release
        names the survivors its sums were unmasked or decrypted over and what was published. A
        round aborted after its sums were decoded logs its release too (``"published": false``)
        before its abort: the coordinator learned those sums, so every site's whole-history
        audit (M-206) must count them."""
        if stage == Stage.ABORTED:
            decoded = self.decoded.get(view.round_id)  # a VALIDATING round's is logged already
            if decoded:
                fields = self._release_fields(view, decoded=decoded)
                self.store.append_log("release", {**fields, "published": False})
            self.store.append_log("round-aborted", {"round_id": view.round_id, "reason": reason})
        elif detail:  # PUBLISHED or VALIDATING, with what the round published
            self.store.append_log("release", {**self._release_fields(view), **detail})
        if stage in Stage.FINAL or detail:
            self.decoded.pop(view.round_id, None)

    def _release_fields(
        self, view: RoundView, *, decoded: Mapping[str, Sequence[str]] | None = None
    ) -> dict[str, object]:
        """A release statement's round, run, survivors and releases (what M-206 audits); with
        ``decoded`` (an aborted round), only those releases, each over the sites in its sum."""
        run = self.run_of(view)
        releases = [r for r in view.releases if decoded is None or r.name in decoded]
        survivors = (
            run.mode.contributors(view)
            if decoded is None
            else {s for sites in decoded.values() for s in sites}
        )
        return release_statement_fields(
            round_id=view.round_id,
            run_id=run.run_id,
            survivors=survivors,
            releases=[
                (r.name, r.kind, r.class_names, r.members if decoded is None else decoded[r.name])
                for r in releases
            ],
        )

    def _abort(
        self, view: RoundView, reason: str, *, replan_with: tuple[str, ...] | None = None
    ) -> None:
        """ABORT ``view``; with ``replan_with``, open a replacement round with those sites when
        they are at least ``min_participants`` (the gate round: [round.gate] min_sites);
        otherwise the run ends (:meth:`_close`)."""
        run = self.run_of(view)
        enough = len(replan_with or ()) >= run.min_sites(view.row.number)
        sites = replan_with if enough else None
        with self.announcer.transition():  # the aborted round and its replacement
            self._set_stage(view, Stage.ABORTED, reason=reason)
            if sites is not None:
                replacement = self._new_round(
                    run,
                    number=view.row.number,
                    parent=view.row.parent_round_id,
                    participants=sites,
                    timeout_s=run.settings.upload_timeout_s,
                )
        self.metrics.rounds.labels(outcome="aborted").inc()
        run.mode.forget(view.round_id)
        if sites is not None:
            self._open(replacement, sites)
            return
        if replan_with is not None:
            log.warning(
                "round aborted; too few sites remain for a replacement round",
                extra={"round_id": view.round_id, "remaining": len(replan_with)},
            )
        self._close(self.find(view.round_id), run)

    def _close(self, ended: RoundView, run: Run) -> None:
        """After the active run's last round ended: open its next round (round 2, or the
        evaluation round over the model's contributors, or the gate round after VALIDATING), or
        end the run. An aborted evaluation round ends the run published: its model stays; an
        aborted gate round ends it FAILED (its candidate's round aborted), or ABORTED by an
        admin. After the gate round the run ends as its candidate's round did."""
        settings, number = run.settings, ended.row.number
        gated = run.gated(number)
        if ended.stage == Stage.ABORTED:
            reason = ended.row.abort_reason
            if gated:  # the candidate was never published: the gate could not decide
                admin = reason.startswith("aborted by admin")
                why = (
                    reason if admin else f"validation gate could not score the candidate: {reason}"
                )
                self._end_candidate(ended, None, why)
                self._finish_run(run.run_id, "aborted" if admin else "failed", why)
            elif number > settings.rounds:
                self._finish_run(run.run_id, "published", f"evaluation aborted: {reason}")
            else:
                self._finish_run(run.run_id, "aborted", reason)
        elif gated:  # the gate decided: its candidate's round is PUBLISHED or ABORTED
            parent = self.find(ended.row.parent_round_id)
            failed = parent.stage == Stage.ABORTED
            self._finish_run(
                run.run_id, "failed" if failed else "published", parent.row.abort_reason
            )
        elif ended.stage == Stage.VALIDATING or number < settings.rounds + int(settings.evaluate):
            sites = ended.row.participants
            if number == settings.rounds:  # the evaluation round: the model's contributors
                sites = tuple(sorted(run.mode.contributors(ended)))
            following = self._new_round(
                run,
                number=number + 1,
                parent=ended.round_id,
                participants=sites,
                timeout_s=settings.upload_timeout_s,
            )
            self._open(following, sites)
        else:
            self._finish_run(run.run_id, "published", "")

    def _open(self, view: RoundView, participants: tuple[str, ...]) -> None:
        """Publish the signed plan of a round over ``participants`` with its audit records
        (:mod:`afl.server.plan.open`), or abort the round with the reason."""
        run = self.run_of(view)
        opened = open_plan(
            self.store,
            key=self._key,
            federation_id=self.config.federation_id,
            run=run,
            view=view,
            participants=participants,
            sums=lambda round_id: self.sums(self.find(round_id)),
            roster_sha256=self.roster_sha256,
        )
        with self.announcer.transition():
            for event, detail in opened.audits:
                self.store.audit(event, detail)
            if not opened.refusal:
                self.store.update_round(
                    view.round_id,
                    stage=Stage.PLAN_REVIEW,
                    deadline_ms=self.now_ms() + int(run.settings.upload_timeout_s * 1000),
                    participants=participants,
                    plan=opened.plan,
                    plan_signature=opened.signature,
                )
                self.store.audit(
                    "plan-published",
                    {"round_id": view.round_id, "releases": list(opened.releases)},
                )
                self._emit(view.round_id)
        if opened.refusal:
            self._abort(view, opened.refusal)

    def _wait(self, view: RoundView, run: Run, now: int) -> None:
        enrolments = self.store.enrolments()
        expected = set(view.row.participants)
        notes = {
            s: why
            for s in sorted(expected & set(enrolments))
            if (why := run.refuses(enrolments[s]))
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

    def _solve(self, view: RoundView, run: Run) -> None:
        """SOLVING: publish what the sums give (:mod:`afl.server.solve.publish`), or abort."""
        outcome = self.solver.solve(view, run)
        if isinstance(outcome, SolveFailed):
            self._abort(view, outcome.reason)
        elif outcome is not None:
            with self.announcer.transition():  # the gate's decision and its evaluation: one
                if outcome.verdict is not None:
                    self._end_candidate(view, outcome.verdict, outcome.verdict.reason())
                stage = Stage.VALIDATING if outcome.candidate else Stage.PUBLISHED
                self._set_stage(view, stage, publication=outcome)
            if not outcome.candidate:
                self.metrics.rounds.labels(outcome="published").inc()

    # --- the validation gate (afl.server.solve.gate) -------------------------------------------

    def _end_candidate(self, gate: RoundView, verdict: GateVerdict | None, reason: str) -> None:
        """Decide the candidate of the gate round's parent: publish it (``verdict`` passed: the
        same ``Model`` bytes signed "model") or ABORT its round with ``reason``; the gate's
        figures go into the audit log (event "gate") in the same transaction."""
        parent = self.find(gate.row.parent_round_id)
        if parent.stage in Stage.FINAL:  # decided before a restart
            return
        detail = verdict.to_json() if verdict is not None else {"passed": False, "reason": reason}
        passed = verdict is not None and verdict.passed
        with self.announcer.transition():
            self.store.audit(
                "gate", {"round_id": parent.round_id, "gate_round_id": gate.round_id, **detail}
            )
            if passed:
                candidate = self.store.candidate(parent.round_id)
                assert candidate is not None, "a VALIDATING round has a candidate"
                published = self.solver.publish_candidate(parent.round_id, candidate[0])
                self._set_stage(parent, Stage.PUBLISHED, publication=published)
            else:
                log.error(
                    "validation gate failed", extra={"round_id": parent.round_id, "reason": reason}
                )
                self._set_stage(parent, Stage.ABORTED, reason=reason)
        self.metrics.rounds.labels(outcome="published" if passed else "aborted").inc()
