"""CKKS-mode requests of the coordinator and their gRPC methods (design §7, coordinator.proto).

Flow: the decryptor uploads its public context (``Upload`` kind CKKS_PUBLIC_CONTEXT) and signs
an announcement (``PublishCkksContext``; the server verifies the signature with the decryptor's
provisioned identity key and refuses any context holding a secret key); sites fetch it
(``GetCkksContext`` + ``Download``), send their aggregate tags sealed to the decryptor
(``SendAggregateTags``) and upload ciphertexts; once every upload is in (stage SOLVING), the
decryptor polls ``GetDecryptionJobs`` (one job per planned release without an outcome, with the
signed plan), downloads each homomorphic sum (``Download`` kind CKKS_AGGREGATE), uploads the
decrypted, grid-rounded result (kind DECRYPTED_AGGREGATE) and signs the outcome
(``ReportDecryption``). Only the decryptor-role site may fetch tags, jobs and aggregates or report.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from afl.crypto import ckks
from afl.crypto.ckks_wire import (
    CKKS_CONTEXT_CONTEXT,
    DECRYPTION_CONTEXT,
    context_fields,
    decryption_fields,
)
from afl.crypto.errors import CryptoError
from afl.crypto.signatures import load_public_key_raw, verify_fields
from afl.proto.v1 import common_pb2
from afl.proto.v1 import coordinator_pb2 as pb
from afl.server.coordinator import Coordinator
from afl.server.errors import (
    ConflictError,
    InvalidRequestError,
    NotPermittedError,
    WrongStageError,
)
from afl.server.mode_ckks import CkksStrategy, PublishedContext
from afl.server.plan import PlannedRelease
from afl.server.rounds import RoundView, Stage
from afl.server.uploads import AssembledUpload

__all__ = ["CKKS_DECRYPTOR_KINDS", "CkksService", "CkksServicerMixin"]

_CHUNK = 1 << 20
#: Upload kinds only the decryptor sends (routed here, not to the statistic uploads).
CKKS_DECRYPTOR_KINDS = (pb.PAYLOAD_KIND_CKKS_PUBLIC_CONTEXT, pb.PAYLOAD_KIND_DECRYPTED_AGGREGATE)


class CkksService:
    """CKKS requests on top of a :class:`afl.server.coordinator.Coordinator`."""

    def __init__(self, coordinator: Coordinator) -> None:
        self.coordinator = coordinator
        self.machine = coordinator.machine
        self._staged_context: dict[str, bytes] = {}
        self._staged_results: dict[tuple[str, str], bytes] = {}

    @property
    def strategy(self) -> CkksStrategy:
        strategy = self.machine.strategy
        if not isinstance(strategy, CkksStrategy):
            raise WrongStageError("this federation does not run aggregation = 'ckks'")
        return strategy

    def decryptor_id(self) -> str:
        ids = [s for s, e in self.coordinator.config.sites.items() if e.role == "decryptor"]
        if len(ids) != 1:
            raise WrongStageError("the federation must provision exactly one decryptor site")
        return str(ids[0])

    def _require_decryptor(self, site_id: str) -> None:
        self.coordinator._enrolled(site_id)
        if site_id != self.decryptor_id():
            raise NotPermittedError(f"site {site_id!r} is not the federation's CKKS decryptor")

    def _release(self, view: RoundView, name: str) -> PlannedRelease:
        for release in view.releases:
            if release.name == name:
                return release
        raise InvalidRequestError(f"no release named {name!r} in round {view.round_id!r}")

    # --- uploads of other kinds than STATISTIC -----------------------------------------------

    def accept_upload(self, site_id: str, upload: AssembledUpload) -> pb.UploadReceipt:
        self._require_decryptor(site_id)
        strategy = self.strategy
        with self.machine.lock:
            if upload.kind == pb.PAYLOAD_KIND_CKKS_PUBLIC_CONTEXT:
                self._staged_context[site_id] = upload.data
            elif upload.kind == pb.PAYLOAD_KIND_DECRYPTED_AGGREGATE:
                view = self.machine.find(upload.round_id or "-")
                self._release(view, upload.release_name)
                strategy.round_state(view.round_id)
                self._staged_results[(view.round_id, upload.release_name)] = upload.data
            else:
                raise InvalidRequestError("unexpected payload kind for the decryptor")
        return pb.UploadReceipt(
            round_id=upload.round_id,
            release_name=upload.release_name,
            sha256=upload.sha256,
            bytes_received=len(upload.data),
        )

    # --- context -----------------------------------------------------------------------------

    def publish(self, site_id: str, request: pb.CkksContextAnnouncement) -> None:
        self._require_decryptor(site_id)
        data = self._staged_context.get(site_id)
        if data is None or hashlib.sha256(data).digest() != request.context_sha256:
            raise InvalidRequestError("upload the context (CKKS_PUBLIC_CONTEXT) before announcing")
        key = load_public_key_raw(self.coordinator.config.sites[site_id].identity_public_key)
        try:
            verify_fields(
                key,
                request.signature,
                context=CKKS_CONTEXT_CONTEXT,
                fields=context_fields(
                    round_id=request.round_id,
                    context_sha256=request.context_sha256,
                    cipher_public_key=request.cipher_public_key,
                ),
            )
            ctx = ckks.load_public_context(data)  # refuses a context holding a secret key
        except CryptoError as exc:
            raise InvalidRequestError(f"CKKS context refused: {exc}") from exc
        announcement = pb.CkksContextAnnouncement()
        announcement.CopyFrom(request)
        announcement.decryptor_site_id = site_id
        announcement.size_bytes = len(data)
        with self.machine.lock:
            try:
                self.strategy.publish(PublishedContext(data, ctx, announcement))
            except WrongStageError as exc:
                raise ConflictError(str(exc)) from exc
            self.coordinator.store.audit(
                "ckks-context-published",
                {"site_id": site_id, "sha256": request.context_sha256.hex(), "bytes": len(data)},
            )

    def get_context(self, site_id: str) -> pb.CkksContextAnnouncement:
        self.coordinator._enrolled(site_id)
        with self.machine.lock:
            return self.strategy.context().announcement

    def download(self, site_id: str, request: pb.DownloadRequest) -> tuple[str, str, bytes]:
        """(round_id, name, bytes) of the context (any enrolled site) or an aggregate."""
        self.coordinator._enrolled(site_id)
        if request.kind == pb.PAYLOAD_KIND_CKKS_PUBLIC_CONTEXT:
            with self.machine.lock:
                return request.round_id, "ckks/context", self.strategy.context().data
        if request.kind != pb.PAYLOAD_KIND_CKKS_AGGREGATE:
            raise InvalidRequestError("Download serves CKKS_PUBLIC_CONTEXT or CKKS_AGGREGATE")
        self._require_decryptor(site_id)
        with self.machine.lock:
            view = self.machine.find(request.round_id or "-")
            self._release(view, request.release_name)
            state = self.strategy.round_state(view.round_id)
            data = state.aggregates.get(request.release_name)
        if data is None:
            raise WrongStageError(f"no decryption job for {request.release_name!r}")
        return view.round_id, request.release_name, data

    # --- tags ----------------------------------------------------------------------------------

    def send_tags(self, site_id: str, request: pb.SendAggregateTagsRequest) -> None:
        self.coordinator._enrolled(site_id)
        decryptor = self.decryptor_id()
        if request.sealed.recipient_site_id != decryptor:
            raise InvalidRequestError(f"aggregate tags must be sealed to {decryptor!r}")
        with self.machine.lock:
            view = self.machine.find(request.round_id or "-")
            self.machine.require_participant(view, site_id)
            sealed = pb.SealedMessage()
            sealed.CopyFrom(request.sealed)
            sealed.sender_site_id = site_id
            tags = self.strategy.round_state(view.round_id).tags
            if site_id in tags and tags[site_id] != sealed:
                raise ConflictError("this site already sent other aggregate tags this round")
            tags[site_id] = sealed

    def get_tags(self, site_id: str, request: common_pb2.RoundRef) -> pb.SealedMessages:
        self._require_decryptor(site_id)
        with self.machine.lock:
            view = self.machine.find(request.round_id or "-")
            tags = self.strategy.round_state(view.round_id).tags
            return pb.SealedMessages(
                round_id=view.round_id, messages=[tags[s] for s in sorted(tags)]
            )

    # --- decryption ----------------------------------------------------------------------------

    def jobs(self, site_id: str, request: common_pb2.RoundRef) -> pb.DecryptionJobs:
        self._require_decryptor(site_id)
        with self.machine.lock:
            view = self.machine.find(request.round_id)
            out = pb.DecryptionJobs(round_id=view.round_id)
            if view.row.plan is None or view.row.plan_signature is None:
                return out
            out.release_plan.CopyFrom(
                common_pb2.SignedReleasePlan(plan=view.row.plan, signature=view.row.plan_signature)
            )
            if view.row.stage != Stage.SOLVING:
                return out
            uploads = self.coordinator.store.uploads(view.round_id)
            for name in self.strategy.pending(view.round_id, view.releases):
                release = self._release(view, name)
                payloads = {
                    s: self.coordinator.store.read_payload(uploads[(s, name)])
                    for s in release.members
                }
                data = self.strategy.aggregate(view.round_id, release, payloads)
                out.jobs.append(
                    pb.DecryptionJob(
                        release_name=name,
                        member_site_ids=list(release.members),
                        ciphertext_sha256=hashlib.sha256(data).digest(),
                        size_bytes=len(data),
                    )
                )
            return out

    def report(self, site_id: str, request: pb.DecryptionOutcome) -> None:
        self._require_decryptor(site_id)
        key = load_public_key_raw(self.coordinator.config.sites[site_id].identity_public_key)
        try:
            verify_fields(
                key,
                request.signature,
                context=DECRYPTION_CONTEXT,
                fields=decryption_fields(
                    round_id=request.round_id,
                    release_name=request.release_name,
                    status=request.status,
                    result_sha256=request.result_sha256,
                ),
            )
        except CryptoError as exc:
            raise NotPermittedError("decryption outcome signature does not verify") from exc
        with self.machine.lock:
            view = self.machine.find(request.round_id or "-")
            release = self._release(view, request.release_name)
            data = b""
            if request.status == pb.DECRYPTION_STATUS_DECRYPTED:
                data = self._staged_results.pop((view.round_id, release.name), b"")
                if hashlib.sha256(data).digest() != request.result_sha256:
                    raise InvalidRequestError("upload the result (DECRYPTED_AGGREGATE) first")
            self.strategy.accept_result(
                view.round_id, release, status=request.status, data=data, reason=request.reason
            )
            self.coordinator.store.audit(
                "ckks-decryption",
                {
                    "round_id": view.round_id,
                    "release": release.name,
                    "status": pb.DecryptionStatus.Name(request.status),
                    "reason": request.reason[:300],
                },
            )
            self.machine.advance()


def _chunks(round_id: str, name: str, kind: int, data: bytes) -> Iterator[pb.UploadChunk]:
    digest = hashlib.sha256(data).digest()
    total = max(1, -(-len(data) // _CHUNK))
    for i in range(total):
        yield pb.UploadChunk(
            round_id=round_id,
            release_name=name,
            chunk_index=i,
            total_chunks=total,
            data=data[i * _CHUNK : (i + 1) * _CHUNK],
            sha256=digest if i == total - 1 else b"",
            kind=kind,  # type: ignore[arg-type]
            total_bytes=len(data),
        )


class CkksServicerMixin:
    """gRPC methods of the CKKS mode; mixed into :class:`afl.server.servicer.CoordinatorServicer`
    (which provides ``coordinator`` and ``_call``)."""

    coordinator: Coordinator
    _call: Callable[..., Any]

    def _ckks(self) -> CkksService:
        service = getattr(self, "_ckks_service", None)
        if service is None:
            service = CkksService(self.coordinator)
            self._ckks_service = service
        return service

    def PublishCkksContext(
        self, request: pb.CkksContextAnnouncement, context: grpc.ServicerContext
    ) -> Any:
        def body(site: str) -> common_pb2.Ack:
            self._ckks().publish(site, request)
            return common_pb2.Ack(message="context published")

        return self._call("PublishCkksContext", context, body)

    def GetCkksContext(self, request: common_pb2.RoundRef, context: grpc.ServicerContext) -> Any:
        return self._call("GetCkksContext", context, lambda s: self._ckks().get_context(s))

    def Download(
        self, request: pb.DownloadRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.UploadChunk]:
        round_id, name, data = self._call(
            "Download", context, lambda s: self._ckks().download(s, request)
        )
        yield from _chunks(round_id, name, int(request.kind), data)

    def SendAggregateTags(
        self, request: pb.SendAggregateTagsRequest, context: grpc.ServicerContext
    ) -> Any:
        def body(site: str) -> common_pb2.Ack:
            self._ckks().send_tags(site, request)
            return common_pb2.Ack(message="tags stored")

        return self._call("SendAggregateTags", context, body)

    def GetAggregateTags(self, request: common_pb2.RoundRef, context: grpc.ServicerContext) -> Any:
        return self._call("GetAggregateTags", context, lambda s: self._ckks().get_tags(s, request))

    def GetDecryptionJobs(self, request: common_pb2.RoundRef, context: grpc.ServicerContext) -> Any:
        return self._call("GetDecryptionJobs", context, lambda s: self._ckks().jobs(s, request))

    def ReportDecryption(self, request: pb.DecryptionOutcome, context: grpc.ServicerContext) -> Any:
        def body(site: str) -> common_pb2.Ack:
            self._ckks().report(site, request)
            return common_pb2.Ack(message="outcome recorded")

        return self._call("ReportDecryption", context, body)

    def ckks_upload(self, site: str, upload: AssembledUpload) -> pb.UploadReceipt:
        """Uploads of kind CKKS_PUBLIC_CONTEXT / DECRYPTED_AGGREGATE (decryptor only)."""
        return self._ckks().accept_upload(site, upload)
