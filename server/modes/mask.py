"""The coordinator's ``mask`` mode: pairwise masking with drop-out recovery (Bonawitz et al.
CCS'17; docs/protocol.md §4.2, docs/architecture.md §4).

Once every participant accepted the signed plan, the round runs the transport-free server state
machine :class:`~afl.crypto.secagg.server.SecAggServer` through these RoundStage values, each with
its own deadline (``upload_timeout_s``); a stage closes as soon as every live site has answered,
or at its deadline with the sites that did (the others have dropped out):

    ADVERTISE_KEYS -> SHARE_KEYS -> UPLOAD (masked input) -> CONSISTENCY_CHECK -> UNMASK -> SOLVING

A stage closing with fewer than t live sites, or a release left with fewer than its t_R
surviving members, ABORTS the round with the reason and releases nothing. The decoded sums
(over the surviving members, U3) go to the same solve as the plaintext mode.

Encodings (docs/protocol.md §5): release R is fixed-point encoded in Z_{2^64} with its declared
bound B_R (Gram: ``gram_bound``; class vectors: ``vector_bound``; the counts of an evaluation
release: N, :func:`afl.server.solve.evaluation.count_bound`) and the most fractional bits f
with m_R·B_R·2^f < 2^63 (m_R members); sites reject out-of-range values with an error. A masked
upload is handed to the protocol as soon as the site's last release arrives, BEFORE it is stored:
a refusal (wrong length, a site outside U2, the wrong stage) is the site's error status, never a
silent drop. The stored uploads are the masked uint64 vectors only.

:class:`MaskRequests` serves the mode's RPCs (coordinator.proto "MASK mode"): every request is
checked — the caller is enrolled and a participant of the round, the round runs this mode and is
in the request's stage, and the message passes the protocol state machine (signatures, senders,
shapes, duplicates). A retry of the identical request is acknowledged as a duplicate.

Sparse graph (``mask_graph = "sparse"``, SecAgg+; docs/protocol.md §4.2): the plan carries the
degree k, the neighbourhood threshold t_N, C and D chosen by
:func:`afl.crypto.secagg.graph_bounds.choose_graph` for the participants (t = n - D); each site's
acceptance carries its signed graph commitment, which the coordinator journals
(:data:`afl.server.modes.base.DECISION_JOURNAL_KIND`) and serves with ``GetGraphCommitments`` from
ADVERTISE_KEYS on; the state machine checks every reveal against it and derives the graph.

Crash safety: every message a site sends (key adverts, encrypted share bundles, consistency
signatures, unmask responses) is persisted in the store's message journal before it is
acknowledged, and masked inputs are stored uploads. The server state machine is deterministic, so
a restarted coordinator rebuilds a round's :class:`MaskRound` by replaying the journal through a
fresh :class:`~afl.crypto.secagg.server.SecAggServer` — every stage before the round's stored
stage received and closed, the current one received — and the round goes on where it stopped;
in SOLVING the unmasked sums are recomputed the same way.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar, cast

import numpy as np
from google.protobuf.message import Message
from numpy.typing import NDArray

from afl.core.aggregation import AggregationError
from afl.core.row_bounds import release_bounds
from afl.crypto.errors import (
    CryptoError,
    DuplicateMessageError,
    ProtocolError,
    RoundAbortedError,
    StageError,
    UnknownParticipantError,
)
from afl.crypto.identity.signatures import load_public_key_raw
from afl.crypto.identity.signed_blobs import blob_sha256
from afl.crypto.secagg.config import ReleaseSpec, default_threshold
from afl.crypto.secagg.graph_bounds import choose_graph, colluders_for, dropouts_for
from afl.crypto.secagg.messages import (
    ClientMessage,
    KeyDirectory,
    RoutedShares,
    UnmaskRequest,
)
from afl.crypto.secagg.server import SecAggServer
from afl.proto import wire
from afl.proto.v1 import common_pb2 as cpb
from afl.proto.v1 import coordinator_pb2 as pb
from afl.server.config import MaskSettings, RoundSettings
from afl.server.errors import (
    ConflictError,
    InvalidRequestError,
    NotPermittedError,
    WrongStageError,
)
from afl.server.modes.base import (
    DECISION_JOURNAL_KIND,
    Declared,
    ModeEnvironment,
    PlanOptions,
    RoundAccess,
    RoundContext,
    Transition,
    decoded_releases,
    participant_round,
    shaped,
)
from afl.server.plan.dp_mask import dp_mask_encodings
from afl.server.plan.release import PlannedRelease, RoundView
from afl.server.solve.evaluation import count_bound

__all__ = ["MASK_STAGES", "MaskMode", "MaskRequests", "MaskRound"]

log = logging.getLogger("afl.server.mask")
#: The answer of a MASK request: a protocol message.
T = TypeVar("T", bound=Message)

#: RoundStage values of the masked exchange, in order.
MASK_STAGES = (
    pb.ROUND_STAGE_ADVERTISE_KEYS,
    pb.ROUND_STAGE_SHARE_KEYS,
    pb.ROUND_STAGE_UPLOAD,
    pb.ROUND_STAGE_CONSISTENCY_CHECK,
    pb.ROUND_STAGE_UNMASK,
)
FloatArray = NDArray[np.float64]
#: Journal kind of the masked exchange's messages.
JOURNAL_KIND = "mask"


@dataclass
class MaskRound:
    """In-memory state of one round's masked exchange."""

    server: SecAggServer
    lengths: dict[str, int]
    expected: set[str]
    received: set[str] = field(default_factory=set)  # sites heard from in this stage
    directory: KeyDirectory | None = None
    routed: dict[str, RoutedShares] = field(default_factory=dict)
    survivors: tuple[str, ...] | None = None
    unmask: UnmaskRequest | None = None
    #: (stage, site) -> SHA-256 of the journaled request: a retry is recognised without reading
    #: the journal (which holds every site's share bundles) on each request.
    journaled: dict[tuple[int, str], bytes] = field(default_factory=dict)
    #: Sparse graph: each participant's signed acceptance with its graph commitment.
    decisions: dict[str, pb.PlanDecision] = field(default_factory=dict)
    #: The answers every participant gets alike (the graph commitments, the key directory, the
    #: survivors, the consistency signatures, the unmask request), each built and serialized
    #: once from state that is fixed by then (the plan decisions, a closed stage): a K-site
    #: round asks for most of them K times, each with O(K) entries. Name -> (type, bytes).
    answers: dict[str, tuple[type[Message], bytes]] = field(default_factory=dict)


