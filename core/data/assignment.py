"""Task heterogeneity: which site labels which class (docs/method.md §2, paper §IV "Missing m").

An assignment is a boolean ``active`` matrix of shape (K sites, C classes): ``active[k, c]``
is true iff site k annotates class c; the labels of inactive classes are structurally absent.

Missing-m generation (the paper's protocol): each site labels ``C - m`` classes drawn uniformly
at random without replacement, and the whole draw is repeated until every class is labelled by
at least one site (rejection sampling: the result is uniform over all valid assignments). With
``K == C`` and ``m == C - 1`` the paper fixes "Missing 7 = client i labels class i": the identity.

A coverage spec file fixes the assignment by hand. Schema (JSON, or TOML with the same keys)::

    {"classes": ["Atelectasis", "Cardiomegaly", ...],
     "sites":   ["hospital-a", "hospital-b", ...],
     "labels":  {"hospital-a": ["Atelectasis"], "hospital-b": ["Cardiomegaly", ...], ...}}

Every site must appear in ``labels`` (an empty list is allowed: the site then contributes
features but no labels); every class must be labelled by at least one site.
"""

from __future__ import annotations

import json
import os
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

_DRAW_BATCH = 256
MAX_DRAWS = 200_000


class AssignmentError(ValueError):
    """An assignment cannot be generated, or a coverage spec is invalid."""


def missing_m_assignment(
    *, num_clients: int = 8, num_classes: int = 8, missing: int, seed: int
) -> NDArray[np.bool_]:
    """Draw a Missing-m assignment: (K, C) mask, ``C - m`` classes per site, every class covered.

    Deterministic for a given seed (``numpy.random.default_rng(seed)``; this is experimental
    protocol randomness, not a secret). Raises :class:`AssignmentError` when infeasible
    (``K (C - m) < C``) or when no valid draw is found within ``MAX_DRAWS`` tries.
    """
    k, c, m = num_clients, num_classes, missing
    if k < 1 or c < 1:
        raise AssignmentError(f"need at least one site and one class (K={k}, C={c})")
    if not 0 <= m < c:
        raise AssignmentError(
            f"missing must be in [0, {c - 1}] so that each site labels >= 1 class"
        )
    per_site = c - m
    if k * per_site < c:
        raise AssignmentError(
            f"infeasible: {k} sites x {per_site} classes each = {k * per_site} < {c} classes, "
            "so some class would have no labeller"
        )
    if per_site == 1 and k == c:
        return np.eye(k, dtype=np.bool_)  # the paper's Missing 7: client i labels class i
    rng = np.random.default_rng(seed)
    for _ in range(0, MAX_DRAWS, _DRAW_BATCH):
        # Each row of each draw: a uniform random (C - m)-subset (first entries of a permutation).
        order = np.argsort(rng.random((_DRAW_BATCH, k, c)), axis=-1)[..., :per_site]
        masks = np.zeros((_DRAW_BATCH, k, c), dtype=np.bool_)
        np.put_along_axis(masks, order, True, axis=-1)
        covered = masks.any(axis=1).all(axis=-1)
        if covered.any():
            chosen: NDArray[np.bool_] = masks[int(np.argmax(covered))]
            return chosen
    raise AssignmentError(
        f"no assignment covering all {c} classes found in {MAX_DRAWS} draws "
        f"(K={k}, C={c}, missing={m}); give the coverage explicitly with a coverage spec file"
    )


@dataclass(frozen=True)
class CoverageSpec:
    """A hand-written assignment: ``active[k, c]`` iff ``sites[k]`` labels ``classes[c]``."""

    classes: tuple[str, ...]
    sites: tuple[str, ...]
    active: NDArray[np.bool_]

    def classes_of(self, site: str) -> tuple[str, ...]:
        k = self.sites.index(site)
        return tuple(c for c, on in zip(self.classes, self.active[k], strict=True) if on)


def _str_list(raw: Any, what: str) -> tuple[str, ...]:
    if not isinstance(raw, list) or not all(isinstance(x, str) and x for x in raw):
        raise AssignmentError(f"{what} must be a list of non-empty strings")
    if len(set(raw)) != len(raw):
        raise AssignmentError(f"{what} has duplicates: {raw}")
    return tuple(raw)


