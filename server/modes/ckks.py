"""The coordinator's ``ckks`` mode: homomorphic sums, decrypted once by the decryptor site
(docs/protocol.md §4.3, docs/architecture.md §4).

The server never holds a secret key. It keeps the decryptor's PUBLIC context (checked with
:func:`afl.crypto.ckks.scheme.ensure_public`: a context holding a secret key is refused, and a server
configured or restarted with one refuses to start), checks every uploaded ciphertext list
against the release's layout, forms the homomorphic sum Σ_{k ∈ members} c_k of each planned
release (:func:`afl.crypto.ckks.scheme.sum_ciphertexts`) and hands it to the decryptor as a decryption
job. The decryptor's grid-rounded float64 result is what :meth:`CkksMode.sums` returns to the
solve; a refused job aborts the round (nothing else is released).

Stages: the UPLOAD stage of the plaintext mode (:class:`afl.server.modes.base.PlainUploadStage`), then
SOLVING is held until every release has an outcome from the decryptor.

Plan encoding: every release's upload is ``DTYPE_CKKS_VECTORS`` with a ``CkksEncoding`` whose
pre-scale is ``choose_prescale(bound=B, num_summands=K)`` (K = members, B = ``[round]
ckks_gram_bound`` or ``ckks_vector_bound``: the declared bound on |entry| of one site's Gram or
class vector) and whose grid step is ``default_grid`` (:mod:`afl.crypto.ckks.params`). The counts
of an evaluation release have B = N (:func:`afl.server.solve.evaluation.count_bound`: ``eval_max_rows``,
else the members' declared row counts) and the integer grid (step 1: the decryptor returns the
exact counts; the pre-scale keeps the CKKS error below half a step). In DP
mode the pre-scale and grid keep the sites' noise grid exactly (:mod:`afl.server.plan.dp_ckks`).

Flow of the RPCs (:class:`CkksRequests`): the decryptor uploads its public context (``Upload``
kind CKKS_PUBLIC_CONTEXT) and signs an announcement (``PublishCkksContext``; verified with the
decryptor's provisioned identity key); sites fetch it (``GetCkksContext`` + ``Download``), send
their aggregate tags sealed to the decryptor (``SendAggregateTags``) and upload ciphertexts; once
every upload is in (SOLVING), the decryptor, woken by its ``WatchRounds`` stream, asks
``GetDecryptionJobs`` (one job per planned
release without an outcome, with the signed plan), downloads each homomorphic sum (``Download``
kind CKKS_AGGREGATE), uploads the decrypted, grid-rounded result (kind DECRYPTED_AGGREGATE) and
signs the outcome (``ReportDecryption``). Only the decryptor-role site may fetch tags, jobs and
aggregates or report.

Durable state: the published context (``<state_dir>/ckks/context.bin`` and its signed
announcement, federation-wide: :class:`CkksContexts`), which a restarted server re-loads and
re-checks; and per round, every sealed tag message, staged decrypted result and signed decryption
outcome, persisted in the store's message journal BEFORE it is acknowledged, so a restarted
coordinator rebuilds the round's :class:`CkksRound` and resumes it (the homomorphic sums are
recomputed from the stored ciphertexts).
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from afl.core.aggregation import AggregationError
from afl.crypto.ckks import params as cp
from afl.crypto.ckks import scheme as ckks
from afl.crypto.ckks.wire import (
    CKKS_CONTEXT_CONTEXT,
    DECRYPTION_CONTEXT,
    context_fields,
    decryption_fields,
    verify_sealed_tags,
)
from afl.crypto.errors import CryptoError
from afl.crypto.identity.signatures import load_public_key_raw, verify_fields
from afl.crypto.identity.signed_blobs import blob_sha256
from afl.proto import wire
from afl.proto.v1 import common_pb2 as cpb
from afl.proto.v1 import coordinator_pb2 as pb
from afl.server.config import RoundSettings
from afl.server.errors import (
    ConflictError,
    InvalidRequestError,
    NotPermittedError,
    WrongStageError,
)
from afl.server.modes.base import (
    Declared,
    ModeEnvironment,
    PlainUploadStage,
    PlanOptions,
    RoundAccess,
    RoundContext,
    decode_float64,
    participant_round,
    shaped,
)
from afl.server.modes.ckks_context import CkksContexts, PublishedContext
from afl.server.plan.dp_ckks import dp_ckks_encodings
from afl.server.plan.release import PlannedRelease, RoundView
from afl.server.solve.evaluation import count_bound
from afl.server.store import MessageRow

__all__ = ["CKKS_DECRYPTOR_KINDS", "CkksMode", "CkksRequests"]

DEFAULT_GRAM_BOUND = 1.0e6
DEFAULT_VECTOR_BOUND = 1.0e3
#: Journal kinds of a CKKS round (module docstring) and the site id they are filed under.
TAGS, STAGED, OUTCOME = "ckks-tags", "ckks-result", "ckks-outcome"
DECRYPTOR = "(decryptor)"
#: Upload kinds only the decryptor sends.
CKKS_DECRYPTOR_KINDS = (pb.PAYLOAD_KIND_CKKS_PUBLIC_CONTEXT, pb.PAYLOAD_KIND_DECRYPTED_AGGREGATE)
FloatArray = NDArray[np.float64]


@dataclass
class CkksRound:
    """One round's CKKS state: sealed tags, homomorphic sums, staged and accepted results."""

    tags: dict[str, pb.SealedMessage] = field(default_factory=dict)
    aggregates: dict[str, bytes] = field(default_factory=dict)
    staged_results: dict[str, bytes] = field(default_factory=dict)
    outcomes: dict[str, bytes] = field(default_factory=dict)  # release -> signed outcome bytes
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
        contexts: CkksContexts | None = None,
        settings: RoundSettings | None = None,
        gram_bound: float = DEFAULT_GRAM_BOUND,
        vector_bound: float = DEFAULT_VECTOR_BOUND,
    ) -> None:
        self._eval_rows = 0
        if settings is not None:
            self.settings = settings
            gram_bound, vector_bound = settings.ckks_gram_bound, settings.ckks_vector_bound
            # under DP (no declared rows, M-127) the counts are bounded by [round.dp] max_samples
            dp_rows = settings.dp.max_samples if settings.dp is not None else 0
            self._eval_rows = settings.eval_max_rows or dp_rows
        self.gram_bound, self.vector_bound = float(gram_bound), float(vector_bound)
        self.contexts = contexts or CkksContexts()
        self._rounds: dict[str, CkksRound] = {}
        self._sum_lock = threading.Lock()
        #: Parsed and checked uploads by (release, site): (SHA-256 of the payload, ciphertexts).
        #: Each ciphertext list is parsed once (:meth:`prepare_upload`, outside the coordinator's
        #: lock) and summed from memory when its SHA-256 is the stored upload's; at most one
        #: per release and site; dropped once the round's sums are formed (or it is forgotten).
        self._parsed: dict[tuple[str, str], tuple[bytes, list[Any]]] = {}
        self._parsed_lock = threading.Lock()

    @classmethod
    def for_run(cls, env: ModeEnvironment) -> CkksMode:
        return cls(contexts=env.ckks_contexts, settings=env.settings)

    # --- plan --------------------------------------------------------------------------------

    def encoding(self, members: int, *, gram: bool = True) -> cpb.CkksEncoding:
        """Pre-scale and grid of a release summed over ``members`` sites (module docstring)."""
        bound = self.gram_bound if gram else self.vector_bound
        prescale = cp.choose_prescale(bound=bound, num_summands=members)
        grid = cp.default_grid(prescale=prescale, num_summands=members)
        return cpb.CkksEncoding(prescale=prescale, grid_step=grid)

    def count_encoding(self, release: PlannedRelease, *, declared: Declared) -> cpb.CkksEncoding:
        """An evaluation release's counts: B = N and the integer grid (module docstring)."""
        members = len(release.members)
        bound = count_bound(release.members, declared=declared, rows=self._eval_rows)
        try:
            prescale = cp.choose_prescale(bound=bound, num_summands=members)
            finest = cp.min_grid(prescale=prescale, num_summands=members)
        except CryptoError as exc:
            raise ValueError(f"release {release.name}: {exc}") from exc
        if not 2.0 * finest <= 1.0:
            raise ValueError(f"release {release.name}: counts of {bound:.6g} rows do not fit CKKS")
        return cpb.CkksEncoding(prescale=prescale, grid_step=1.0)

    def _release_encoding(
        self, release: PlannedRelease, *, declared: Declared | None = None
    ) -> cpb.Encoding:
        packing = cpb.PACKING_UPPER_TRIANGLE if release.packed else cpb.PACKING_DENSE
        if release.evaluation is not None:
            ckks_encoding = self.count_encoding(release, declared=declared or {})
        else:
            ckks_encoding = self.encoding(len(release.members), gram=release.packed)
        return cpb.Encoding(dtype=cpb.DTYPE_CKKS_VECTORS, packing=packing, ckks=ckks_encoding)

    def plan_options(
        self, participants: tuple[str, ...], *, declared: Declared | None = None
    ) -> PlanOptions:
        def encoding(release: PlannedRelease) -> cpb.Encoding:
            return self._release_encoding(release, declared=declared)

        return PlanOptions(aggregation=cpb.AGGREGATION_MODE_CKKS, encoding=encoding)

    def dp_encodings(self, plan: cpb.ReleasePlan, *, declared: Declared | None = None) -> None:
        """Pre-scales and grids that keep the sites' noise grid (:mod:`afl.server.plan.dp_ckks`);
        N is the run's [round.dp] max_samples."""
        settings: RoundSettings | None = getattr(self, "settings", None)
        dp = settings.dp if settings is not None else None
        dp_ckks_encodings(plan, max_samples=dp.max_samples if dp is not None else 0)

    def context(self) -> PublishedContext:
        return self.contexts.context()

    # --- uploads, sums and results -----------------------------------------------------------

    def round_state(self, view: RoundView, ctx: RoundContext) -> CkksRound:
        """The round's state, rebuilt from the message journal after a restart."""
        state = self._rounds.get(view.round_id)
        if state is None:
            state = CkksRound()
            for message in ctx.messages(view.round_id):
                self._replay(view, state, message)
            self._rounds[view.round_id] = state
        return state

    def _replay(self, view: RoundView, state: CkksRound, message: MessageRow) -> None:
        kind, _, name = message.kind.partition(":")
        if kind == TAGS:
            state.tags[message.site_id] = pb.SealedMessage.FromString(message.data)
        elif kind == STAGED:
            state.staged_results[name] = message.data
        elif kind == OUTCOME:
            outcome = pb.DecryptionOutcome.FromString(message.data)
            data = state.staged_results.pop(name, b"")
            self._record(state, _release(view, name), outcome, data)

    def forget(self, round_id: str) -> None:
        state = self._rounds.pop(round_id, None)
        if state is not None:
            with self._parsed_lock:
                self._parsed.clear()  # a finished round's parsed uploads (one round at a time)

    def _parse(self, release: PlannedRelease, data: bytes) -> list[Any]:
        try:
            return ckks.deserialize_ciphertexts(
                self.context().ctx, ckks.unpack_ciphertexts(data), length=release.length
            )
        except CryptoError as exc:
            raise InvalidRequestError(f"release {release.name!r}: {exc}") from exc

    def _prepared(self, release: str, site_id: str, sha256: bytes) -> list[Any] | None:
        with self._parsed_lock:
            entry = self._parsed.get((release, site_id))
        return entry[1] if entry is not None and entry[0] == sha256 else None

    def prepare_upload(
        self, *, site_id: str, release: PlannedRelease, data: bytes, sha256: bytes
    ) -> None:
        """Parse and check the ciphertexts against the release's layout (outside the
        coordinator's lock) and keep them for :meth:`check_upload` and :meth:`aggregate`."""
        if self._prepared(release.name, site_id, sha256) is not None:
            return
        vectors = self._parse(release, data)
        with self._parsed_lock:
            self._parsed[(release.name, site_id)] = (bytes(sha256), vectors)

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
        digest = hashlib.sha256(data).digest()
        if self._prepared(release.name, site_id, digest) is None:  # not parsed before the lock
            vectors = self._parse(release, data)
            with self._parsed_lock:
                self._parsed[(release.name, site_id)] = (digest, vectors)

    def aggregate(self, view: RoundView, ctx: RoundContext, release: PlannedRelease) -> bytes:
        """Packed ciphertexts of Σ_k c_k over ``release.members`` (computed once per round)."""
        state = self.round_state(view, ctx)
        with self._sum_lock:
            if release.name not in state.aggregates:
                uploads = ctx.uploads(view.round_id)
                context, length = self.context().ctx, release.length
                ciphertexts = []
                for site in release.members:
                    row = uploads[(site, release.name)]
                    vectors = self._prepared(release.name, site, row.sha256)
                    if vectors is None:  # e.g. after a restart: parse the stored payload
                        vectors = self._parse(release, ctx.read_payload(row))
                    ciphertexts.append(vectors)
                total = ckks.sum_ciphertexts(context, ciphertexts, length=length)
                state.aggregates[release.name] = ckks.pack_ciphertexts(
                    ckks.serialize_ciphertexts(total)
                )
                if all(r.name in state.aggregates for r in view.releases):
                    self._drop_parsed(view)
            return state.aggregates[release.name]

    def _drop_parsed(self, view: RoundView) -> None:
        names = {r.name for r in view.releases}
        with self._parsed_lock:
            for key in [k for k in self._parsed if k[0] in names]:
                del self._parsed[key]

    def add_tags(
        self, view: RoundView, ctx: RoundContext, site_id: str, sealed: pb.SealedMessage
    ) -> None:
        """Keep a site's sealed tags (persisted first); the same tags again are a no-op."""
        tags = self.round_state(view, ctx).tags
        if site_id in tags:
            if tags[site_id] != sealed:
                raise ConflictError("this site already sent other aggregate tags this round")
            return
        ctx.put_message(
            view.round_id,
            stage=pb.ROUND_STAGE_UPLOAD,
            site_id=site_id,
            kind=TAGS,
            data=sealed.SerializeToString(),
        )
        tags[site_id] = sealed

    def stage_result(
        self, view: RoundView, ctx: RoundContext, release: PlannedRelease, data: bytes
    ) -> None:
        """Keep the decryptor's result upload until its signed outcome arrives (persisted first)."""
        state = self.round_state(view, ctx)
        if release.name in state.outcomes:
            return  # a retry of a result whose outcome is already recorded
        try:
            ctx.put_message(
                view.round_id,
                stage=pb.ROUND_STAGE_SOLVING,
                site_id=DECRYPTOR,
                kind=f"{STAGED}:{release.name}",
                data=data,
            )
        except ValueError as exc:
            raise ConflictError(f"release {release.name!r}: {exc}") from exc
        state.staged_results[release.name] = data

    def accept_result(
        self,
        view: RoundView,
        ctx: RoundContext,
        release: PlannedRelease,
        outcome: pb.DecryptionOutcome,
    ) -> None:
        """Record the decryptor's outcome for ``release`` (the caller verified its signature and
        that a DECRYPTED outcome names the staged result's digest): persisted, then applied."""
        state = self.round_state(view, ctx)
        if release.name in state.outcomes:
            if state.outcomes[release.name] == outcome.SerializeToString():
                return  # a retry (its answer may have been lost in a coordinator restart)
            raise WrongStageError(f"release {release.name!r} already has a decryption outcome")
        data = b""
        if outcome.status == pb.DECRYPTION_STATUS_DECRYPTED:
            data = state.staged_results.get(release.name, b"")
            if hashlib.sha256(data).digest() != outcome.result_sha256:
                raise InvalidRequestError("upload the result (DECRYPTED_AGGREGATE) first")
            decode_float64(data, length=release.length, what=release.name)
        ctx.put_message(
            view.round_id,
            stage=pb.ROUND_STAGE_SOLVING,
            site_id=DECRYPTOR,
            kind=f"{OUTCOME}:{release.name}",
            data=outcome.SerializeToString(),
        )
        state.staged_results.pop(release.name, None)
        self._record(state, release, outcome, data)

    @staticmethod
    def _record(
        state: CkksRound, release: PlannedRelease, outcome: pb.DecryptionOutcome, data: bytes
    ) -> None:
        state.outcomes[release.name] = outcome.SerializeToString()
        if outcome.status != pb.DECRYPTION_STATUS_DECRYPTED:
            status = pb.DecryptionStatus.Name(outcome.status)
            state.refused[release.name] = f"{status}: {outcome.reason}"
            return
        values = decode_float64(data, length=release.length, what=release.name)
        state.results[release.name] = shaped(release, values)

    def sums(self, view: RoundView, ctx: RoundContext) -> dict[str, FloatArray] | None:
        """The decryptor's results; None while a release still waits for its outcome."""
        state = self.round_state(view, ctx)
        for release in view.releases:
            if release.name in state.refused:
                raise AggregationError(
                    f"the decryptor refused release {release.name!r}: {state.refused[release.name]}"
                )
        if state.pending(view.releases):
            return None
        return {r.name: state.results[r.name] for r in view.releases}


