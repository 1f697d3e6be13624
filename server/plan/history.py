"""What the coordinator has already learned, for auditing a new training plan with it
(docs/protocol.md §6, M-124): every training release of every run whose sums were released, over
the sites whose data the sums actually contain.

Runs of one federation sum the same per-site statistics (a site's Gram matrix and class vectors
come from its feature cache), so a release of a new run can be differenced with the releases of
earlier runs: run 1 over five sites and run 2 over four of them give the fifth site's statistics.
Each run alone passes the audit; only the whole history shows the exposure.

The audit runs at plan time (:func:`history_audit`, round 1 and 2 of every run without DP), in
``mask`` again over the survivors before anything is unmasked, and at submission
(:func:`submission_audit`): a run whose first plan, predicted over every member it names, would
expose a site is refused before it is queued (M-124).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from afl.core.audit import history as core_history
from afl.core.leakage import Exposure, LeakageReport
from afl.crypto.transparency.statements import decode_statement
from afl.proto.v1 import common_pb2 as cpb
from afl.proto.v1 import coordinator_pb2 as pb
from afl.server.config import RoundSettings
from afl.server.plan.release import (
    PlannedRelease,
    leakage_rows,
    releases_from_plan,
    round1_releases,
)
from afl.server.store import Store

__all__ = [
    "ReleasedRound",
    "first_plan_releases",
    "history_audit",
    "history_exposures",
    "history_refusal",
    "released_history",
    "stored_history",
    "submission_audit",
]


@dataclass(frozen=True)
class ReleasedRound:
    """A round whose sums the coordinator decoded: its releases and the sites in those sums."""

    round_id: str
    run_id: str
    releases: Sequence[PlannedRelease]
    contributors: Collection[str]


def released_history(
    rounds: Iterable[ReleasedRound], *, exclude_run: str = ""
) -> list[tuple[str, list[PlannedRelease]]]:
    """(round id, releases) of every released round outside ``exclude_run``, each release's
    members cut to the round's contributors (a member that dropped out is not in the sum)."""
    history: list[tuple[str, list[PlannedRelease]]] = []
    for released in rounds:
        if exclude_run and released.run_id == exclude_run:
            continue
        contributors = frozenset(released.contributors)
        cut = [
            replace(r, members=tuple(m for m in r.members if m in contributors))
            for r in released.releases
        ]
        history.append((released.round_id, [r for r in cut if r.members]))
    return history


def history_exposures(
    releases: Sequence[PlannedRelease],
    participants: Sequence[str],
    *,
    history: Sequence[tuple[str, Sequence[PlannedRelease]]],
) -> tuple[LeakageReport, list[Exposure]]:
    """The audit of the plan with the history, and the exposures that need an earlier release
    and that the history alone did not determine: what this plan adds to what is known
    (:func:`afl.core.audit.history.history_exposures`, at :func:`audit_plan`'s minimum cohort)."""
    earlier = [row for rid, old in history for row in leakage_rows(old, tag=f"{rid}/")]
    return core_history.history_exposures(
        leakage_rows(releases),
        history=earlier,
        sites=participants,
        min_cohort=min(3, max(1, len(participants))),
    )


def history_refusal(exposures: Sequence[Exposure], *, round_id: str, plan: str = "") -> str:
    """One line: which sites the plan of ``round_id`` (or the one ``plan`` names) would expose,
    through which earlier releases, and what the operator can do instead."""
    return core_history.history_refusal(
        exposures, round_id=round_id, rule="docs/protocol.md §6, M-124", plan=plan
    )


#: Statistic kinds that are a function of a site's data alone, so every run releases the same
#: per-site values (round 2's pseudo-label vectors depend on the run's model, evaluations on theirs).
_DATA_KINDS = frozenset({cpb.STATISTIC_KIND_GRAM, cpb.STATISTIC_KIND_CLASS_VECTOR})


def stored_history(
    store: Store, *, exclude_round: str = ""
) -> list[tuple[str, list[PlannedRelease]]]:
    """Every published training round's data releases (Gram, class vectors: the statistics of a
    site's data that every run sums alike), cut to the model's contributors; a gated round's
    too, whatever the gate decided (its sums were released to solve the candidate); and a round
    aborted after its sums were decoded, over the survivors of its unpublished `release`
    statement in the federation log (M-209)."""
    unpublished = _unpublished(store)
    released: list[ReleasedRound] = []
    for row in store.rounds():
        if not row.plan or row.round_id == exclude_round:
            continue
        model = store.model(row.round_id) if row.stage == pb.ROUND_STAGE_PUBLISHED else None
        solved = model[1] if model is not None else None
        if solved is None and (candidate := store.candidate(row.round_id)) is not None:
            solved = candidate[0]
        releases = [r for r in releases_from_plan(row.plan) if r.kind in _DATA_KINDS]
        if solved is not None:
            contributors = tuple(pb.Model.FromString(solved).contributors)
        elif row.round_id in unpublished:
            contributors = unpublished[row.round_id]
        else:
            continue
        if releases:
            released.append(ReleasedRound(row.round_id, row.run_id, releases, contributors))
    return released_history(released)


