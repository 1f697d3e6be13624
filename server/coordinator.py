"""Request handling of the coordinator: enrolment, status, plan decisions, uploads, models
(docs/architecture.md §2). Transport-free: the gRPC servicer decodes messages, takes the caller's
site id from its certificate and calls these methods; errors are :mod:`afl.server.errors` classes.
The coordinator is also the :class:`~afl.server.modes.base.RoundAccess` of the mode request handlers
(:class:`~afl.server.modes.mask.MaskRequests`, :class:`~afl.server.modes.ckks.CkksRequests`).

Enrolment (coordinator.proto ``GetEnrolChallenge``, ``Enroll``; docs/protocol.md §3, M-74): the
certificate's site id must be provisioned; ``enrol_challenge`` hands it a fresh 32-byte nonce
(OS CSPRNG) kept in memory for that site id for ``ENROL_CHALLENGE_TTL_S`` (at most
``MAX_OPEN_CHALLENGES`` per site, the oldest dropped); ``enroll`` consumes the nonce on its first
use, whatever the outcome, then requires the provisioned identity key and a proof over every
declared field and the nonce (context "enrol", :func:`afl.proto.wire.enrol_proof_fields`). A
replayed request, a changed field, another site's nonce or an expired one is refused; a
restarted server knows no nonce (the site asks again).

Uploads are idempotent by (round, site, release, sha256): the same digest again returns the
stored receipt with ``duplicate = True``; another digest is a :class:`ConflictError`. Whether a
new payload may be stored now is the round's mode's decision (``check_upload``).
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from afl.core.about import afl_version
from afl.core.row_bounds import RowBounds
from afl.core.suggest import unknown_names
from afl.crypto.errors import CryptoError
from afl.crypto.identity.signatures import load_public_key_raw, verify_fields
from afl.crypto.identity.signed_blobs import (
    ENROL_CONTEXT,
    blob_sha256,
    verify_plan_decision,
)
from afl.proto import wire
from afl.proto.v1 import common_pb2
from afl.proto.v1 import coordinator_pb2 as pb
from afl.server.config import ServerConfig
from afl.server.daemon.observability import ServerMetrics
from afl.server.errors import (
    ConflictError,
    DiskFullError,
    InvalidRequestError,
    NotPermittedError,
    ServerError,
    WrongStageError,
)
from afl.server.groupcommit import GroupCommit
from afl.server.limits import held_calls
from afl.server.modes.base import (
    DECISION_JOURNAL_KIND,
    AggregationMode,
    RoundContext,
    require_upload_stage,
)
from afl.server.plan.release import PlannedRelease, RoundView
from afl.server.reports import check_report
from afl.server.rounds import RoundMachine
from afl.server.solve.evaluation import EVALUATION_ROWS
from afl.server.store import EnrolmentRow, Store
from afl.server.transparency import FederationLog, cosigned_to_proto, log_entry_to_proto

__all__ = [
    "CHECKPOINT_HOLD_MAX_S",
    "ENROL_CHALLENGE_TTL_S",
    "MAX_OPEN_CHALLENGES",
    "SERVER_VERSION",
    "Coordinator",
]

SERVER_VERSION = f"afl-server/{afl_version()}"
ENROL_CHALLENGE_TTL_S = 300.0
MAX_OPEN_CHALLENGES = 4
#: The longest a GetCheckpoint answer is held for its ``wait_ms`` (docs/protocol.md §11a).
CHECKPOINT_HOLD_MAX_S = 2.0
_ROLES = {"participant": pb.SITE_ROLE_PARTICIPANT, "decryptor": pb.SITE_ROLE_DECRYPTOR}

log = logging.getLogger("afl.server.coordinator")


class Coordinator:
    """The coordinator's domain API; thread-safe (one lock)."""

    def __init__(
        self,
        config: ServerConfig,
        store: Store,
        identity_key: Ed25519PrivateKey,
        *,
        metrics: ServerMetrics | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.metrics = metrics or ServerMetrics()
        self.machine = RoundMachine(config, store, identity_key, metrics=self.metrics, clock=clock)
        self.store = store
        self.lock: threading.Condition = self.machine.lock
        self._holding: set[str] = set()  # the sites with a held GetCheckpoint
        self._max_holding = held_calls(config.limits, sites=len(config.sites))
        self._holding_lock = threading.Lock()
        self._clock = clock
        self._challenges: dict[str, dict[bytes, float]] = {}  # site -> nonce -> expiry (s)
        # site -> its enrolment as last read from the store: every request checks its caller's,
        # and a hit here does not wait for the lock (the stored row changes only in enroll,
        # which drops the site's entry under the lock once the new row is committed).
        self._enrolled: dict[str, EnrolmentRow] = {}
        self.log = FederationLog(store, key=identity_key, federation_id=config.federation_id)
        # The sites' small log writes (cosignatures, DP-ledger statements) arrive together at
        # each step of a round: whoever takes the lock commits those queued with it. (Not an
        # opening: its survivors check may advance the round, which commits on its own.)
        self.log_writes = GroupCommit(store, self.lock, isolated=(ServerError,))
        with self.lock:
            self.machine.advance()

    # --- RoundAccess (what the mode request handlers use) ------------------------------------

    @property
    def context(self) -> RoundContext:
        return self.machine

    def mode_of(self, view: RoundView) -> AggregationMode:
        return self.machine.mode_of(view)

    def find(self, round_id: str) -> RoundView:
        return self.machine.find(round_id)

    def require_participant(self, view: RoundView, site_id: str) -> None:
        self.machine.require_participant(view, site_id)

    def advance(self) -> None:
        """Apply due transitions (call with the lock held)."""
        self.machine.advance()

    # --- identity ----------------------------------------------------------------------------

    def _known(self, site_id: str) -> None:
        if site_id not in self.config.sites:
            raise NotPermittedError(f"site {site_id!r} is not provisioned in this federation")

    def _enrolment(self, site_id: str) -> EnrolmentRow | None:
        """The site's committed enrolment, from memory once read (the lock only on a miss)."""
        row = self._enrolled.get(site_id)
        if row is None:
            with self.lock:
                row = self.store.enrolment(site_id)
                if row is not None:
                    self._enrolled[site_id] = row
        return row

    def require_enrolled(self, site_id: str) -> EnrolmentRow:
        """The caller's enrolment; :class:`NotPermittedError` for strangers and the unenrolled."""
        self._known(site_id)
        row = self._enrolment(site_id)
        if row is None:
            raise NotPermittedError(f"site {site_id!r} has not enrolled; call Enroll first")
        return row

    def enrol_challenge(self, site_id: str) -> pb.EnrolChallenge:
        """A fresh nonce for ``site_id`` (from its certificate), valid once (module docstring)."""
        self._known(site_id)
        now = self._clock()
        nonce = secrets.token_bytes(32)
        with self.lock:
            open_ = {n: t for n, t in self._challenges.get(site_id, {}).items() if t > now}
            while len(open_) >= MAX_OPEN_CHALLENGES:
                del open_[min(open_, key=open_.__getitem__)]
            open_[nonce] = now + ENROL_CHALLENGE_TTL_S
            self._challenges[site_id] = open_
        return pb.EnrolChallenge(
            nonce=nonce,
            expires_unix_ms=int((now + ENROL_CHALLENGE_TTL_S) * 1000),
            federation_id=self.config.federation_id,
            site_id=site_id,
        )

    def _consume_challenge(self, site_id: str, nonce: bytes) -> None:
        with self.lock:
            expiry = self._challenges.get(site_id, {}).pop(nonce, None)
        if expiry is None:
            raise WrongStageError(
                "enrolment challenge unknown or already used: call GetEnrolChallenge, then Enroll"
            )
        if expiry <= self._clock():
            raise WrongStageError("enrolment challenge expired: call GetEnrolChallenge again")

    def enroll(self, site_id: str, request: pb.EnrollRequest) -> pb.EnrollResponse:
        """Register ``site_id`` (from its certificate) and its identity key, proven over a fresh
        challenge and every declared field (module docstring)."""
        self._known(site_id)
        entry = self.config.sites[site_id]
        self._consume_challenge(site_id, bytes(request.challenge))
        if request.identity_public_key != entry.identity_public_key:
            raise NotPermittedError("identity key differs from the key provisioned for this site")
        try:
            verify_fields(
                load_public_key_raw(request.identity_public_key),
                request.proof,
                context=ENROL_CONTEXT,
                fields=wire.enrol_proof_fields(
                    request,
                    federation_id=self.config.federation_id,
                    site_id=site_id,
                    server_identity_public_key=self.config.identity_public_key,
                ),
            )
        except CryptoError as exc:
            raise NotPermittedError(
                "enrol proof does not verify over this challenge and the declared fields"
            ) from exc
        if request.role not in (pb.SITE_ROLE_UNSPECIFIED, _ROLES[entry.role]):
            raise NotPermittedError(f"site {site_id!r} is provisioned as {entry.role}")
        if request.protocol_version not in (0, wire.PROTOCOL_VERSION):
            raise WrongStageError(
                f"this site speaks wire protocol {request.protocol_version}, the coordinator "
                f"speaks {wire.PROTOCOL_VERSION}: install the coordinator's afl release on the "
                "site (operations guide §11)"
            )
        if request.feature_dim < 0 or len(request.labelled_classes) > 10_000:
            raise InvalidRequestError("feature_dim and labelled_classes are out of range")
        bounds = RowBounds(int(request.declared_rows), float(request.declared_max_row_norm))
        if (request.declared_rows or request.declared_max_row_norm) and not bounds.valid:
            raise InvalidRequestError(f"declared row bounds {bounds} are not valid")
        # Classes outside server.toml's are kept (a later run may use them); the note names them
        # (a misspelling shows up here). Whether the site's features fit a run (backbone, d,
        # weights digest, random-init) is decided per run (afl.server.rounds).
        unknown = unknown_names(sorted(set(request.labelled_classes)), self.config.round.classes)
        note = (
            f"enrolled; classes not in server.toml's [round] classes: {unknown}" if unknown else ""
        )
        with self.lock:
            self.store.put_enrolment(
                EnrolmentRow(
                    site_id,
                    bytes(request.identity_public_key),
                    entry.role,
                    tuple(dict.fromkeys(request.labelled_classes)),
                    request.backbone,
                    request.feature_dim,
                    row_bounds=bounds.powers_of_two() if bounds.valid else None,
                    weights_sha256=request.weights_sha256,
                    random_init=request.random_init,
                ),
                software_version=request.software_version,
            )
            self._enrolled.pop(site_id, None)  # the next check reads the committed row
            self.store.audit("enrolled", {"site_id": site_id, **({"note": note} if note else {})})
            self.metrics.enrolments.inc()
            log.info("site enrolled", extra={"site_id": site_id, "note": note})
            self.machine.advance()
        return pb.EnrollResponse(
            site_id=site_id,
            federation_id=self.config.federation_id,
            server_identity_public_key=self.config.identity_public_key,
            protocol_version=wire.PROTOCOL_VERSION,
            message=note or "enrolled",
        )

    # --- rounds ------------------------------------------------------------------------------

    def _visible(self, view: RoundView, site_id: str) -> bool:
        return site_id in view.row.participants

    def status(self, site_id: str, round_id: str = "") -> pb.StatusResponse:
        self._known(site_id)
        with self.lock:
            enrolled = self._enrolment(site_id) is not None
            view = self.machine.find(round_id)
            latest = self.store.model()
            response = pb.StatusResponse(
                federation_id=self.config.federation_id,
                site_id=site_id,
                enrolled=enrolled,
                latest_model_round_id=latest[0] if latest else "",
                server_version=SERVER_VERSION,
                restores_acknowledged=self.store.restores_acknowledged(),
            )
            note = self.machine.notes.get(site_id, "") if enrolled else ""
            if note:
                response.note = note
            elif enrolled and self._visible(view, site_id):
                response.round.CopyFrom(self.machine.status(view, site_id))
            return response

    def round_config(self, site_id: str, round_id: str = "") -> pb.RoundConfig:
        self.require_enrolled(site_id)
        with self.lock:
            view = self.machine.find(round_id)
            self.machine.require_participant(view, site_id)
            row = view.row
            if row.plan is None or row.plan_signature is None:
                raise WrongStageError(f"round {row.round_id!r} has no release plan yet")
            run = self.machine.run_of(view)
        settings = run.settings
        config = pb.RoundConfig(
            federation_id=self.config.federation_id,
            round_id=row.round_id,
            round_number=row.number,
            parent_round_id=row.parent_round_id,
            participants=list(row.participants),
            class_names=list(settings.classes),
            feature_dim=settings.feature_dim,
            backbone=settings.backbone,
            gamma=settings.gamma,
            gram_scope=common_pb2.ReleasePlan.FromString(row.plan).gram_scope,
            aggregation=run.mode.proto_mode,  # type: ignore[arg-type]
            dp=common_pb2.ReleasePlan.FromString(row.plan).dp,
            min_participants=settings.min_participants,
            stage_timeout_s=int(settings.upload_timeout_s),
            release_plan=common_pb2.SignedReleasePlan(plan=row.plan, signature=row.plan_signature),
            protocol_version=wire.PROTOCOL_VERSION,
            run_id=run.run_id,
        )
        if row.number == 2 <= settings.rounds:  # not the evaluation round of a 1-round run
            r = settings.refinement
            config.refinement.CopyFrom(
                pb.RefinementParams(
                    tau=r.tau, alpha=r.alpha, delta_pos=r.delta_pos, delta_neg=r.delta_neg
                )
            )
        return config

    def decide(self, site_id: str, decision: pb.PlanDecision) -> None:
        """Record a signed accept/refuse of the round's plan."""
        enrolment = self.require_enrolled(site_id)
        with self.lock:
            view = self.machine.find(decision.round_id or "-")
            self.machine.require_participant(view, site_id)
            if view.row.plan is None:
                raise WrongStageError(f"round {view.round_id!r} has no release plan yet")
            if decision.plan_sha256 != blob_sha256(view.row.plan):
                raise WrongStageError("the decision names another release plan than this round's")
            previous = self.store.decision(view.round_id, site_id)
            if previous is not None and previous[0] == decision.accept:
                return  # a retry (e.g. its answer was lost in a coordinator restart)
            accepting = (pb.ROUND_STAGE_PLAN_REVIEW, pb.ROUND_STAGE_UPLOAD)
            if view.stage not in accepting:
                raise WrongStageError(f"round {view.round_id!r} is not reviewing a plan")
            try:
                verify_plan_decision(
                    enrolment.identity_public_key,
                    decision.signature,
                    round_id=view.round_id,
                    accept=decision.accept,
                    plan_sha256=decision.plan_sha256,
                    graph_commitment=decision.graph_commitment,
                    evaluation_rows=decision.evaluation_rows,
                )
            except CryptoError as exc:
                raise NotPermittedError("plan decision signature does not verify") from exc
            if decision.evaluation_rows not in EVALUATION_ROWS:
                raise InvalidRequestError(
                    f"evaluation_rows must be one of {sorted(EVALUATION_ROWS)}, got "
                    f"{decision.evaluation_rows[:40]!r}"
                )
            if previous is not None:
                raise WrongStageError("a different decision on this plan is already recorded")
            # sparse MASK graph, or the rows an evaluation scores: kept signed
            if decision.accept and (decision.graph_commitment or decision.evaluation_rows):
                self.store.put_message(
                    view.round_id,
                    stage=int(view.stage),
                    site_id=site_id,
                    kind=DECISION_JOURNAL_KIND,
                    data=decision.SerializeToString(),
                )
            reason = decision.reason[:500]
            self.store.put_decision(
                view.round_id,
                site_id,
                accept=decision.accept,
                reason=reason,
                signed=decision.SerializeToString(),
                audit={
                    "round_id": view.round_id,
                    "site_id": site_id,
                    "accept": decision.accept,
                    "reason": reason,
                    "plan_sha256": decision.plan_sha256.hex(),
                },
            )
            self.machine.advance()

    def upload(self, site_id: str, upload: wire.AssembledPayload) -> pb.UploadReceipt:
        """Store one checked payload (see the module docstring for idempotency). The round's
        state is checked under the lock; then, outside it, the mode prepares the payload (CKKS:
        parses every ciphertext) and its file is written and fsynced under a name of its own
        (:meth:`Store.stage_payload`), so neither holds up another call; under the lock again
        the state is checked anew, the payload checked, the file renamed into place and its row
        committed. A refused upload's staged file is erased; only an upload the round's state
        allows gets one."""
        self.require_enrolled(site_id)
        if upload.kind not in (pb.PAYLOAD_KIND_UNSPECIFIED, pb.PAYLOAD_KIND_STATISTIC):
            raise InvalidRequestError("sites upload STATISTIC payloads only")
        with self.lock:
            view = self.machine.find(upload.round_id or "-")
            mode = self.machine.mode_of(view)
            checked = self._upload_allowed(view, site_id, upload)
            if isinstance(checked, pb.UploadReceipt):
                return checked  # stored before: nothing to write
            require_upload_stage(view, mode.upload_stages)
        mode.prepare_upload(
            site_id=site_id, release=checked, data=upload.data, sha256=upload.sha256
        )
        try:
            staged = self.store.stage_payload(
                view.round_id, site_id, data=upload.data, sha256=upload.sha256
            )
        except DiskFullError:
            with self.lock:
                self.metrics.uploads.labels(outcome="disk-full").inc()
                self._hold_open(self.machine.find(view.round_id), site_id)
            raise
        try:
            return self._store_upload(site_id, upload, staged)
        finally:
            if staged.exists():  # refused, or stored meanwhile by a retry: no row names it
                self.store.discard_staged(staged)

    def _upload_allowed(
        self, view: RoundView, site_id: str, upload: wire.AssembledPayload
    ) -> PlannedRelease | pb.UploadReceipt:
        """The release ``upload`` is for, when ``site_id`` may upload it to ``view`` now (its
        state: a participant, no other payload stored for it, the plan accepted, a member of
        the release), or the receipt of the same payload stored before; raises otherwise.
        Called with the lock held, before the payload is written and again before its row is
        committed."""
        self.machine.require_participant(view, site_id)
        existing = self.store.site_uploads(view.round_id, site_id).get(upload.release_name)
        if existing is not None:
            if existing.sha256 != upload.sha256:
                self.metrics.uploads.labels(outcome="conflict").inc()
                raise ConflictError(
                    f"release {upload.release_name!r} already holds a different payload from "
                    "this site; uploads cannot be replaced"
                )
            self.metrics.uploads.labels(outcome="duplicate").inc()
            return self._receipt(
                view, existing.release_name, existing.sha256, existing.size, duplicate=True
            )
        decision = self.store.decision(view.round_id, site_id)
        if view.stage in (pb.ROUND_STAGE_PLAN_REVIEW, pb.ROUND_STAGE_UPLOAD) and (
            decision is None or not decision[0]
        ):
            raise WrongStageError("accept the release plan (RespondToPlan) before uploading")
        release = next((r for r in view.releases if r.name == upload.release_name), None)
        if release is None:
            raise InvalidRequestError(
                f"no release named {upload.release_name!r} in round {view.round_id!r}"
            )
        if site_id not in release.members:
            raise NotPermittedError(f"site {site_id!r} is not a member of {release.name!r}")
        return release

    def _store_upload(
        self, site_id: str, upload: wire.AssembledPayload, staged: Path
    ) -> pb.UploadReceipt:
        """:meth:`upload`'s checks and commit under the lock (``staged``: its file, written)."""
        with self.lock:
            view = self.machine.find(upload.round_id or "-")
            release = self._upload_allowed(view, site_id, upload)
            if isinstance(release, pb.UploadReceipt):
                return release
            self.machine.mode_of(view).check_upload(
                view, self.machine, site_id=site_id, release=release, data=upload.data
            )
            try:
                self.store.put_upload(
                    view.round_id,
                    site_id,
                    release.name,
                    data=upload.data,
                    sha256=upload.sha256,
                    audit={
                        "round_id": view.round_id,
                        "site_id": site_id,
                        "release": release.name,
                        "sha256": upload.sha256.hex(),
                        "bytes": len(upload.data),
                    },
                    staged=staged,
                )
            except DiskFullError:
                self.metrics.uploads.labels(outcome="disk-full").inc()
                self._hold_open(view, site_id)
                raise
            self.metrics.uploads.labels(outcome="stored").inc()
            self.metrics.upload_bytes.inc(len(upload.data))
            self.machine.advance()
            return self._receipt(
                view, release.name, upload.sha256, len(upload.data), duplicate=False
            )

    def _hold_open(self, view: RoundView, site_id: str) -> None:
        """A site's upload was refused for a full disk and the site retries it (a "try later"
        status): keep the stage open for ``[limits] full_disk_hold_s`` more seconds, so that space
        freed within the sites' retry window lets every site in (docs/protocol.md M-141). When
        even that small write fails, the deadline stays as it was."""
        until = self.machine.now_ms() + int(self.config.full_disk_hold_s * 1000)
        if view.row.deadline_ms >= until:
            return
        try:
            self.store.update_round(
                view.round_id,
                stage=view.stage,
                deadline_ms=until,
                abort_reason=view.row.abort_reason,
            )
        except (sqlite3.Error, OSError) as exc:
            log.warning(
                "the disk is full; the stage deadline could not be extended",
                extra={"round_id": view.round_id, "reason": str(exc)},
            )
            return
        log.warning(
            "the disk is full: an upload was refused (the site retries); the stage stays open",
            extra={"round_id": view.round_id, "site_id": site_id, "deadline_ms": until},
        )

    @staticmethod
    def _receipt(
        view: RoundView, release: str, sha256: bytes, size: int, *, duplicate: bool
    ) -> pb.UploadReceipt:
        return pb.UploadReceipt(
            round_id=view.round_id,
            release_name=release,
            sha256=sha256,
            bytes_received=size,
            duplicate=duplicate,
        )

    def run_participants(self, run_id: str) -> set[str]:
        """The sites that were members of a plan of ``run_id``: the participants of its rounds
        that published a signed plan (call with the lock held)."""
        return {
            site
            for row in self.store.rounds(run_id)
            if row.plan is not None
            for site in row.participants
        }

    def _require_need_to_know(self, site_id: str, round_id: str, what: str) -> None:
        """Need-to-know (docs/protocol.md M-160): with ``[access] need_to_know`` (the default), a
        run's model and evaluation go only to the sites that were members of its plans; any other
        site (one outside the run, the decryptor) is refused, and the refusal is recorded."""
        if not self.config.need_to_know:
            return
        row = self.store.round(round_id)
        if row is not None and site_id in self.run_participants(row.run_id):
            return
        self.store.audit("read-refused", {"site_id": site_id, "what": what, "round_id": round_id})
        raise NotPermittedError(
            f"site {site_id!r} took no part in the run of round {round_id!r}: its {what} goes "
            "to the run's participants only (need-to-know)"
        )

    def _latest_readable(self, site_id: str) -> str:
        """The round id of the latest model ``site_id`` may read ("" when none)."""
        found = self.store.model()
        if found is None or not self.config.need_to_know:
            return found[0] if found else ""
        readable = ""
        for row in self.store.rounds():
            if self.store.model(row.round_id) is not None and site_id in self.run_participants(
                row.run_id
            ):
                readable = row.round_id
        return readable

    def model(self, site_id: str, round_id: str = "") -> pb.SignedModel:
        """The signed model of ``round_id`` (the latest the site may read when ""); while the
        round is VALIDATING, its candidate (signed with context "candidate-model") for the
        round's participants, who score it in the validation gate (docs/protocol.md §6.2).
        Need-to-know applies (:meth:`_require_need_to_know`); every read is an audit record
        "model-read" (who, which round, the SHA-256 of the ``Model`` bytes)."""
        self.require_enrolled(site_id)
        with self.lock:
            wanted = round_id or self._latest_readable(site_id)
            found = self.store.model(wanted) if wanted else None
            signed: tuple[bytes, bytes] | None = None
            candidate = False
            if found is not None:
                self._require_need_to_know(site_id, found[0], "model")
                signed = found[1], found[2]
            elif round_id:
                view = self.machine.find(round_id)
                stored = self.store.candidate(round_id)
                if view.stage == pb.ROUND_STAGE_VALIDATING and stored is not None:
                    self.machine.require_participant(view, site_id)
                    signed, candidate = stored, True
            if signed is None:
                where = f" for round {round_id!r}" if round_id else ""
                if not round_id and self.store.model() is not None:
                    where = f" of a run site {site_id!r} took part in (need-to-know)"
                raise WrongStageError(f"no model has been published{where}")
            self.store.audit(
                "model-read",
                {
                    "site_id": site_id,
                    "round_id": wanted,
                    "candidate": candidate,
                    "sha256": hashlib.sha256(signed[0]).hexdigest(),
                },
            )
        return pb.SignedModel(model=signed[0], signature=signed[1])

    def evaluation(self, site_id: str, round_id: str) -> pb.SignedEvaluation:
        """The signed evaluation of the evaluation round ``round_id``, for the run's participants
        (need-to-know); every read is an audit record "evaluation-read"."""
        self.require_enrolled(site_id)
        with self.lock:
            found = self.store.evaluation(round_id)
            if found is None:
                raise WrongStageError(f"no evaluation has been published for round {round_id!r}")
            self._require_need_to_know(site_id, round_id, "evaluation")
            self.store.audit(
                "evaluation-read",
                {
                    "site_id": site_id,
                    "round_id": round_id,
                    "sha256": hashlib.sha256(found[0]).hexdigest(),
                },
            )
        return pb.SignedEvaluation(evaluation=found[0], signature=found[1])

    def report(self, site_id: str, report: pb.ClientReport) -> None:
        """Store a site's report once it is checked (:mod:`afl.server.reports`)."""
        self.require_enrolled(site_id)
        check_report(report, site_id=site_id)
        with self.lock:
            view = self.machine.find(report.round_id or "-")
            self.machine.require_participant(view, site_id)
            outcome = pb.ClientOutcome.Name(report.outcome)
            reason = report.reason[:500]  # the site's own words (no statistics, protocol.md §11)
            self.store.put_report(
                view.round_id,
                site_id,
                report.SerializeToString(),
                audit={
                    "round_id": view.round_id,
                    "site_id": site_id,
                    "outcome": outcome,
                    "reason": reason,
                    "bytes_sent": report.bytes_sent,
                },
            )
        if report.outcome != pb.CLIENT_OUTCOME_COMPLETED:
            log.warning(
                "site reported %s: %s",
                outcome.removeprefix("CLIENT_OUTCOME_"),
                reason or "(no reason given)",
                extra={"site_id": site_id, "round_id": view.round_id, "reason": reason},
            )

    def events_after(
        self, site_id: str, sequence: int, *, timeout_s: float
    ) -> tuple[list[pb.RoundEvent], int]:
        """Round events numbered above ``sequence`` of rounds ``site_id`` takes part in (the
        CKKS decryptor: of every round, since it serves them all), waiting up to ``timeout_s``
        for any event; also returns the last sequence number looked at."""
        self.require_enrolled(site_id)
        every = self.config.sites[site_id].role == "decryptor"
        with self.lock:
            self.lock.wait_for(lambda: len(self.machine.events) > sequence, timeout=timeout_s)
            events = self.machine.events[sequence:]
            mine = [e for e in events if every or site_id in e.status.participants]
            return mine, len(self.machine.events)

    def rounds_up_to(self, round_id: str) -> set[str]:
        """Ids of ``round_id`` and every round before it (empty when ``round_id`` is "")."""
        with self.lock:
            ids = [row.round_id for row in self.store.rounds()] if round_id else []
        return set(ids[: ids.index(round_id) + 1]) if round_id in ids else set()

    def event_count(self) -> int:
        with self.lock:
            return len(self.machine.events)

    def tick(self) -> None:
        """Apply due timeouts (the daemon calls this periodically)."""
        with self.lock:
            self.machine.advance()

    # --- the federation log (afl.server.transparency) -------------------------------------------

    def log_checkpoint(
        self, site_id: str, request: pb.CheckpointRequest | None = None
    ) -> pb.CosignedLogCheckpoint:
        """The newest checkpoint (``request.size`` 0) or that of ``request.size``, with its
        cosignatures and the proofs the request asks for (:meth:`FederationLog.answer`). With
        ``wait_ms`` and a condition (``wait_cosignatures``, ``wait_grown_past``) that the answer
        does not meet yet, the answer is held until the store commits what meets it
        (:mod:`afl.server.logwait`), at most :data:`CHECKPOINT_HOLD_MAX_S` and one held call
        per caller (a second one is answered at once), and computed afresh."""
        self.require_enrolled(site_id)
        request = request or pb.CheckpointRequest()
        want, past = int(request.wait_cosignatures), int(request.wait_grown_past)
        if past and request.size:
            raise InvalidRequestError(
                "wait_grown_past waits for the newest checkpoint: a request for the checkpoint "
                f"of size {request.size} cannot ask for it"
            )
        with self.lock:
            answer = self.log.answer(request)
        hold_s = min(request.wait_ms / 1000, CHECKPOINT_HOLD_MAX_S)
        met = (want and len(answer.cosignatures) >= want) or (
            past and answer.checkpoint.size > past
        )
        if hold_s <= 0 or met or not (want or past) or not self._hold(site_id):
            return self._with_entries(request, answer)
        try:
            self.store.log_changes.wait(
                checkpoint=int(answer.checkpoint.size),
                cosigners=[c.witness for c in answer.cosignatures],
                want_cosigners=want,
                grown_past=past,
                timeout_s=hold_s,
            )
        finally:
            with self._holding_lock:
                self._holding.discard(site_id)
        with self.lock:
            answer = self.log.answer(request)
        return self._with_entries(request, answer)

    def _with_entries(
        self, request: pb.CheckpointRequest, answer: pb.CosignedLogCheckpoint
    ) -> pb.CosignedLogCheckpoint:
        """``answer`` with the statements ``request`` asks for (``with_entries``): those from
        ``entries_from`` up to the answered checkpoint's size, as :meth:`log_entries` serves
        them (committed ones, read without the lock; at most one GetLogEntries answer's worth)."""
        start, size = int(request.entries_from), int(answer.checkpoint.size)
        if request.with_entries and start < size:
            answer.entries.extend(log_entry_to_proto(row) for row in self.log.entries(start, size))
        return answer

    def _hold(self, site_id: str) -> bool:
        """Take ``site_id``'s one held-GetCheckpoint slot (False: it holds one already, or the
        worker pool has no thread to spare for another)."""
        with self._holding_lock:
            if site_id in self._holding or len(self._holding) >= self._max_holding:
                return False
            self._holding.add(site_id)
            return True

    def log_consistency(self, site_id: str, old_size: int, new_size: int) -> pb.LogProof:
        self.require_enrolled(site_id)
        with self.lock:
            return pb.LogProof(hashes=self.log.consistency(old_size, new_size))

    def log_inclusion(self, site_id: str, request: pb.InclusionProofRequest) -> pb.LogProof:
        self.require_enrolled(site_id)
        with self.lock:
            index, path = self.log.inclusion(
                leaf=bytes(request.leaf_hash), index=int(request.index), size=int(request.size)
            )
        return pb.LogProof(index=index, hashes=path)

    def log_entries(self, site_id: str, start: int, end: int) -> pb.LogEntries:
        self.require_enrolled(site_id)
        rows = self.log.entries(start, end)  # committed statements: read without the lock
        return pb.LogEntries(entries=[log_entry_to_proto(row) for row in rows])

    def log_dp_release(self, site_id: str, request: pb.DpRelease) -> pb.LogProof:
        """Append the caller's signed DP-ledger entry (docs/protocol.md M-195); its index."""
        self.require_enrolled(site_id)
        statement = bytes(request.statement)
        index = self.log_writes.run(lambda: self.log.record_dp_release(site_id, statement))
        return pb.LogProof(index=index)

    def log_opening(
        self,
        site_id: str,
        request: pb.Opening,
        *,
        survivors_of: Callable[[str], Sequence[str]],
    ) -> pb.LogProof:
        """Append the caller's signed opening of a masked or CKKS round (docs/protocol.md
        M-232); ``survivors_of``: the round's survivors as its exchange holds them."""
        self.require_enrolled(site_id)
        with self.lock:
            index = self.log.record_opening(
                site_id, bytes(request.statement), survivors_of=survivors_of
            )
        return pb.LogProof(index=index)

    def log_decrypting(
        self, site_id: str, request: pb.Decrypting, *, solving: Callable[[str], bytes]
    ) -> pb.LogProof:
        """Append the decryptor's signed `decrypting` statement of a CKKS round (docs/protocol.md
        M-235); ``solving``: the digest of the round's plan while its decryptor may decrypt."""
        self.require_enrolled(site_id)
        with self.lock:
            index = self.log.record_decrypting(site_id, bytes(request.statement), solving=solving)
        return pb.LogProof(index=index)

    def log_cosign(self, site_id: str, request: pb.LogCosignature) -> pb.CosignedLogCheckpoint:
        """Keep the caller's cosignature (its certificate names the witness); the checkpoint
        with the cosignatures it now has."""
        self.require_enrolled(site_id)
        if request.witness != site_id:
            raise NotPermittedError(
                f"a cosignature names witness {request.witness!r}, the caller is {site_id!r}"
            )
        size, root, signature = int(request.size), bytes(request.root), bytes(request.signature)
        found = self.log_writes.run(
            lambda: self.log.cosign(site_id, size=size, root=root, signature=signature)
        )
        log.info(
            "log checkpoint cosigned",
            extra={
                "site_id": site_id,
                "size": int(request.size),
                "cosignatures": len(found.cosignatures),
            },
        )
        return cosigned_to_proto(found)
