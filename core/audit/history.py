"""The differencing audit of a new plan over the federation's whole history (docs/protocol.md
§6 M-124 at the coordinator, §11a M-206..M-208 at every site).

Runs of one federation sum the same per-site statistics (a site's Gram matrix and class vectors
come from its feature cache), so a release of a new run can be differenced with the releases of
earlier runs: run 1 over {1..5} and run 2 over {1..4} give site 5's statistics; runs over
{C,D,F}, {A,B,X,V} and {A,B,X,C,D,F} give V's as G(ABXV) − (G(ABXCDF) − G(CDF)), although no
site of the last run ever shared a run with V. Each run alone passes the audit; only the whole
history shows the exposure. Each earlier release counts over the sites its sum actually holds
(the survivors it was unmasked or decrypted over), not its planned members.

Pure: the coordinator feeds it its stored rounds, a site the release statements of the
federation log; both audit with :func:`afl.core.leakage.audit_releases`.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

from afl.core.leakage import Exposure, LeakageReport, Release, audit_releases

__all__ = ["ReleasedRound", "history_exposures", "history_refusal", "history_releases"]


@dataclass(frozen=True)
class ReleasedRound:
    """A round whose sums were released: its releases (planned members) and the sites its sums
    actually contain (``contributors``: the survivors)."""

    round_id: str
    run_id: str
    releases: Sequence[Release]
    contributors: Collection[str]


def history_releases(
    rounds: Iterable[ReleasedRound], *, exclude_run: str = "", exclude_round: str = ""
) -> list[Release]:
    """Every release of ``rounds`` (but ``exclude_run``'s and ``exclude_round``'s) named
    ``<round id>/<release>``, its members cut to the round's contributors (a member that dropped
    out is not in the sum); a release left with no member is dropped. A round stated more than
    once (a gated round is logged as a candidate, then as published; a site adds what it
    unmasked itself) counts each distinct member set of a release once: the same sum again adds
    nothing, and a different one under the same name (a round id used twice) is another sum,
    named ``<round id>/<release>~<n>``, never a replacement."""
    out: list[Release] = []
    seen: dict[tuple[str, str], list[frozenset[int | str]]] = {}
    for released in rounds:
        if (exclude_run and released.run_id == exclude_run) or (
            exclude_round and released.round_id == exclude_round
        ):
            continue
        alive = frozenset(released.contributors)
        for r in released.releases:
            members = frozenset(r.members) & alive
            name = f"{released.round_id}/{r.name}"
            sums = seen.setdefault((name, r.quantity), [])
            if not members or members in sums:
                continue
            sums.append(members)
            out.append(
                Release(name if len(sums) == 1 else f"{name}~{len(sums)}", members, r.quantity)
            )
    return out


def history_exposures(
    plan: Sequence[Release],
    *,
    history: Sequence[Release],
    sites: Collection[str],
    min_cohort: int,
    known_from: Sequence[Release] | None = None,
    signed: Sequence[Release] | None = None,
) -> tuple[LeakageReport, list[Exposure]]:
    """The audit of ``plan`` together with ``history`` (names distinct from the plan's), and
    the exposures (single sites, and groups smaller than ``min_cohort``) that this plan adds:
    determined by plan and history together, with a certificate that needs an earlier release,
    and not determined by the history alone (what was known before stays known; refusing the
    plan would not hide it).

    A site's audit holds releases of three kinds of evidence (docs/protocol.md M-233):
    ``history``, every release the log states (the coordinator's statements may be false);
    ``signed``, the part some site signed (its openings, its own records), which a coordinator
    alone cannot make up; ``known_from``, the part that no single party's word makes (every
    survivor signed it), the only part whose exposures may excuse a plan as known before.
    A release only the coordinator states, over one site, would make that site look exposed
    before and let through a plan that really exposes it; so the plan must also add nothing,
    together with ``signed``, to what ``known_from`` alone determines (a real round one
    survivor could not sign is in ``signed``, and the plan that differences it is refused).
    What ``history`` alone determines is still not blamed on the plan in the first check, so
    a made-up release cannot stop every later plan. Defaults: ``known_from`` is ``history``
    (one party's books: the coordinator's own audit), ``signed`` is ``known_from``."""
    report, found = _added(plan, history, excused_by=history, sites=sites, min_cohort=min_cohort)
    if signed is None and known_from is None:
        return report, found
    excuse = list(history if known_from is None else known_from)
    signed_part = list(excuse if signed is None else signed)
    if _distinct(excuse) != _distinct(history):
        _, more = _added(plan, signed_part, excused_by=excuse, sites=sites, min_cohort=min_cohort)
        seen = {(e.sites, e.quantity) for e in found}
        found += [e for e in more if (e.sites, e.quantity) not in seen]
    return report, found


def _added(
    plan: Sequence[Release],
    history: Sequence[Release],
    *,
    excused_by: Sequence[Release],
    sites: Collection[str],
    min_cohort: int,
) -> tuple[LeakageReport, list[Exposure]]:
    """The audit of ``plan`` with ``history``, and the exposures it adds that need an earlier
    release and that ``excused_by`` alone does not determine."""
    earlier = {r.name for r in history}
    universe = sorted(
        {*sites, *(s for r in (*plan, *history, *excused_by) for s in r.members)}, key=str
    )
    report = audit_releases([*plan, *history], universe, min_cohort=min_cohort)
    found = [
        e
        for e in (*report.exposed_sites, *report.small_groups)
        if any(name in earlier for name, _ in e.certificate)
    ]
    if found:
        alone = audit_releases(list(excused_by), universe, min_cohort=min_cohort)
        known = {(e.sites, e.quantity) for e in (*alone.exposed_sites, *alone.small_groups)}
        found = [e for e in found if (e.sites, e.quantity) not in known]
    return report, found


def _distinct(releases: Sequence[Release]) -> set[tuple[str, frozenset[int | str], str]]:
    """The distinct sums of ``releases`` (a name's ``~n`` suffix depends on order)."""
    return {(r.name.split("~")[0], frozenset(r.members), r.quantity) for r in releases}


def history_refusal(
    exposures: Sequence[Exposure], *, round_id: str, rule: str, plan: str = ""
) -> str:
    """One line: which sites the plan of ``round_id`` (or the one ``plan`` names, e.g. a
    submitted run's predicted first plan) would expose, through which earlier releases
    (``round/release``), and what the operator can do instead; ``rule`` names the clause of
    docs/protocol.md that refuses it."""
    sites = sorted({str(s) for e in exposures for s in e.sites})
    earlier = sorted(  # the Gram releases first: one per round, the clearest evidence
        {name.split("#")[0] for e in exposures for name, _ in e.certificate if "/" in name},
        key=lambda name: ("/gram" not in name, name),
    )
    quantities = sorted({e.quantity for e in exposures})
    shown = ", ".join(earlier[:4]) + (f" and {len(earlier) - 4} more" if len(earlier) > 4 else "")
    subject = plan or f"the plan of round {round_id}"
    return (
        f"{subject}, differenced with earlier released sums ({shown}), would "
        f"expose the {'/'.join(quantities)} statistics of {', '.join(sites)} ({rule}): keep "
        "those sites in the run (a departed site's contribution included), wait until more "
        "sites join so that no difference isolates one, or re-train with DP ([round.dp]) "
        "covering the difference"
    )
