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

from afl.core.leakage import Exposure, LeakageReport
from afl.server.plan.release import PlannedRelease, audit_plan

__all__ = ["ReleasedRound", "history_exposures", "history_refusal", "released_history"]


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
    (their certificate names a release of ``history``): what this plan adds to what is known."""
    report = audit_plan(releases, participants, history=history)
    earlier = {f"{rid}/" for rid, _ in history}
    found = [
        e
        for e in (*report.exposed_sites, *report.small_groups)
        if any(name.startswith(tuple(earlier)) for name, _ in e.certificate)
    ]
    return report, found


def history_refusal(exposures: Sequence[Exposure], *, round_id: str) -> str:
    """One line: which sites the plan would expose, through which earlier releases, and what the
    operator can do instead."""
    sites = sorted({str(s) for e in exposures for s in e.sites})
    earlier = sorted(
        {name.split("#")[0] for e in exposures for name, _ in e.certificate if "/" in name}
    )
    quantities = sorted({e.quantity for e in exposures})
    shown = ", ".join(earlier[:4]) + (f" and {len(earlier) - 4} more" if len(earlier) > 4 else "")
    return (
        f"the plan of round {round_id}, differenced with earlier released sums ({shown}), would "
        f"expose the {'/'.join(quantities)} statistics of {', '.join(sites)} "
        "(docs/protocol.md §6, M-124): keep those sites in the run, wait until more sites join "
        "so that no difference isolates one, or re-train with DP ([round.dp]) covering the "
        "difference"
    )
