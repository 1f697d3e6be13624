"""Command line of `afl audit`: the leakage audit of a coverage spec (docs/protocol.md §6).

    afl audit --coverage FILE [--gram-scope per-class|global] [--min-cohort 3] [--json]

FILE (JSON, or TOML by suffix) is either
``{"sites": [...], "classes": {"Atelectasis": [site, ...], ...}}`` (class -> labelling sites) or
the simulate coverage format ``{"classes": [...], "sites": [...], "labels": {site: [class]}}``.
Exit status: 0 when the plan passes, 1 when it fails, 2 on an invalid spec.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from afl.core.data.assignment import AssignmentError, coverage_from_mapping, read_spec_file
from afl.core.leakage import (
    DEFAULT_MIN_COHORT,
    ReleasePlanError,
    SiteId,
    audit_releases,
    format_report,
    releases_for_round,
)


class CoverageFileError(ValueError):
    """The coverage file cannot be read or has the wrong shape."""


def _site_list(raw: Any) -> list[SiteId]:
    if not isinstance(raw, list) or not raw:
        raise CoverageFileError("'sites' must be a non-empty list of site names or numbers")
    for s in raw:
        if isinstance(s, bool) or not isinstance(s, int | str):
            raise CoverageFileError(f"site {s!r} is neither a name nor an integer")
    return list(raw)


def parse_coverage(raw: Any) -> tuple[list[SiteId], dict[str, list[SiteId]]]:
    """Return (sites, class -> labelling sites) from either accepted format."""
    if not isinstance(raw, dict) or "sites" not in raw or "classes" not in raw:
        raise CoverageFileError("a coverage file needs the keys 'sites' and 'classes'")
    sites = _site_list(raw["sites"])
    if "labels" in raw:
        try:
            spec = coverage_from_mapping(raw)
        except AssignmentError as exc:
            raise CoverageFileError(str(exc)) from exc
        coverage: dict[str, list[SiteId]] = {
            cls: [s for k, s in enumerate(spec.sites) if spec.active[k, c]]
            for c, cls in enumerate(spec.classes)
        }
        return list(spec.sites), coverage
    classes = raw["classes"]
    if not isinstance(classes, dict) or not classes:
        raise CoverageFileError("'classes' must map each class name to its labelling sites")
    coverage = {}
    for cls, members in classes.items():
        if not isinstance(members, list):
            raise CoverageFileError(f"classes[{cls!r}] must be a list of sites")
        coverage[str(cls)] = _site_list(members) if members else []
    return sites, coverage


def load_coverage(path: str | Path) -> tuple[list[SiteId], dict[str, list[SiteId]]]:
    """Read and parse a coverage file (JSON, or TOML for a ``.toml`` suffix)."""
    p = Path(path)
    try:
        raw = read_spec_file(p)
    except AssignmentError as exc:
        raise CoverageFileError(str(exc)) from exc
    try:
        return parse_coverage(raw)
    except CoverageFileError as exc:
        raise CoverageFileError(f"{p}: {exc}") from exc


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `afl audit`."""
    parser.add_argument("--coverage", required=True, metavar="FILE", help="coverage spec (JSON)")
    parser.add_argument(
        "--gram-scope",
        choices=("per-class", "global"),
        default="global",
        help="release plan to audit (default: global, the hardened default)",
    )
    parser.add_argument(
        "--min-cohort",
        type=int,
        default=DEFAULT_MIN_COHORT,
        help=f"smallest group whose sum may be learnt (default {DEFAULT_MIN_COHORT})",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def run(args: argparse.Namespace) -> int:
    """Print the leakage report; 0 = pass, 1 = fail, 2 = invalid input."""
    try:
        sites, coverage = load_coverage(args.coverage)
        releases = releases_for_round(
            coverage=coverage, participants=sites, gram_scope=args.gram_scope
        )
        report = audit_releases(releases, sites, min_cohort=args.min_cohort)
    except (CoverageFileError, ReleasePlanError) as exc:
        print(f"afl audit: {exc}", file=sys.stderr)
        return 2
    if args.json:
        doc = {"coverage": str(args.coverage), "gram_scope": args.gram_scope, **report.to_dict()}
        print(json.dumps(doc, indent=2))
    else:
        print(f"Coverage: {args.coverage}   gram_scope: {args.gram_scope}")
        print(format_report(report), end="")
    return 0 if report.passed else 1
