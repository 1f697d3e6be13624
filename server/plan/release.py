"""The release plan of a round: what the server will learn, signed before any upload
(docs/protocol.md §6).

Round 1 (from coverage and ``gram_scope``, via :func:`afl.core.leakage.releases_for_round`):

* ``global``: ``gram[all]`` = Σ_k G_k over all participants, and ``b[c]`` = Σ_k b_{k,c} over all
  participants for every class (non-labellers send zeros): coverage never leaves the sites.
* ``per-class`` (paper eq. 13-15): one ``gram{S}`` per distinct coverage set S_c and ``b[c]``
  over S_c; classes nobody labels get no release (their W column stays 0). With ``rounds = 2``
  round 2 needs the global Gram (eq. 20): it is planned IN ROUND 1 as ``gram[all]`` (unless a
  coverage set already is everyone), so the round-1 audit sees every Gram sum the server learns.

Round 2 (eq. 19-21): ``b_pseudo[c]`` for every class over all participants (non-contributors send
zeros); the Gram and b of round 1 are reused, nothing else is released.

The evaluation round of a run (``evaluate = true``, :mod:`afl.server.solve.evaluation`) releases score
histograms and confusion counts of the published model (``Release.evaluation`` names it); each
such release sums two audit quantities per class (:attr:`PlannedRelease.quantities`).

Every release is its own upload slot (``upload_name == name``): Gram releases are packed upper
triangles (d(d+1)/2 float64), class vectors are [d, 1] dense, all little-endian float64. The
plan is serialized once; its bytes are signed (context "release-plan") and stored, and a
resumed server re-reads the same bytes.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from afl.core.aggregation import GramScope
from afl.core.evaluation.federated import evaluation_quantities
from afl.core.evaluation.scorebins import ScoreBins
from afl.core.leakage import LeakageReport, Release, audit_releases, releases_for_round
from afl.crypto.identity.signed_blobs import PLAN_CONTEXT, sign_blob
from afl.proto.v1 import common_pb2
from afl.proto.wire import EVALUATION_KINDS, evaluation_spec, read_evaluation, release_length
from afl.server.store import RoundRow

__all__ = [
    "GLOBAL_GRAM",
    "EvaluationTarget",
    "PlanOptions",
    "PlannedRelease",
    "RoundView",
    "audit_plan",
    "build_plan",
    "leakage_rows",
    "releases_from_plan",
    "round1_releases",
    "round2_releases",
    "sign_plan",
]

GLOBAL_GRAM = "gram[all]"
_SCOPES = {"global": common_pb2.GRAM_SCOPE_GLOBAL, "per-class": common_pb2.GRAM_SCOPE_PER_CLASS}


@dataclass(frozen=True)
class EvaluationTarget:
    """What an evaluation release measures (``Release.evaluation``): the model (SHA-256 of its
    signed ``Model`` bytes), the score bins and the decision threshold."""

    model_sha256: bytes
    bins: ScoreBins
    threshold: float = 0.5


@dataclass(frozen=True)
class PlannedRelease:
    """One aggregate of the plan: its members, statistic kind, classes and logical shape (and, for
    an evaluation release, the model it evaluates)."""

    name: str
    members: tuple[str, ...]
    kind: int  # common_pb2.StatisticKind
    class_names: tuple[str, ...]
    shape: tuple[int, ...]
    evaluation: EvaluationTarget | None = None

    @property
    def packed(self) -> bool:
        """Gram releases travel as packed upper triangles."""
        return self.kind == common_pb2.STATISTIC_KIND_GRAM

    @property
    def length(self) -> int:
        """Wire elements of one site's contribution (:func:`afl.proto.wire.release_length`)."""
        return release_length(shape=self.shape, packed=self.packed)

    @property
    def quantity(self) -> str:
        """Which releases may be combined linearly (afl.core.leakage): Gram, or one class's b."""
        if self.packed:
            return "gram"
        prefix = "b_pseudo" if self.kind == common_pb2.STATISTIC_KIND_PSEUDO_CLASS_VECTOR else "b"
        return f"{prefix}[{self.class_names[0]}]"

    @property
    def quantities(self) -> list[str]:
        """Every quantity the release sums: :attr:`quantity`, or for an evaluation release two
        per class (:func:`afl.core.evaluation.federated.evaluation_quantities`, as a site audits them)."""
        if self.evaluation is None:
            return [self.quantity]
        model = self.evaluation.model_sha256.hex()
        return evaluation_quantities(self.class_names, model_sha256=model)


