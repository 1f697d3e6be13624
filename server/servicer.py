"""The gRPC servicers of afl-server: every RPC of the Coordinator and Admin services, thin
(docs/architecture.md §2).

Each method decodes its request, takes the caller's site id from its mTLS certificate, calls the
domain code — :class:`~afl.server.coordinator.Coordinator` for the shared flow,
:class:`~afl.server.modes.mask.MaskRequests` and :class:`~afl.server.modes.ckks.CkksRequests` for
the mode-specific RPCs — and maps errors to status codes in ONE place (:func:`status_for`).

The site id comes from ``context.auth_context()["x509_pem_cert"]`` (the verified client
certificate; :func:`afl.crypto.identity.pki.site_id_from_pem`), never from a message field. Only with the
``--insecure`` dev flag is it read from the ``x-afl-site-id`` metadata header instead. A mode RPC
naming a round of another mode is FAILED_PRECONDITION. The Admin service (:class:`AdminServicer`,
:mod:`afl.server.admin`) takes the caller's admin name from an ``afl-admin:<name>`` certificate
(``x-afl-admin`` header with ``--insecure``); site certificates never open it.

Long-lived streams (``WatchRounds``, ``Upload``, ``Download``) each hold one of the caller's
per-site slots (:class:`afl.server.limits.SiteStreams`; the excess is RESOURCE_EXHAUSTED, marked
"try later" like a full disk: trailing metadata ``wire.TRY_LATER_TRAILER``), and an
upload whose next chunk does not come within ``[limits] upload_idle_timeout_s`` is closed with
DEADLINE_EXCEEDED (:func:`afl.server.limits.idle_limited`).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import grpc

from afl.crypto.errors import CryptoError
from afl.crypto.identity.pki import PkiError, admin_name_from_pem, site_id_from_pem
from afl.crypto.identity.revocation import RevocationList
from afl.proto import wire
from afl.proto.v1 import admin_pb2 as apb
from afl.proto.v1 import admin_pb2_grpc, common_pb2, coordinator_pb2_grpc
from afl.proto.v1 import coordinator_pb2 as pb
from afl.server.admin import AdminRequests
from afl.server.config import ServerConfig
from afl.server.coordinator import Coordinator
from afl.server.errors import (
    ConflictError,
    DiskFullError,
    InvalidRequestError,
    NotPermittedError,
    RefusedError,
    StoppingError,
    WrongStageError,
)
from afl.server.limits import IdleStreamError, LimitExceededError, SiteStreams, idle_limited
from afl.server.modes.ckks import CKKS_DECRYPTOR_KINDS, CkksRequests
from afl.server.modes.mask import MaskRequests

__all__ = [
    "INSECURE_ADMIN_HEADER",
    "INSECURE_SITE_HEADER",
    "AdminServicer",
    "CoordinatorServicer",
    "status_for",
]

INSECURE_SITE_HEADER = "x-afl-site-id"
INSECURE_ADMIN_HEADER = "x-afl-admin"
log = logging.getLogger("afl.server.servicer")
T = TypeVar("T")

_CODES: tuple[tuple[type[Exception], grpc.StatusCode], ...] = (
    (InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (NotPermittedError, grpc.StatusCode.PERMISSION_DENIED),
    (WrongStageError, grpc.StatusCode.FAILED_PRECONDITION),
    (RefusedError, grpc.StatusCode.FAILED_PRECONDITION),
    (ConflictError, grpc.StatusCode.ALREADY_EXISTS),
    (DiskFullError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (StoppingError, grpc.StatusCode.UNAVAILABLE),
    (LimitExceededError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (IdleStreamError, grpc.StatusCode.DEADLINE_EXCEEDED),
    (wire.WireLimitError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (wire.WireError, grpc.StatusCode.INVALID_ARGUMENT),
    (CryptoError, grpc.StatusCode.PERMISSION_DENIED),
)


#: Refusals that pass once the coordinator recovers (free disk space, a stream slot): sent with
#: the trailing metadata ``wire.TRY_LATER_TRAILER`` so that sites retry them with back-off.
_TRY_LATER: tuple[type[Exception], ...] = (DiskFullError, LimitExceededError)


def status_for(error: Exception) -> tuple[grpc.StatusCode, str]:
    """The gRPC status code and message for an exception raised while serving a request.

    Domain errors keep their message (they never contain statistics or key material); anything
    else is INTERNAL with a generic message (details go to the server log only).
    """
    for kind, code in _CODES:
        if isinstance(error, kind):
            return code, str(error)
    return grpc.StatusCode.INTERNAL, "internal server error (see the server log)"


class _Thin:
    """The one place errors become statuses, for both services."""

    coordinator: Coordinator

    def _identify(self, context: grpc.ServicerContext) -> str:
        raise NotImplementedError

    def _call(self, method: str, context: grpc.ServicerContext, body: Callable[[str], T]) -> T:
        try:
            return body(self._identify(context))
        except Exception as exc:  # the one place errors become statuses
            code, message = status_for(exc)
            self.coordinator.metrics.rpc_errors.labels(method=method, code=code.name).inc()
            if code is grpc.StatusCode.INTERNAL:
                log.exception("unexpected error", extra={"method": method})
            else:
                log.info(
                    "request refused",
                    extra={"method": method, "code": code.name, "reason": message},
                )
            if isinstance(exc, _TRY_LATER):
                context.set_trailing_metadata(((wire.TRY_LATER_TRAILER, "1"),))
            context.abort(code, message)
            raise AssertionError("unreachable") from exc  # context.abort raises


#: A site's id from its certificate, parsed once per certificate (every call presents it; the
#: revocation check still runs on every call, the list can change).
_site_id_of_pem = functools.lru_cache(maxsize=4096)(site_id_from_pem)


def _peer_identity(
    context: grpc.ServicerContext,
    *,
    insecure: bool,
    header: str,
    parse: Callable[[bytes], str],
    revocation: RevocationList | None,
) -> str:
    if insecure:
        for key, value in context.invocation_metadata():
            if key == header:
                return str(value)
        raise NotPermittedError(f"--insecure mode: send the {header} header")
    certs = context.auth_context().get("x509_pem_cert") or []
    if not certs:
        raise NotPermittedError("no client certificate: mutual TLS is required")
    try:
        identity = parse(certs[0])
        refusal = None if revocation is None else revocation.refusal(certs[0])
    except PkiError as exc:
        raise NotPermittedError(f"the client certificate does not fit this service: {exc}") from exc
    if refusal is not None:  # M-173: a revoked certificate opens nothing
        raise NotPermittedError(f"{identity}: {refusal}")
    return identity


def _revocation(config: ServerConfig) -> RevocationList | None:
    if config.crl is None:
        return None
    return RevocationList(config.crl, ca_certificate_pem=config.ca_cert.read_bytes())


class CoordinatorServicer(_Thin, coordinator_pb2_grpc.CoordinatorServicer):
    """gRPC front end of one :class:`Coordinator`."""

    def __init__(
        self,
        coordinator: Coordinator,
        *,
        insecure: bool = False,
        watch_poll_s: float = 1.0,
        stopping: Callable[[], bool] = lambda: False,
    ) -> None:
        self.coordinator = coordinator
        self._insecure = insecure
        self._revocation = _revocation(coordinator.config)
        self._watch_poll_s = watch_poll_s
        self._stopping = stopping
        self.streams = SiteStreams(coordinator.config.limits)
        self._mask = MaskRequests(coordinator)
        self._ckks = CkksRequests(coordinator, coordinator.machine.ckks_contexts)

    def _identify(self, context: grpc.ServicerContext) -> str:
        return _peer_identity(
            context,
            insecure=self._insecure,
            header=INSECURE_SITE_HEADER,
            parse=_site_id_of_pem,
            revocation=self._revocation,
        )

    def _stream_slot(self, site: str, kind: str, context: grpc.ServicerContext) -> None:
        """Hold one of ``site``'s ``kind`` slots until the call terminates."""
        self.streams.acquire(site, kind)
        if not context.add_callback(lambda: self.streams.release(site, kind)):
            self.streams.release(site, kind)  # the call has already ended

    @staticmethod
    def _ack(message: str, action: Callable[[], object]) -> common_pb2.Ack:
        action()
        return common_pb2.Ack(message=message)

    # --- the shared flow ---------------------------------------------------------------------

    def GetEnrolChallenge(
        self, request: pb.EnrolChallengeRequest, context: grpc.ServicerContext
    ) -> Any:
        return self._call("GetEnrolChallenge", context, self.coordinator.enrol_challenge)

    def Enroll(self, request: pb.EnrollRequest, context: grpc.ServicerContext) -> Any:
        return self._call("Enroll", context, lambda s: self.coordinator.enroll(s, request))

    def GetStatus(self, request: pb.StatusRequest, context: grpc.ServicerContext) -> Any:
        return self._call(
            "GetStatus", context, lambda s: self.coordinator.status(s, request.round_id)
        )

    def WatchRounds(
        self, request: pb.WatchRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.RoundEvent]:
        def body(s: str) -> tuple[str, set[str]]:
            site = self.coordinator.require_enrolled(s).site_id
            self._stream_slot(site, "watch", context)
            return site, self.coordinator.rounds_up_to(request.after_round_id)

        site, earlier = self._call("WatchRounds", context, body)
        sequence = 0
        while context.is_active() and not self._stopping():
            events, sequence = self.coordinator.events_after(
                site, sequence, timeout_s=self._watch_poll_s
            )
            for event in events:
                if event.status.round_id not in earlier:
                    yield event

    def GetRoundConfig(self, request: common_pb2.RoundRef, context: grpc.ServicerContext) -> Any:
        return self._call(
            "GetRoundConfig", context, lambda s: self.coordinator.round_config(s, request.round_id)
        )

    def RespondToPlan(self, request: pb.PlanDecision, context: grpc.ServicerContext) -> Any:
        return self._call(
            "RespondToPlan",
            context,
            lambda s: self._ack("decision recorded", lambda: self.coordinator.decide(s, request)),
        )

    def Upload(
        self, request_iterator: Iterator[pb.UploadChunk], context: grpc.ServicerContext
    ) -> Any:
        config = self.coordinator.config

        def body(site: str) -> pb.UploadReceipt:
            self.coordinator.require_enrolled(site)  # refuse strangers before reading a payload
            with self.streams.hold(site, "upload"):
                chunks = idle_limited(
                    request_iterator,
                    idle_s=config.limits.upload_idle_timeout_s,
                    what=f"upload from {site}",
                )
                upload = wire.assemble(
                    chunks,
                    max_chunk_bytes=config.max_chunk_bytes,
                    max_bytes=config.max_upload_bytes,
                )
                if upload.kind in CKKS_DECRYPTOR_KINDS:
                    return self._ckks.accept_decryptor_upload(site, upload)
                return self.coordinator.upload(site, upload)

        return self._call("Upload", context, body)

    def Download(
        self, request: pb.DownloadRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.UploadChunk]:
        def body(site: str) -> tuple[str, str, bytes]:
            self._stream_slot(site, "download", context)
            return self._ckks.download(site, request)

        round_id, name, data = self._call("Download", context, body)
        yield from wire.iter_chunks(data, round_id=round_id, release_name=name, kind=request.kind)

    def GetModel(self, request: pb.ModelRequest, context: grpc.ServicerContext) -> Any:
        return self._call(
            "GetModel", context, lambda s: self.coordinator.model(s, request.round_id)
        )

    def GetEvaluation(self, request: pb.EvaluationRequest, context: grpc.ServicerContext) -> Any:
        return self._call(
            "GetEvaluation", context, lambda s: self.coordinator.evaluation(s, request.round_id)
        )

    def SubmitReport(self, request: pb.ClientReport, context: grpc.ServicerContext) -> Any:
        return self._call(
            "SubmitReport",
            context,
            lambda s: self._ack("report stored", lambda: self.coordinator.report(s, request)),
        )

    # --- the federation log ------------------------------------------------------------------

    def GetCheckpoint(self, request: pb.CheckpointRequest, context: grpc.ServicerContext) -> Any:
        return self._call(
            "GetCheckpoint", context, lambda s: self.coordinator.log_checkpoint(s, request)
        )

    def GetConsistencyProof(
        self, request: pb.ConsistencyProofRequest, context: grpc.ServicerContext
    ) -> Any:
        return self._call(
            "GetConsistencyProof",
            context,
            lambda s: self.coordinator.log_consistency(s, request.old_size, request.new_size),
        )

    def GetInclusionProof(
        self, request: pb.InclusionProofRequest, context: grpc.ServicerContext
    ) -> Any:
        return self._call(
            "GetInclusionProof", context, lambda s: self.coordinator.log_inclusion(s, request)
        )

    def GetLogEntries(self, request: pb.LogEntriesRequest, context: grpc.ServicerContext) -> Any:
        return self._call(
            "GetLogEntries",
            context,
            lambda s: self.coordinator.log_entries(s, request.start, request.end),
        )

    def CosignCheckpoint(self, request: pb.LogCosignature, context: grpc.ServicerContext) -> Any:
        return self._call(
            "CosignCheckpoint", context, lambda s: self.coordinator.log_cosign(s, request)
        )

    def RecordDpRelease(self, request: pb.DpRelease, context: grpc.ServicerContext) -> Any:
        return self._call(
            "RecordDpRelease", context, lambda s: self.coordinator.log_dp_release(s, request)
        )

    def RecordOpening(self, request: pb.Opening, context: grpc.ServicerContext) -> Any:
        return self._call(
            "RecordOpening",
            context,
            lambda s: self.coordinator.log_opening(
                s, request, survivors_of=lambda r: self._opening_survivors(s, r)
            ),
        )

    def RecordDecrypting(self, request: pb.Decrypting, context: grpc.ServicerContext) -> Any:
        return self._call(
            "RecordDecrypting",
            context,
            lambda s: self.coordinator.log_decrypting(
                s, request, solving=lambda r: self._ckks.decrypting_plan(s, r)
            ),
        )

    def _opening_survivors(self, site: str, round_id: str) -> Sequence[str]:
        """The survivors an opening of ``round_id`` must state: the CKKS round's participants,
        else the masked round's survivor list (each raises outside the stages that take one)."""
        if self._ckks.runs_ckks(round_id):
            return self._ckks.opening_survivors(site, round_id)
        return self._mask.survivors(site, round_id).survivors

    # --- MASK mode ---------------------------------------------------------------------------

    def GetGraphCommitments(
        self, request: common_pb2.RoundRef, context: grpc.ServicerContext
    ) -> Any:
        return self._call(
            "GetGraphCommitments",
            context,
            lambda s: self._mask.graph_commitments(s, request.round_id),
        )

    def AdvertiseKeys(self, request: pb.AdvertiseKeysRequest, context: grpc.ServicerContext) -> Any:
        return self._call("AdvertiseKeys", context, lambda s: self._mask.advertise_keys(s, request))

    def GetAdvertisedKeys(self, request: common_pb2.RoundRef, context: grpc.ServicerContext) -> Any:
        return self._call(
            "GetAdvertisedKeys",
            context,
            lambda s: self._mask.advertised_keys(s, request.round_id),
        )

    def ShareKeys(self, request: pb.ShareKeysRequest, context: grpc.ServicerContext) -> Any:
        return self._call("ShareKeys", context, lambda s: self._mask.share_keys(s, request))

    def GetSharedKeys(self, request: common_pb2.RoundRef, context: grpc.ServicerContext) -> Any:
        return self._call(
            "GetSharedKeys",
            context,
            lambda s: self._mask.shared_keys(s, request.round_id),
        )

    def GetSurvivors(self, request: common_pb2.RoundRef, context: grpc.ServicerContext) -> Any:
        return self._call(
            "GetSurvivors", context, lambda s: self._mask.survivors(s, request.round_id)
        )

    def ConsistencyCheck(
        self, request: pb.ConsistencySignature, context: grpc.ServicerContext
    ) -> Any:
        def body(s: str) -> Any:
            if request.opening:  # in the log first (M-232), as RecordOpening logs it
                self.coordinator.log_opening(
                    s,
                    pb.Opening(statement=request.opening),
                    survivors_of=lambda r: self._opening_survivors(s, r),
                )
                request.ClearField("opening")  # the round's record keeps the signature alone
            return self._mask.consistency_check(s, request)

        return self._call("ConsistencyCheck", context, body)

    def GetConsistencySignatures(
        self, request: common_pb2.RoundRef, context: grpc.ServicerContext
    ) -> Any:
        return self._call(
            "GetConsistencySignatures",
            context,
            lambda s: self._mask.consistency_signatures(s, request.round_id),
        )

    def GetUnmaskRequest(self, request: common_pb2.RoundRef, context: grpc.ServicerContext) -> Any:
        return self._call(
            "GetUnmaskRequest",
            context,
            lambda s: self._mask.unmask_request(s, request.round_id),
        )

    def Unmask(self, request: pb.UnmaskResponse, context: grpc.ServicerContext) -> Any:
        return self._call("Unmask", context, lambda s: self._mask.unmask(s, request))

    # --- CKKS mode ---------------------------------------------------------------------------

    def PublishCkksContext(
        self, request: pb.CkksContextAnnouncement, context: grpc.ServicerContext
    ) -> Any:
        return self._call(
            "PublishCkksContext",
            context,
            lambda s: self._ack("context published", lambda: self._ckks.publish(s, request)),
        )

    def GetCkksContext(self, request: common_pb2.RoundRef, context: grpc.ServicerContext) -> Any:
        return self._call("GetCkksContext", context, lambda s: self._ckks.get_context(s))

    def SendAggregateTags(
        self, request: pb.SendAggregateTagsRequest, context: grpc.ServicerContext
    ) -> Any:
        return self._call(
            "SendAggregateTags",
            context,
            lambda s: self._ack("tags stored", lambda: self._ckks.send_tags(s, request)),
        )

    def GetAggregateTags(self, request: common_pb2.RoundRef, context: grpc.ServicerContext) -> Any:
        return self._call("GetAggregateTags", context, lambda s: self._ckks.get_tags(s, request))

    def GetDecryptionJobs(self, request: common_pb2.RoundRef, context: grpc.ServicerContext) -> Any:
        return self._call("GetDecryptionJobs", context, lambda s: self._ckks.jobs(s, request))

    def ReportDecryption(self, request: pb.DecryptionOutcome, context: grpc.ServicerContext) -> Any:
        return self._call(
            "ReportDecryption",
            context,
            lambda s: self._ack("outcome recorded", lambda: self._ckks.report(s, request)),
        )


