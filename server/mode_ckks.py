"""The coordinator's ``ckks`` mode: homomorphic sums, decrypted once by the decryptor site
(docs/protocol.md §4.3, docs/architecture.md §4).

The server never holds a secret key. It keeps the decryptor's PUBLIC context (checked with
:func:`afl.crypto.ckks.ensure_public`: a context holding a secret key is refused, and a server
configured or restarted with one refuses to start), checks every uploaded ciphertext list
against the release's layout, forms the homomorphic sum Σ_{k ∈ members} c_k of each planned
release (:func:`afl.crypto.ckks.sum_ciphertexts`) and hands it to the decryptor as a decryption
job. The decryptor's grid-rounded float64 result is what :meth:`CkksMode.sums` returns to the
solve; a refused job aborts the round (nothing else is released).

Stages: the UPLOAD stage of the plaintext mode (:class:`afl.server.modes.PlainUploadStage`), then
SOLVING is held until every release has an outcome from the decryptor.

Plan encoding: every release's upload is ``DTYPE_CKKS_VECTORS`` with a ``CkksEncoding`` whose
pre-scale is ``choose_prescale(bound=B, num_summands=K)`` (K = members, B = ``[round]
ckks_gram_bound`` or ``ckks_vector_bound``: the declared bound on |entry| of one site's Gram or
class vector) and whose grid step is ``default_grid`` (:mod:`afl.crypto.ckks_params`). In DP
mode the pre-scale and grid keep the sites' noise grid exactly (:mod:`afl.server.dp_ckks`).

Flow of the RPCs (:class:`CkksRequests`): the decryptor uploads its public context (``Upload``
kind CKKS_PUBLIC_CONTEXT) and signs an announcement (``PublishCkksContext``; verified with the
decryptor's provisioned identity key); sites fetch it (``GetCkksContext`` + ``Download``), send
their aggregate tags sealed to the decryptor (``SendAggregateTags``) and upload ciphertexts; once
every upload is in (SOLVING), the decryptor polls ``GetDecryptionJobs`` (one job per planned
release without an outcome, with the signed plan), downloads each homomorphic sum (``Download``
kind CKKS_AGGREGATE), uploads the decrypted, grid-rounded result (kind DECRYPTED_AGGREGATE) and
signs the outcome (``ReportDecryption``). Only the decryptor-role site may fetch tags, jobs and
aggregates or report.

State lives in memory except the published context (``<state_dir>/ckks/context.bin`` and its
signed announcement), which a restarted server re-loads and re-checks.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from afl.core.aggregation import AggregationError
from afl.crypto import ckks
from afl.crypto import ckks_params as cp
from afl.crypto.ckks_wire import (
    CKKS_CONTEXT_CONTEXT,
    DECRYPTION_CONTEXT,
    context_fields,
    decryption_fields,
)
from afl.crypto.errors import CryptoError
from afl.crypto.signatures import load_public_key_raw, verify_fields
from afl.proto import wire
from afl.proto.v1 import common_pb2 as cpb
from afl.proto.v1 import coordinator_pb2 as pb
from afl.server.config import ServerConfig
from afl.server.dp_ckks import dp_ckks_encodings
from afl.server.errors import (
    ConfigError,
    ConflictError,
    InvalidRequestError,
    NotPermittedError,
    WrongStageError,
)
from afl.server.modes import (
    PlainUploadStage,
    PlanOptions,
    RoundAccess,
    RoundContext,
    decode_float64,
    participant_round,
    shaped,
)
from afl.server.plan import PlannedRelease, RoundView

__all__ = [
    "CKKS_DECRYPTOR_KINDS",
    "CkksMode",
    "CkksRequests",
    "PublishedContext",
    "load_public_context_file",
]

DEFAULT_GRAM_BOUND = 1.0e6
DEFAULT_VECTOR_BOUND = 1.0e3
#: Upload kinds only the decryptor sends.
CKKS_DECRYPTOR_KINDS = (pb.PAYLOAD_KIND_CKKS_PUBLIC_CONTEXT, pb.PAYLOAD_KIND_DECRYPTED_AGGREGATE)
FloatArray = NDArray[np.float64]


def load_public_context_file(path: Path) -> tuple[bytes, Any]:
    """Read a serialized CKKS context; :class:`ConfigError` (refuse to start) if it holds a
    secret key or does not have the vetted parameters."""
    data = path.read_bytes()
    try:
        ctx = ckks.load_public_context(data)
    except CryptoError as exc:
        raise ConfigError(
            f"{path}: refusing to start: the CKKS context is not an acceptable PUBLIC context "
            f"({exc}); the server must never hold the decryptor's secret key"
        ) from exc
    return data, ctx


@dataclass
class PublishedContext:
    """The decryptor's public context as published (bytes, parsed context, announcement)."""

    data: bytes
    ctx: Any
    announcement: pb.CkksContextAnnouncement