class MaskMode:
    """Server side of ``aggregation = "mask"`` (module docstring)."""

    name = "mask"
    proto_mode = int(cpb.AGGREGATION_MODE_MASK)
    exchange_stages: tuple[int, ...] = MASK_STAGES
    upload_stages: tuple[int, ...] = (pb.ROUND_STAGE_UPLOAD,)

    def __init__(
        self,
        mask: MaskSettings,
        *,
        identities: Mapping[str, bytes],
        settings: RoundSettings | None = None,
    ) -> None:
        self.mask = mask
        if settings is not None:
            self.settings = settings
        self._timeout_s = settings.upload_timeout_s if settings is not None else 600.0
        self._eval_rows = 0
        if settings is not None:  # under DP (no declared rows, M-127): [round.dp] max_samples
            dp_rows = settings.dp.max_samples if settings.dp is not None else 0
            self._eval_rows = settings.eval_max_rows or dp_rows
        self._identities = {s: load_public_key_raw(k) for s, k in identities.items()}
        self.rounds: dict[str, MaskRound] = {}
        self._sums: dict[str, dict[str, FloatArray]] = {}
        self._contributors: dict[str, tuple[str, ...]] = {}
        # site -> (release, SHA-256) -> a masked payload received and verified, held until the
        # site's last release arrives (:meth:`prepare_upload`); prepare runs outside the
        # coordinator's lock, in the handler threads.
        self._held: dict[str, dict[tuple[str, bytes], bytes]] = {}
        self._held_lock = threading.Lock()

    @classmethod
    def for_run(cls, env: ModeEnvironment) -> MaskMode:
        if env.settings.mask is None:
            raise ValueError("aggregation = 'mask' needs the [round] mask_* bounds")
        identities = {s: e.identity_public_key for s, e in env.config.sites.items()}
        return cls(env.settings.mask, identities=identities, settings=env.settings)

    # --- plan --------------------------------------------------------------------------------

    def sparse_graph(self, n: int) -> cpb.MaskGraph | None:
        """The plan's sparse graph over n participants, or None for the full graph (configured,
        or no degree below n - 1 meets the bounds, e.g. for a handful of sites)."""
        if self.mask.graph != "sparse":
            return None
        choice = choose_graph(
            n=n,
            colluders=colluders_for(n, self.mask.colluder_fraction),
            dropouts=dropouts_for(n, self.mask.dropout_fraction),
            security_bits=self.mask.security_bits,
        )
        if choice is None:
            log.info("no sparse graph over %d sites meets the bounds: the full graph is used", n)
            return None
        return cpb.MaskGraph(
            degree=choice.degree,
            share_threshold=choice.share_threshold,
            colluders=choice.colluders,
            dropouts=choice.dropouts,
            failure_log2=choice.failure_log2,
        )

    def plan_options(
        self, participants: tuple[str, ...], *, declared: Declared | None = None
    ) -> PlanOptions:
        graph = self.sparse_graph(len(participants))
        if graph is not None:
            t = len(participants) - graph.dropouts
        else:
            t = self.mask.threshold or default_threshold(len(participants))
        if not 2 <= t <= len(participants):
            raise ValueError(f"mask_threshold {t} must lie in 2..{len(participants)}")
        bounds = dict(declared or {})
        if not (self.mask.gram_bound and self.mask.vector_bound):
            _require_declarations(participants, bounds, what="the mask bounds")

        def encoding(release: PlannedRelease) -> cpb.Encoding:
            return self.encoding(release, declared=bounds)

        return PlanOptions(
            aggregation=cpb.AGGREGATION_MODE_MASK,
            encoding=encoding,
            mask_threshold=t,
            mask_graph=graph,
        )

    def bounds(self, release: PlannedRelease, *, declared: Declared) -> tuple[float, float]:
        """(Gram bound, class-vector bound) of ``release``: the configured ones, else the largest
        declared by its members (:func:`afl.core.row_bounds.release_bounds`)."""
        gram, vector = self.mask.gram_bound, self.mask.vector_bound
        if gram and vector:
            return gram, vector
        from_sites = release_bounds(declared[s] for s in release.members)
        return gram or from_sites[0], vector or from_sites[1]

    def encoding(
        self, release: PlannedRelease, *, declared: Declared | None = None
    ) -> cpb.Encoding:
        """uint64 fixed point with bound B and f = max{f : m·B·2^f < 2^63} (module docstring)."""
        if release.evaluation is not None:  # integer counts of at most N rows per site
            rows = self._eval_rows or self.mask.max_samples
            bound = count_bound(release.members, declared=declared or {}, rows=rows)
        else:
            gram, vector = self.bounds(release, declared=declared or {})
            bound = gram if release.packed else vector
        m = len(release.members)
        threshold = None if m >= 3 else m  # t_R below the minimum cohort only for tiny releases
        try:
            spec = ReleaseSpec(
                name=release.name,
                members=release.members,
                length=1,
                bound=bound,
                threshold=threshold,
            )
            frac_bits = spec.codec().frac_bits
        except CryptoError as exc:
            raise ValueError(f"release {release.name}: bound {bound:.6g}: {exc}") from exc
        packing = cpb.PACKING_UPPER_TRIANGLE if release.packed else cpb.PACKING_DENSE
        return cpb.Encoding(
            dtype=cpb.DTYPE_UINT64_LE,
            packing=packing,
            fixed_point=cpb.FixedPointEncoding(
                bound=bound, frac_bits=frac_bits, min_survivors=spec.min_survivors
            ),
        )

    def dp_encodings(self, plan: cpb.ReleasePlan, *, declared: Declared | None = None) -> None:
        """Bounds, f and t_R of the noised statistics (:mod:`afl.server.plan.dp_mask`); N is
        ``mask_max_samples``, else ``[round.dp] max_samples``, else the largest row count the
        participants declared (a site whose policy requires DP declares none)."""
        settings: RoundSettings | None = getattr(self, "settings", None)
        dp = settings.dp if settings is not None else None
        samples = self.mask.max_samples or (dp.max_samples if dp is not None else 0)
        if not samples:
            bounds = dict(declared or {})
            participants = tuple(plan.participants)
            _require_declarations(participants, bounds, what="mask_max_samples (DP)")
            samples = max(bounds[s].rows for s in participants)
        dp_mask_encodings(plan, max_samples=samples)

    # --- the exchange ------------------------------------------------------------------------

    def _fresh(self, view: RoundView, ctx: RoundContext) -> MaskRound:
        assert view.row.plan is not None
        config = wire.round_config_from_plan(
            cpb.ReleasePlan.FromString(view.row.plan), plan_sha256=blob_sha256(view.row.plan)
        )
        decisions = _signed_decisions(view, ctx) if config.graph is not None else {}
        commitments = {s: bytes(d.graph_commitment) for s, d in decisions.items()}
        server = SecAggServer(
            config=config,
            identities=self._identities,
            commitments=commitments if config.graph is not None else None,
        )
        lengths = {r.name: r.length for r in config.releases}
        return MaskRound(server, lengths, set(config.cohort), decisions=decisions)

    def begin(self, view: RoundView, ctx: RoundContext) -> Transition:
        try:
            self.rounds[view.round_id] = self._fresh(view, ctx)
        except ProtocolError as exc:  # a sparse graph without every participant's commitment
            return self._abort(view, f"the masked exchange cannot start: {exc}")
        return Transition(pb.ROUND_STAGE_ADVERTISE_KEYS, timeout_s=self._timeout_s)

    def _state(self, view: RoundView, ctx: RoundContext) -> MaskRound:
        """The round's state; rebuilt from the journal after a restart (module docstring)."""
        state = self.rounds.get(view.round_id)
        if state is None:
            if view.stage not in MASK_STAGES:
                raise WrongStageError(
                    f"round {view.round_id!r} is {wire.stage_name(view.stage)}, not in the masked "
                    "exchange"
                )
            state = self.rounds[view.round_id] = self._replay(view, ctx, upto=view.stage)
        return state

    def _replay(self, view: RoundView, ctx: RoundContext, *, upto: int) -> MaskRound:
        """Every stage before ``upto`` received and closed, ``upto`` itself received."""
        state = self._fresh(view, ctx)
        journal = [m for m in ctx.messages(view.round_id) if m.kind == JOURNAL_KIND]
        state.journaled = {(m.stage, m.site_id): _digest(m.data) for m in journal}
        for stage in MASK_STAGES:
            if stage > upto:
                break
            if stage == pb.ROUND_STAGE_UPLOAD:
                self._replay_uploads(view, ctx, state)
            for message in journal:
                if message.stage == stage:
                    parsed = _parse(stage, message.site_id, message.data, state)
                    state.server.receive(parsed, sender=message.site_id)
                    state.received.add(message.site_id)
            if stage < upto:
                self._close(stage, state)
        return state

    def _replay_uploads(self, view: RoundView, ctx: RoundContext, state: MaskRound) -> None:
        uploads = ctx.uploads(view.round_id)
        complete: dict[str, dict[str, bytes]] = {}
        for (site, name), row in uploads.items():  # oldest first: sites in the order they ended
            names = {r.name for r in view.releases if site in r.members}
            complete.setdefault(site, {})[name] = ctx.read_payload(row)
            if set(complete[site]) == names and site in state.expected:
                self._feed(view, state, site, complete[site])

    def _feed(
        self, view: RoundView, state: MaskRound, site_id: str, payloads: Mapping[str, bytes]
    ) -> None:
        message = wire.masked_upload(site_id, view.round_id, payloads, state.lengths)
        state.server.receive(message, sender=site_id)
        state.received.add(site_id)

    def drive(self, view: RoundView, ctx: RoundContext) -> Transition | None:
        state = self._state(view, ctx)
        if set(state.received) < state.expected and ctx.now_ms() < view.row.deadline_ms:
            return None
        try:
            following = self._close(view.stage, state)
            if following == pb.ROUND_STAGE_SOLVING:
                self._keep_result(view, ctx, state)
        except RoundAbortedError as exc:
            return self._abort(view, str(exc))
        if following == pb.ROUND_STAGE_CONSISTENCY_CHECK:  # survivors known, nothing unmasked yet
            assert state.survivors is not None
            refusal = ctx.exposes_history(view, view.releases, state.survivors)
            if refusal:
                return self._abort(view, f"before unmasking: {refusal}")
        if following != pb.ROUND_STAGE_SOLVING:
            return Transition(following, timeout_s=self._timeout_s)
        del self.rounds[view.round_id]
        return Transition(pb.ROUND_STAGE_SOLVING)

    def _keep_result(self, view: RoundView, ctx: RoundContext, state: MaskRound) -> None:
        """Keep the unmasked sums for the solve; when a release was withheld, the round aborts,
        and what the coordinator nevertheless decoded (the other releases' sums) is stated in
        the reason and in a "mask-withheld" audit record (names and digests), then discarded."""
        result = state.server.result
        assert result is not None
        if result.withheld:
            why = "; ".join(f"{n}: {r}" for n, r in sorted(result.withheld.items()))
            decoded = sorted(result.sums)
            ctx.note_decoded(view.round_id, {n: result.contributors[n] for n in decoded})
            ctx.audit(
                "mask-withheld",
                {
                    "round_id": view.round_id,
                    "withheld": dict(sorted(result.withheld.items())),
                    "decoded": decoded_releases(result.sums),
                    "contributors": {n: list(c) for n, c in sorted(result.contributors.items())},
                },
            )
            seen = (
                f"the coordinator decoded the sums of {', '.join(decoded)} and discarded them"
                if decoded
                else "the coordinator decoded no sum"
            )
            raise RoundAbortedError(f"releases withheld ({why}); {seen}; nothing published")
        self._sums[view.round_id] = {r.name: shaped(r, result.sums[r.name]) for r in view.releases}
        self._contributors[view.round_id] = result.survivors

    def _abort(self, view: RoundView, reason: str) -> Transition:
        self.rounds.pop(view.round_id, None)
        log.warning("masked round aborted", extra={"round_id": view.round_id, "reason": reason})
        return Transition(pb.ROUND_STAGE_ABORTED, reason=reason)

    @staticmethod
    def _close(stage: int, state: MaskRound) -> int:
        server = state.server
        state.received = set()
        if stage == pb.ROUND_STAGE_ADVERTISE_KEYS:
            state.directory = server.close_advertise()
            state.expected = {a.site_id for a in state.directory.adverts}
            return pb.ROUND_STAGE_SHARE_KEYS
        if stage == pb.ROUND_STAGE_SHARE_KEYS:
            state.routed = server.close_share_keys()
            state.expected = set(state.routed)
            return pb.ROUND_STAGE_UPLOAD
        if stage == pb.ROUND_STAGE_UPLOAD:
            state.survivors = server.close_masked_input().survivors
            state.expected = set(state.survivors)
            return pb.ROUND_STAGE_CONSISTENCY_CHECK
        if stage == pb.ROUND_STAGE_CONSISTENCY_CHECK:
            state.unmask = server.close_consistency()
            state.expected = {s.site_id for s in state.unmask.signatures}
            return pb.ROUND_STAGE_UNMASK
        server.close_unmask()
        return pb.ROUND_STAGE_SOLVING

    def prepare_upload(
        self, *, site_id: str, release: PlannedRelease, data: bytes, sha256: bytes
    ) -> None:
        """Hold the payload under its verified SHA-256 until the site's last release arrives:
        :meth:`check_upload` then hands the site's whole masked input to the protocol without
        reading its earlier releases back from disk (a payload held is used only where the
        stored row names the same digest; after a restart they are read from disk)."""
        with self._held_lock:
            self._held.setdefault(site_id, {})[(release.name, sha256)] = data

    def _take_held(self, site_id: str) -> dict[tuple[str, bytes], bytes]:
        """The payloads held for ``site_id``, no longer held."""
        with self._held_lock:
            return self._held.pop(site_id, {})

    def check_upload(
        self,
        view: RoundView,
        ctx: RoundContext,
        *,
        site_id: str,
        release: PlannedRelease,
        data: bytes,
    ) -> None:
        """Masked input: UPLOAD stage only, from sites of U2; the site's last release hands the
        whole masked input to the protocol (a refusal is raised, nothing is stored)."""
        if view.stage not in self.upload_stages:
            raise WrongStageError("masked input is accepted only in the UPLOAD stage")
        state = self._state(view, ctx)
        if site_id not in state.expected:
            raise NotPermittedError(f"site {site_id!r} dropped out before MaskedInput")
        if len(data) != 8 * release.length:
            raise InvalidRequestError(
                f"masked release {release.name!r} must be {release.length} uint64 "
                f"({8 * release.length} bytes), got {len(data)} bytes"
            )
        others = [r.name for r in view.releases if site_id in r.members and r.name != release.name]
        stored = ctx.site_uploads(view.round_id, site_id)
        if any(name not in stored for name in others):
            return  # not the site's last release yet
        held = self._take_held(site_id)
        payloads = {release.name: data}
        for name in others:
            row = stored[name]
            found = held.get((name, row.sha256))
            payloads[name] = found if found is not None else ctx.read_payload(row)
        try:
            self._feed(view, state, site_id, payloads)
        except (wire.WireError, ProtocolError) as exc:
            raise InvalidRequestError(f"masked input refused: {exc}") from exc

    # --- results -----------------------------------------------------------------------------

    def sums(self, view: RoundView, ctx: RoundContext) -> Mapping[str, FloatArray]:
        """The unmasked sums (recomputed from the journal after a restart)."""
        if view.round_id not in self._sums:
            try:
                self._keep_result(view, ctx, self._replay(view, ctx, upto=pb.ROUND_STAGE_SOLVING))
            except (ProtocolError, wire.WireError) as exc:
                raise AggregationError(
                    f"round {view.round_id!r}: the masked exchange cannot be replayed: {exc}"
                ) from exc
        return self._sums[view.round_id]

    def contributors(self, view: RoundView) -> tuple[str, ...]:
        return self._contributors.get(view.round_id, tuple(view.row.participants))

    def forget(self, round_id: str) -> None:
        with self._held_lock:  # a run's rounds run one at a time
            self._held.clear()
        self.rounds.pop(round_id, None)
        self._sums.pop(round_id, None)
        self._contributors.pop(round_id, None)

    # --- request handling (called with the lock held) ----------------------------------------

    def state(self, view: RoundView, ctx: RoundContext, stage: int) -> MaskRound:
        """The round's state, if it is (at least) in ``stage``; else :class:`WrongStageError`."""
        if view.stage < stage or view.stage not in MASK_STAGES:
            raise WrongStageError(
                f"round {view.round_id!r} is {wire.stage_name(view.stage)}, "
                f"not {wire.stage_name(stage)}"
            )
        return self._state(view, ctx)

    def receive(
        self, view: RoundView, ctx: RoundContext, site_id: str, stage: int, raw: bytes
    ) -> bool:
        """Hand one client message of ``stage`` (its serialized request) to the protocol and
        persist it; True if it repeats a request already journaled (idempotent, also after the
        stage closed: its answer may have been lost in a restart) or comes for a PUBLISHED round
        (ignored), :class:`ConflictError` if it differs from a journaled one."""
        known = self._journaled(view, ctx, stage, site_id)
        if known is not None:
            if known == _digest(raw):
                return True
            raise ConflictError("a different message of this stage was already received")
        if view.stage == pb.ROUND_STAGE_PUBLISHED:  # a retry after its run's journal was deleted:
            return True  # the round released its sums, nothing a site sends changes them
        state = self.state(view, ctx, stage)
        if view.stage != stage:
            raise WrongStageError(f"round {view.round_id!r} has moved past this stage")
        try:
            message = _parse(stage, site_id, raw, state)
            state.server.receive(message, sender=site_id)
        except wire.WireError as exc:
            raise InvalidRequestError(str(exc)) from exc
        except (StageError, UnknownParticipantError) as exc:
            raise WrongStageError(str(exc)) from exc
        except DuplicateMessageError as exc:
            raise ConflictError(str(exc)) from exc
        except ProtocolError as exc:
            raise InvalidRequestError(str(exc)) from exc
        try:
            ctx.put_message(
                view.round_id, stage=stage, site_id=site_id, kind=JOURNAL_KIND, data=raw
            )
        except BaseException:
            self.rounds.pop(view.round_id, None)  # memory must not run ahead of the journal
            raise
        state.received.add(site_id)
        state.journaled[(stage, site_id)] = _digest(raw)
        return False

    def _journaled(
        self, view: RoundView, ctx: RoundContext, stage: int, site_id: str
    ) -> bytes | None:
        """SHA-256 of the request of (stage, site) already journaled, if any: from the round's
        in-memory index during the exchange, else (after it, a rare retry) from the journal."""
        if view.stage in MASK_STAGES:
            return self._state(view, ctx).journaled.get((stage, site_id))
        for stored in ctx.messages(view.round_id):
            if (stored.stage, stored.site_id, stored.kind) == (stage, site_id, JOURNAL_KIND):
                return _digest(stored.data)
        return None