class AdminServicer(_Thin, admin_pb2_grpc.AdminServicer):
    """gRPC front end of the Admin service (:class:`afl.server.admin.AdminRequests`)."""

    def __init__(self, coordinator: Coordinator, *, insecure: bool = False) -> None:
        self.coordinator = coordinator
        self._insecure = insecure
        self._revocation = _revocation(coordinator.config)
        self._admin = AdminRequests(coordinator)

    def _identify(self, context: grpc.ServicerContext) -> str:
        return _peer_identity(
            context,
            insecure=self._insecure,
            header=INSECURE_ADMIN_HEADER,
            parse=admin_name_from_pem,
            revocation=self._revocation,
        )

    def SubmitRun(self, request: apb.SubmitRunRequest, context: grpc.ServicerContext) -> Any:
        return self._call("SubmitRun", context, lambda a: self._admin.submit(a, request))

    def ListRuns(self, request: apb.ListRunsRequest, context: grpc.ServicerContext) -> Any:
        return self._call("ListRuns", context, lambda a: self._admin.list(a))

    def GetRun(self, request: apb.RunRef, context: grpc.ServicerContext) -> Any:
        return self._call("GetRun", context, lambda a: self._admin.get(a, request.run_id))

    def AbortRun(self, request: apb.AbortRunRequest, context: grpc.ServicerContext) -> Any:
        return self._call("AbortRun", context, lambda a: self._admin.abort(a, request))

    def GetLogs(self, request: apb.LogRequest, context: grpc.ServicerContext) -> Any:
        return self._call("GetLogs", context, lambda a: self._admin.logs(a, request))

    def GetRunModel(self, request: apb.RunRef, context: grpc.ServicerContext) -> Any:
        return self._call("GetRunModel", context, lambda a: self._admin.model(a, request.run_id))

    def GetRunEvaluation(self, request: apb.RunRef, context: grpc.ServicerContext) -> Any:
        return self._call(
            "GetRunEvaluation", context, lambda a: self._admin.evaluation(a, request.run_id)
        )
