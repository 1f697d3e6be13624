"""Solving a round: from its released sums to what it publishes, the signed model or, in a run's
evaluation round, the signed evaluation (docs/architecture.md §2, "The life of a round"). The
round machine (:mod:`afl.server.rounds`) stores the :class:`Publication` and marks the round
PUBLISHED in one transaction, or aborts the round with the :class:`SolveFailed` reason. Under a
validation gate (:mod:`afl.server.solve.gate`) the final round's model is a CANDIDATE (signed
"candidate-model", its round VALIDATING), the gate round's evaluation carries the
:class:`GateVerdict`, and a passed candidate is signed again as the model
(:meth:`Solver.publish_candidate`)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from numpy.typing import NDArray

from afl.core.aggregation import AggregationError
from afl.crypto.identity.signed_blobs import CANDIDATE_CONTEXT, MODEL_CONTEXT, sign_blob
from afl.proto.v1 import common_pb2 as cpb
from afl.proto.v1 import coordinator_pb2 as pb
from afl.server.plan.release import RoundView
from afl.server.runs import Run
from afl.server.solve.dp import solve_dp_run
from afl.server.solve.evaluation import (
    build_signed_evaluation,
    evaluation_result,
    members_in_sample,
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
from afl.server.store import Store

__all__ = ["Publication", "RoundReader", "SolveFailed", "Solver"]

log = logging.getLogger("afl.server.solve")
Sums = Mapping[str, NDArray[np.float64]]


class RoundReader(Protocol):
    """What solving reads of the other rounds (the round machine)."""

    def find(self, round_id: str) -> RoundView: ...

    def sums(self, view: RoundView) -> Sums | None: ...

    def evaluation_rows(self, round_id: str) -> dict[str, str]:
        """Each site's signed statement of the rows it scores in an evaluation round."""
        ...


@dataclass(frozen=True)
class Publication:
    """What a solved round publishes: a signed model or a signed evaluation; with
    ``candidate``, a gated round's model (stored as a candidate, not published); with
    ``verdict``, the gate round's decision on its parent's candidate; with ``gate``, a candidate
    the gate passed, signed as the model."""

    round_id: str
    signed: pb.SignedModel | pb.SignedEvaluation
    candidate: bool = False
    verdict: GateVerdict | None = None
    gate: bool = False

    def store(self, store: Store) -> dict[str, object]:
        """Write the signed file and its row; returns the stage record's detail."""
        signed = self.signed
        if isinstance(signed, pb.SignedModel) and self.candidate:
            digest = store.put_candidate(
                self.round_id, model=signed.model, signature=signed.signature
            )
            return {"candidate_sha256": digest}
        if isinstance(signed, pb.SignedModel):
            digest = store.put_model(self.round_id, model=signed.model, signature=signed.signature)
            return {"model_sha256": digest, **({"gate": True} if self.gate else {})}
        store.put_evaluation(
            self.round_id, evaluation=signed.evaluation, signature=signed.signature
        )
        return published_detail(signed)


def _dp_of(plan_bytes: bytes) -> dict[str, object] | None:
    """A DP evaluation plan's ε, δ, unit and σ per release (None without DP)."""
    plan = cpb.ReleasePlan.FromString(plan_bytes)
    if not plan.dp.enabled:
        return None
    return {
        "epsilon": plan.dp.epsilon,
        "delta": plan.dp.delta,
        "unit": "patient" if plan.dp.unit == cpb.PRIVACY_UNIT_PATIENT else "image",
        "sigma": {r.name: r.noise.sigma for r in plan.releases},
    }


@dataclass(frozen=True)
class SolveFailed:
    """Why a round's sums give nothing to publish (the round aborts with it)."""

    reason: str


