"""The `afl` command. Each subcommand lives in a module exposing ``add_arguments`` and ``run``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from types import ModuleType

from afl.core.about import afl_version
from afl.core.aggregation import AggregationError
from afl.core.data.assignment import AssignmentError
from afl.core.data.featurecache import FeatureCacheError
from afl.core.data.nih import NihMetadataError
from afl.core.labels import LabelError
from afl.lab.bench import cmd as bench_cmd
from afl.lab.demo import cmd as demo
from afl.lab.report import cmd as report_cmd
from afl.lab.simulate import cmd as simulate_cmd
from afl.ops import admin as admin_cmd
from afl.ops import audit as audit_cmd
from afl.ops import ca as ca_cmd
from afl.ops import export as export_cmd
from afl.ops import provision as provision_cmd
from afl.ops import verify_log_cmd

# Errors caused by what the user gave us: one clear line, exit status 2, no traceback.
USER_ERRORS: tuple[type[Exception], ...] = (
    AggregationError,
    AssignmentError,
    FeatureCacheError,
    LabelError,
    NihMetadataError,
    FileNotFoundError,
)

COMMANDS: tuple[tuple[str, str, ModuleType], ...] = (
    ("simulate", "run the paper's experiment grid in process (no network)", simulate_cmd),
    ("demo", "a full federation on the embedded default (what `make demo` runs)", demo),
    (
        "provision",
        "DEMO/TESTS ONLY: a whole federation in one folder, every site's private keys "
        "generated here (production: `afl ca` and `afl-client init`)",
        provision_cmd,
    ),
    (
        "ca",
        "production provisioning, operator's side: the CA, the coordinator's keys, signing "
        "the sites' requests (private keys stay where they are made)",
        ca_cmd,
    ),
    (
        "admin",
        "the runs of a federation: submit, ls, status, abort, logs, download-model",
        admin_cmd,
    ),
    (
        "export",
        "a published model as TorchScript + ONNX + model card (site or coordinator)",
        export_cmd,
    ),
    ("verify-log", "check the hash chain of afl-server's audit log", verify_log_cmd),
    (
        "report",
        "a self-contained HTML report: `afl simulate` results, or an `afl export` folder",
        report_cmd,
    ),
    ("bench", "benchmark suites (JSON output; see docs/benchmarks.md)", bench_cmd),
    ("audit", "leakage audit of a coverage spec's release plan, for compliance review", audit_cmd),
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="afl",
        description="Analytic federated learning with secure aggregation (see README.md).",
    )
    parser.add_argument("--version", action="version", version=f"afl {afl_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, help_text, module in COMMANDS:
        p = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(p)
        p.set_defaults(func=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code: int = args.func(args)
    except USER_ERRORS as exc:
        print(f"afl {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return code


if __name__ == "__main__":
    sys.exit(main())
