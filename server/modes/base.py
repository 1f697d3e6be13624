"""Aggregation modes of the coordinator: the declared interface, and the ``plaintext`` mode
(docs/architecture.md §4).

The round state machine (:mod:`afl.server.rounds`) owns the stages every round shares —
WAITING_FOR_PARTICIPANTS, PLAN_REVIEW, SOLVING, PUBLISHED, ABORTED — and asks the round's
:class:`AggregationMode` for everything between an accepted plan and the released sums:

* :meth:`~AggregationMode.plan_options` and :meth:`~AggregationMode.dp_encodings`: the mode's part
  of the signed release plan (aggregation mode, each release's wire encoding, MASK's threshold);
* :meth:`~AggregationMode.begin`: the first exchange stage once every participant accepted;
* :meth:`~AggregationMode.drive`: the transition due in one of the mode's
  :attr:`~AggregationMode.exchange_stages` (or None);
* :meth:`~AggregationMode.check_upload`: whether a site's payload may be stored now;
* :meth:`~AggregationMode.sums`: the released sums the solve uses (None: not available yet);
* :meth:`~AggregationMode.contributors`: whose data the published model contains.

Modes never set stages themselves: they return a :class:`Transition` that the round machine
applies (store first, then the audit log, then the event). They read the round through
:class:`RoundContext` and answer mode-specific RPCs through :class:`RoundAccess`, both implemented
by the coordinator; they never touch its private members.

``plaintext`` (this module): little-endian float64 statistics in the clear over TLS, summed with
:func:`afl.core.aggregation.sum_members` in sorted site order. One exchange stage, UPLOAD: sites
that accepted the plan may upload while others still review; the round moves to SOLVING once
every participant's uploads are stored, and at the stage deadline it aborts and is re-planned with
the sites whose uploads are complete.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import numpy as np
from numpy.typing import NDArray

from afl.core.aggregation import AggregationError, sum_members
from afl.core.packing import unpack_upper
from afl.core.row_bounds import RowBounds
from afl.proto import wire
from afl.proto.v1 import common_pb2 as cpb
from afl.proto.v1 import coordinator_pb2 as pb
from afl.server.config import RoundSettings, ServerConfig
from afl.server.errors import InvalidRequestError, WrongStageError
from afl.server.modes.ckks_context import CkksContexts
from afl.server.modes.influence import upload_bound_problem
from afl.server.plan.release import PlannedRelease, PlanOptions, RoundView
from afl.server.store import EnrolmentRow, MessageRow, Store, UploadRow

__all__ = [
    "DECISION_JOURNAL_KIND",
    "AggregationMode",
    "Declared",
    "ModeEnvironment",
    "PlainUploadStage",
    "PlaintextMode",
    "PlanOptions",
    "RoundAccess",
    "RoundContext",
    "Transition",
    "complete_sites",
    "decode_float64",
    "decoded_releases",
    "participant_round",
    "require_upload_stage",
    "shaped",
]

FloatArray = NDArray[np.float64]
#: Row bounds each site declared at enrolment (site id -> bounds; absent = not declared).
Declared = Mapping[str, RowBounds]


@dataclass(frozen=True)
class Transition:
    """A stage change a mode asks the round machine to apply.

    ``timeout_s``: the new stage's deadline is now + timeout_s (None keeps the current deadline).
    ``replan_with``: for ABORTED only, open a replacement round with these sites (None: no
    replacement).
    """

    stage: int
    reason: str = ""
    timeout_s: float | None = None
    replan_with: tuple[str, ...] | None = None


#: Journal kind of a site's signed plan decision that carries a graph commitment (a sparse-graph
#: MASK plan, :mod:`afl.server.modes.mask`).
DECISION_JOURNAL_KIND = "plan-decision"


class RoundContext(Protocol):
    """A round's durable state as a mode sees it (implemented by the round machine): read access,
    and the journal where a secure mode persists every protocol message before acknowledging it,
    so that a restarted coordinator can rebuild the mode's state."""

    def now_ms(self) -> int: ...

    def decisions(self, round_id: str) -> dict[str, tuple[bool, str]]: ...

    def uploads(self, round_id: str) -> dict[tuple[str, str], UploadRow]: ...

    def site_uploads(self, round_id: str, site_id: str) -> dict[str, UploadRow]: ...

    def read_payload(self, row: UploadRow) -> bytes: ...

    def put_message(
        self, round_id: str, *, stage: int, site_id: str, kind: str, data: bytes
    ) -> None: ...

    def messages(self, round_id: str) -> list[MessageRow]: ...

    def audit(self, event: str, detail: Mapping[str, object]) -> None:
        """Append a record to the coordinator's hash-chained audit log."""
        ...

    def row_bounds(self, site_id: str) -> RowBounds | None:
        """The N and L ``site_id`` declared at enrolment (None if it declared none)."""
        ...

    def exposes_history(
        self, view: RoundView, releases: Sequence[PlannedRelease], members: Sequence[str]
    ) -> str:
        """The refusal when the releases, summed over ``members`` only, expose a site together
        with the federation's earlier releases ("" when not; docs/protocol.md §6, M-124)."""
        ...

    def note_decoded(self, round_id: str, contributors: Mapping[str, Sequence[str]]) -> None:
        """The coordinator decoded the sums of these releases (name -> the sites in each sum):
        if the round aborts, its federation-log `release` statement still names them (M-209)."""
        ...


