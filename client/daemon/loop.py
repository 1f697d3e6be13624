"""The afl-client daemon loop: one site taking part in rounds, from enrolment to the verified
model (the steps are docs/architecture.md §3). It verifies and decides (:mod:`afl.client.daemon.
verify`, :mod:`afl.client.policy.plan`), sends what :mod:`afl.client.payloads.dispatch` builds
through the round's mode (:mod:`afl.client.modes`), and keeps a :class:`~afl.client.daemon.
report.RoundReport` of each round. A run with a validation gate (docs/protocol.md §6.2) ends its
final round VALIDATING: the site keeps the candidate, scores it in the evaluation round and keeps
the published model only if the signed evaluation says the gate passed.

Exit codes: 0 the last round completed (or nothing new to take part in), 1 failure, 3 this site
refused the plan, 4 the last round was aborted and no replacement came (also when it was aborted
before this site took part; an aborted round is followed by waiting up to ``linger_s`` for the
replacement round), 5 the run went on without this site (left out: the coordinator's note says
why) and it took part in no round.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from importlib import metadata
from typing import Any, NamedTuple

import numpy as np

from afl.client.config import ClientConfig
from afl.client.connectivity import connect
from afl.client.daemon.anchor import LedgerAnchor
from afl.client.daemon.background import Background
from afl.client.daemon.evaluation import (
    evaluated_model,
    evaluation_problem,
    evaluation_rows,
    is_candidate,
    save_evaluation,
)
from afl.client.daemon.opening import (
    Opened,
    OpeningPublication,
    counted_releases,
    never_decrypted,
    opened_releases,
    undecrypted_aborts,
    witnessed_releases,
)
from afl.client.daemon.report import RoundReport
from afl.client.daemon.rpc import STOP_JOIN_S, CoordinatorClient, RoundFailed
from afl.client.daemon.state import DaemonState, plan_summary
from afl.client.daemon.transparency import (
    HOLD_MIN_S,
    IDLE_WITNESS_S,
    QUORUM_POLL_S,
    LogEvidence,
    LogWitness,
)
from afl.client.daemon.transport import (
    INSECURE_SITE_HEADER,
    DaemonError,
    RemoteCallError,
    check_round_id,
    retry_policy,
)
from afl.client.daemon.verify import (
    VerificationError,
    VerifiedModel,
    verify_evaluation,
    verify_model,
    verify_round_config,
)
from afl.client.daemon.witness import Witness
from afl.client.modes.base import AggregationMode, RoundSession
from afl.client.modes.ckks import ContextPrefetch, ZeroFiller, ciphertexts_for
from afl.client.modes.registry import MODES
from afl.client.payloads.dispatch import (
    ROUND_TWO_KINDS,
    Scoring,
    needs_parent_model,
    round_payloads,
)
from afl.client.payloads.evaluation import is_evaluation_plan
from afl.client.payloads.stats import (
    RoundOne,
    SlotPayload,
    labelled_mask,
    load_or_compute_stats,
    round_classes,
)
from afl.client.policy.dp import DpContext, assess_plan, dp_report
from afl.client.policy.ledger import DpLedger
from afl.client.policy.loghistory import (
    LogHistoryError,
    logged_rounds,
    whole_history_problem,
    with_unmasked,
)
from afl.client.policy.plan import PolicyDecision, check_plan, survivor_problem
from afl.client.policy.roster import kit_revocations, revoked_participant, roster_problem
from afl.client.retention import enforce_retention
from afl.core.audit.history import ReleasedRound
from afl.core.data.featurecache import FeatureCache, open_cache
from afl.core.refinement import RefinementParams
from afl.core.row_bounds import RowBounds, measure
from afl.core.stats import LocalStats
from afl.crypto.identity import signatures, signed_blobs
from afl.crypto.secagg.graph import graph_commitment, new_graph_nonce
from afl.proto import wire
from afl.proto.v1 import common_pb2 as cpb
from afl.proto.v1 import coordinator_pb2 as pb
from afl.proto.v1 import coordinator_pb2_grpc as pb_grpc

__all__ = [
    "EXIT_ABORTED",
    "EXIT_FAILED",
    "EXIT_LEFT_OUT",
    "EXIT_OK",
    "EXIT_REFUSED",
    "ClientDaemon",
    "RoundFailed",
]

EXIT_OK, EXIT_FAILED, EXIT_REFUSED, EXIT_ABORTED, EXIT_LEFT_OUT = 0, 1, 3, 4, 5
_OUTCOME_EXIT: dict[int, int] = {
    pb.CLIENT_OUTCOME_COMPLETED: EXIT_OK,
    pb.CLIENT_OUTCOME_REFUSED_PLAN: EXIT_REFUSED,
    pb.CLIENT_OUTCOME_ABORTED: EXIT_ABORTED,
    pb.CLIENT_OUTCOME_FAILED: EXIT_FAILED,
}
log = logging.getLogger("afl.client")
#: The longest pause (seconds) between a CKKS participant's witnessing steps while its round is
#: decrypted (:meth:`ClientDaemon._witness_while_decrypted`): the decryptor's quorum waits on them.
DECRYPTION_WITNESS_MAX_S = 0.25
#: How long (seconds) a site's audit waits for the decryptor's cosignature on a checkpoint that
#: holds a CKKS round's abort before counting that round as released (M-235): many of the
#: decryptor's idle witnessing steps (every second or two, afl.client.daemon.decryptor.WITNESS_S).
DECRYPTOR_SEEN_S = 20.0
_PSEUDO = (*ROUND_TWO_KINDS, cpb.STATISTIC_KIND_PSEUDO_FEATURE_SUM, cpb.STATISTIC_KIND_PSEUDO_COUNT)


@functools.cache
def _version() -> str:
    try:
        return metadata.version("afl")
    except metadata.PackageNotFoundError:  # pragma: no cover
        return "0+unknown"


class LogHistory(NamedTuple):
    """The log's history a plan was audited with (:meth:`ClientDaemon._whole_history`): every
    released round, the rounds some site signed, and those no single party's word makes."""

    rounds: list[ReleasedRound]
    known: list[ReleasedRound]
    signed: list[ReleasedRound]


def witness_key(
    r: pb.RoundStatus | None, latest_model_round_id: str, *, site_id: str
) -> tuple[str, int, str]:
    """What of a status answer a site's witnessing on it follows
    (:meth:`ClientDaemon._observe`): the round, its stage (0 while ``site_id`` takes part in it
    before its solve) and the latest model."""
    if r is None:
        return ("", 0, latest_model_round_id)
    taking_part = site_id in r.participants and r.stage < pb.ROUND_STAGE_SOLVING
    return (r.round_id, 0 if taking_part else int(r.stage), latest_model_round_id)


class PlanLogCheck:
    """The federation log's check of the plan under review in ``cfg``
    (:meth:`ClientDaemon._plan_in_log`), started in a background thread before the site checks
    the plan itself: the site cosigns the checkpoint that holds the plan at once, so the roster's
    quorum gathers while every site checks, and the quorum wait mostly finds it there. It names
    the plan by ``cfg``'s round id and the SHA-256 of its signed bytes, before they are verified:
    its result counts only for the plan the site then verified under those two
    (:meth:`result_for`). The round ends it (:meth:`end`) on every path."""

    def __init__(self, daemon: ClientDaemon, cfg: pb.RoundConfig) -> None:
        self.round_id = cfg.round_id
        self.plan_sha256 = signed_blobs.blob_sha256(cfg.release_plan.plan)  # the plan's digest
        stage_timeout_s = float(cfg.stage_timeout_s)
        self.stop = threading.Event()
        self._task = Background(
            lambda: daemon._plan_in_log(
                self.round_id, self.plan_sha256, stage_timeout_s=stage_timeout_s, stop=self.stop
            ),
            name=f"plan-log-{cfg.round_id}",
        )

    def result_for(
        self, plan: cpb.ReleasePlan, plan_sha256: bytes
    ) -> tuple[str, pb.CosignedLogCheckpoint | None]:
        """Why the log forbids acting on ``plan`` ("" when a checkpoint cosigned by a quorum
        holds it), and that checkpoint: the one the whole-history audit reads."""
        if (plan.round_id, plan_sha256) != (self.round_id, self.plan_sha256):
            return "the plan checked in the federation log is not the plan this site verified", None
        return self._task.wait()

    def end(self) -> None:
        """Stop the quorum wait (the site refused the plan, or the round failed) and join the
        thread; a split view it found stops the site (another failure is moot here: the site
        acts on a plan only through :meth:`result_for`)."""
        self.stop.set()
        self._task.join(raising=LogEvidence)