@dataclass(frozen=True)
class PlanOptions:
    """An aggregation mode's part of the plan: the mode, each release's wire encoding (default:
    plaintext float64), MASK's round threshold t and its sparse graph (None: the full graph)."""

    aggregation: int = common_pb2.AGGREGATION_MODE_PLAINTEXT
    encoding: Callable[[PlannedRelease], common_pb2.Encoding] | None = None
    mask_threshold: int = 0
    mask_graph: common_pb2.MaskGraph | None = None


@dataclass(frozen=True)
class RoundView:
    """A stored round row plus the releases of its signed plan (empty before the plan exists)."""

    row: RoundRow
    releases: tuple[PlannedRelease, ...]

    @property
    def round_id(self) -> str:
        return self.row.round_id

    @property
    def stage(self) -> int:
        return self.row.stage


def _planned(release: Release, *, d: int, participants: Sequence[str]) -> PlannedRelease:
    members = tuple(s for s in participants if s in release.members)
    if release.quantity == "gram":
        return PlannedRelease(release.name, members, common_pb2.STATISTIC_KIND_GRAM, (), (d, d))
    cls = release.quantity[2:-1]  # "b[<class>]"
    return PlannedRelease(
        release.name, members, common_pb2.STATISTIC_KIND_CLASS_VECTOR, (cls,), (d, 1)
    )


def round1_releases(
    *,
    classes: Sequence[str],
    participants: Sequence[str],
    coverage: Mapping[str, Collection[str]],
    gram_scope: GramScope,
    d: int,
    need_global_gram: bool,
) -> list[PlannedRelease]:
    """Round-1 releases (module docstring). ``coverage`` maps a site to the classes it labels."""
    ordered = sorted(participants)
    if gram_scope == "global":
        by_class: dict[str, Collection[str]] = {c: ordered for c in classes}
    else:
        by_class = {c: [s for s in ordered if c in coverage.get(s, ())] for c in classes}
        by_class = {c: members for c, members in by_class.items() if members}
    releases = releases_for_round(coverage=by_class, participants=ordered, gram_scope=gram_scope)
    if gram_scope == "per-class":
        releases = [  # deterministic and readable names: gram[all] for the full set
            Release(GLOBAL_GRAM, r.members, r.quantity)
            if r.quantity == "gram" and r.members == frozenset(ordered)
            else r
            for r in releases
        ]
        if need_global_gram and all(r.name != GLOBAL_GRAM for r in releases):
            releases.insert(0, Release(GLOBAL_GRAM, frozenset(ordered), "gram"))
    return [_planned(r, d=d, participants=ordered) for r in releases]


def round2_releases(
    *, classes: Sequence[str], participants: Sequence[str], d: int
) -> list[PlannedRelease]:
    """Round-2 releases: one pseudo-label class vector sum per class over all participants."""
    members = tuple(sorted(participants))
    return [
        PlannedRelease(
            f"b_pseudo[{c}]", members, common_pb2.STATISTIC_KIND_PSEUDO_CLASS_VECTOR, (c,), (d, 1)
        )
        for c in classes
    ]


def leakage_rows(releases: Sequence[PlannedRelease], *, tag: str = "") -> list[Release]:
    """The releases as :class:`afl.core.leakage.Release` rows named ``<tag><name>``, one per
    quantity (``#<quantity>`` appended where a release sums several)."""
    return [
        Release(
            f"{tag}{r.name}" + (f"#{q}" if len(r.quantities) > 1 else ""), frozenset(r.members), q
        )
        for r in releases
        for q in r.quantities
    ]


