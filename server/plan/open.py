"""Opening a round: its release plan over the chosen participants, audited for leakage,
DP-calibrated when the run adds noise, and signed (docs/architecture.md §2, "The life of a
round"). :func:`open_plan` only decides; the round machine (:mod:`afl.server.rounds`) stores the
plan with its audit records in one transaction, or aborts the round with the refusal."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from numpy.typing import NDArray

from afl.core.aggregation import AggregationError
from afl.core.dp.evaluation import DP_EVALUATION_BINS
from afl.core.evaluation.scorebins import DEFAULT_SCORE_BINS, ScoreBins
from afl.core.leakage import LeakageReport
from afl.proto.v1 import common_pb2 as cpb
from afl.proto.v1 import coordinator_pb2 as pb
from afl.server.modes.base import Declared
from afl.server.plan.dp import (
    DpCalibration,
    apply_dp,
    audit_dp_plan,
    calibrate,
    calibrate_evaluation,
    dp_releases,
)
from afl.server.plan.history import first_plan_releases, history_audit
from afl.server.plan.release import (
    PlannedRelease,
    RoundView,
    audit_plan,
    build_plan,
    releases_from_plan,
    round2_releases,
    sign_plan,
)
from afl.server.runs import Run
from afl.server.solve.dp import dp_evaluation_bins
from afl.server.solve.evaluation import earlier_evaluations, evaluation_releases
from afl.server.store import EnrolmentRow, Store

__all__ = ["OpenedPlan", "open_plan"]

Audit = tuple[str, dict[str, object]]
#: The released sums of a round by its id (None when they are not available).
SumsOf = Callable[[str], Mapping[str, NDArray[np.float64]] | None]


@dataclass
class OpenedPlan:
    """A round's signed plan, or the ``refusal`` that aborts the round; ``audits`` are the
    records (event, detail) to append either way."""

    plan: bytes = b""
    signature: bytes = b""
    releases: tuple[str, ...] = ()
    refusal: str = ""
    audits: list[Audit] = field(default_factory=list)


def open_plan(
    store: Store,
    *,
    key: Ed25519PrivateKey,
    federation_id: str,
    run: Run,
    view: RoundView,
    participants: tuple[str, ...],
    sums: SumsOf | None = None,
    roster_sha256: bytes = b"",
) -> OpenedPlan:
    """The signed plan of ``view`` over ``participants`` (or why it cannot be opened);
    ``sums`` reads a round's released sums (a DP evaluation places its bins from the run's
    noisy training statistics, docs/protocol.md §6.1); ``roster_sha256`` the digest of the
    roster the coordinator logged, which the plan binds (M-221)."""
    opening = _Opening(store, key, federation_id, run, view, participants, sums, roster_sha256)
    return opening.open()


@dataclass(frozen=True)
class _Opening:
    """What opening one round reads: the store, the signing key and the round."""

    store: Store
    key: Ed25519PrivateKey
    federation_id: str
    run: Run
    view: RoundView
    participants: tuple[str, ...]
    sums: SumsOf | None = None
    roster_sha256: bytes = b""

    @property
    def evaluating(self) -> bool:
        """Whether this is the run's evaluation round."""
        return self.view.row.number > self.run.settings.rounds

    def open(self) -> OpenedPlan:
        settings, view = self.run.settings, self.view
        enrolments = self.store.enrolments()
        try:
            releases, report = self._releases(enrolments)
        except (ValueError, AggregationError) as exc:  # a DP evaluation without its bins
            return OpenedPlan(refusal=f"the DP evaluation cannot place its score bins: {exc}")
        opened = OpenedPlan(
            audits=[("plan-audit", {"round_id": view.round_id, **report.to_dict()})]
        )
        if view.row.number <= settings.rounds and settings.dp is None:  # M-124
            opened.refusal, detail = history_audit(
                self.store, round_id=view.round_id, releases=releases, members=self.participants
            )
            if detail is not None:
                opened.audits.append(("plan-audit-history", detail))
            if opened.refusal:
                return opened
        calibration = None
        if settings.dp is not None:
            plaintext = self.run.mode.name == "plaintext"
            try:
                if self.evaluating:  # docs/protocol.md §6.1: eval_epsilon, composed with the run
                    calibration = calibrate_evaluation(
                        releases,
                        settings.dp,
                        participants=self.participants,
                        plaintext=plaintext,
                        earlier=[p for p, _ in self._training_rounds()],
                    )
                else:
                    calibration = calibrate(
                        releases,
                        settings.dp,
                        participants=self.participants,
                        plaintext=plaintext,
                        run_rounds=settings.rounds,
                        classes=settings.classes,
                        parent=self._parent_plan(),
                    )
            except ValueError as exc:
                opened.refusal = f"DP calibration failed: {exc}"
                return opened
            opened.audits.append(
                ("dp-budget", {"round_id": view.round_id, **calibration.to_audit()})
            )
            if not report.passed:  # every site's epsilon <= the target: DP covers the exposure
                opened.audits.append(("dp-covers-audit", {"round_id": view.round_id}))
        opened.refusal = self._audit_refusal(report, calibration)
        if not opened.refusal:
            declared = {s: e.row_bounds for s, e in enrolments.items() if e.row_bounds is not None}
            self._sign(opened, releases, report, calibration, declared)
        return opened

    def _releases(
        self, enrolments: Mapping[str, EnrolmentRow]
    ) -> tuple[list[PlannedRelease], LeakageReport]:
        """The round's releases and their leakage audit: the evaluation round's score releases
        (audited with the federation's earlier evaluations), DP statistics, round 1 or 2."""
        settings, view, participants = self.run.settings, self.view, self.participants
        coverage = {s: e.labelled_classes for s, e in enrolments.items()}
        if self.evaluating:  # the run's evaluation round
            model = self._evaluated_model()
            releases = evaluation_releases(
                classes=settings.classes,
                participants=participants,
                model_sha256=hashlib.sha256(model).digest(),
                bins=DEFAULT_SCORE_BINS if settings.dp is None else self._dp_bins(model),
            )
            history = earlier_evaluations(
                [(r.round_id, tuple(releases_from_plan(r.plan)) if r.plan else ())
                 for r in self.store.rounds() if r.stage == pb.ROUND_STAGE_PUBLISHED],
                exclude=view.round_id,
            )  # fmt: skip
            return releases, audit_plan(releases, participants, history=history)
        if settings.dp is not None:  # DP mode releases additive statistics (docs/protocol.md §7)
            releases = dp_releases(
                classes=settings.classes,
                participants=participants,
                coverage=coverage,
                gram_scope=settings.gram_scope,
                d=settings.feature_dim,
                round_number=view.row.number,
                need_global_gram=settings.rounds == 2,
            )
            return releases, audit_dp_plan(releases, participants)
        if view.row.number == 1:
            releases = first_plan_releases(settings, participants=participants, coverage=coverage)
        else:
            releases = round2_releases(
                classes=settings.classes, participants=participants, d=settings.feature_dim
            )
        return releases, audit_plan(releases, participants)

    def _training_rounds(self) -> list[tuple[cpb.ReleasePlan, str]]:
        """The signed plans (and round ids) of the training rounds of the evaluated model, round
        1 first: the evaluation's parent and, for a round 2, its parent."""
        out: list[tuple[cpb.ReleasePlan, str]] = []
        round_id = self.view.row.parent_round_id
        while round_id:
            row = self.store.round(round_id)
            if row is None or row.plan is None:
                raise ValueError(f"round {round_id!r} has no stored plan")
            out.insert(0, (cpb.ReleasePlan.FromString(row.plan), round_id))
            round_id = row.parent_round_id if row.number > 1 else ""
        return out

    def _dp_bins(self, model: bytes) -> ScoreBins:
        """The DP evaluation's bins from the run's round-1 released noisy statistics
        (:func:`afl.server.solve.dp.dp_evaluation_bins`)."""
        first, round_id = self._training_rounds()[0]
        sums = None if self.sums is None else self.sums(round_id)
        if sums is None:
            raise ValueError(f"the released sums of round {round_id!r} are not available")
        return dp_evaluation_bins(
            model,
            plan_bytes=first.SerializeToString(),
            sums=sums,
            num_bins=DP_EVALUATION_BINS,
        )

    def _evaluated_model(self) -> bytes:
        """The ``Model`` bytes an evaluation round scores: the published model of its parent
        round, or (the validation gate) the parent's candidate."""
        parent = self.view.row.parent_round_id
        model = self.store.model(parent)
        if model is not None:
            return model[1]
        candidate = self.store.candidate(parent)
        assert candidate is not None, "an evaluation round follows a model or a candidate"
        return candidate[0]

    def _audit_refusal(self, report: LeakageReport, calibration: DpCalibration | None) -> str:
        """Why a plan that fails the leakage audit cannot be opened ("" when it can)."""
        settings = self.run.settings
        if report.passed or settings.operator_override:
            return ""
        if self.evaluating:
            return (
                "the evaluation plan, with the federation's earlier evaluations, fails the "
                "leakage audit (docs/protocol.md §6.1); set operator_override with a reason"
            )
        if settings.gram_scope == "per-class" and calibration is None:
            return (
                "the per-class release plan fails the leakage audit (docs/protocol.md §6); set "
                "operator_override with a reason, or use gram_scope = 'global'"
            )
        return ""

    def _sign(
        self,
        opened: OpenedPlan,
        releases: list[PlannedRelease],
        report: LeakageReport,
        calibration: DpCalibration | None,
        declared: Declared,
    ) -> None:
        """Build the plan with the mode's options and DP noise and sign it into ``opened`` (or
        set its refusal)."""
        settings, mode, view = self.run.settings, self.run.mode, self.view
        try:
            plan = build_plan(
                federation_id=self.federation_id,
                round_id=view.round_id,
                round_number=view.row.number,
                participants=self.participants,
                gram_scope=settings.gram_scope,
                releases=releases,
                operator_override=settings.operator_override and not report.passed,
                override_reason=settings.override_reason if not report.passed else "",
                options=mode.plan_options(self.participants, declared=declared),
            )
        except ValueError as exc:
            opened.refusal = f"the {mode.name} plan cannot be built: {exc}"
            return
        plan.run_id = self.run.run_id
        plan.roster_sha256 = self.roster_sha256
        if calibration is not None:
            apply_dp(plan, calibration)
            try:
                mode.dp_encodings(plan, declared=declared)
            except ValueError as exc:
                opened.refusal = f"DP encoding failed: {exc}"
                return
        signed = sign_plan(plan, self.key)
        opened.plan, opened.signature = signed.plan, signed.signature
        opened.releases = tuple(r.name for r in releases)

    def _parent_plan(self) -> cpb.ReleasePlan | None:
        """Round 1's signed plan, for round 2 of a run (None in round 1)."""
        if self.view.row.number == 1:
            return None
        parent = self.store.round(self.view.row.parent_round_id)
        return cpb.ReleasePlan.FromString((parent.plan if parent else None) or b"")