class ClientDaemon:
    """One site's daemon; :meth:`run` returns the process exit code."""

    #: Whether each DP-ledger entry is published in the federation log before the upload (M-195);
    #: the Flower site's relay carries no federation log (docs/protocol.md §11a, "Still open").
    anchors_ledger = True

    def __init__(
        self,
        config: ClientConfig,
        *,
        insecure: bool = False,
        max_rounds: int | None = None,
        modes: Mapping[int, AggregationMode] | None = None,
    ) -> None:
        self.config = config
        self.site_id = config.site_id
        self.insecure = insecure
        self.max_rounds = max_rounds
        self.modes = dict(MODES if modes is None else modes)
        self.identity = signatures.load_private_key_pem(config.identity_key_path.read_bytes())
        self.server_key = signatures.load_public_key_raw(config.server_public_key)
        t = config.timing
        self.retry = retry_policy(t)
        self.metadata: tuple[tuple[str, str], ...] = (
            ((INSECURE_SITE_HEADER, self.site_id),) if insecure else ()
        )
        self.state = config.state_dir
        self.store = DaemonState(config.state_dir)
        self.witness = Witness(config.state_dir, site_id=self.site_id)
        self.log_witness = LogWitness.for_site(config, self.identity)
        self._witnessed_at = 0.0
        self._witnessed_key: tuple[str, int, str] | None = None
        self._running_round = ""  # the round run_round is in (its own steps witness the log)
        self._context: ContextPrefetch | None = None  # CKKS: the round's context, fetched ahead
        self._zeros: ZeroFiller | None = None  # CKKS: encryptions of zero drawn while waiting
        self._openings_verified: set[str] = set()  # opening statements verified (one each)
        # The log's history each accepted plan was audited with (the survivors check's too).
        self._log_history: dict[str, LogHistory] = {}
        self.ledger = DpLedger(config.state_dir / "dp-ledger")
        self.anchor = LedgerAnchor(
            self.ledger, self.log_witness, key=self.identity, config=str(config.path)
        )
        self.revocations = kit_revocations(config)
        self.cache: FeatureCache | None = None
        self.stats: LocalStats | None = None
        self.stats_from_state = False
        self.labelled = np.zeros(0, dtype=bool)
        self.row_bounds: RowBounds | None = None
        self.warnings: list[str] = list(config.warnings)
        self.timings: dict[str, float] = {}

    # -- phases ----------------------------------------------------------------------------
    def prepare(self) -> LocalStats:
        """Open the feature cache and load (or compute once) the round-1 statistics."""
        start = time.perf_counter()
        self.cache = open_cache(self.config.data.cache)
        self.labelled, _ = labelled_mask(self.cache, self.config.data.classes)
        self.stats, cached = load_or_compute_stats(
            self.cache, active=self.labelled, state_dir=self.state
        )
        self.stats_from_state = cached
        self.row_bounds = measure(self.cache.features)
        self.warnings += list(self.stats.skipped)
        self.timings["statistics"] = time.perf_counter() - start
        log.info(
            "site=%s statistics %s: n=%d d=%d labelled=%d classes",
            self.site_id,
            "read from state" if cached else "computed",
            self.stats.n,
            self.stats.d,
            int(self.labelled.sum()),
        )
        return self.stats

    def _backbone(self) -> str:
        assert self.cache is not None
        meta = self.cache.meta
        configured = self.config.data.backbone or meta.extra.get("backbone")
        return str(configured or ("surrogate" if meta.surrogate else meta.source))

    def enroll(self) -> pb.EnrollResponse:
        """Enroll with the identity key and its proof of possession (context "enrol")."""
        assert self.stats is not None and self.cache is not None
        start = time.perf_counter()
        names = self.cache.meta.classes
        coverage = [c for i, c in enumerate(names) if self.stats.contributes[i]]
        response = self.rpc.enroll(
            federation_id=self.config.federation_id,
            identity=self.identity,
            identity_public_key=self.config.identity_public_key,
            server_public_key=self.config.server_public_key,
            role=pb.SITE_ROLE_PARTICIPANT,
            labelled_classes=coverage if self.config.policy.disclose_coverage else [],
            backbone=self._backbone(),
            feature_dim=self.stats.d,
            software_version=_version(),
            row_bounds=(
                self.row_bounds.declared()
                if self.row_bounds is not None and self.config.policy.disclose_row_bounds
                else None
            ),
            weights_sha256=str(self.cache.meta.extra.get("weights_sha256") or ""),
            random_init=self.cache.meta.random_init,
        )
        self.timings["enrol"] = time.perf_counter() - start
        log.info("site=%s enrolled in %s", self.site_id, response.federation_id)
        return response

    def _model(
        self,
        round_id: str,
        *,
        class_names: list[str],
        plan_sha256: bytes | None,
        candidate: bool = False,
        expect_sha256: str = "",
        witness: bool = True,
    ) -> tuple[VerifiedModel, int]:
        """Fetch, verify and keep the round's model (``candidate``: the candidate of a round in
        VALIDATING, kept apart; ``expect_sha256``: the model must be these ``Model`` bytes;
        ``witness`` False: the caller witnesses the log's newest checkpoint itself)."""
        assert self.stats is not None
        signed: pb.SignedModel = self.rpc.call("GetModel", pb.ModelRequest(round_id=round_id))
        verified = verify_model(
            signed,
            server_key=self.server_key,
            federation_id=self.config.federation_id,
            round_id=round_id,
            class_names=class_names,
            d=self.stats.d,
            plan_sha256=plan_sha256,
            context=signed_blobs.CANDIDATE_CONTEXT if candidate else signed_blobs.MODEL_CONTEXT,
        )
        if expect_sha256 and verified.model_sha256 != expect_sha256:
            raise VerificationError(
                f"round {round_id}: the published model (sha256 {verified.model_sha256[:16]}...) "
                f"is not the candidate the gate scored ({expect_sha256[:16]}...)"
            )
        if candidate:
            self.store.save_candidate(round_id, signed)
        else:
            self.store.save_model(round_id, signed, verified.weights)
            # the log's release of this model is in the newest checkpoint: cosign it, so that an
            # export of the model finds a quorum-cosigned checkpoint that holds it (M-198)
            if witness:
                self._witness_log()
        return verified, signed.ByteSize()

    def _round_problems(self, cfg: pb.RoundConfig) -> str:
        assert self.stats is not None and self.cache is not None
        # The round's classes may differ from the cache's (docs/method.md §1.1): classes this
        # site does not hold get zero columns (daemon_stats.round_classes), never a refusal.
        if cfg.feature_dim != self.stats.d:
            return (
                f"the round needs d = {cfg.feature_dim}, this site's cache has d = {self.stats.d}"
            )
        if cfg.backbone and cfg.backbone != self._backbone():
            return f"the round needs features from {cfg.backbone!r}, this site has {self._backbone()!r}"
        return ""

    def _decide(
        self, cfg: pb.RoundConfig, *, round_id: str
    ) -> tuple[PolicyDecision, cpb.ReleasePlan | None, bytes]:
        """The decision on the plan of ``cfg``, sent for the announced round ``round_id``."""
        if cfg.round_id != round_id:
            return (
                PolicyDecision(
                    False,
                    f"the coordinator announced round {round_id} but sent the configuration of "
                    f"round {cfg.round_id[:80]!r}",
                ),
                None,
                b"",
            )
        if cfg.protocol_version not in (0, wire.PROTOCOL_VERSION):  # M-231, before the plan
            return (
                PolicyDecision(
                    False,
                    f"the coordinator speaks wire protocol {cfg.protocol_version}, this site "
                    f"speaks {wire.PROTOCOL_VERSION}: run the same afl release on both "
                    "(operations guide §11)",
                ),
                None,
                b"",
            )
        try:
            plan, plan_sha = verify_round_config(
                cfg, server_key=self.server_key, federation_id=self.config.federation_id
            )
        except VerificationError as exc:
            return PolicyDecision(False, str(exc)), None, b""
        problem = roster_problem(plan, config=self.config) or self._revoked_peer(plan)
        if problem:
            return PolicyDecision(False, problem), plan, plan_sha
        problem = self._round_problems(cfg)
        if not problem and is_evaluation_plan(plan):  # only a model this site verified
            has_holdout = self.config.data.holdout is not None
            problem = evaluation_problem(plan, has_holdout=has_holdout, **self._model_source())
        if problem:
            return PolicyDecision(False, problem), plan, plan_sha
        try:
            problem = self._ledger_problem(cfg, plan, plan_sha)
            context = self._dp_context(cfg)
        except DaemonError as exc:  # LedgerError, or a parent round id that names no file
            return PolicyDecision(False, str(exc)), plan, plan_sha
        if problem:
            return PolicyDecision(False, problem), plan, plan_sha
        decision = check_plan(
            plan,
            site_id=self.site_id,
            policy=self.config.policy,
            supported_modes=tuple(self.modes),
            history=self.store.history(exclude_round=cfg.round_id),
            dp_context=context,
            peer_history=self.store.history(
                exclude_round=cfg.round_id, only=self.store.uploaded_rounds()
            ),
            planned_history=self.store.history(exclude_round=cfg.round_id, planned=True),
        )
        return decision, plan, plan_sha

    def _revoked_peer(self, plan: cpb.ReleasePlan) -> str:
        """Why this plan's peers are refused by the federation's revocation list (M-178): a
        participant whose identity key in this site's ``[peers]`` the CA revoked, or a list that
        cannot be read or verified; "" otherwise (or without ``[tls] crl``)."""
        return revoked_participant(
            plan, revocations=self.revocations, peers=self.config.peers, site_id=self.site_id
        )

    def _plan_in_log(
        self, round_id: str, plan_sha256: bytes, *, stage_timeout_s: float, stop: threading.Event
    ) -> tuple[str, pb.CosignedLogCheckpoint | None]:
        """Why the federation log forbids acting on the plan ``plan_sha256`` of ``round_id``
        ("" when a checkpoint cosigned by a quorum of the roster holds it,
        :mod:`afl.client.daemon.transparency`) and that checkpoint, run while the site checks the
        plan itself (:class:`PlanLogCheck`); it also fetches the log's statements up to that
        checkpoint for the whole-history audit. ``stop``: the site refused the plan meanwhile."""
        self.log_witness.restore_acknowledged(self.witness.acknowledged)
        self._witnessed_at = time.monotonic()  # the plan check witnesses the newest checkpoint
        wait_s, poll_s, max_poll_s = self._quorum_polling(stage_timeout_s)
        audited = not self.config.policy.allow_exposure  # the statements come with the answer
        problem, checkpoint = self.log_witness.plan_problem(
            self.rpc.call,
            round_id=round_id,
            plan_sha256=plan_sha256,
            wait_s=wait_s,
            poll_s=poll_s,
            max_poll_s=max_poll_s,
            stop=stop,
            with_entries=audited,
        )
        if checkpoint is not None and not stop.is_set() and audited:
            try:
                self.log_witness.statements(self.rpc.call, checkpoint)
            except LogEvidence:
                raise
            except DaemonError:
                pass  # read again, with its error, by the audit
        return problem, checkpoint

    def _logged(
        self,
        plan: cpb.ReleasePlan,
        plan_sha256: bytes,
        decision: PolicyDecision,
        in_log: PlanLogCheck,
    ) -> PolicyDecision:
        """``decision``, or a refusal when the plan is not in a checkpoint of the federation log
        cosigned by a quorum of the roster (``in_log``, :meth:`_plan_in_log`), or when the log's
        whole history at that checkpoint and the plan expose a site (:meth:`_whole_history`)."""
        problem, checkpoint = in_log.result_for(plan, plan_sha256)
        if problem or checkpoint is None:
            return PolicyDecision(False, problem or "the plan is not in the federation log")
        return self._whole_history(plan, decision, checkpoint)

    def _whole_history(
        self,
        plan: cpb.ReleasePlan,
        decision: PolicyDecision,
        checkpoint: pb.CosignedLogCheckpoint,
    ) -> PolicyDecision:
        """``decision``, or a refusal when the plan, differenced with every release of the
        federation log at ``checkpoint`` (the quorum checkpoint that holds the plan), exposes ANY
        site's statistics (:mod:`afl.client.policy.loghistory`, M-206). Waived, as the site's own
        differencing rule is, by ``allow_exposure`` or DP that covers this site."""
        policy = self.config.policy
        if policy.allow_exposure or decision.audit.get("covered_by_dp"):
            return decision
        try:
            logged = self.log_witness.statements(self.rpc.call, checkpoint)
            own = self.store.unmasked()
            statements, unlogged = with_unmasked(logged, own)
            opened = opened_releases(
                logged,
                federation=self.config.federation_id,
                keys=self.log_witness.roster,
                verified=self._openings_verified,
            )
            dead = self._never_decrypted(logged, opened)  # M-235
            opened = [o for o in opened if o.mode != "ckks" or o.release["round_id"] not in dead]
            in_log = {f.get("round_id") for kind, f in logged if kind == "release"}
            unlogged = sorted({*unlogged, *(str(o.release["round_id"]) for o in opened)} - in_log)
            # Every release counts; only those no single party's word makes are known before
            # (M-233): this site's own unmasked rounds and releases every survivor opened.
            counted = [("release", r) for r in counted_releases(opened)]
            rounds = logged_rounds([*statements, *counted])
            signed = logged_rounds([*(("release", f) for f in own), *counted])
            known = logged_rounds(("release", f) for f in (*own, *witnessed_releases(opened)))
        except (DaemonError, LogHistoryError) as exc:
            return PolicyDecision(
                False, f"the federation's history cannot be audited from its log: {exc}"
            )
        if unlogged:
            log.warning(
                "site=%s: the federation log holds no release statement of round(s) %s, which "
                "this site helped unmask or a site's signed opening names; its audit counts "
                "them as released",
                self.site_id, ", ".join(unlogged),
            )  # fmt: skip
        # Kept for the survivors check, which audits the sums as they will be unmasked.
        self._log_history = {plan.round_id: LogHistory(rounds, known, signed)}  # one round
        problem, detail = whole_history_problem(
            plan, rounds=rounds, known=known, signed=signed, min_cohort=policy.min_cohort
        )
        if detail is not None and unlogged:
            detail["unmasked_not_logged"] = unlogged
        audit = {**decision.audit, "whole_history": detail} if detail else decision.audit
        if problem:
            return PolicyDecision(False, f"this site refuses: {problem}", audit)
        return replace(decision, audit=audit)

    def _never_decrypted(
        self, logged: Sequence[tuple[str, Mapping[str, Any]]], opened: Sequence[Opened]
    ) -> set[str]:
        """The CKKS rounds whose openings release nothing (M-235): the log records them as
        aborted, holds no `decrypting` statement of them, and the pinned decryptor has cosigned
        a checkpoint that holds the abort (this site waits up to :data:`DECRYPTOR_SEEN_S` for
        it: the idle decryptor witnesses every second or two). Without that cosignature
        each such round counts as released, and the site says so."""
        policy = self.config.policy
        aborts = undecrypted_aborts(
            logged,
            federation=self.config.federation_id,
            decryptor=policy.ckks_decryptor,
            keys=self.log_witness.roster,
        )
        ckks = {str(o.release["round_id"]) for o in opened if o.mode == "ckks"}
        aborts = {r: i for r, i in aborts.items() if r in ckks}
        if not aborts or policy.ckks_decryptor is None:
            return set()
        t = self.config.timing
        seen = self.log_witness.cosigned_by(
            self.rpc.call,
            policy.ckks_decryptor,
            covering=max(aborts.values()) + 1,
            wait_s=DECRYPTOR_SEEN_S,
            poll_s=min(t.poll_interval_s, 0.05),
            max_poll_s=t.max_poll_interval_s,
        )
        dead = never_decrypted(aborts, seen_by_decryptor=seen)
        if len(dead) < len(aborts):
            log.warning(
                "site=%s: the decryptor %s has not cosigned a log checkpoint that holds the "
                "abort of CKKS round(s) %s: its audit counts them as released",
                self.site_id, policy.ckks_decryptor, ", ".join(sorted(set(aborts) - dead)),
            )  # fmt: skip
        return dead

    def _observe(self, response: pb.StatusResponse) -> None:
        """Every status answer: the restore check (:class:`Witness`), and, at most every
        :data:`IDLE_WITNESS_S`, witnessing the log's newest checkpoint (so that a quorum
        gathers while sites outside the round wait). A split view stops the site."""
        self.witness.observe(response)
        r = response.round if response.HasField("round") else None
        # A new round, stage or published model is witnessed at once: the plan of a run this
        # site is not in needs its cosignature for a quorum, and nothing else may wake it
        # before that stage's timeout (docs/protocol.md §11a). Inside a round this site takes
        # part in, past its plan review, neither a stage change nor the model is: the round's
        # own steps witness (the plan check, the ledger statement, the release check after the
        # model), nobody's quorum waits on it meanwhile, and witnessing here would hold the
        # status answer the round waits for (a cosignature, an fsync and three RPCs at each
        # barrier). After the round the published model is witnessed as usual, but for the
        # checkpoint the round's release check witnessed last: the status answers that show the
        # round published (the key the check sets) are witnessed again after IDLE_WITNESS_S.
        if (
            r is not None
            and r.round_id == self._running_round
            and r.stage > pb.ROUND_STAGE_PLAN_REVIEW
        ):
            return
        seen_key = witness_key(r, response.latest_model_round_id, site_id=self.site_id)
        taking_part = r is not None and seen_key[1] == 0
        # Past its plan review, a participant's idle re-witnessing stops (it put a cosignature,
        # a commit at the coordinator and three RPCs on every site every few seconds of the
        # exchange). The one quorum wait inside a round, the survivors' openings (M-232), is
        # cosigned by the survivors' own polls at the unmask stage and by the sites outside the
        # round, which witness at every stage change (each survivor's consistency signature
        # carries its opening, logged before the signature is kept, so the unmask stage begins
        # with every opening in the log) and every IDLE_WITNESS_S.
        quiet = r is not None and taking_part and r.stage > pb.ROUND_STAGE_PLAN_REVIEW
        now = time.monotonic()
        if seen_key == self._witnessed_key and (quiet or now - self._witnessed_at < IDLE_WITNESS_S):
            return
        self._witnessed_key = seen_key
        self._witness_log(now)

    def _witness_log(self, now: float | None = None, *, hold_s: float = 0.0) -> None:
        """Witness the log's newest checkpoint; a split view stops the site, another failure is
        logged (the next status answer tries again). ``hold_s``: the coordinator may hold its
        answer up to that long until the log grows past the last checkpoint this site cosigned
        (a statement for it to cosign)."""
        self._witnessed_at = time.monotonic() if now is None else now
        self.log_witness.restore_acknowledged(self.witness.acknowledged)
        last = self.log_witness.last
        try:
            self.log_witness.witness(
                self.rpc.call,
                hold_s=hold_s,
                wait_grown_past=last.checkpoint.size if last is not None else 0,
            )
        except LogEvidence:
            raise
        except DaemonError as exc:
            log.warning("site=%s could not witness the federation log: %s", self.site_id, exc)

    def _ledger_problem(self, cfg: pb.RoundConfig, plan: cpb.ReleasePlan, plan_sha: bytes) -> str:
        """Why the ledger forbids this plan ("" when it does not): the site already uploaded under
        another plan of this round id (the audit and the DP budgets leave out the site's own
        releases of the round being decided), or a DP round 2 (or pseudo-label releases) whose
        round 1 of the same run the site recorded no upload under (it would compose with
        nothing, docs/protocol.md M-88)."""
        if cfg.parent_round_id:
            check_round_id(cfg.parent_round_id)
        anchored = self.anchor.problem()  # the ledger still holds what the log holds of it
        if anchored:
            return anchored
        recorded = self.ledger.entry_for(cfg.round_id)
        if recorded is not None and recorded.plan_sha256 != plan_sha.hex():
            return (
                f"this site already uploaded under another release plan of round {cfg.round_id} "
                f"(sha256 {recorded.plan_sha256[:16]}...); a round has one plan"
            )
        if plan.dp.enabled and (
            plan.round_number >= 2 or any(r.kind in _PSEUDO for r in plan.releases)
        ):
            run = cfg.run_id or cfg.parent_round_id
            first = self.ledger.entry_for(cfg.parent_round_id) if cfg.parent_round_id else None
            if first is None or first.run_id != run:
                return (
                    f"a DP round {plan.round_number} of run {run!r} composes with its round 1, "
                    f"but this site recorded no upload under round {cfg.parent_round_id!r} of "
                    "that run"
                )
        return ""

    def _model_source(self) -> dict[str, Any]:
        """Where this site's verified models are, and the keys to verify them again."""
        return {
            "state_dir": self.state,
            "server_public_key": self.config.server_public_key,
            "federation_id": self.config.federation_id,
        }

    def _evaluation_result(self, round_id: str, model_sha256: str) -> dict[str, Any]:
        """Fetch, verify and keep the signed evaluation of ``round_id``."""
        signed = self.rpc.call("GetEvaluation", pb.EvaluationRequest(round_id=round_id))
        evaluation = verify_evaluation(
            signed,
            server_key=self.server_key,
            federation_id=self.config.federation_id,
            round_id=round_id,
            model_sha256=model_sha256,
        )
        files = save_evaluation(signed, evaluation, self.state / "evaluations")
        digest = signed_blobs.blob_sha256(signed.evaluation).hex()
        result: dict[str, Any] = {
            "sha256": digest, "members": list(evaluation.members), "files": files
        }  # fmt: skip
        gate = json.loads(evaluation.evaluation_json or b"{}").get("gate")
        if gate is not None:  # the validation gate's verdict (docs/protocol.md §6.2)
            result["gate"] = gate
            result["model_round_id"] = evaluation.model_round_id
        return result

    def _gate_outcome(self, plan: cpb.ReleasePlan, report: RoundReport) -> None:
        """After a gate's evaluation: keep the published model if the candidate passed (the same
        ``Model`` bytes, now signed "model"); RoundFailed with the gate's reason if it failed."""
        assert report.evaluation is not None
        gate = report.evaluation.get("gate")
        candidate = evaluated_model(plan, **self._model_source())
        if gate is None or not is_candidate(candidate):
            return
        if not gate.get("passed"):
            reason = str(gate.get("reason") or "validation gate failed")
            log.error("site=%s: the candidate was not published: %s", self.site_id, reason)
            raise RoundFailed(pb.CLIENT_OUTCOME_FAILED, reason)
        round_id = check_round_id(str(report.evaluation["model_round_id"]))
        self.receive_model(
            round_id,
            class_names=list(candidate.model.class_names),
            plan_sha256=bytes(candidate.model.plan_sha256),
            report=report,
            expect_sha256=candidate.model_sha256,
        )

    def _dp_context(self, cfg: pb.RoundConfig) -> DpContext:
        """Patient ids, the lifetime ledger without this round, and μ of the run's round 1."""
        assert self.cache is not None
        unit = self.config.policy.privacy_unit
        first = self.ledger.entry_for(cfg.parent_round_id) if cfg.parent_round_id else None
        return DpContext(
            has_patient_ids=self.cache.patients is not None,
            ledger=self.ledger.spent(unit=unit, exclude_round=cfg.round_id),
            run_mu=first.mu_for(unit) if first is not None else 0.0,
        )

    def _record(
        self, cfg: pb.RoundConfig, plan: cpb.ReleasePlan, plan_sha: bytes, report: RoundReport
    ) -> Background[None] | None:
        """Write the plan's ledger entry (before any message of the round's exchange leaves)
        and start logging its statement
        (:meth:`afl.client.daemon.anchor.LedgerAnchor.start_publishing`; None when this site
        does not anchor its ledger); a DP plan's assessment goes into ``report``."""
        dp = assess_plan(
            plan, site_id=self.site_id, policy=self.config.policy, context=self._dp_context(cfg)
        )
        entry = self.ledger.record(
            federation_id=self.config.federation_id,
            round_id=cfg.round_id,
            round_number=int(cfg.round_number),
            run_id=cfg.run_id or cfg.parent_round_id or cfg.round_id,
            plan_sha256=plan_sha.hex(),
            aggregation=cpb.AggregationMode.Name(plan.aggregation),
            unit="patient" if plan.dp.unit == cpb.PRIVACY_UNIT_PATIENT else "image",
            images_per_patient=int(plan.dp.images_per_patient or 1),
            delta=min(float(plan.dp.delta), self.config.policy.lifetime_delta),
            mu=dp.mu,
            epsilon=dp.epsilon,
            releases=tuple(
                {"name": r.name, "sensitivity": r.noise.sensitivity, "sigma": r.noise.sigma}
                for r in plan.releases
                if self.site_id in r.member_site_ids
            ),
        )
        if plan.dp.enabled:
            report.dp = dp_report(plan, self.site_id, dp)
        if not self.anchors_ledger:
            return None
        self.log_witness.restore_acknowledged(self.witness.acknowledged)
        self.anchor.reconcile_after_restore(self.rpc.call)
        return self.anchor.start_publishing(self.rpc.call, entry)  # in the log first (M-195)

    def _respond(
        self,
        round_id: str,
        decision: PolicyDecision,
        plan_sha: bytes,
        *,
        graph_nonce: bytes = b"",
        evaluation_rows: str = "",
    ) -> None:
        """Sign and send the decision; accepting a sparse-graph MASK plan commits to
        ``graph_nonce`` (docs/protocol.md §4.2 "Sparse graph"), accepting an evaluation plan
        states ``evaluation_rows`` ("held-out" or "in-sample", docs/protocol.md §6.1)."""
        commitment = (
            graph_commitment(round_id=round_id, site_id=self.site_id, nonce=graph_nonce)
            if graph_nonce and decision.accept
            else b""
        )
        signature = signatures.sign_fields(
            self.identity,
            context=signed_blobs.PLAN_DECISION_CONTEXT,
            fields=signed_blobs.plan_decision_fields(
                round_id=round_id,
                accept=decision.accept,
                plan_sha256=plan_sha,
                graph_commitment=commitment,
                evaluation_rows=evaluation_rows,
            ),
        )
        request = pb.PlanDecision(
            round_id=round_id,
            accept=decision.accept,
            reason=decision.reason,
            plan_sha256=plan_sha,
            signature=signature,
            graph_commitment=commitment,
            evaluation_rows=evaluation_rows,
        )
        self.rpc.call("RespondToPlan", request)

    def payloads(
        self, cfg: pb.RoundConfig, plan: cpb.ReleasePlan, mode: AggregationMode, report: RoundReport
    ) -> list[SlotPayload]:
        """This site's payloads for an accepted plan (:func:`afl.client.payloads.dispatch.
        round_payloads`), after fetching what they need from outside its data: round 1's model
        for a round 2 (fetched and verified), the model an evaluation round scores (one this
        site verified) and the rows it scores."""
        assert self.stats is not None and self.cache is not None
        class_names = list(cfg.class_names)
        view = round_classes(
            self.stats,
            cache_classes=self.cache.meta.classes,
            labelled=self.labelled,
            round_classes=class_names,
        )
        if view.note:
            log.warning("site=%s round %s: %s", self.site_id, cfg.round_id, view.note)
            report.classes_note = view.note
        t0 = time.perf_counter()
        round_one = None
        if needs_parent_model(plan):
            parent, nbytes = self._model(
                cfg.parent_round_id, class_names=class_names, plan_sha256=None
            )
            report.bytes_received += nbytes
            ref = cfg.refinement
            params = RefinementParams(
                tau=ref.tau, alpha=ref.alpha, delta_pos=ref.delta_pos, delta_neg=ref.delta_neg
            )
            round_one = RoundOne(weights=parent.weights, refinement=params)
        scoring = None
        if is_evaluation_plan(plan):  # the run's evaluation round (docs/protocol.md §6.1)
            evaluated = evaluated_model(plan, **self._model_source())
            rows = evaluation_rows(self.config.data, training=self.cache, labelled=self.labelled)
            report.evaluation = {"model_sha256": evaluated.model_sha256, **rows.to_json()}
            if rows.in_sample:
                report.round_warnings = [
                    "evaluated on the training cache (in-sample): set [data] holdout"
                ]
            scoring = Scoring(
                weights=evaluated.weights,
                classes=evaluated.classes,
                model_sha256=evaluated.model_sha256,
                cache=rows.cache,
                labelled=rows.labelled,
                min_mass=self.config.policy.min_cohort,  # without DP (docs/protocol.md §6.1)
            )
        payloads = round_payloads(
            plan,
            site_id=self.site_id,
            cache=self.cache,
            view=view,
            class_names=class_names,
            encode=mode.encode,
            state_dir=self.state,
            round_one=round_one,
            scoring=scoring,
        )
        if round_one is not None:  # round 1's model, the pseudo-labels, the payloads
            report.timings_s["pseudo_labels"] = time.perf_counter() - t0
        return payloads

    def run_round(self, status: pb.RoundStatus, report: RoundReport) -> None:
        """Take part in one round; fills ``report``; raises :class:`RoundFailed` if no model."""
        assert self.stats is not None and self.cache is not None
        timings = report.timings_s
        round_id = status.round_id
        start = time.perf_counter()
        cfg: pb.RoundConfig = self.rpc.call("GetRoundConfig", cpb.RoundRef(round_id=round_id))
        report.bytes_received += cfg.ByteSize()
        report.round_number = cfg.round_number
        reviewing = status.stage == pb.ROUND_STAGE_PLAN_REVIEW or not status.caller_accepted_plan
        # The log already holds the plan under review: its check (this site's cosignature, the
        # roster's quorum, the plan's inclusion) runs while the site checks the plan itself,
        # once the config is at least for the announced round in this site's wire version.
        in_log = (
            PlanLogCheck(self, cfg)
            if reviewing
            and cfg.round_id == round_id
            and cfg.protocol_version in (0, wire.PROTOCOL_VERSION)
            else None
        )
        graph_nonce = b""
        try:
            decision, plan, plan_sha = self._decide(cfg, round_id=round_id)
            if decision.accept and plan is not None:  # one upload per round, ever (M-200)
                replay = self._replay_problem(status, plan, plan_sha)
                if replay:
                    decision = PolicyDecision(False, replay, decision.audit)
            if not reviewing and decision.accept and plan is not None:
                decision = self._accepted_before(round_id, plan_sha, decision)
            report.plan = plan_summary(cfg, plan, decision, plan_sha)
            if reviewing:
                if decision.accept:  # only a plan the federation log holds under a quorum
                    t0 = time.perf_counter()
                    assert plan is not None and in_log is not None
                    decision = self._logged(plan, plan_sha, decision, in_log)
                    timings["log_witness"] = time.perf_counter() - t0
                    report.plan = plan_summary(cfg, plan, decision, plan_sha)
                elif in_log is not None:
                    in_log.stop.set()  # the refusal leaves first; the thread is joined below
                if plan is not None and plan.mask_graph.degree:  # a sparse MASK graph
                    graph_nonce = new_graph_nonce()
                rows = ""
                if plan is not None and decision.accept and is_evaluation_plan(plan):
                    rows = "in-sample" if self.config.data.holdout is None else "held-out"
                self._respond(
                    round_id, decision, plan_sha, graph_nonce=graph_nonce, evaluation_rows=rows
                )
        finally:
            if in_log is not None:  # no thread outlives the plan review, whatever happened
                in_log.end()
        timings["plan_check"] = time.perf_counter() - start
        if not decision.accept:
            log.warning("site=%s REFUSED round %s: %s", self.site_id, round_id, decision.reason)
            raise RoundFailed(pb.CLIENT_OUTCOME_REFUSED_PLAN, decision.reason)
        assert plan is not None
        self.store.remember(plan)
        mode = self.modes[plan.aggregation]
        if plan.aggregation == cpb.AGGREGATION_MODE_CKKS:  # checked while the round goes on
            self._context = ContextPrefetch(
                RoundSession(
                    rpc=self.rpc,
                    round_id=round_id,
                    site_id=self.site_id,
                    plan=plan,
                    identity_key=self.identity,
                    ckks_decryptor=self.config.policy.ckks_decryptor,
                ),
                self.config.peers,
            )
        class_names = list(cfg.class_names)
        t0 = time.perf_counter()
        payloads = self.payloads(cfg, plan, mode, report)
        timings["payloads"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        status = self.rpc.await_stage(round_id, at_least=mode.first_stage)
        timings["wait_upload_stage"] = time.perf_counter() - t0
        # The upload register, then the ledger entry, are on disk before any message of the
        # exchange leaves (a replayed round is refused before it spends anything), and the
        # entry's statement is in the log before any statistic leaves (the exchange's uploads
        # wait for the publication).
        t0 = time.perf_counter()
        payloads = self._claim(cfg, plan, plan_sha, payloads, status)
        publication = self._record(cfg, plan, plan_sha, report)
        timings["ledger"] = time.perf_counter() - t0
        opening = (
            self._opening(plan, plan_sha, stage_timeout_s=cfg.stage_timeout_s)
            if plan.aggregation == cpb.AGGREGATION_MODE_MASK
            else None
        )
        # In CKKS the opening (over every participant) is logged and waited for while the site
        # encrypts, before its first statistic leaves (M-232).
        ckks_opening, opened = (
            self._ckks_opening(plan, plan_sha, stage_timeout_s=cfg.stage_timeout_s)
            if plan.aggregation == cpb.AGGREGATION_MODE_CKKS
            else (None, None)
        )
        waits = [b.wait for b in (publication, opened) if b is not None]

        def before_statistics() -> None:
            for wait in waits:
                wait()

        t0 = time.perf_counter()
        try:
            session = self.round_session(
                round_id,
                plan=plan,
                plan_sha256=plan_sha,
                survivor_floors=decision.survivor_floors,
                graph_nonce=graph_nonce,
                covered=bool(decision.audit.get("covered_by_dp")),
                before_statistics=before_statistics if waits else None,
                opening=opening,
            )
            records = mode.exchange(
                session, payloads, already_complete=set(status.caller_uploads_complete)
            )
        finally:
            # No thread outlives the round. Its error shows at the first upload; if the exchange
            # failed first, the exchange's error is raised, unless the log showed a split view
            # or other evidence, which stops the site whatever else went wrong.
            if ckks_opening is not None:  # a failed exchange does not wait for its quorum
                ckks_opening.stopped.set()
            for thread in (publication, opened):
                if thread is not None:
                    thread.join(raising=LogEvidence)
            self._end_context()
        if publication is not None:
            publication.wait()  # every slot was held already (a resumed round): logged all the same
        self.store.uploads.finish(round_id)
        timings["upload"] = time.perf_counter() - t0
        timings.update(session.timings)
        report.ckks = dict(session.ckks_counts) or None
        report.sent(records)
        t0 = time.perf_counter()
        decrypting = (
            self._witness_while_decrypted(round_id)
            if plan.aggregation == cpb.AGGREGATION_MODE_CKKS
            else None
        )
        try:
            # Not stage_only: the GetStatus answer at PUBLISHED names this round's model as the
            # latest, which the restore check records before the site completes the round
            # (M-142).
            status = self.rpc.await_stage(round_id, at_least=pb.ROUND_STAGE_PUBLISHED)
        finally:
            if decrypting is not None:
                stop, witnessing = decrypting
                stop.set()
                witnessing.join(raising=LogEvidence)  # a split view stops the site
        timings["wait_model"] = time.perf_counter() - t0
        if is_evaluation_plan(plan):  # the run's evaluation round: its signed result
            assert report.evaluation is not None  # what it scored (self.payloads)
            evaluated = report.evaluation["model_sha256"]
            report.evaluation.update(self._evaluation_result(round_id, evaluated))
            self._gate_outcome(plan, report)
            return
        candidate = status.stage == pb.ROUND_STAGE_VALIDATING  # the gate scores it first
        # The log's statement of what this round released is what every other site's
        # whole-history audit reads: its members check it (M-230), while the model is verified.
        # The check witnesses the newest checkpoint, which holds that statement: it is the
        # model's witnessing step too (M-198), so the model is kept without one of its own.
        t0 = time.perf_counter()
        survivors = self.store.survivors(round_id)
        checked = Background(
            lambda: self.log_witness.check_release(self.rpc.call, plan, survivors=survivors),
            name=f"release-{round_id}",
        )
        try:
            self.receive_model(
                round_id,
                class_names=class_names,
                plan_sha256=plan_sha,
                report=report,
                candidate=candidate,
                witness=False,
            )
        finally:
            checked.join(raising=LogEvidence)  # a misstated statement stops the site, whatever
        checked.wait()  # else failed
        if not candidate:  # the status answer that shows it published needs no step of its own
            self._witnessed_key = witness_key(status, round_id, site_id=self.site_id)
            self._witnessed_at = time.monotonic()
        timings["model"] = time.perf_counter() - t0

    def round_session(
        self,
        round_id: str,
        *,
        plan: cpb.ReleasePlan,
        plan_sha256: bytes,
        survivor_floors: Mapping[str, int],
        graph_nonce: bytes = b"",
        covered: bool = False,
        before_statistics: Callable[[], None] | None = None,
        opening: OpeningPublication | None = None,
    ) -> RoundSession:
        """What the aggregation mode's exchange needs of this site for an accepted plan
        (``covered``: DP covers this site, as its plan decision found; ``before_statistics``:
        waits for the round's ledger statement in the log; ``opening``: MASK, the statement
        logged from the survivors check on, waited for before the unmask shares)."""
        return RoundSession(
            rpc=self.rpc,
            round_id=round_id,
            site_id=self.site_id,
            plan=plan,
            identity_key=self.identity,
            peer_keys=self.config.peers,
            ckks_decryptor=self.config.policy.ckks_decryptor,
            survivor_floors=survivor_floors,
            plan_sha256=plan_sha256,
            graph_nonce=graph_nonce,
            survivors_check=self._survivors_check(plan, covered=covered, opening=opening),
            before_statistics=before_statistics,
            before_unmask=opening.wait if opening is not None else None,
            ckks_context=self._context.result if self._context is not None else None,
            ckks_zeros=self._zeros.zeros_for if self._zeros is not None else None,
        )

    def _end_context(self) -> None:
        """End the round's CKKS context fetch (:class:`ContextPrefetch`), if any."""
        if self._context is not None:
            self._context.end()
            self._context = None

    def _witness_while_decrypted(self, round_id: str) -> tuple[threading.Event, Background[None]]:
        """While this site waits for its CKKS round's model: witness the log's newest checkpoint
        in a thread, pausing from :data:`QUORUM_POLL_S` and backing off to
        :data:`DECRYPTION_WITNESS_MAX_S` between steps, until the returned event is set; the
        coordinator holds each step's answer up to :data:`HOLD_MIN_S` until the log grows (so the
        decryptor's statement is cosigned as it is committed, most often; a held call cannot be
        interrupted, and the thread is joined once the model is published). The decryptor
        decrypts only once its `decrypting` statement is in a checkpoint cosigned by a quorum
        of the roster (M-235), and the round's participants witness nothing else meanwhile
        (:meth:`_observe`): without this, the quorum would wait for the model that waits for it.
        A failed step is logged and retried; a split view stops the site."""
        stop = threading.Event()
        t = self.config.timing
        ceiling = min(t.max_poll_interval_s, DECRYPTION_WITNESS_MAX_S)

        def witness() -> None:
            delay = min(t.poll_interval_s, QUORUM_POLL_S)
            while not stop.wait(delay):
                self._witness_log(hold_s=min(ceiling, HOLD_MIN_S))  # joined once published
                delay = min(delay * 1.5, ceiling)

        return stop, Background(witness, name=f"decrypting-{round_id}")

    def _quorum_polling(self, stage_timeout_s: float) -> tuple[float, float, float]:
        """(wait_s, poll_s, max_poll_s) of a wait for the roster's quorum on the log: as long
        as a stage (the round's ``stage_timeout_s``, else this site's upload timeout). The
        quorum's cosignatures arrive within moments of this site's own: poll briefly at first
        (a few small RPCs), then back off."""
        t = self.config.timing
        wait_s = float(stage_timeout_s or t.upload_timeout_s)
        return wait_s, min(t.poll_interval_s, QUORUM_POLL_S), t.max_poll_interval_s

    def _opening(
        self,
        plan: cpb.ReleasePlan,
        plan_sha256: bytes,
        *,
        stage_timeout_s: float,
        withheld: str = "no unmask share is sent",
    ) -> OpeningPublication:
        """The round's `opening` statement (:mod:`afl.client.daemon.opening`): in MASK logged
        from the survivors check and waited for before the unmask shares
        (:meth:`_quorum_polling`)."""
        wait_s, poll_s, max_poll_s = self._quorum_polling(stage_timeout_s)
        return OpeningPublication(
            self.log_witness,
            self.rpc.call,
            key=self.identity,
            plan=plan,
            plan_sha256=plan_sha256,
            quorum_wait=lambda **step: self.log_witness.quorum_problem(
                self.rpc.call, wait_s=wait_s, poll_s=poll_s, max_poll_s=max_poll_s, **step
            ),
            withheld=withheld,
        )

    def _ckks_opening(
        self, plan: cpb.ReleasePlan, plan_sha256: bytes, *, stage_timeout_s: float
    ) -> tuple[OpeningPublication, Background[None]]:
        """The CKKS round's `opening` over every participant (a CKKS sum holds them all, or the
        round aborts), logged and waited for in a thread from the upload stage on; the uploads
        wait for it. Setting the publication's ``stopped`` ends the wait at its next poll (the
        round ended first)."""
        opening = self._opening(
            plan, plan_sha256, stage_timeout_s=stage_timeout_s, withheld="no statistic is sent"
        )

        def publish() -> None:
            opening.start(plan.participants)
            opening.wait()

        return opening, Background(publish, name=f"opening-{plan.round_id}")

    def _replay_problem(
        self, status: pb.RoundStatus, plan: cpb.ReleasePlan, plan_sha: bytes
    ) -> str:
        """Why this site must not take part in a round it already sent statistics to (""
        when it may): :meth:`afl.client.policy.uploads.UploadRegister.refusal`."""
        return self.store.uploads.refusal(
            status.round_id,
            already_complete=status.caller_uploads_complete,
            plan_sha256=plan_sha.hex(),
            resumable=plan.aggregation != cpb.AGGREGATION_MODE_MASK,
            reported=self.store.reported_rounds(),
        )

    def _claim(
        self,
        cfg: pb.RoundConfig,
        plan: cpb.ReleasePlan,
        plan_sha: bytes,
        payloads: Sequence[SlotPayload],
        status: pb.RoundStatus,
    ) -> list[SlotPayload]:
        """Record the round in the upload register before anything of its exchange leaves
        (asking the rule again: the coordinator's state may have changed while this site
        waited); the payloads to send: those of the first claim on a resumed round."""
        problem = self._replay_problem(status, plan, plan_sha)
        if problem:
            log.warning("site=%s REFUSED round %s: %s", self.site_id, cfg.round_id, problem)
            raise RoundFailed(pb.CLIENT_OUTCOME_REFUSED_PLAN, problem)
        mask = plan.aggregation == cpb.AGGREGATION_MODE_MASK
        return self.store.uploads.claim(
            federation_id=self.config.federation_id,
            run_id=cfg.run_id or cfg.parent_round_id or cfg.round_id,
            round_id=cfg.round_id,
            round_number=int(cfg.round_number),
            plan_sha256=plan_sha.hex(),
            aggregation=cpb.AggregationMode.Name(plan.aggregation),
            payloads=payloads,
            keep_bytes=not mask,  # a masked exchange is never resumed
        )

    def _survivors_check(
        self, plan: cpb.ReleasePlan, *, covered: bool, opening: OpeningPublication | None = None
    ) -> Callable[[Sequence[str]], bytes]:
        """MASK: refuse (RoundFailed) when unmasking over the survivors would expose a site by
        differencing (:func:`afl.client.policy.plan.survivor_problem`), else record them in the
        history and return the ``opening`` statement that the consistency signature carries
        (the coordinator logs it before it keeps the signature); all before this site signs
        them or sends an unmask share. A refused survivor
        set is not recorded: with every honest survivor refusing, nothing is unmasked over it,
        and recording it would make every later plan over the planned members look like a
        difference."""

        def check(survivors: Sequence[str]) -> bytes:
            problem = survivor_problem(
                plan,
                site_id=self.site_id,
                policy=self.config.policy,
                survivors=survivors,
                history=self.store.history(exclude_round=plan.round_id),
                planned_history=self.store.history(exclude_round=plan.round_id, planned=True),
                covered=covered,
            ) or self._whole_history_over(plan, survivors, covered=covered)
            if problem:
                log.warning("site=%s REFUSED round %s: %s", self.site_id, plan.round_id, problem)
                raise RoundFailed(pb.CLIENT_OUTCOME_REFUSED_PLAN, problem)
            self.store.record_survivors(plan.round_id, survivors)
            self.store.record_unmasking(plan, survivors)  # for the whole-history audit
            # every site's audit: in the log before the signature is kept
            return opening.carried(survivors) if opening is not None else b""

        return check

    def _accepted_before(
        self, round_id: str, plan_sha: bytes, decision: PolicyDecision
    ) -> PolicyDecision:
        """``decision``, or a refusal when the coordinator says this site accepted the plan of
        ``round_id`` (so its review, the plan's log check and the whole-history audit are
        skipped) but this site holds no claim of an upload under that plan: only its own record
        shows it accepted (a site claims its upload right after its review, M-200)."""
        record = self.store.uploads.get(round_id)
        if record is not None and record.plan_sha256 == plan_sha.hex():
            return decision
        return PolicyDecision(
            False,
            f"the coordinator says this site accepted the plan of round {round_id}, but this "
            "site holds no record of taking part under it (it never reviewed it, or stopped "
            "before its exchange began): it takes no part without its own review",
            decision.audit,
        )

    def _whole_history_over(
        self, plan: cpb.ReleasePlan, survivors: Sequence[str], *, covered: bool
    ) -> str:
        """Why the plan's sums, as they will be unmasked over ``survivors``, expose a site
        through the log's whole history ("" when they do not, M-206): the history the plan was
        audited with at plan time, the plan cut to the survivors (a drop-out the coordinator
        reports changes which sums are released)."""
        history = self._log_history.pop(plan.round_id, None)
        policy = self.config.policy
        # None: no log was read for this plan (the Flower relay carries none; a plan this site
        # did not review itself is refused before its exchange, _accepted_before).
        if policy.allow_exposure or covered or history is None:
            return ""
        problem, _ = whole_history_problem(
            plan,
            rounds=history.rounds,
            known=history.known,
            signed=history.signed,
            min_cohort=policy.min_cohort,
            survivors=survivors,
        )
        if not problem:
            return ""
        return f"this site refuses to unmask over the survivors {sorted(survivors)}: {problem}"

    def receive_model(
        self,
        round_id: str,
        *,
        class_names: list[str],
        plan_sha256: bytes,
        report: RoundReport,
        candidate: bool = False,
        expect_sha256: str = "",
        witness: bool = True,
    ) -> None:
        """Fetch the round's signed model (or its candidate), verify it against the accepted
        plan, keep it, and note it in ``report`` (``witness``: as :meth:`_model`)."""
        model, nbytes = self._model(
            round_id,
            class_names=class_names,
            plan_sha256=plan_sha256,
            candidate=candidate,
            expect_sha256=expect_sha256,
            witness=witness,
        )
        report.bytes_received += nbytes
        if candidate:
            report.candidate = {
                "sha256": model.model_sha256,
                "note": "not published: the validation gate scores it first",
            }
            return
        report.model = {
            "sha256": model.model_sha256,
            "weights_sha256": model.weights_sha256,
            "shape": list(model.weights.shape),
            "signature_valid": True,
            "contributors": list(model.model.contributors),
            "path": str(self.store.model_path(round_id)),
        }

    def _aborted_meanwhile(self, round_id: str) -> RoundFailed | None:
        """A call refused as FAILED_PRECONDITION because the round was aborted meanwhile (e.g.
        another site refused the plan) is an abort, not a failure of this site."""
        try:
            r = self.rpc.status(round_id).round
        except RemoteCallError:
            return None
        if r.stage == pb.ROUND_STAGE_ABORTED:
            return RoundFailed(pb.CLIENT_OUTCOME_ABORTED, f"round aborted: {r.abort_reason}")
        return None

    def _new_report(self, *, run_id: str, round_id: str, round_number: int) -> RoundReport:
        """The report of a round this site starts taking part in."""
        return RoundReport(
            site_id=self.site_id,
            federation_id=self.config.federation_id,
            run_id=run_id,
            round_id=round_id,
            round_number=round_number,
            timings_s=dict(self.timings),
        )

    def _finish(self, report: RoundReport, outcome: int, reason: str = "") -> int:
        """End the round: its report written (the one place) and sent; the exit code."""
        # The cosignature the round's release check kept (M-198), before the report: none when
        # the coordinator's operator acknowledged a restore meanwhile (the restored log may not
        # hold its checkpoint). One that fails to leave is sent again by the next witnessing
        # step that finds its checkpoint without it.
        self.log_witness.restore_acknowledged(self.witness.acknowledged)
        try:
            self.log_witness.flush(self.rpc.call)
        except DaemonError as exc:
            log.warning("site=%s could not send its log cosignature: %s", self.site_id, exc)
        name = pb.ClientOutcome.Name(outcome)  # type: ignore[arg-type]
        report.outcome = name.removeprefix("CLIENT_OUTCOME_")
        report.reason = reason
        report.warnings = [*self.warnings, *report.round_warnings]
        if self.rpc.watcher is not None:
            report.round_events_by_stream = self.rpc.watcher.events_received
        path = self.store.write_report(report)
        log.info("site=%s round %s %s; report %s", self.site_id, report.round_id,
                 report.outcome, path)  # fmt: skip
        if report.round_id:
            message = pb.ClientReport(
                round_id=report.round_id,
                outcome=outcome,  # type: ignore[arg-type]
                reason=reason,
                warnings=report.warnings,
                bytes_sent=report.bytes_sent,
                bytes_received=report.bytes_received,
                timings_s=report.timings_s,
                model_signature_valid=report.verified,
                software_version=_version(),
            )
            try:
                self.rpc.call("SubmitReport", message)
            except RemoteCallError as exc:
                log.warning("site=%s could not submit its report: %s", self.site_id, exc)
        self.retain()
        return _OUTCOME_EXIT[outcome]

    def retain(self) -> None:
        """Apply ``[retention]`` (afl.client.retention, M-179): at start-up and after each
        round; what it erased is listed, by SHA-256, in ``state_dir/retention/``."""
        record = enforce_retention(self.state, self.config.retention, site_id=self.site_id)
        if record is not None:
            log.info("site=%s retention erased expired files; record %s", self.site_id, record)

    def run(self) -> int:
        """Prepare, enroll, take part in rounds until none is left (or, serving, until the
        process is stopped); the exit code."""
        self.retain()  # before the statistics are loaded: expired ones are recomputed
        if self.stats is None:
            self.prepare()
        try:
            with connect(self.config, insecure=self.insecure) as channel:
                self.rpc = CoordinatorClient(
                    pb_grpc.CoordinatorStub(channel),
                    site_id=self.site_id,
                    timing=self.config.timing,
                    retry=self.retry,
                    metadata=self.metadata,
                )
                self.rpc.observe = self._observe
                try:
                    self.enroll()
                    self._reconcile_ledger()
                    self.rpc.watch()
                    self._zeros = self._zero_filler()
                    return self._rounds()
                finally:
                    if self._zeros is not None:
                        self._zeros.stop()
                    self.rpc.close()
        finally:  # the channel is closed: a call the filler still makes ends at once
            if self._zeros is not None:
                self._zeros.join(STOP_JOIN_S)

    def _zero_filler(self) -> ZeroFiller | None:
        """A site whose policy allows ``ckks`` and pins a decryptor draws encryptions of zero
        (unless ``[client] ckks_draw_ahead = false``) while it waits for its rounds
        (:class:`afl.client.modes.ckks.ZeroFiller`, M-237): as many as a training round over its
        cache's classes takes (not its labelled ones, which its encryption's timing would then
        reveal), again after each round when it serves."""
        policy = self.config.policy
        decryptor = policy.ckks_decryptor
        if (
            not self.config.ckks_draw_ahead
            or "ckks" not in policy.allowed_aggregation
            or not decryptor
            or decryptor == self.site_id
            or self.stats is None
            or self.cache is None
        ):
            return None
        session = RoundSession(  # outside any round: the context is the federation's
            rpc=self.rpc,
            round_id="",
            site_id=self.site_id,
            plan=cpb.ReleasePlan(),
            identity_key=self.identity,
            ckks_decryptor=decryptor,
        )
        want = ciphertexts_for(dim=self.stats.d, classes=len(self.cache.meta.classes))
        filler = ZeroFiller(session, self.config.peers, want=want, refill=self.config.serve)
        return filler.start()

    def _reconcile_ledger(self) -> None:
        """The DP ledger against this site's releases in the federation log (M-196), after the
        restore check of a first status answer (an acknowledged restore is witnessed afresh)."""
        self.witness.observe(self.rpc.call("GetStatus", pb.StatusRequest()))
        self.log_witness.restore_acknowledged(self.witness.acknowledged)
        self.anchor.reconcile(self.rpc.call)

    def _rounds(self) -> int:
        serve = self.config.serve
        done = self.store.completed_rounds()
        lingering = bool(done)
        rounds, code = 0, EXIT_OK
        while self.max_rounds is None or rounds < self.max_rounds:
            t0 = time.perf_counter()
            status = self.rpc.wait_for_round(done, lingering=lingering, forever=serve)
            if status is None:
                break
            check_round_id(status.round_id)  # it names the round's report, model and ledger entry
            report = self._new_report(
                run_id=status.run_id, round_id=status.round_id, round_number=status.round_number
            )
            report.timings_s["wait_round"] = time.perf_counter() - t0
            t1 = time.perf_counter()
            done.add(status.round_id)
            self.witness.join(status)  # before the plan decision and the uploads leave
            lingering = True
            try:
                try:
                    self._running_round = status.round_id
                    if self._zeros is not None:  # drawn while idle, never during a round
                        self._zeros.pause()
                    self.run_round(status, report)
                except RemoteCallError as exc:
                    aborted = self._aborted_meanwhile(status.round_id)
                    if aborted is None:
                        raise
                    raise aborted from exc
                finally:
                    self._running_round = ""
                    self._end_context()  # a round that failed before its exchange
                    if self._zeros is not None:
                        self._zeros.resume()
            except RoundFailed as exc:
                code = self._finish(report, exc.outcome, exc.reason)
                # An aborted round is usually followed by a replacement round (new plan) with
                # the remaining sites: wait for it. A serving daemon goes on after any outcome.
                if exc.outcome != pb.CLIENT_OUTCOME_ABORTED and not serve:
                    return code
                continue
            except (DaemonError, VerificationError, ValueError) as exc:
                code = self._finish(report, pb.CLIENT_OUTCOME_FAILED, str(exc))
                if not serve or isinstance(exc, LogEvidence):
                    raise
                log.error("site=%s round %s failed: %s", self.site_id, status.round_id, exc)
                continue
            report.timings_s["round"] = time.perf_counter() - t1
            self.witness.complete(status)  # before the report leaves
            self._finish(report, pb.CLIENT_OUTCOME_COMPLETED)
            rounds += 1
            code = EXIT_OK
        return self._no_part(code) if rounds == 0 else code

    def _no_part(self, code: int) -> int:
        """Exit code of a daemon that took part in no round: a round that listed it was
        aborted first (exit 4, as an aborted round), or the run went on without it (exit 5);
        0 stays for a daemon with nothing new to do (e.g. restarted after its run published)."""
        if code != EXIT_OK or not self.rpc.passed:
            return code
        aborted = [why for _, was_aborted, why in self.rpc.passed if was_aborted]
        why = aborted[-1] if aborted else self.rpc.passed[-1][2]
        code = EXIT_ABORTED if aborted else EXIT_LEFT_OUT
        log.error("site=%s took part in no round: %s (exit status %d)", self.site_id, why, code)
        return code