def audit_plan(
    releases: Sequence[PlannedRelease],
    participants: Sequence[str],
    *,
    history: Sequence[tuple[str, Sequence[PlannedRelease]]] = (),
) -> LeakageReport:
    """Leakage audit (docs/protocol.md §6) of the plan, together with the releases of earlier
    rounds (``history``: (round id, releases)), at the default minimum cohort (3, or K when
    K < 3); a release of several quantities is one row per quantity."""
    rows = [
        *leakage_rows(releases),
        *(x for rid, old in history for x in leakage_rows(old, tag=f"{rid}/")),
    ]
    universe = sorted({*participants, *(s for r in rows for s in r.members)})
    return audit_releases(rows, universe, min_cohort=min(3, max(1, len(participants))))


def _encoding(release: PlannedRelease) -> common_pb2.Encoding:
    packing = common_pb2.PACKING_UPPER_TRIANGLE if release.packed else common_pb2.PACKING_DENSE
    return common_pb2.Encoding(dtype=common_pb2.DTYPE_FLOAT64_LE, packing=packing)


def build_plan(
    *,
    federation_id: str,
    round_id: str,
    round_number: int,
    participants: Sequence[str],
    gram_scope: GramScope,
    releases: Sequence[PlannedRelease],
    operator_override: bool = False,
    override_reason: str = "",
    options: PlanOptions = PlanOptions(),
) -> common_pb2.ReleasePlan:
    """The ReleasePlan message (no DP) with a fresh 32-byte round salt; ``options`` is the
    aggregation mode's part (:meth:`afl.server.modes.base.AggregationMode.plan_options`)."""
    encode = options.encoding or _encoding
    return common_pb2.ReleasePlan(
        version=1,
        federation_id=federation_id,
        round_id=round_id,
        round_number=round_number,
        participants=sorted(participants),
        aggregation=options.aggregation,  # type: ignore[arg-type]
        gram_scope=_SCOPES[gram_scope],
        releases=[
            common_pb2.Release(
                name=r.name,
                member_site_ids=list(r.members),
                kind=r.kind,  # type: ignore[arg-type]
                class_names=list(r.class_names),
                shape=list(r.shape),
                encoding=encode(r),
                noise=common_pb2.DpNoise(mechanism=common_pb2.NOISE_MECHANISM_NONE),
                upload_name=r.name,
                evaluation=None
                if r.evaluation is None
                else evaluation_spec(
                    model_sha256=r.evaluation.model_sha256,
                    bins=r.evaluation.bins,
                    threshold=r.evaluation.threshold,
                ),
            )
            for r in releases
        ],
        dp=common_pb2.DpParams(enabled=False),
        operator_override=operator_override,
        override_reason=override_reason,
        round_salt=os.urandom(32),
        mask_threshold=options.mask_threshold,
        mask_graph=options.mask_graph,
    )


def sign_plan(
    plan: common_pb2.ReleasePlan, identity_key: Ed25519PrivateKey
) -> common_pb2.SignedReleasePlan:
    """Serialize once and sign those bytes (context "release-plan")."""
    blob = plan.SerializeToString()
    return common_pb2.SignedReleasePlan(
        plan=blob, signature=sign_blob(identity_key, context=PLAN_CONTEXT, blob=blob)
    )


def releases_from_plan(plan_bytes: bytes) -> list[PlannedRelease]:
    """The releases of a stored, serialized plan (what a resumed server enforces). Parsed once
    per distinct plan (the round machine reads the open round's plan on every request; a plan
    of K members lists each release's K names)."""
    return list(_parsed_releases(plan_bytes))


@functools.lru_cache(maxsize=16)
def _parsed_releases(plan_bytes: bytes) -> tuple[PlannedRelease, ...]:
    plan = common_pb2.ReleasePlan.FromString(plan_bytes)
    return tuple(
        PlannedRelease(
            r.name,
            tuple(r.member_site_ids),
            int(r.kind),
            tuple(r.class_names),
            tuple(r.shape),
            _target(r) if r.kind in EVALUATION_KINDS else None,
        )
        for r in plan.releases
    )


def _target(release: common_pb2.Release) -> EvaluationTarget:
    spec = read_evaluation(release)
    return EvaluationTarget(bytes.fromhex(spec.model_sha256), spec.bins, spec.threshold)