def _unpublished(store: Store) -> dict[str, tuple[str, ...]]:
    """round -> survivors of the log's `release` statements of rounds aborted after their sums
    were decoded (``"published": false``)."""
    out: dict[str, tuple[str, ...]] = {}
    for entry in store.log_statements("release"):
        fields = decode_statement(entry, federation=store.federation_id)[1]
        if fields.get("published") is False and isinstance(
            survivors := fields.get("survivors"), list
        ):
            out[str(fields.get("round_id"))] = tuple(str(s) for s in survivors)
    return out


def history_audit(
    store: Store, *, round_id: str, releases: Sequence[PlannedRelease], members: Sequence[str]
) -> tuple[str, dict[str, object] | None]:
    """The refusal (one line) when ``releases`` summed over ``members`` only, differenced with
    what the federation already released, expose a site, and the detail of its
    "plan-audit-history" audit record; ("", None) when they do not (M-124)."""
    summed = frozenset(members)
    releases = [replace(r, members=tuple(m for m in r.members if m in summed)) for r in releases]
    exposed, report = _exposures(store, releases, members, exclude_round=round_id)
    if report is None:
        return "", None
    detail = {"round_id": round_id, "members": list(members), **report.to_dict()}
    return history_refusal(exposed, round_id=round_id), detail


def first_plan_releases(
    settings: RoundSettings,
    *,
    participants: Sequence[str],
    coverage: Mapping[str, Collection[str]],
) -> list[PlannedRelease]:
    """The round-1 releases of a run without DP over ``participants`` (``coverage``: the classes
    each site declared it labels): what its plan releases, and what a submission predicts."""
    return round1_releases(
        classes=settings.classes,
        participants=participants,
        coverage=coverage,
        gram_scope=settings.gram_scope,
        d=settings.feature_dim,
        need_global_gram=settings.rounds == 2,
    )


def submission_audit(
    store: Store, settings: RoundSettings, *, name: str
) -> tuple[str, dict[str, object] | None]:
    """The refusal (one line) of a submitted run whose first (training) plan, predicted over
    every member the run names (``[round] participants``, or every data site of server.toml)
    with the sites' stored declarations, would expose a site together with what the federation
    already released, and the detail of its "run-submit-refused" audit record; ("", None) when it
    would not, or when the plan cannot be predicted at submission (M-124):

    * a run with ``[round.dp]``: its noise covers the difference (its plans are not audited
      with the history at plan time either);
    * a ``per-class`` run with a member that has declared no labelled classes yet (a site that
      has not enrolled): its coverage sets are unknown.

    Plan time stays the gate for everything a submission cannot know: members that do not enrol
    before round 1 opens (it opens over fewer sites), members left out for their declarations,
    sites added to server.toml before the run starts, and replacement rounds."""
    if settings.dp is not None:
        return "", None
    members = settings.participants
    coverage = {s: e.labelled_classes for s, e in store.enrolments().items()}
    if settings.gram_scope == "per-class" and not all(coverage.get(s) for s in members):
        return "", None
    releases = first_plan_releases(settings, participants=members, coverage=coverage)
    exposed, report = _exposures(store, releases, members)
    if report is None:
        return "", None
    run = f"run {name!r}" if name else "the submitted run"
    plan = f"{run} is refused: its round-1 plan over its {len(members)} sites"
    sites = sorted({str(s) for e in exposed for s in e.sites})
    detail = {"name": name, "members": list(members), "exposed": sites, **report.to_dict()}
    return history_refusal(exposed, round_id="1", plan=plan), detail


def _exposures(
    store: Store,
    releases: Sequence[PlannedRelease],
    members: Sequence[str],
    *,
    exclude_round: str = "",
) -> tuple[list[Exposure], LeakageReport | None]:
    """The exposures ``releases`` over ``members`` add to the stored history, and the audit's
    report (None when they add none)."""
    history = stored_history(store, exclude_round=exclude_round)
    if not history:
        return [], None
    report, exposed = history_exposures(releases, members, history=history)
    return (exposed, report) if exposed else ([], None)