@dataclass
class CkksRound:
    """One round's CKKS state: sealed tags, homomorphic sums, staged and accepted results."""

    tags: dict[str, pb.SealedMessage] = field(default_factory=dict)
    aggregates: dict[str, bytes] = field(default_factory=dict)
    staged_results: dict[str, bytes] = field(default_factory=dict)
    results: dict[str, FloatArray] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)

    def pending(self, releases: tuple[PlannedRelease, ...]) -> list[str]:
        """Releases without a decryption outcome yet."""
        return [
            r.name for r in releases if r.name not in self.results and r.name not in self.refused
        ]


class CkksMode(PlainUploadStage):
    """Server side of ``aggregation = "ckks"`` (module docstring)."""

    name = "ckks"
    proto_mode = int(cpb.AGGREGATION_MODE_CKKS)

    def __init__(
        self,
        *,
        gram_bound: float = DEFAULT_GRAM_BOUND,
        vector_bound: float = DEFAULT_VECTOR_BOUND,
        state_dir: Path | None = None,
        configured_context: Path | None = None,
        dp_max_samples: int = 0,
    ) -> None:
        self.gram_bound, self.vector_bound = float(gram_bound), float(vector_bound)
        self.dp_max_samples = dp_max_samples
        self._dir = None if state_dir is None else Path(state_dir) / "ckks"
        self._rounds: dict[str, CkksRound] = {}
        self._sum_lock = threading.Lock()
        self.staged_contexts: dict[str, bytes] = {}
        self.published: PublishedContext | None = None
        self.configured: tuple[bytes, Any] | None = None
        if configured_context is not None:
            self.configured = load_public_context_file(configured_context)
        if self._dir is not None and (self._dir / "context.bin").is_file():
            data, ctx = load_public_context_file(self._dir / "context.bin")
            announcement = pb.CkksContextAnnouncement.FromString(
                (self._dir / "announcement.bin").read_bytes()
            )
            self.published = PublishedContext(data, ctx, announcement)

    @classmethod
    def from_config(cls, config: ServerConfig) -> CkksMode:
        return cls(
            gram_bound=config.round.ckks_gram_bound,
            vector_bound=config.round.ckks_vector_bound,
            state_dir=config.state_dir,
            configured_context=config.ckks_public_context,
            dp_max_samples=config.round.dp.max_samples if config.round.dp is not None else 0,
        )

    # --- plan --------------------------------------------------------------------------------

    def encoding(self, members: int, *, gram: bool = True) -> cpb.CkksEncoding:
        """Pre-scale and grid of a release summed over ``members`` sites (module docstring)."""
        bound = self.gram_bound if gram else self.vector_bound
        prescale = cp.choose_prescale(bound=bound, num_summands=members)
        grid = cp.default_grid(prescale=prescale, num_summands=members)
        return cpb.CkksEncoding(prescale=prescale, grid_step=grid)

    def _release_encoding(self, release: PlannedRelease) -> cpb.Encoding:
        packing = cpb.PACKING_UPPER_TRIANGLE if release.packed else cpb.PACKING_DENSE
        return cpb.Encoding(
            dtype=cpb.DTYPE_CKKS_VECTORS,
            packing=packing,
            ckks=self.encoding(len(release.members), gram=release.packed),
        )

    def plan_options(self, participants: tuple[str, ...]) -> PlanOptions:
        return PlanOptions(aggregation=cpb.AGGREGATION_MODE_CKKS, encoding=self._release_encoding)

    def dp_encodings(self, plan: cpb.ReleasePlan) -> None:
        """Pre-scales and grids that keep the sites' noise grid (:mod:`afl.server.dp_ckks`)."""
        dp_ckks_encodings(plan, max_samples=self.dp_max_samples)

    # --- context -----------------------------------------------------------------------------

    def publish(self, published: PublishedContext) -> None:
        """Record the decryptor's checked public context (persisted when a state dir is set)."""
        ckks.ensure_public(published.ctx)
        if self.configured is not None and self.configured[0] != published.data:
            raise InvalidRequestError("the published context differs from the configured one")
        if self.published is not None:
            if self.published.data != published.data:
                raise ConflictError("a different CKKS context is already published")
            return
        if self._dir is not None:
            self._dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            (self._dir / "context.bin").write_bytes(published.data)
            (self._dir / "announcement.bin").write_bytes(published.announcement.SerializeToString())
        self.published = published

    def context(self) -> PublishedContext:
        if self.published is None:
            raise WrongStageError("the decryptor has not published its CKKS context yet")
        return self.published

    # --- uploads, sums and results -----------------------------------------------------------

    def round_state(self, round_id: str) -> CkksRound:
        return self._rounds.setdefault(round_id, CkksRound())

    def check_upload(
        self,
        view: RoundView,
        ctx: RoundContext,
        *,
        site_id: str,
        release: PlannedRelease,
        data: bytes,
    ) -> None:
        self.require_accepting(view)
        try:
            ckks.deserialize_ciphertexts(
                self.context().ctx, ckks.unpack_ciphertexts(data), length=release.length
            )
        except CryptoError as exc:
            raise InvalidRequestError(f"release {release.name!r}: {exc}") from exc

    def aggregate(
        self, round_id: str, release: PlannedRelease, payloads: Mapping[str, bytes]
    ) -> bytes:
        """Packed ciphertexts of Σ_k c_k over ``release.members`` (computed once per round)."""
        state = self.round_state(round_id)
        with self._sum_lock:
            if release.name not in state.aggregates:
                ctx, length = self.context().ctx, release.length
                uploads = [
                    ckks.deserialize_ciphertexts(
                        ctx, ckks.unpack_ciphertexts(payloads[s]), length=length
                    )
                    for s in release.members
                ]
                total = ckks.sum_ciphertexts(ctx, uploads, length=length)
                state.aggregates[release.name] = ckks.pack_ciphertexts(
                    ckks.serialize_ciphertexts(total)
                )
            return state.aggregates[release.name]

    def accept_result(
        self, round_id: str, release: PlannedRelease, *, status: int, data: bytes, reason: str
    ) -> None:
        """Record the decryptor's outcome for ``release`` (the caller verified its signature)."""
        state = self.round_state(round_id)
        if release.name in state.results or release.name in state.refused:
            raise WrongStageError(f"release {release.name!r} already has a decryption outcome")
        if status != pb.DECRYPTION_STATUS_DECRYPTED:
            state.refused[release.name] = f"{pb.DecryptionStatus.Name(status)}: {reason}"  # type: ignore[arg-type]
            return
        values = decode_float64(data, length=release.length, what=release.name)
        state.results[release.name] = shaped(release, values)

    def sums(self, view: RoundView, ctx: RoundContext) -> dict[str, FloatArray] | None:
        """The decryptor's results; None while a release still waits for its outcome."""
        state = self.round_state(view.round_id)
        for release in view.releases:
            if release.name in state.refused:
                raise AggregationError(
                    f"the decryptor refused release {release.name!r}: {state.refused[release.name]}"
                )
        if state.pending(view.releases):
            return None
        return {r.name: state.results[r.name] for r in view.releases}


