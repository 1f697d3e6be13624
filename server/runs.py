"""The coordinator's runs: the queue of submitted runs, the one active run, how a run ends and
what it published (docs/architecture.md §2, "Runs"). The rounds of a run are the round machine's
(:mod:`afl.server.rounds`); it asks this module which run comes next and tells it when one ends.
Each change of a run and its audit record are one :meth:`Store.transaction`."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from afl.proto.v1 import coordinator_pb2 as pb
from afl.server.config import RoundSettings, ServerConfig, run_settings, settings_table
from afl.server.errors import RefusedError, WrongStageError
from afl.server.modes.base import AggregationMode, ModeEnvironment
from afl.server.modes.ckks_context import CkksContexts
from afl.server.modes.registry import mode_for
from afl.server.plan.history import submission_audit
from afl.server.store import ENDED_RUN_STATES, EnrolmentRow, RunRow, Store

__all__ = ["Run", "Runs"]

log = logging.getLogger("afl.server.runs")
_DAY_MS = 86_400_000


@dataclass
class Run:
    """A run: its stored row, its validated settings and its aggregation mode."""

    row: RunRow
    settings: RoundSettings
    mode: AggregationMode

    @property
    def run_id(self) -> str:
        return self.row.run_id

    def gated(self, number: int) -> bool:
        """Whether round ``number`` is the evaluation round of the run's validation gate."""
        return self.settings.gate is not None and number == self.settings.rounds + 1

    def min_sites(self, number: int) -> int:
        """The fewest sites a replacement of round ``number`` needs: [round]
        min_participants, or in the gate round [round.gate] min_sites."""
        gate = self.settings.gate
        return (
            gate.min_sites
            if gate is not None and self.gated(number)
            else self.settings.min_participants
        )

    def refuses(self, enrolment: EnrolmentRow) -> str:
        """Why an enrolled site cannot take part in this run ("" if it can): its declared
        backbone or d differ from the run's, its features come from a random-init backbone and
        the run is no test ([round] allow_random_init), they come from other weights than the
        run pins ([round] backbone_sha256), or the run plans per class and the site did not
        disclose the classes it labels."""
        s, run_id = self.settings, self.run_id
        if s.gram_scope == "per-class" and not enrolment.labelled_classes:
            return (
                f"run {run_id} plans per class (gram_scope = 'per-class') and needs the "
                "classes each site labels; this site disclosed none: set [policy] "
                "disclose_coverage = true in its client.toml (docs/protocol.md §6)"
            )
        if enrolment.random_init and not s.allow_random_init:
            return (
                f"run {run_id} refuses features of a RANDOM-INIT backbone (test features); "
                "re-extract with the federation's weights, or the run must set allow_random_init"
            )
        digest = enrolment.weights_sha256.lower()
        if s.backbone_sha256 and digest != s.backbone_sha256 and not enrolment.random_init:
            return (
                f"run {run_id} pins weights sha256 {s.backbone_sha256} ([round] "
                f"backbone_sha256), the site declared {digest or 'no digest'}"
            )
        if s.backbone and enrolment.backbone and enrolment.backbone != s.backbone:
            return (
                f"run {run_id} needs features from {s.backbone!r}, the site declared "
                f"{enrolment.backbone!r}"
            )
        if enrolment.feature_dim and enrolment.feature_dim != s.feature_dim:
            return (
                f"run {run_id} needs d = {s.feature_dim}, the site declared "
                f"d = {enrolment.feature_dim}"
            )
        return ""