@dataclass(frozen=True)
class Solver:
    """Signs what solved rounds publish with the coordinator's identity key."""

    key: Ed25519PrivateKey
    federation_id: str
    rounds: RoundReader

    def solve(self, view: RoundView, run: Run) -> Publication | SolveFailed | None:
        """The publication of a SOLVING round, why there is none, or None while its sums are
        not available yet (e.g. CKKS: the decryptor has not answered every job)."""
        evaluation = view.row.number > run.settings.rounds
        what = "evaluation" if evaluation else "solve"
        try:
            sums = self.rounds.sums(view)
            if sums is None:
                return None
            require_finite(sums, what="the sum of release")
            if evaluation:
                return self._evaluation(view, run, sums)
            gated = run.settings.gate is not None and view.row.number == run.settings.rounds
            return Publication(view.round_id, self._model(view, run, sums, gated), gated)
        except SOLVE_ERRORS as exc:  # no value crashes the coordinator (docs/protocol.md §9)
            log.error(f"{what} failed", extra={"round_id": view.round_id, "reason": str(exc)})
            return SolveFailed(f"{what} failed: {exc}")

    def publish_candidate(self, round_id: str, model: bytes) -> Publication:
        """The candidate ``model`` of ``round_id`` the gate passed: the same ``Model`` bytes
        signed with context "model"."""
        signature = sign_blob(self.key, context=MODEL_CONTEXT, blob=model)
        return Publication(round_id, pb.SignedModel(model=model, signature=signature), gate=True)

    def _model(self, view: RoundView, run: Run, sums: Sums, gated: bool) -> pb.SignedModel:
        settings = run.settings
        weights = self._weights(view, run, sums)
        require_finite({"W": weights}, what="the solved model")
        assert view.row.plan is not None
        return build_signed_model(
            weights,
            identity_key=self.key,
            federation_id=self.federation_id,
            round_id=view.round_id,
            round_number=view.row.number,
            classes=settings.classes,
            gamma=settings.gamma,
            backbone=settings.backbone,
            contributors=run.mode.contributors(view),
            plan_bytes=view.row.plan,
            context=CANDIDATE_CONTEXT if gated else MODEL_CONTEXT,
        )

    def _evaluation(self, view: RoundView, run: Run, sums: Sums) -> Publication:
        """The pooled documents from the released sums (:mod:`afl.server.solve.evaluation`);
        in the gate round, with the gate's verdict, which every scoring site receives."""
        parent = view.row.parent_round_id
        members = tuple(sorted(run.mode.contributors(view)))  # known once the sums are
        result = evaluation_result(
            view.releases,
            sums,
            members=members,
            calibration=run.settings.eval_calibration,
            context={"run_id": run.run_id, "round_id": view.round_id, "model_round_id": parent},
            dp=_dp_of(view.row.plan or b""),
            in_sample=members_in_sample(self.rounds.evaluation_rows(view.round_id), members),
        )
        verdict = None
        gate = run.settings.gate
        if gate is not None and run.gated(view.row.number):
            verdict = gate_verdict(result.stats, members=len(members), settings=gate)
            result.evaluation["gate"] = verdict.to_json()
        signed = build_signed_evaluation(
            result,
            identity_key=self.key,
            federation_id=self.federation_id,
            run_id=run.run_id,
            round_id=view.round_id,
            model_round_id=parent,
            members=members,
            plan_bytes=view.row.plan or b"",
        )
        return Publication(view.round_id, signed, verdict=verdict)

    def _parent_sums(self, view: RoundView) -> tuple[RoundView, Sums]:
        parent = self.rounds.find(view.row.parent_round_id)
        parent_sums = self.rounds.sums(parent)
        if parent_sums is None:
            raise AggregationError(f"round {parent.round_id!r} has no released sums")
        return parent, parent_sums

    def _weights(self, view: RoundView, run: Run, sums: Sums) -> NDArray[np.float64]:
        """W of a DP run (both rounds' noised statistics), of round 1, or of round 2."""
        settings = run.settings
        if settings.dp is not None:
            first_round = None
            if view.row.number == 2:
                first, first_sums = self._parent_sums(view)
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
        parent, parent_sums = self._parent_sums(view)
        return solve_round_two(
            parent.releases,
            parent_sums,
            view.releases,
            sums,
            classes=settings.classes,
            gamma=settings.gamma,
            alpha=settings.refinement.alpha,
        )
