"""What the coordinator has already learned, for auditing a new training plan with it
(docs/protocol.md §6, M-124): every training release of every run whose sums were released, over
the sites whose data the sums actually contain.

Runs of one federation sum the same per-site statistics (a site's Gram matrix and class vectors
come from its feature cache), so a release of a new run can be differenced with the releases of
earlier runs: run 1 over five sites and run 2 over four of them give the fifth site's statistics.
Each run alone passes the audit; only the whole history shows the exposure.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, replace

from afl.core.audit import history as core_history
from afl.core.leakage import Exposure, LeakageReport
from afl.crypto.transparency.statements import decode_statement
from afl.proto.v1 import common_pb2 as cpb
from afl.proto.v1 import coordinator_pb2 as pb
from afl.server.plan.release import PlannedRelease, leakage_rows, releases_from_plan
from afl.server.store import Store

__all__ = [
    "ReleasedRound",
    "history_audit",
    "history_exposures",
    "history_refusal",
    "released_history",
    "stored_history",
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


def history_refusal(exposures: Sequence[Exposure], *, round_id: str) -> str:
    """One line: which sites the plan would expose, through which earlier releases, and what the
    operator can do instead."""
    return core_history.history_refusal(
        exposures, round_id=round_id, rule="docs/protocol.md §6, M-124"
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
    for _, kind, entry, _ in store.log_entries(0, store.log_size()):
        if kind != "release":
            continue
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
    history = stored_history(store, exclude_round=round_id)
    if not history:
        return "", None
    summed = frozenset(members)
    releases = [replace(r, members=tuple(m for m in r.members if m in summed)) for r in releases]
    report, exposed = history_exposures(releases, members, history=history)
    if not exposed:
        return "", None
    detail = {"round_id": round_id, "members": list(members), **report.to_dict()}
    return history_refusal(exposed, round_id=round_id), detail
