"""Thin gRPC servicer of the Coordinator service (design §9): decode, take the caller's site id
from its mTLS certificate, call :class:`~afl.server.coordinator.Coordinator`, and map errors to
status codes in ONE place (:func:`status_for`).

The site id comes from ``context.auth_context()["x509_pem_cert"]`` (the verified client
certificate; :func:`afl.crypto.pki.site_id_from_pem`), never from a message field. Only with the
``--insecure`` dev flag is it read from the ``x-afl-site-id`` metadata header instead.
RPCs of the masking and CKKS modes stay UNIMPLEMENTED (the generated base class).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import grpc

from afl.crypto.errors import CryptoError
from afl.crypto.pki import PkiError, site_id_from_pem
from afl.proto.v1 import common_pb2
from afl.proto.v1 import coordinator_pb2 as pb
from afl.server.ckks_service import CKKS_DECRYPTOR_KINDS, CkksServicerMixin
from afl.server.coordinator import Coordinator
from afl.server.errors import (
    ConflictError,
    InvalidRequestError,
    NotPermittedError,
    TooLargeError,
    WrongStageError,
)
from afl.server.mask_rpcs import MaskRpcs
from afl.server.unimplemented import OtherModesServicer
from afl.server.uploads import assemble

__all__ = ["INSECURE_SITE_HEADER", "CoordinatorServicer", "status_for"]

INSECURE_SITE_HEADER = "x-afl-site-id"
log = logging.getLogger("afl.server.servicer")
T = TypeVar("T")

_CODES: tuple[tuple[type[Exception], grpc.StatusCode], ...] = (
    (InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (NotPermittedError, grpc.StatusCode.PERMISSION_DENIED),
    (WrongStageError, grpc.StatusCode.FAILED_PRECONDITION),
    (ConflictError, grpc.StatusCode.ALREADY_EXISTS),
    (TooLargeError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (CryptoError, grpc.StatusCode.PERMISSION_DENIED),
)


def status_for(error: Exception) -> tuple[grpc.StatusCode, str]:
    """The gRPC status code and message for an exception raised while serving a request.

    Domain errors keep their message (they never contain statistics or key material); anything
    else is INTERNAL with a generic message (details go to the server log only).
    """
    for kind, code in _CODES:
        if isinstance(error, kind):
            return code, str(error)
    return grpc.StatusCode.INTERNAL, "internal server error (see the server log)"


class CoordinatorServicer(MaskRpcs, CkksServicerMixin, OtherModesServicer):
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
        self._watch_poll_s = watch_poll_s
        self._stopping = stopping

    # --- plumbing ----------------------------------------------------------------------------

    def _site(self, context: grpc.ServicerContext) -> str:
        if self._insecure:
            for key, value in context.invocation_metadata():
                if key == INSECURE_SITE_HEADER:
                    return str(value)
            raise NotPermittedError(f"--insecure mode: send the {INSECURE_SITE_HEADER} header")
        certs = context.auth_context().get("x509_pem_cert") or []
        if not certs:
            raise NotPermittedError("no client certificate: mutual TLS is required")
        try:
            return site_id_from_pem(certs[0])
        except PkiError as exc:
            raise NotPermittedError("the client certificate names no valid site") from exc

    def _call(self, method: str, context: grpc.ServicerContext, body: Callable[[str], T]) -> T:
        try:
            return body(self._site(context))
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
            context.abort(code, message)
            raise AssertionError("unreachable") from exc  # context.abort raises

    # --- RPCs --------------------------------------------------------------------------------

    def Enroll(self, request: pb.EnrollRequest, context: grpc.ServicerContext) -> Any:
        return self._call("Enroll", context, lambda s: self.coordinator.enroll(s, request))

    def GetStatus(self, request: pb.StatusRequest, context: grpc.ServicerContext) -> Any:
        return self._call(
            "GetStatus", context, lambda s: self.coordinator.status(s, request.round_id)
        )

    def WatchRounds(
        self, request: pb.WatchRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.RoundEvent]:
        site = self._call("WatchRounds", context, lambda s: self.coordinator._enrolled(s).site_id)
        earlier = self.coordinator.rounds_up_to(request.after_round_id)
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
        def body(site: str) -> common_pb2.Ack:
            self.coordinator.decide(site, request)
            return common_pb2.Ack(message="decision recorded")

        return self._call("RespondToPlan", context, body)

    def Upload(
        self, request_iterator: Iterator[pb.UploadChunk], context: grpc.ServicerContext
    ) -> Any:
        config = self.coordinator.config

        def body(site: str) -> pb.UploadReceipt:
            self.coordinator._enrolled(site)  # refuse strangers before reading their payload
            upload = assemble(
                request_iterator,
                max_chunk_bytes=config.max_chunk_bytes,
                max_upload_bytes=config.max_upload_bytes,
            )
            if upload.kind in CKKS_DECRYPTOR_KINDS:
                return self.ckks_upload(site, upload)
            return self.coordinator.upload(site, upload)

        return self._call("Upload", context, body)

    def GetModel(self, request: pb.ModelRequest, context: grpc.ServicerContext) -> Any:
        return self._call(
            "GetModel", context, lambda s: self.coordinator.model(s, request.round_id)
        )

    def SubmitReport(self, request: pb.ClientReport, context: grpc.ServicerContext) -> Any:
        def body(site: str) -> common_pb2.Ack:
            self.coordinator.report(site, request)
            return common_pb2.Ack(message="report stored")

        return self._call("SubmitReport", context, body)
