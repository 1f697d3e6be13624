"""Command-line front end of `afl report RESULTS.json|EXPORT_DIR [--out report.html]`: the
simulation report of an `afl simulate` results JSON (:mod:`afl.lab.report.simulation`), or the deployed-round
view of an `afl export` folder (:mod:`afl.lab.report.deployed`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from afl.core.progress import Progress

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of `afl report`."""
    p.add_argument(
        "results",
        metavar="RESULTS.json|EXPORT_DIR",
        help="`afl simulate --out` or --save-dir JSON, or an `afl export` folder (the "
        "deployed-round view: model card, evaluation, calibration)",
    )
    p.add_argument(
        "--out",
        metavar="FILE",
        help="HTML file to write (default: RESULTS.html, or EXPORT_DIR.report.html beside the "
        "export folder, which stays as `afl export` wrote and checksummed it)",
    )
    p.add_argument("--title", help="report title")


def run(args: argparse.Namespace) -> int:
    """Render the report; exit status 2 with one line when the input is not a results JSON."""
    # Imported here: they need matplotlib (the `lab` extra), which the `afl` command of a
    # coordinator image (`afl admin`, `afl verify-log`) does not have.
    from afl.lab.report.deployed import is_export_folder, write_deployed_report
    from afl.lab.report.simulation import ReportError, write_report

    results = Path(args.results)
    deployed = is_export_folder(results)
    if args.out:
        out = Path(args.out)
    elif deployed:
        folder = results if results.is_dir() else results.parent
        out = folder.with_name(folder.name + ".report.html")
    else:
        out = results.with_suffix(".html")
    Progress("afl report")("rendering the plots and the page")
    try:
        if deployed:
            path = write_deployed_report(results, out, title=args.title)
        else:
            path = write_report(results, out, title=args.title)
    except ReportError as exc:
        print(f"afl report: error: {exc}", file=sys.stderr)
        return 2
    print(f"report written to {path}")
    return 0
