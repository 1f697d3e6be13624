"""A site's differencing audit of a plan over the federation's whole history, read from the
federation log (docs/protocol.md §11a, M-206..M-208).

A site's own ``history.json`` holds the rounds it took part in; the coordinator's audit (M-124)
is the coordinator's word. The log's ``release`` statements (quorum-cosigned, the same for every
site) name every round whose sums were released, in every run: its releases with their planned
members and the survivors its sums were actually unmasked or decrypted over. From them the site
rebuilds the federation's released history (:func:`logged_rounds`) and audits the new plan with
it (:func:`whole_history_problem`, :func:`afl.core.audit.history.history_exposures`). A masked
round this site helped unmask also enters as the site itself knows it (:func:`with_unmasked`:
every planned release over the survivors it signed), whatever the log says of it: a coordinator
that decoded an aborted round's sums and logged less cannot hide them from this site. A plan
whose round id the log already holds a release of is refused (a round id is planned once). A
plan that,
differenced with any earlier release, determines ANY site's statistics (a site that left, a site
this one never shared a run with) or the sum of a group smaller than ``min_cohort`` is refused
before anything is sent.

Only data statistics enter the history (Gram, class vectors: a function of a site's data alone,
so every run sums the same per-site values), as at the coordinator; pseudo-label vectors and
evaluation statistics depend on the run's model.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from afl.client.policy.plan import audit_view
from afl.core.audit.history import (
    ReleasedRound,
    history_exposures,
    history_refusal,
    history_releases,
)
from afl.proto import wire
from afl.proto.v1 import common_pb2 as cpb

__all__ = [
    "DATA_KINDS",
    "LogHistoryError",
    "logged_release_problem",
    "logged_rounds",
    "release_fields",
    "whole_history_problem",
    "with_unmasked",
]

#: The statistic kinds whose per-site values every run sums alike.
DATA_KINDS = frozenset({cpb.STATISTIC_KIND_GRAM, cpb.STATISTIC_KIND_CLASS_VECTOR})
RULE = "docs/protocol.md §11a, M-206"


class LogHistoryError(ValueError):
    """A release statement of the log does not have the fields a release statement has."""


def _strings(value: object, what: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise LogHistoryError(f"{what} is not a list of names")
    return list(value)


def _release(doc: object) -> cpb.Release | None:
    """The logged release as a plan release (None: not a data statistic)."""
    if not isinstance(doc, Mapping):
        raise LogHistoryError("a logged release is not an object")
    kind_name = doc.get("kind")
    try:
        kind = cpb.StatisticKind.Value(str(kind_name))
    except ValueError:
        raise LogHistoryError(f"a logged release has unknown kind {kind_name!r}") from None
    if kind not in DATA_KINDS:
        return None
    name = doc.get("name")
    if not isinstance(name, str) or not name:
        raise LogHistoryError("a logged release has no name")
    return cpb.Release(
        name=name,
        kind=kind,
        class_names=_strings(doc.get("classes"), f"the classes of release {name}"),
        member_site_ids=_strings(doc.get("members"), f"the members of release {name}"),
    )


def logged_rounds(statements: Iterable[tuple[str, Mapping[str, Any]]]) -> list[ReleasedRound]:
    """Every released round of the log's (kind, fields) statements, in log order: its data
    releases over their planned members and its survivors (:class:`LogHistoryError` when a
    release statement is malformed)."""
    rounds: list[ReleasedRound] = []
    for kind, fields in statements:
        if kind != "release":
            continue
        round_id, run_id = fields.get("round_id"), fields.get("run_id", "")
        if not isinstance(round_id, str) or not round_id or not isinstance(run_id, str):
            raise LogHistoryError("a release statement names no round")
        survivors = _strings(fields.get("survivors"), f"the survivors of round {round_id}")
        releases = [r for d in fields.get("releases", []) if (r := _release(d)) is not None]
        rounds.append(ReleasedRound(round_id, run_id, audit_view(releases), survivors))
    return rounds


def release_fields(plan: cpb.ReleasePlan, *, survivors: Collection[str]) -> dict[str, Any]:
    """A `release` statement's fields for ``plan``'s round unmasked over ``survivors`` (the
    coordinator's format, :func:`afl.proto.wire.release_statement_fields`): what a site
    records of a round it helped unmask (:func:`with_unmasked`)."""
    return wire.release_statement_fields(
        round_id=plan.round_id,
        run_id=plan.run_id,
        survivors=survivors,
        releases=[(r.name, r.kind, r.class_names, r.member_site_ids) for r in plan.releases],
    )


def with_unmasked(
    statements: Sequence[tuple[str, Mapping[str, Any]]],
    unmasked: Sequence[Mapping[str, Any]],
) -> tuple[list[tuple[str, Mapping[str, Any]]], list[str]]:
    """The log's statements and, after them, each round this site helped unmask
    (``unmasked``: the :func:`release_fields` it recorded before it signed the survivors) as
    this site knows it: every planned release over the survivors it signed. Both count (an
    aborted round's statement names only what the coordinator says it decoded, a coordinator
    may log none, and a round id stated twice is two sums; the same sum twice counts once,
    :func:`afl.core.audit.history.history_releases`). Also the ids of those rounds the log has
    no release of."""
    logged = {f.get("round_id") for kind, f in statements if kind == "release"}
    merged: list[tuple[str, Mapping[str, Any]]] = [
        *statements,
        *(("release", f) for f in unmasked),
    ]
    return merged, sorted({str(f["round_id"]) for f in unmasked} - logged)


def whole_history_problem(
    plan: cpb.ReleasePlan,
    *,
    rounds: Sequence[ReleasedRound],
    min_cohort: int,
    known: Sequence[ReleasedRound] | None = None,
    signed: Sequence[ReleasedRound] | None = None,
    survivors: Collection[str] | None = None,
) -> tuple[str, dict[str, object] | None]:
    """Why this site refuses ``plan`` given every released round of the log ("" when nothing
    new is exposed), and the audit's detail (None without a history): the plan's releases over
    its participants, differenced with every earlier release over its survivors, must not
    determine any site's statistics nor the sum of a group smaller than ``min_cohort``.
    ``known``: the rounds whose exposures count as known before the plan (default: all of
    ``rounds``); ``signed``: the rounds some site signed (default: ``known``). A site
    passes as ``known`` only the rounds no single party's word makes (M-233: its own unmasked
    rounds, releases every survivor signed an opening of) and as ``signed`` those and every
    other verified opening; the coordinator's statements count as releases only
    (:func:`afl.core.audit.history.history_exposures`), so a false one, the coordinator's or
    one site's, can only make the audit stricter. ``survivors``: the sites the plan's sums will
    actually hold (a masked round's survivor list, M-206): each release over its members among
    them, the participants cut likewise."""
    if any(r.round_id == plan.round_id for r in rounds):
        return (
            f"the federation log already holds a release of round {plan.round_id}: a round id "
            f"is planned once ({RULE})",
            None,
        )
    history = history_releases(rounds)
    if not history:
        return "", None
    releases, sites = audit_view(list(plan.releases)), list(plan.participants)
    if survivors is not None:
        alive = set(survivors)
        releases = [replace(r, members=r.members & alive) for r in releases]
        sites = [s for s in sites if s in alive]
    report, exposed = history_exposures(
        releases,
        history=history,
        sites=sites,
        min_cohort=min_cohort,
        known_from=None if known is None else history_releases(known),
        signed=None if signed is None else history_releases(signed),
    )
    detail: dict[str, object] = {
        "rounds": len(rounds),
        "exposed": [
            {"sites": sorted(str(s) for s in e.sites), "quantity": e.quantity} for e in exposed
        ],
        "passed": not exposed,
        "method": report.method,
    }
    if not exposed:
        return "", detail
    return history_refusal(exposed, round_id=plan.round_id, rule=RULE), detail


def logged_release_problem(
    plan: cpb.ReleasePlan,
    statements: Iterable[tuple[str, Mapping[str, Any]]],
    *,
    survivors: Collection[str] | None,
) -> str:
    """Why the log's `release` statement of this site's published round misstates it ("" when
    it does not; docs/protocol.md M-230). Every other site's whole-history audit reads the
    statement, and only the round's members can check it: it must exist, list exactly the
    plan's releases (name, kind, classes, planned members), and name as survivors sites of the
    plan only, and, when this site learned them (MASK: the survivor list it signed in the
    consistency check), exactly those."""
    found = [
        f
        for kind, f in statements
        if kind == "release" and f.get("round_id") == plan.round_id and f.get("published", True)
    ]
    if not found:
        return f"the federation log holds no release statement of round {plan.round_id}"
    fields = found[-1]
    docs = fields.get("releases")
    logged = {
        str(d.get("name")): d
        for d in (docs if isinstance(docs, list) else [])
        if isinstance(d, Mapping)
    }
    planned = {r.name: r for r in plan.releases}
    if set(logged) != set(planned):
        return (
            f"the federation log's release statement of round {plan.round_id} names releases "
            f"{sorted(logged)}, the signed plan {sorted(planned)}"
        )
    for name, r in planned.items():
        d = logged[name]
        stated = (d.get("kind"), d.get("classes"), sorted(d.get("members") or []))
        signed = (cpb.StatisticKind.Name(r.kind), list(r.class_names), sorted(r.member_site_ids))
        if stated != signed:
            return (
                f"the federation log states release {name} of round {plan.round_id} as "
                f"{stated}, the signed plan as {signed}"
            )
    logged_survivors = set(_strings(fields.get("survivors"), f"the survivors of {plan.round_id}"))
    if not logged_survivors <= set(plan.participants):
        extra = sorted(logged_survivors - set(plan.participants))
        return (
            f"the federation log names {extra} as survivors of round {plan.round_id}, which "
            "its signed plan does not have"
        )
    if survivors is not None and logged_survivors != set(survivors):
        return (
            f"the federation log names survivors {sorted(logged_survivors)} for round "
            f"{plan.round_id}; this site signed {sorted(survivors)} in its consistency check"
        )
    return ""