def _digest(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def _parse(stage: int, site_id: str, raw: bytes, state: MaskRound) -> ClientMessage:
    """A site's serialized request of ``stage`` as the protocol message (sender = the site)."""
    if stage == pb.ROUND_STAGE_ADVERTISE_KEYS:
        return wire.advert_from_proto(site_id, pb.AdvertiseKeysRequest.FromString(raw))
    if stage == pb.ROUND_STAGE_SHARE_KEYS:
        return wire.share_keys_from_proto(site_id, pb.ShareKeysRequest.FromString(raw))
    if stage == pb.ROUND_STAGE_CONSISTENCY_CHECK:
        assert state.survivors is not None
        request = pb.ConsistencySignature.FromString(raw)
        return wire.consistency_from_proto(site_id, request, survivors=state.survivors)
    if stage == pb.ROUND_STAGE_UNMASK:
        return wire.unmask_response_from_proto(site_id, pb.UnmaskResponse.FromString(raw))
    raise WrongStageError(f"stage {wire.stage_name(stage)} takes no message")


def _signed_decisions(view: RoundView, ctx: RoundContext) -> dict[str, pb.PlanDecision]:
    """The participants' journaled acceptances that carry a graph commitment (sparse graph)."""
    out = {}
    for message in ctx.messages(view.round_id):
        if message.kind == DECISION_JOURNAL_KIND and message.site_id in view.row.participants:
            out[message.site_id] = pb.PlanDecision.FromString(message.data)
    return out


def _require_declarations(participants: tuple[str, ...], declared: Declared, *, what: str) -> None:
    """ValueError naming the participants that declared no row bounds when ``what`` needs them."""
    missing = [s for s in participants if s not in declared]
    if missing:
        raise ValueError(
            f"{what} come from the sites' declared row bounds, and {', '.join(missing)} declared "
            "none at enrolment (its [policy] disclose_row_bounds = false, or an older afl-client); "
            "set mask_feature_norm and mask_max_samples in server.toml [round] instead"
        )


class MaskRequests:
    """Domain side of the MASK RPCs (module docstring); the servicer decodes and encodes."""

    def __init__(self, access: RoundAccess) -> None:
        self.access = access

    def _mode(self, view: RoundView) -> MaskMode:
        mode = self.access.mode_of(view)
        if not isinstance(mode, MaskMode):
            raise WrongStageError(f"round {view.round_id!r} does not run aggregation = 'mask'")
        return mode

    def _send(self, site: str, round_id: str, stage: int, raw: bytes) -> cpb.Ack:
        with participant_round(self.access, site, round_id) as view:
            retry = self._mode(view).receive(view, self.access.context, site, stage, raw)
        return cpb.Ack(message="duplicate ignored" if retry else "received")

    def _get(
        self,
        site: str,
        round_id: str,
        stage: int,
        body: Callable[[RoundView, MaskRound], T],
        *,
        shared: str = "",
    ) -> T:
        """``body``'s answer to ``site`` once the round is in ``stage``. With ``shared`` (a name):
        an answer that is the same for every participant, built and serialized on the first
        request, then parsed afresh for each participant asking (after the same checks of the
        caller), so no caller holds another's message."""
        with participant_round(self.access, site, round_id, advance_first=True) as view:
            state = self._mode(view).state(view, self.access.context, stage)
            if not shared:
                return body(view, state)
            cached = state.answers.get(shared)
            if cached is None:  # what it is built from is fixed once the stage opens
                built = body(view, state)
                cached = state.answers[shared] = (type(built), built.SerializeToString())
        kind, data = cached
        return cast(T, kind.FromString(data))

    def graph_commitments(self, site: str, round_id: str) -> pb.GraphCommitments:
        def body(view: RoundView, state: MaskRound) -> pb.GraphCommitments:
            if state.server.config.graph is None:
                raise WrongStageError(f"round {view.round_id!r} masks with the full graph")
            decisions = state.decisions
            return pb.GraphCommitments(
                round_id=view.round_id,
                commitments=[
                    pb.GraphCommitment(
                        site_id=s,
                        plan_sha256=d.plan_sha256,
                        commitment=d.graph_commitment,
                        signature=d.signature,
                    )
                    for s, d in sorted(decisions.items())
                ],
            )

        return self._get(site, round_id, pb.ROUND_STAGE_ADVERTISE_KEYS, body, shared="commitments")

    def advertise_keys(self, site: str, request: pb.AdvertiseKeysRequest) -> cpb.Ack:
        stage = pb.ROUND_STAGE_ADVERTISE_KEYS
        return self._send(site, request.round_id, stage, request.SerializeToString())

    def advertised_keys(self, site: str, round_id: str) -> pb.AdvertisedKeys:
        def body(view: RoundView, state: MaskRound) -> pb.AdvertisedKeys:
            assert state.directory is not None
            return wire.directory_to_proto(state.directory)

        return self._get(site, round_id, pb.ROUND_STAGE_SHARE_KEYS, body, shared="directory")

    def share_keys(self, site: str, request: pb.ShareKeysRequest) -> cpb.Ack:
        stage = pb.ROUND_STAGE_SHARE_KEYS
        return self._send(site, request.round_id, stage, request.SerializeToString())

    def shared_keys(self, site: str, round_id: str) -> pb.SharedKeys:
        def body(view: RoundView, state: MaskRound) -> pb.SharedKeys:
            if site not in state.routed:
                raise NotPermittedError(f"site {site!r} dropped out before ShareKeys closed")
            return wire.routed_to_proto(state.routed[site])

        return self._get(site, round_id, pb.ROUND_STAGE_UPLOAD, body)

    def survivors(self, site: str, round_id: str) -> pb.SurvivorList:
        def body(view: RoundView, state: MaskRound) -> pb.SurvivorList:
            assert state.survivors is not None
            return pb.SurvivorList(round_id=view.round_id, survivors=list(state.survivors))

        return self._get(site, round_id, pb.ROUND_STAGE_CONSISTENCY_CHECK, body, shared="survivors")

    def consistency_check(self, site: str, request: pb.ConsistencySignature) -> cpb.Ack:
        stage = pb.ROUND_STAGE_CONSISTENCY_CHECK
        return self._send(site, request.round_id, stage, request.SerializeToString())

    def consistency_signatures(self, site: str, round_id: str) -> pb.ConsistencySignatures:
        def body(view: RoundView, state: MaskRound) -> pb.ConsistencySignatures:
            assert state.unmask is not None
            request = wire.unmask_request_to_proto(state.unmask)
            return pb.ConsistencySignatures(
                round_id=view.round_id, survivors=request.survivors, signatures=request.signatures
            )

        return self._get(site, round_id, pb.ROUND_STAGE_UNMASK, body, shared="signatures")

    def unmask_request(self, site: str, round_id: str) -> pb.UnmaskRequest:
        def body(view: RoundView, state: MaskRound) -> pb.UnmaskRequest:
            assert state.unmask is not None
            return wire.unmask_request_to_proto(state.unmask)

        return self._get(site, round_id, pb.ROUND_STAGE_UNMASK, body, shared="unmask")

    def unmask(self, site: str, request: pb.UnmaskResponse) -> cpb.Ack:
        stage = pb.ROUND_STAGE_UNMASK
        return self._send(site, request.round_id, stage, request.SerializeToString())