class RoundAccess(Protocol):
    """What a mode's request handlers may use of the coordinator (all under :attr:`lock`)."""

    lock: threading.Condition
    config: ServerConfig
    store: Store

    @property
    def context(self) -> RoundContext: ...

    def require_enrolled(self, site_id: str) -> EnrolmentRow: ...

    def find(self, round_id: str) -> RoundView: ...

    def mode_of(self, view: RoundView) -> AggregationMode: ...

    def require_participant(self, view: RoundView, site_id: str) -> None: ...

    def advance(self) -> None: ...


@contextmanager
def participant_round(
    access: RoundAccess, site_id: str, round_id: str, *, advance_first: bool = False
) -> Iterator[RoundView]:
    """Hold the lock with the round ``round_id`` (which the request must name) checked for
    ``site_id`` (enrolled, a participant); apply due transitions after the body (and before, if
    ``advance_first``)."""
    access.require_enrolled(site_id)
    with access.lock:
        if advance_first:
            access.advance()
        view = access.find(round_id or "-")
        access.require_participant(view, site_id)
        yield view
        access.advance()


class AggregationMode(Protocol):
    """What the round state machine needs from an aggregation mode (module docstring)."""

    settings: RoundSettings
    name: str
    proto_mode: int
    exchange_stages: tuple[int, ...]
    #: The stages in which a site's payload may be stored (``check_upload`` refuses the others;
    #: the coordinator checks it before it writes the payload's file).
    upload_stages: tuple[int, ...]

    def plan_options(
        self, participants: tuple[str, ...], *, declared: Declared | None = None
    ) -> PlanOptions:
        """Mode, encodings and threshold of the plan over ``participants`` (ValueError: none
        fits); ``declared``: the row bounds each site declared at enrolment (None: unknown)."""
        ...

    def dp_encodings(self, plan: cpb.ReleasePlan, *, declared: Declared | None = None) -> None:
        """Rewrite a DP plan's encodings for the noised statistics (ValueError: they do not fit)."""
        ...

    def begin(self, view: RoundView, ctx: RoundContext) -> Transition:
        """The first exchange stage, once every participant accepted the plan."""
        ...

    def drive(self, view: RoundView, ctx: RoundContext) -> Transition | None:
        """The transition due in one of :attr:`exchange_stages`, or None."""
        ...

    def prepare_upload(
        self, *, site_id: str, release: PlannedRelease, data: bytes, sha256: bytes
    ) -> None:
        """The part of :meth:`check_upload` that needs no round state (e.g. parsing ciphertexts),
        run before the coordinator's lock is taken so that it holds up no other call; raise on
        data that can never be stored. What it computes may be kept, under the payload's
        verified ``sha256``, for :meth:`check_upload` and the sums."""
        ...

    def check_upload(
        self,
        view: RoundView,
        ctx: RoundContext,
        *,
        site_id: str,
        release: PlannedRelease,
        data: bytes,
    ) -> None:
        """Raise unless ``data`` may be stored now as ``site_id``'s upload to ``release``."""
        ...

    def sums(self, view: RoundView, ctx: RoundContext) -> Mapping[str, FloatArray] | None:
        """The released sums in their logical shapes; None while they are not available yet.
        :class:`afl.core.aggregation.AggregationError` when they never will be."""
        ...

    def contributors(self, view: RoundView) -> tuple[str, ...]:
        """The sites whose statistics the released sums contain."""
        ...

    def forget(self, round_id: str) -> None:
        """Drop what the mode keeps in memory for a finished round (the store keeps the rest)."""
        ...


def decode_float64(data: bytes, *, length: int, what: str) -> FloatArray:
    """``length`` little-endian float64 values; :class:`InvalidRequestError` on a wrong size or
    any NaN/inf (the message names ``what``, never a value)."""
    if len(data) != 8 * length:
        raise InvalidRequestError(
            f"{what}: payload has {len(data)} bytes, the release's shape needs {8 * length}"
        )
    values = np.frombuffer(data, dtype="<f8").astype(np.float64)
    if not np.isfinite(values).all():
        raise InvalidRequestError(f"{what}: payload contains NaN or infinite values")
    return values


def decoded_releases(sums: Mapping[str, NDArray[np.float64]]) -> list[dict[str, object]]:
    """What an audit record says of decoded sums: per release, its name and the SHA-256 of the
    float64 little-endian bytes of its values (a digest, never the statistic itself)."""
    return [
        {
            "release": name,
            "sha256": hashlib.sha256(
                np.ascontiguousarray(values, dtype="<f8").tobytes()
            ).hexdigest(),
        }
        for name, values in sorted(sums.items())
    ]