class CkksRequests:
    """Domain side of the CKKS RPCs (module docstring); the servicer decodes and encodes."""

    def __init__(self, access: RoundAccess, mode: CkksMode) -> None:
        self.access, self.mode = access, mode

    def decryptor_id(self) -> str:
        ids = [s for s, e in self.access.config.sites.items() if e.role == "decryptor"]
        if len(ids) != 1:
            raise WrongStageError("the federation must provision exactly one decryptor site")
        return str(ids[0])

    def _require_decryptor(self, site_id: str) -> None:
        self.access.require_enrolled(site_id)
        if site_id != self.decryptor_id():
            raise NotPermittedError(f"site {site_id!r} is not the federation's CKKS decryptor")

    def _identity(self, site_id: str) -> Any:
        return load_public_key_raw(self.access.config.sites[site_id].identity_public_key)

    @staticmethod
    def _release(view: RoundView, name: str) -> PlannedRelease:
        for release in view.releases:
            if release.name == name:
                return release
        raise InvalidRequestError(f"no release named {name!r} in round {view.round_id!r}")

    # --- uploads of the decryptor --------------------------------------------------------------

    def accept_decryptor_upload(
        self, site_id: str, upload: wire.AssembledPayload
    ) -> pb.UploadReceipt:
        """Uploads of kind CKKS_PUBLIC_CONTEXT / DECRYPTED_AGGREGATE (decryptor only)."""
        self._require_decryptor(site_id)
        with self.access.lock:
            if upload.kind == pb.PAYLOAD_KIND_CKKS_PUBLIC_CONTEXT:
                self.mode.staged_contexts[site_id] = upload.data
            elif upload.kind == pb.PAYLOAD_KIND_DECRYPTED_AGGREGATE:
                view = self.access.find(upload.round_id or "-")
                self._release(view, upload.release_name)
                self.mode.round_state(view.round_id).staged_results[upload.release_name] = (
                    upload.data
                )
            else:
                raise InvalidRequestError("unexpected payload kind for the decryptor")
        return pb.UploadReceipt(
            round_id=upload.round_id,
            release_name=upload.release_name,
            sha256=upload.sha256,
            bytes_received=len(upload.data),
        )

    # --- context -------------------------------------------------------------------------------

    def publish(self, site_id: str, request: pb.CkksContextAnnouncement) -> None:
        self._require_decryptor(site_id)
        data = self.mode.staged_contexts.get(site_id)
        if data is None or hashlib.sha256(data).digest() != request.context_sha256:
            raise InvalidRequestError("upload the context (CKKS_PUBLIC_CONTEXT) before announcing")
        try:
            verify_fields(
                self._identity(site_id),
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
        with self.access.lock:
            self.mode.publish(PublishedContext(data, ctx, announcement))
            self.access.store.audit(
                "ckks-context-published",
                {"site_id": site_id, "sha256": request.context_sha256.hex(), "bytes": len(data)},
            )

    def get_context(self, site_id: str) -> pb.CkksContextAnnouncement:
        self.access.require_enrolled(site_id)
        with self.access.lock:
            return self.mode.context().announcement

    def download(self, site_id: str, request: pb.DownloadRequest) -> tuple[str, str, bytes]:
        """(round_id, name, bytes) of the context (any enrolled site) or an aggregate."""
        self.access.require_enrolled(site_id)
        if request.kind == pb.PAYLOAD_KIND_CKKS_PUBLIC_CONTEXT:
            with self.access.lock:
                return request.round_id, "ckks/context", self.mode.context().data
        if request.kind != pb.PAYLOAD_KIND_CKKS_AGGREGATE:
            raise InvalidRequestError("Download serves CKKS_PUBLIC_CONTEXT or CKKS_AGGREGATE")
        self._require_decryptor(site_id)
        with self.access.lock:
            view = self.access.find(request.round_id or "-")
            self._release(view, request.release_name)
            data = self.mode.round_state(view.round_id).aggregates.get(request.release_name)
        if data is None:
            raise WrongStageError(f"no decryption job for {request.release_name!r}")
        return view.round_id, request.release_name, data

    # --- tags ----------------------------------------------------------------------------------

    def send_tags(self, site_id: str, request: pb.SendAggregateTagsRequest) -> None:
        decryptor = self.decryptor_id()
        if request.sealed.recipient_site_id != decryptor:
            raise InvalidRequestError(f"aggregate tags must be sealed to {decryptor!r}")
        with participant_round(self.access, site_id, request.round_id) as view:
            sealed = pb.SealedMessage()
            sealed.CopyFrom(request.sealed)
            sealed.sender_site_id = site_id
            tags = self.mode.round_state(view.round_id).tags
            if site_id in tags and tags[site_id] != sealed:
                raise ConflictError("this site already sent other aggregate tags this round")
            tags[site_id] = sealed

    def get_tags(self, site_id: str, request: cpb.RoundRef) -> pb.SealedMessages:
        self._require_decryptor(site_id)
        with self.access.lock:
            view = self.access.find(request.round_id or "-")
            tags = self.mode.round_state(view.round_id).tags
            return pb.SealedMessages(
                round_id=view.round_id, messages=[tags[s] for s in sorted(tags)]
            )

    # --- decryption ----------------------------------------------------------------------------

    def jobs(self, site_id: str, request: cpb.RoundRef) -> pb.DecryptionJobs:
        self._require_decryptor(site_id)
        with self.access.lock:
            view = self.access.find(request.round_id)
            out = pb.DecryptionJobs(round_id=view.round_id)
            if view.row.plan is None or view.row.plan_signature is None:
                return out
            out.release_plan.CopyFrom(
                cpb.SignedReleasePlan(plan=view.row.plan, signature=view.row.plan_signature)
            )
            if view.stage != pb.ROUND_STAGE_SOLVING:
                return out
            uploads = self.access.store.uploads(view.round_id)
            for name in self.mode.round_state(view.round_id).pending(view.releases):
                release = self._release(view, name)
                payloads = {
                    s: self.access.store.read_payload(uploads[(s, name)]) for s in release.members
                }
                data = self.mode.aggregate(view.round_id, release, payloads)
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
        try:
            verify_fields(
                self._identity(site_id),
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
        with self.access.lock:
            view = self.access.find(request.round_id or "-")
            release = self._release(view, request.release_name)
            data = b""
            if request.status == pb.DECRYPTION_STATUS_DECRYPTED:
                staged = self.mode.round_state(view.round_id).staged_results
                data = staged.pop(release.name, b"")
                if hashlib.sha256(data).digest() != request.result_sha256:
                    raise InvalidRequestError("upload the result (DECRYPTED_AGGREGATE) first")
            self.mode.accept_result(
                view.round_id, release, status=request.status, data=data, reason=request.reason
            )
            self.access.store.audit(
                "ckks-decryption",
                {
                    "round_id": view.round_id,
                    "release": release.name,
                    "status": pb.DecryptionStatus.Name(request.status),
                    "reason": request.reason[:300],
                },
            )
            self.access.advance()