def _release(view: RoundView, name: str) -> PlannedRelease:
    for release in view.releases:
        if release.name == name:
            return release
    raise InvalidRequestError(f"no release named {name!r} in round {view.round_id!r}")


class CkksRequests:
    """Domain side of the CKKS RPCs (module docstring); the servicer decodes and encodes."""

    def __init__(self, access: RoundAccess, contexts: CkksContexts) -> None:
        self.access, self.contexts = access, contexts

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

    def _mode(self, view: RoundView) -> CkksMode:
        mode = self.access.mode_of(view)
        if not isinstance(mode, CkksMode):
            raise WrongStageError(f"round {view.round_id!r} does not run aggregation = 'ckks'")
        return mode

    # --- uploads of the decryptor --------------------------------------------------------------

    def accept_decryptor_upload(
        self, site_id: str, upload: wire.AssembledPayload
    ) -> pb.UploadReceipt:
        """Uploads of kind CKKS_PUBLIC_CONTEXT / DECRYPTED_AGGREGATE (decryptor only)."""
        self._require_decryptor(site_id)
        with self.access.lock:
            if upload.kind == pb.PAYLOAD_KIND_CKKS_PUBLIC_CONTEXT:
                self.contexts.staged[site_id] = upload.data
            elif upload.kind == pb.PAYLOAD_KIND_DECRYPTED_AGGREGATE:
                view = self.access.find(upload.round_id or "-")
                release = _release(view, upload.release_name)
                self._mode(view).stage_result(view, self.access.context, release, upload.data)
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
        data = self.contexts.staged.get(site_id)
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
            self.contexts.publish(PublishedContext(data, ctx, announcement))
            self.access.store.audit(
                "ckks-context-published",
                {"site_id": site_id, "sha256": request.context_sha256.hex(), "bytes": len(data)},
            )

    def get_context(self, site_id: str) -> pb.CkksContextAnnouncement:
        """The published announcement. Read without the coordinator's lock: the published
        context is set once and never replaced (:meth:`CkksContexts.publish`), so a site's
        fetch never queues behind the round's other calls."""
        self.access.require_enrolled(site_id)
        return self.contexts.context().announcement

    def download(self, site_id: str, request: pb.DownloadRequest) -> tuple[str, str, bytes]:
        """(round_id, name, bytes) of the context (any enrolled site) or an aggregate."""
        self.access.require_enrolled(site_id)
        if request.kind == pb.PAYLOAD_KIND_CKKS_PUBLIC_CONTEXT:  # set once: no lock (get_context)
            return request.round_id, "ckks/context", self.contexts.context().data
        if request.kind != pb.PAYLOAD_KIND_CKKS_AGGREGATE:
            raise InvalidRequestError("Download serves CKKS_PUBLIC_CONTEXT or CKKS_AGGREGATE")
        self._require_decryptor(site_id)
        with self.access.lock:
            view = self.access.find(request.round_id or "-")
            release = _release(view, request.release_name)
            mode = self._mode(view)
            if view.stage != pb.ROUND_STAGE_SOLVING:
                raise WrongStageError(f"no decryption job for {request.release_name!r}")
            data = mode.aggregate(view, self.access.context, release)
        return view.round_id, request.release_name, data

    # --- openings (docs/protocol.md M-232) -------------------------------------------------------

    def runs_ckks(self, round_id: str) -> bool:
        """Whether ``round_id`` is a round of this coordinator run in ``ckks``."""
        with self.access.lock:
            try:
                view = self.access.find(round_id or "-")
            except WrongStageError:
                return False
            return isinstance(self.access.mode_of(view), CkksMode)

    def opening_survivors(self, site_id: str, round_id: str) -> list[str]:
        """The survivors a participant's `opening` of the CKKS round ``round_id`` must state:
        every participant (a CKKS sum holds every participant's ciphertext, or the round aborts),
        taken only while the round is in its upload stage (:class:`WrongStageError` otherwise;
        the site itself sends no statistic before its opening is logged)."""
        with participant_round(self.access, site_id, round_id) as view:
            mode = self._mode(view)
            if view.stage != pb.ROUND_STAGE_UPLOAD:
                raise WrongStageError(
                    f"round {view.round_id!r} is {wire.stage_name(view.stage)}: a CKKS round "
                    "takes openings in its upload stage"
                )
            return list(mode.contributors(view))

    def decrypting_plan(self, site_id: str, round_id: str) -> bytes:
        """The SHA-256 of the plan the decryptor's `decrypting` statement of ``round_id`` must
        name (M-235): taken only from the federation's decryptor, for a CKKS round in its
        solving stage (:class:`WrongStageError` otherwise)."""
        self._require_decryptor(site_id)
        with self.access.lock:
            view = self.access.find(round_id or "-")
            self._mode(view)
            if view.stage != pb.ROUND_STAGE_SOLVING or view.row.plan is None:
                raise WrongStageError(
                    f"round {view.round_id!r} is {wire.stage_name(view.stage)}: its decryptor "
                    "states its decryption in the solving stage"
                )
            return blob_sha256(view.row.plan)

    # --- tags ----------------------------------------------------------------------------------

    def send_tags(self, site_id: str, request: pb.SendAggregateTagsRequest) -> None:
        """Keep a site's sealed tags for the decryptor, once the site's signature checks
        (the decryptor checks it again: it trusts no tag the server hands it)."""
        decryptor = self.decryptor_id()
        if request.sealed.recipient_site_id != decryptor:
            raise InvalidRequestError(f"aggregate tags must be sealed to {decryptor!r}")
        with participant_round(self.access, site_id, request.round_id) as view:
            if view.row.plan is None:
                raise WrongStageError(f"round {view.round_id!r} has no release plan yet")
            binding = wire.tag_binding(
                cpb.ReleasePlan.FromString(view.row.plan),
                plan_sha256=blob_sha256(view.row.plan),
                sender=site_id,
                decryptor=decryptor,
                decryptor_key=self.contexts.context().announcement.cipher_public_key,
            )
            try:
                verify_sealed_tags(
                    wire.sealed_tags_from_proto(request.sealed),
                    binding=binding,
                    sender_identity=self._identity(site_id),
                )
            except CryptoError as exc:
                raise InvalidRequestError(
                    "aggregate tags are not signed by this site for this round, plan and "
                    "decryptor key"
                ) from exc
            sealed = pb.SealedMessage()
            sealed.CopyFrom(request.sealed)
            sealed.sender_site_id = site_id
            self._mode(view).add_tags(view, self.access.context, site_id, sealed)

    def get_tags(self, site_id: str, request: cpb.RoundRef) -> pb.SealedMessages:
        self._require_decryptor(site_id)
        with self.access.lock:
            view = self.access.find(request.round_id or "-")
            tags = self._mode(view).round_state(view, self.access.context).tags
            return pb.SealedMessages(
                round_id=view.round_id, messages=[tags[s] for s in sorted(tags)]
            )

    # --- decryption ----------------------------------------------------------------------------

    def jobs(self, site_id: str, request: cpb.RoundRef) -> pb.DecryptionJobs:
        self._require_decryptor(site_id)
        with self.access.lock:
            view = self.access.find(request.round_id)
            out = pb.DecryptionJobs(round_id=view.round_id)
            mode = self.access.mode_of(view)
            if (
                view.row.plan is None
                or view.row.plan_signature is None
                or not isinstance(mode, CkksMode)
            ):
                return out
            out.release_plan.CopyFrom(
                cpb.SignedReleasePlan(plan=view.row.plan, signature=view.row.plan_signature)
            )
            if view.stage != pb.ROUND_STAGE_SOLVING:
                return out
            context = self.access.context
            for name in mode.round_state(view, context).pending(view.releases):
                release = _release(view, name)
                data = mode.aggregate(view, context, release)
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
        with self.access.lock:
            view = self.access.find(request.round_id or "-")
            if view.row.plan is None:
                raise WrongStageError(f"round {view.round_id!r} has no release plan yet")
            try:  # bound to this federation, the round and the digest of its signed plan
                verify_fields(
                    self._identity(site_id),
                    request.signature,
                    context=DECRYPTION_CONTEXT,
                    fields=decryption_fields(
                        federation_id=self.access.config.federation_id,
                        round_id=view.round_id,
                        plan_sha256=blob_sha256(view.row.plan),
                        release_name=request.release_name,
                        status=request.status,
                        result_sha256=request.result_sha256,
                    ),
                )
            except CryptoError as exc:
                raise NotPermittedError("decryption outcome signature does not verify") from exc
            release = _release(view, request.release_name)
            self._mode(view).accept_result(view, self.access.context, release, request)
            self.access.store.audit(
                "ckks-decryption",
                {
                    "round_id": view.round_id,
                    "release": release.name,
                    "status": pb.DecryptionStatus.Name(request.status),
                    "reason": request.reason[:300],
                    "members": list(release.members),
                    "result_sha256": request.result_sha256.hex(),
                },
            )
            self.access.advance()
