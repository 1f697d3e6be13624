"""Leakage audit of a release plan: which sites' data do linear combinations of the sums expose.

See docs/protocol.md §6. Secure aggregation hides the individual inputs of one sum, but the server
learns every released sum. Releases of the SAME quantity (e.g. every Gram-matrix sum) can be added
and subtracted: with the releases-by-sites 0/1 incidence matrix ``A`` (R x K), the server learns
``x·A`` for every rational row vector ``x``. Hence (Chin & Ozsoyoglu 1982; Denning et al. 1979):

* site k is *exposed* iff ``e_k ∈ rowspace(A)``;
* a group S of sites has a *determined sum* iff ``1_S ∈ rowspace(A)``.

Method: exact rational Gaussian elimination (:class:`fractions.Fraction`) into reduced row-echelon
form, keeping for every basis row its combination of the original releases. Reducing a vector
``v`` against the basis leaves a residual; ``v`` is in the row space iff the residual is zero, and
the accumulated coefficients are then a *certificate* ``x`` with ``x·A = v`` that anyone can check.
Reduction is linear, so the residual of ``1_S`` is the sum of the singleton residuals: groups are
tested by summing precomputed residuals (a float prefilter, then the exact check).

Group search: every group of 2 .. ``min_cohort - 1`` sites is enumerated when the number of such
groups is at most ``max_group_candidates`` (default 200,000: e.g. K = 64 with min cohort 3, or
K = 20 with min cohort 5). Beyond that budget only singletons (always exact, any K) and releases
smaller than the min cohort are reported and the report says the group search was skipped.
Only *minimal* groups are reported (no non-empty proper subset is itself determined).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Literal

import numpy as np
from numpy.typing import NDArray

SiteId = int | str
GramScope = Literal["per-class", "global"]

DEFAULT_MIN_COHORT = 3
DEFAULT_MAX_GROUP_CANDIDATES = 200_000


class ReleasePlanError(ValueError):
    """A release plan or coverage specification is malformed."""


@dataclass(frozen=True)
class Release:
    """One aggregate the server learns: ``name``, its contributing sites and its quantity.

    Releases with the same ``quantity`` can be linearly combined (they sum the same statistic);
    releases of different quantities (Gram vs. one class's b) cannot.
    """

    name: str
    members: frozenset[SiteId]
    quantity: str = "sum"


@dataclass(frozen=True)
class Exposure:
    """A site or group whose contribution to ``quantity`` is determined by the releases.

    ``certificate`` lists (release name, coefficient): ``Σ coefficient · 1_{members}`` equals the
    indicator vector of ``sites`` exactly.
    """

    quantity: str
    sites: frozenset[SiteId]
    certificate: tuple[tuple[str, Fraction], ...]


@dataclass(frozen=True)
class LeakageReport:
    """Result of :func:`audit_releases` (docs/protocol.md §6)."""

    sites: tuple[SiteId, ...]
    releases: tuple[Release, ...]
    min_cohort: int
    exposed_sites: tuple[Exposure, ...]
    small_groups: tuple[Exposure, ...]
    small_releases: tuple[Release, ...]
    group_search_exhaustive: bool
    method: str

    @property
    def passed(self) -> bool:
        """True iff nothing is exposed, no small group is determined and no release is small."""
        return not (self.exposed_sites or self.small_groups or self.small_releases)

    def to_dict(self) -> dict[str, object]:
        """JSON-serialisable summary (for audit logs); coefficients as exact fraction strings."""

        def exposure(e: Exposure) -> dict[str, object]:
            return {
                "quantity": e.quantity,
                "sites": [s for s in self.sites if s in e.sites],
                "certificate": {name: str(c) for name, c in e.certificate},
            }

        return {
            "passed": self.passed,
            "min_cohort": self.min_cohort,
            "method": self.method,
            "group_search_exhaustive": self.group_search_exhaustive,
            "sites": list(self.sites),
            "releases": [
                {
                    "name": r.name,
                    "quantity": r.quantity,
                    "members": [s for s in self.sites if s in r.members],
                }
                for r in self.releases
            ],
            "exposed_sites": [exposure(e) for e in self.exposed_sites],
            "small_groups": [exposure(e) for e in self.small_groups],
            "small_releases": [r.name for r in self.small_releases],
        }

    def exposed_site_ids(self, quantity: str | None = None) -> frozenset[SiteId]:
        """Sites exposed for ``quantity`` (any quantity when None)."""
        return frozenset(
            site
            for exp in self.exposed_sites
            if quantity is None or exp.quantity == quantity
            for site in exp.sites
        )


class _RowSpace:
    """Exact RREF of a 0/1 incidence matrix, with each basis row's combination of releases."""

    def __init__(self, rows: Sequence[Sequence[int]], n_cols: int) -> None:
        self.n_cols = n_cols
        self.n_rows = len(rows)
        basis: list[tuple[int, list[Fraction], list[Fraction]]] = []  # (pivot, row, combination)
        for i, raw in enumerate(rows):
            vec = [Fraction(v) for v in raw]
            combo = [Fraction(0)] * self.n_rows
            combo[i] = Fraction(1)
            for pivot, brow, bcombo in basis:
                f = vec[pivot]
                if f:
                    vec = [a - f * b for a, b in zip(vec, brow, strict=True)]
                    combo = [a - f * b for a, b in zip(combo, bcombo, strict=True)]
            pivot = next((j for j, v in enumerate(vec) if v), -1)
            if pivot < 0:
                continue
            scale = vec[pivot]
            vec = [v / scale for v in vec]
            combo = [c / scale for c in combo]
            new_basis = []
            for bp, brow, bcombo in basis:  # keep the form fully reduced
                f = brow[pivot]
                if f:
                    brow = [a - f * b for a, b in zip(brow, vec, strict=True)]
                    bcombo = [a - f * b for a, b in zip(bcombo, combo, strict=True)]
                new_basis.append((bp, brow, bcombo))
            new_basis.append((pivot, vec, combo))
            basis = sorted(new_basis, key=lambda t: t[0])
        self.basis = basis

    @property
    def rank(self) -> int:
        return len(self.basis)

    def reduce(self, vec: Sequence[Fraction]) -> tuple[list[Fraction], list[Fraction]]:
        """Return (residual, coefficients) with ``vec = coefficients·A + residual``."""
        residual = list(vec)
        coeffs = [Fraction(0)] * self.n_rows
        for pivot, brow, bcombo in self.basis:
            f = residual[pivot]
            if f:
                residual = [a - f * b for a, b in zip(residual, brow, strict=True)]
                coeffs = [a + f * b for a, b in zip(coeffs, bcombo, strict=True)]
        return residual, coeffs


def _vsum(vectors: Iterable[Sequence[Fraction]]) -> list[Fraction]:
    """Exact elementwise sum of equal-length vectors."""
    total: list[Fraction] | None = None
    for v in vectors:
        total = list(v) if total is None else [a + b for a, b in zip(total, v, strict=True)]
    return [] if total is None else total


def _certificate(
    names: Sequence[str], coeffs: Sequence[Fraction]
) -> tuple[tuple[str, Fraction], ...]:
    return tuple((n, c) for n, c in zip(names, coeffs, strict=True) if c)


def _validate(releases: Sequence[Release], sites: Sequence[SiteId], min_cohort: int) -> None:
    if len(set(sites)) != len(sites):
        raise ReleasePlanError("the site universe lists a site twice")
    if min_cohort < 1:
        raise ReleasePlanError(f"min_cohort must be >= 1, got {min_cohort}")
    universe = set(sites)
    names = [r.name for r in releases]
    if len(set(names)) != len(names):
        raise ReleasePlanError("release names must be unique")
    for r in releases:
        unknown = set(r.members) - universe
        if unknown:
            raise ReleasePlanError(
                f"release {r.name!r} names sites outside the universe: {unknown}"
            )


#: A determined set of sites and its coefficient per release (in the order of the releases).
_Found = tuple[frozenset[SiteId], tuple[Fraction, ...]]


def _audit_quantity(
    releases: Sequence[Release],
    sites: Sequence[SiteId],
    min_cohort: int,
    enumerate_groups: bool,
) -> tuple[list[_Found], list[_Found]]:
    """(exposed sites, minimal small groups) of one quantity's releases. The result depends only
    on the releases' member sets (in order), ``sites`` and the search settings, not on the
    quantity's or the releases' names (:func:`audit_releases` labels it)."""
    index = {s: j for j, s in enumerate(sites)}
    k = len(sites)
    rows = []
    for r in releases:
        row = [0] * k
        for s in r.members:
            row[index[s]] = 1
        rows.append(row)
    space = _RowSpace(rows, k)
    # e_j reduces to itself with zero coefficients unless j is a pivot column (reduce subtracts a
    # basis row only where the vector has an entry at its pivot): only pivots need the exact
    # reduction, so K sites cost O(rank·K) rationals instead of O(K²).
    pivots = {pivot for pivot, _, _ in space.basis}
    residuals: dict[int, tuple[Fraction, ...]] = {}
    coeffs: dict[int, list[Fraction]] = {}
    approx = np.eye(k)
    exposed: list[_Found] = []
    for j, site in enumerate(sites):
        if j not in pivots:
            continue
        e = [Fraction(0)] * k
        e[j] = Fraction(1)
        res, co = space.reduce(e)
        residuals[j], coeffs[j] = tuple(res), co
        approx[j] = [float(x) for x in res]
        if not any(res):
            exposed.append((frozenset([site]), tuple(co)))
    groups: list[_Found] = []
    if not enumerate_groups:
        return exposed, groups

    def residual(j: int) -> tuple[Fraction, ...]:
        return residuals.get(j) or tuple(Fraction(int(i == j)) for i in range(k))

    no_coeffs = [Fraction(0)] * len(releases)
    determined: list[frozenset[int]] = [frozenset([j]) for j in residuals if not any(residuals[j])]
    # Float prefilter (cheap), then the exact rational check on the few candidates left.
    tol = 1e-9 * max(1.0, float(np.abs(approx).max(initial=0.0)))
    for size in range(2, min_cohort):
        for combo in _near_zero_sums(approx, size, tol, others=sorted(pivots)):
            if any(_vsum(residual(j) for j in combo)):
                continue
            members = frozenset(combo)
            if any(d < members for d in determined):
                continue
            determined.append(members)
            co = _vsum(coeffs.get(j, no_coeffs) for j in combo)
            groups.append((frozenset(sites[j] for j in combo), tuple(co)))
    return exposed, groups


def _near_zero_sums(
    approx: NDArray[np.float64], size: int, tol: float, *, others: Sequence[int]
) -> Iterator[tuple[int, ...]]:
    """Index tuples i_1 < … < i_size (in lexicographic order) whose rows of ``approx`` sum to
    within ``tol`` of zero in max norm: the float prefilter of the group search, vectorised over
    the last index. Every row outside the sorted ``others`` is a unit vector e_i, so a sum of such
    rows alone has max norm 1 and (with tol < 1) never passes: after a prefix of unit rows only
    the ``others`` are tried as the last index (K sites, r others: O(K·r) passes of K, not K²)."""
    k = approx.shape[0]
    rest = np.asarray(others, dtype=np.int64)
    special = set(others)
    for prefix in itertools.combinations(range(k), size - 1):
        start = prefix[-1] + 1
        if start >= k:
            continue
        partial = approx[list(prefix)].sum(axis=0)
        last = np.arange(start, k)
        if tol < 1 and not special.intersection(prefix):
            last = rest[rest >= start]
        worst = np.abs(approx[last] + partial).max(axis=1)
        for j in last[worst <= tol]:
            yield (*prefix, int(j))


def audit_releases(
    releases: Sequence[Release],
    sites: Sequence[SiteId],
    *,
    min_cohort: int = DEFAULT_MIN_COHORT,
    max_group_candidates: int = DEFAULT_MAX_GROUP_CANDIDATES,
) -> LeakageReport:
    """Audit a release plan (docs/protocol.md §6): exposed sites, small groups, small releases.

    Each quantity is analysed separately (row-space test on its incidence matrix, see the module
    docstring). Raises :class:`ReleasePlanError` on malformed input.

    The report is a function of the (immutable) inputs alone and is remembered for the last
    :data:`AUDIT_CACHE_SIZE` distinct ones in this process: the many sites a host process runs
    audit the same plan over the same history, each with every participant in the universe.
    """
    key = (tuple(releases), tuple(sites), min_cohort, max_group_candidates)
    try:
        hash(key)
    except TypeError:  # members that are not a frozenset: audited (and refused) uncached
        return _audit(*key)
    return _audit_cached(*key)


#: Distinct audits remembered per process (:func:`audit_releases`).
AUDIT_CACHE_SIZE = 64


def _audit(
    releases: tuple[Release, ...],
    sites: tuple[SiteId, ...],
    min_cohort: int,
    max_group_candidates: int,
) -> LeakageReport:
    _validate(releases, sites, min_cohort)
    n_candidates = sum(math.comb(len(sites), s) for s in range(2, min_cohort))
    exhaustive = n_candidates <= max_group_candidates
    quantities: dict[str, list[Release]] = {}
    for r in releases:
        quantities.setdefault(r.quantity, []).append(r)
    exposed: list[Exposure] = []
    groups: list[Exposure] = []
    # Quantities whose releases have the same member sets (e.g. every class vector of a plan with
    # a global Gram) have the same row space: it is analysed once.
    found: dict[tuple[frozenset[SiteId], ...], tuple[list[_Found], list[_Found]]] = {}
    for quantity, rels in quantities.items():
        shape = tuple(frozenset(r.members) for r in rels)
        if shape not in found:
            found[shape] = _audit_quantity(rels, sites, min_cohort, exhaustive)
        names = [r.name for r in rels]
        e, g = found[shape]
        exposed.extend(Exposure(quantity, who, _certificate(names, co)) for who, co in e)
        groups.extend(Exposure(quantity, who, _certificate(names, co)) for who, co in g)
    small = tuple(r for r in releases if len(r.members) < min_cohort)
    if min_cohort <= 2:
        method = "exact rational row-space test; no groups below the minimum cohort besides sites"
    elif exhaustive:
        method = (
            f"exact rational row-space test; all {n_candidates} groups of 2..{min_cohort - 1} "
            "sites searched"
        )
    else:
        method = (
            f"exact rational row-space test for single sites; group search skipped "
            f"({n_candidates} candidate groups > budget {max_group_candidates}): only single "
            "sites and small releases are checked"
        )
    return LeakageReport(
        sites=tuple(sites),
        releases=tuple(releases),
        min_cohort=min_cohort,
        exposed_sites=tuple(exposed),
        small_groups=tuple(groups),
        small_releases=small,
        group_search_exhaustive=exhaustive,
        method=method,
    )


_audit_cached = functools.lru_cache(maxsize=AUDIT_CACHE_SIZE)(_audit)


def _set_label(members: Collection[SiteId], sites: Sequence[SiteId]) -> str:
    return "{" + ",".join(str(s) for s in sites if s in members) + "}"


def releases_for_round(
    *,
    coverage: Mapping[str, Collection[SiteId]],
    participants: Sequence[SiteId],
    gram_scope: GramScope,
) -> list[Release]:
    """Build the release list of one analytic round from a coverage spec (docs/protocol.md §6).

    ``coverage`` maps each class to the participants that label it. ``per-class`` (paper eq. 13-15)
    releases one Gram sum per distinct coverage set and one b sum per class over S_c; ``global``
    releases one Gram sum over all participants and every b_c over all participants
    (non-labellers send zeros).
    """
    universe = set(participants)
    if len(universe) != len(participants):
        raise ReleasePlanError("participants lists a site twice")
    for cls, members in coverage.items():
        if not members:
            raise ReleasePlanError(f"class {cls!r} is labelled by no participant")
        unknown = set(members) - universe
        if unknown:
            raise ReleasePlanError(f"class {cls!r} is labelled by non-participants: {unknown}")
    everyone = frozenset(participants)
    if gram_scope == "global":
        out = [Release("gram[all]", everyone, "gram")]
        out += [Release(f"b[{cls}]", everyone, f"b[{cls}]") for cls in coverage]
        return out
    if gram_scope != "per-class":
        raise ReleasePlanError(f"unknown gram_scope {gram_scope!r}; use 'per-class' or 'global'")
    gram_sets: dict[frozenset[SiteId], list[str]] = {}
    for cls, members in coverage.items():
        gram_sets.setdefault(frozenset(members), []).append(cls)
    out = [
        Release(f"gram{_set_label(members, participants)}", members, "gram")
        for members in gram_sets
    ]
    out += [Release(f"b[{cls}]", frozenset(m), f"b[{cls}]") for cls, m in coverage.items()]
    return out


def format_report(report: LeakageReport) -> str:
    """Plain-text report for compliance reviewers."""
    sites = report.sites
    lines = [
        f"Leakage audit: {len(sites)} sites, {len(report.releases)} releases, "
        f"minimum cohort {report.min_cohort}",
        f"Method: {report.method}",
        f"Verdict: {'PASS' if report.passed else 'FAIL'}",
        "",
        "Releases:",
    ]
    width = max([len("name"), *(len(r.name) for r in report.releases)])
    lines.append(f"  {'name':<{width}}  {'quantity':<16} {'size':>4}  members")
    for r in report.releases:
        flag = "  < min cohort" if r in report.small_releases else ""
        lines.append(
            f"  {r.name:<{width}}  {r.quantity:<16} {len(r.members):>4}  "
            f"{_set_label(r.members, sites)}{flag}"
        )

    def section(title: str, items: Sequence[Exposure]) -> None:
        lines.append("")
        lines.append(f"{title}: {len(items) if items else 'none'}")
        for exp in items:
            cert = " ".join(f"{'+' if c > 0 else '-'}{abs(c)}*{n}" for n, c in exp.certificate)
            lines.append(f"  {exp.quantity:<16} {_set_label(exp.sites, sites):<12} = {cert}")

    section("Sites exposed individually (per quantity)", report.exposed_sites)
    section(f"Groups smaller than {report.min_cohort} with a determined sum", report.small_groups)
    if not report.group_search_exhaustive:
        lines.append("  (group search skipped: too many candidate groups; see method)")
    return "\n".join(lines) + "\n"