def shaped(release: PlannedRelease, flat: NDArray[np.float64]) -> FloatArray:
    """A release's flat wire vector in its logical shape ((d, d) for a packed Gram)."""
    if release.packed:
        return unpack_upper(np.asarray(flat, dtype=np.float64))
    return np.asarray(flat, dtype=np.float64).reshape(release.shape)


def require_upload_stage(view: RoundView, stages: tuple[int, ...]) -> None:
    """:class:`WrongStageError` unless ``view``'s round is in one of ``stages`` (a mode's
    ``upload_stages``)."""
    if view.row.stage not in stages:
        raise WrongStageError(
            f"round {view.round_id!r} is {wire.stage_name(view.row.stage)}, not accepting uploads"
        )


def complete_sites(view: RoundView, ctx: RoundContext) -> list[str]:
    """Participants whose upload of every release they are a member of is stored."""
    uploaded = set(ctx.uploads(view.round_id))
    return [
        s
        for s in view.row.participants
        if all((s, r.name) in uploaded for r in view.releases if s in r.members)
    ]


@dataclass(frozen=True)
class ModeEnvironment:
    """What a mode is built from (:mod:`afl.server.modes.registry`): the server configuration, the
    run's settings and the federation-wide CKKS context of the decryptor."""

    config: ServerConfig
    settings: RoundSettings
    ckks_contexts: CkksContexts


class PlainUploadStage:
    """The UPLOAD stage shared by ``plaintext`` and ``ckks`` (module docstring)."""

    settings: RoundSettings
    exchange_stages: tuple[int, ...] = (pb.ROUND_STAGE_UPLOAD,)
    upload_stages: tuple[int, ...] = (pb.ROUND_STAGE_PLAN_REVIEW, pb.ROUND_STAGE_UPLOAD)

    def begin(self, view: RoundView, ctx: RoundContext) -> Transition:
        return Transition(pb.ROUND_STAGE_UPLOAD)

    def forget(self, round_id: str) -> None:
        """Nothing kept in memory besides the store."""

    def prepare_upload(
        self, *, site_id: str, release: PlannedRelease, data: bytes, sha256: bytes
    ) -> None:
        """Nothing to prepare: every check needs the round's state."""

    def drive(self, view: RoundView, ctx: RoundContext) -> Transition | None:
        done = complete_sites(view, ctx)
        if len(done) == len(view.row.participants):
            return Transition(pb.ROUND_STAGE_SOLVING)
        if ctx.now_ms() >= view.row.deadline_ms:
            late = [s for s in view.row.participants if s not in done]
            return Transition(
                pb.ROUND_STAGE_ABORTED,
                reason=f"timed out waiting for {', '.join(late)}",
                replan_with=tuple(done),
            )
        return None

    def require_accepting(self, view: RoundView) -> None:
        require_upload_stage(view, self.upload_stages)

    def contributors(self, view: RoundView) -> tuple[str, ...]:
        return tuple(view.row.participants)


class PlaintextMode(PlainUploadStage):
    """``aggregation = "plaintext"`` (module docstring)."""

    name = "plaintext"
    proto_mode = int(cpb.AGGREGATION_MODE_PLAINTEXT)

    def __init__(self, settings: RoundSettings) -> None:
        self.settings = settings

    @classmethod
    def for_run(cls, env: ModeEnvironment) -> PlaintextMode:
        return cls(env.settings)

    def plan_options(
        self, participants: tuple[str, ...], *, declared: Declared | None = None
    ) -> PlanOptions:
        return PlanOptions(aggregation=cpb.AGGREGATION_MODE_PLAINTEXT)

    def dp_encodings(self, plan: cpb.ReleasePlan, *, declared: Declared | None = None) -> None:
        """Float64 carries the noised statistics exactly (the sites check the grid range)."""

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
        values = decode_float64(data, length=release.length, what=f"release {release.name!r}")
        declared = ctx.row_bounds(site_id)
        if declared is not None and self.settings.dp is None:  # bounded influence (§6.2)
            problem = upload_bound_problem(release, shaped(release, values), declared=declared)
            if problem:
                raise InvalidRequestError(problem)

    def sums(self, view: RoundView, ctx: RoundContext) -> dict[str, FloatArray]:
        uploads = ctx.uploads(view.round_id)
        out: dict[str, FloatArray] = {}
        for release in view.releases:
            missing = sorted(s for s in release.members if (s, release.name) not in uploads)
            if missing:
                raise AggregationError(f"release {release.name!r} lacks uploads from {missing}")
            arrays = [
                decode_float64(
                    ctx.read_payload(uploads[(s, release.name)]),
                    length=release.length,
                    what=release.name,
                )
                for s in release.members
            ]
            out[release.name] = shaped(release, sum_members(arrays, frozenset(range(len(arrays)))))
        return out
