"""Command-line front end of `afl report RESULTS.json [--out report.html]`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from afl.lab.report import ReportError, write_report

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of `afl report`."""
    p.add_argument(
        "results", metavar="RESULTS.json", help="`afl simulate --out` or --save-dir JSON"
    )
    p.add_argument("--out", metavar="FILE", help="HTML file to write (default: RESULTS.html)")
    p.add_argument("--title", help="report title")


def run(args: argparse.Namespace) -> int:
    """Render the report; exit status 2 with one line when the input is not a results JSON."""
    results = Path(args.results)
    out = Path(args.out) if args.out else results.with_suffix(".html")
    try:
        path = write_report(results, out, title=args.title)
    except ReportError as exc:
        print(f"afl report: error: {exc}", file=sys.stderr)
        return 2
    print(f"report written to {path}")
    return 0