def coverage_from_mapping(raw: Any) -> CoverageSpec:
    """Validate a parsed coverage spec (see the module docstring for the schema)."""
    if not isinstance(raw, dict):
        raise AssignmentError("a coverage spec must be a mapping with classes, sites, labels")
    extra = set(raw) - {"classes", "sites", "labels"}
    if extra or not {"classes", "sites", "labels"} <= set(raw):
        raise AssignmentError(
            f"a coverage spec has exactly the keys classes, sites, labels (got {sorted(raw)})"
        )
    classes = _str_list(raw["classes"], "classes")
    sites = _str_list(raw["sites"], "sites")
    if not classes or not sites:
        raise AssignmentError("a coverage spec needs at least one class and one site")
    labels = raw["labels"]
    if not isinstance(labels, dict):
        raise AssignmentError("labels must map each site to a list of classes")
    unknown_sites = sorted(set(labels) - set(sites))
    if unknown_sites:
        raise AssignmentError(f"labels names unknown sites {unknown_sites}; sites: {list(sites)}")
    missing_sites = [s for s in sites if s not in labels]
    if missing_sites:
        raise AssignmentError(f"sites {missing_sites} have no labels entry (use [] for none)")
    active = np.zeros((len(sites), len(classes)), dtype=np.bool_)
    for k, site in enumerate(sites):
        site_classes = _str_list(labels[site], f"labels[{site!r}]")
        bad = sorted(set(site_classes) - set(classes))
        if bad:
            raise AssignmentError(f"site {site!r} labels unknown classes {bad}")
        for name in site_classes:
            active[k, classes.index(name)] = True
    orphans = [name for j, name in enumerate(classes) if not active[:, j].any()]
    if orphans:
        raise AssignmentError(f"classes {orphans} are labelled by no site")
    return CoverageSpec(classes, sites, active)


def read_spec_file(path: str | os.PathLike[str]) -> Any:
    """Parse a ``.toml`` file, or JSON otherwise (coverage specs and audit inputs)."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise AssignmentError(f"cannot read coverage spec {p}: {exc}") from exc
    try:
        return tomllib.loads(text) if p.suffix.lower() == ".toml" else json.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
        raise AssignmentError(f"{p}: not valid {p.suffix.lstrip('.') or 'JSON'}: {exc}") from exc


def load_coverage_spec(path: str | os.PathLike[str]) -> CoverageSpec:
    """Read a coverage spec from a ``.toml`` file, or JSON otherwise."""
    p = Path(path)
    raw = read_spec_file(p)
    try:
        return coverage_from_mapping(raw)
    except AssignmentError as exc:
        raise AssignmentError(f"{p}: {exc}") from exc


def format_assignment(
    active: NDArray[np.bool_], classes: Sequence[str], site_names: Sequence[str]
) -> str:
    """A small text table: one row per class, one column per site, ``x`` = labelled."""
    mask = np.asarray(active, dtype=np.bool_)
    if mask.shape != (len(site_names), len(classes)):
        raise AssignmentError(
            f"active has shape {mask.shape}, expected ({len(site_names)}, {len(classes)})"
        )
    name_w = max(len("class"), *(len(c) for c in classes))
    widths = [max(3, len(s)) for s in site_names]
    header = " ".join(
        [
            "class".ljust(name_w),
            *(s.rjust(w) for s, w in zip(site_names, widths, strict=True)),
            "#sites",
        ]
    )
    lines = [header]
    for c, name in enumerate(classes):
        cells = ["x" if mask[k, c] else "." for k in range(len(site_names))]
        marks = (cell.rjust(w) for cell, w in zip(cells, widths, strict=True))
        lines.append(" ".join([name.ljust(name_w), *marks, str(int(mask[:, c].sum())).rjust(6)]))
    per_site = (str(int(n)).rjust(w) for n, w in zip(mask.sum(axis=1), widths, strict=True))
    lines.append(" ".join(["#classes".ljust(name_w), *per_site]))
    return "\n".join(lines)