class Runs:
    """The runs of one federation's store; call with the round machine's lock held."""

    def __init__(self, config: ServerConfig, store: Store, ckks_contexts: CkksContexts) -> None:
        self.config, self.store, self.ckks_contexts = config, store, ckks_contexts
        self._cache: dict[str, Run] = {}
        self._next_purge_ms = 0
        self._next_retry_ms = 0

    def bootstrap(self) -> None:
        """The first start creates the run of server.toml's [round] (and gives it the rounds of
        a state folder written before runs existed: the round machine ends it if they ended)."""
        if self.store.run_count():
            return
        legacy = bool(self.store.rounds())
        table = settings_table(self.config.round)  # no history but a legacy folder's own rounds
        run_id = self.submit("initial", table, by="server.toml", audit=False)
        if legacy:
            with self.store.transaction():
                self.store.attach_rounds(run_id)
                self.store.update_run(run_id, state="active")

    def get(self, run_id: str) -> Run:
        """A run with its settings and mode (built once per process)."""
        cached = self._cache.get(run_id)
        if cached is not None:  # its settings never change: read what does (no JSON to parse)
            status = self.store.run_status(run_id)
            if status is None:
                raise WrongStageError(f"no run {run_id!r} on this server")
            state, reason, finished_ms = status
            cached.row = replace(cached.row, state=state, reason=reason, finished_ms=finished_ms)
            return cached
        row = self.store.run_row(run_id)
        if row is None:
            raise WrongStageError(f"no run {run_id!r} on this server")
        settings = run_settings(row.settings, source=f"run {run_id}", sites=self.config.sites)
        env = ModeEnvironment(self.config, settings, self.ckks_contexts)
        run = self._cache[run_id] = Run(row, settings, mode_for(env))
        return run

    def active(self) -> Run | None:
        active = self.store.run_ids(state="active")
        return self.get(active[0]) if active else None

    def next_queued(self) -> Run | None:
        """The oldest queued run when no run is active (the run to start), else None."""
        if self.store.run_ids(state="active"):
            return None
        queued = self.store.runs(state="queued")
        return self.get(queued[0].run_id) if queued else None

    def submit(self, name: str, table: Mapping[str, Any], *, by: str, audit: bool = True) -> str:
        """Queue a run with the [round] settings ``table``; returns its id.

        With ``audit``, the run's first plan, predicted over every member it names, is audited
        with the federation's released history first (:func:`submission_audit`, M-124): a run
        that would expose a site is not stored; its "run-submit-refused" record is, and
        :class:`RefusedError` says which site, through which releases, and what to do instead.
        A run whose members or coverage are not known at submission, or with DP, passes: the
        plan-time audit stays the gate. A coordinator operator who skips this audit is held
        only by the sites' own audit (docs/protocol.md M-206)."""
        settings = run_settings(table, source=f"run {name!r}", sites=self.config.sites)
        if audit:
            refusal, refused = submission_audit(self.store, settings, name=name)
            if refusal:
                assert refused is not None
                with self.store.transaction():
                    self.store.audit("run-submit-refused", {"by": by, **refused})
                log.warning("run refused at submission", extra={"run": name, "reason": refusal})
                raise RefusedError(refusal)
        run_id = f"run-{self.store.run_count() + 1}"
        detail = {
            "run_id": run_id,
            "name": name or run_id,
            "by": by,
            "aggregation": settings.aggregation,
            "gram_scope": settings.gram_scope,
            "rounds": settings.rounds,
            "dp": settings.dp is not None,
        }
        with self.store.transaction():
            self.store.create_run(
                run_id=run_id, name=name or run_id, settings=dict(table), submitted_by=by
            )
            self.store.audit("run-submitted", detail)
        return run_id

    def start(self, run: Run) -> None:
        """Make a queued run the active one."""
        with self.store.transaction():
            self.store.update_run(run.run_id, state="active")
            self.store.audit("run-started", {"run_id": run.run_id})
        log.info("run started", extra={"run_id": run.run_id})

    def finish(self, run_id: str, state: str, reason: str, *, at_ms: int) -> None:
        """End a run PUBLISHED, ABORTED or FAILED (the validation gate); its mode forgets its rounds, and with no payload
        retention its payloads are deleted at once."""
        model = self.published(run_id)
        detail = {
            "run_id": run_id,
            "state": state,
            "reason": reason,
            "model_round_id": model[0] if model else "",
            "model_sha256": hashlib.sha256(model[1]).hexdigest() if model else "",
        }
        with self.store.transaction():
            self.store.update_run(run_id, state=state, reason=reason, at_ms=at_ms)
            self.store.audit("run-finished", detail)
        log.info("run finished", extra={"run_id": run_id, "state": state, "reason": reason})
        run = self.get(run_id)
        for row in self.store.rounds(run_id):
            run.mode.forget(row.round_id)
        if self.config.payload_retention_days <= 0:
            self._purge(run_id)
        if self.config.report_retention_days == 0:
            self._purge_reports(run_id)

    def published(
        self, run_id: str, *, evaluation: bool = False
    ) -> tuple[str, bytes, bytes] | None:
        """(round id, signed bytes, signature) of the run's final published model, or with
        ``evaluation`` of its published evaluation (the round after the last model round)."""
        last = self.get(run_id).settings.rounds
        rounds = [
            r
            for r in self.store.rounds(run_id)
            if r.stage == pb.ROUND_STAGE_PUBLISHED and (r.number > last) == evaluation
        ]
        if not rounds:
            return None
        round_id = rounds[-1].round_id
        if evaluation:
            found = self.store.evaluation(round_id)
            return None if found is None else (round_id, *found)
        return self.store.model(round_id)

    def _purge(self, run_id: str) -> None:
        self.store.purge_payloads(
            [r.round_id for r in self.store.rounds(run_id)], audit={"run_id": run_id}
        )

    def _purge_reports(self, run_id: str) -> None:
        days = self.config.report_retention_days
        self.store.purge_reports(
            [r.round_id for r in self.store.rounds(run_id)],
            reason=f"[retention] reports_days = {days}: run {run_id} ended",
        )

    def retry_erasures(self, now_ms: int) -> None:
        """At most once a minute, hand the payload files the background eraser could not erase
        over again (whatever the retention settings: a run's payloads are erased when it ends
        by default)."""
        if now_ms < self._next_retry_ms:
            return
        self._next_retry_ms = now_ms + 60_000
        self.store.retry_erasures()

    def purge_due(self, now_ms: int) -> None:
        """Delete the payloads of runs that ended more than ``payload_days`` ago and the reports
        of those that ended more than ``reports_days`` ago (retention)."""
        if now_ms < self._next_purge_ms:
            return
        self._next_purge_ms = now_ms + 60_000
        keep_ms = self.config.payload_retention_days * _DAY_MS
        reports = self.config.report_retention_days
        for row in self.store.runs():
            if row.state not in ENDED_RUN_STATES:
                continue
            if row.finished_ms + keep_ms <= now_ms:
                self._purge(row.run_id)
            if reports is not None and row.finished_ms + reports * _DAY_MS <= now_ms:
                self._purge_reports(row.run_id)
