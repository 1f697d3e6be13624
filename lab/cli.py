"""The `afl` command. Each subcommand lives in a module exposing ``add_arguments`` and ``run``.

Only the module of the subcommand given is imported (``afl --help`` and ``--version`` import
none): the operator's commands start in well under a second and run where only the coordinator's
dependencies are installed (tests/test_imports.py pins what each command loads)."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from afl.core.about import afl_version
from afl.core.aggregation import AggregationError
from afl.core.data.assignment import AssignmentError
from afl.core.data.featurecache import FeatureCacheError
from afl.core.data.nih import NihMetadataError
from afl.core.devmode import insecure_refusal
from afl.core.labels import LabelError

# Errors caused by what the user gave us: one clear line, exit status 2, no traceback.
USER_ERRORS: tuple[type[Exception], ...] = (
    AggregationError,
    AssignmentError,
    FeatureCacheError,
    LabelError,
    NihMetadataError,
    FileNotFoundError,
)

# (name, help, module): the module is imported only when its subcommand is given.
COMMANDS: tuple[tuple[str, str, str], ...] = (
    ("simulate", "run the paper's experiment grid in process (no network)", "afl.lab.simulate.cmd"),
    (
        "demo",
        "a full federation on the embedded default (what `make demo` runs)",
        "afl.lab.demo.cmd",
    ),
    (
        "provision",
        "DEMO/TESTS ONLY: a whole federation in one folder, every site's private keys "
        "generated here (production: `afl ca` and `afl-client init`)",
        "afl.ops.provision",
    ),
    (
        "ca",
        "production provisioning, operator's side: the CA, the coordinator's keys, signing "
        "the sites' requests (private keys stay where they are made)",
        "afl.ops.ca",
    ),
    (
        "admin",
        "the runs of a federation: submit, ls, status, abort, logs, download-model",
        "afl.ops.admin",
    ),
    (
        "export",
        "a published model as TorchScript + ONNX + model card (site or coordinator)",
        "afl.ops.export",
    ),
    ("verify-log", "check the hash chain of afl-server's audit log", "afl.ops.verify_log_cmd"),
    (
        "log",
        "the federation log: export, show, verify checkpoints and cosignatures, prove inclusion",
        "afl.ops.fedlog",
    ),
    (
        "audit-export",
        "an offline-verifiable audit bundle of a coordinator (who received what), or --verify one",
        "afl.ops.audit_export",
    ),
    (
        "report",
        "a self-contained HTML report: `afl simulate` results, or an `afl export` folder",
        "afl.lab.report.cmd",
    ),
    ("bench", "benchmark suites (JSON output; see docs/benchmarks.md)", "afl.lab.bench.cmd"),
    (
        "audit",
        "leakage audit of a coverage spec's release plan, for compliance review",
        "afl.ops.audit",
    ),
)


def _chosen(argv: Sequence[str]) -> str | None:
    """The subcommand named in ``argv`` (the first word that is not an option), if any."""
    names = {name for name, _, _ in COMMANDS}
    for word in argv:
        if not word.startswith("-"):
            return word if word in names else None
    return None


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The parser. Every subcommand's arguments are added when ``argv`` is None; otherwise only
    those of the subcommand ``argv`` names (the others are listed with their help alone), so
    that only its module is imported."""
    chosen = None if argv is None else _chosen(argv)
    parser = argparse.ArgumentParser(
        prog="afl",
        description="Analytic federated learning with secure aggregation (see README.md).",
    )
    parser.add_argument("--version", action="version", version=f"afl {afl_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, help_text, module_name in COMMANDS:
        p = sub.add_parser(name, help=help_text, description=help_text)
        if argv is None or name == chosen:
            module = importlib.import_module(module_name)
            module.add_arguments(p)
            p.set_defaults(func=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    words = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(words).parse_args(words)
    refusal = insecure_refusal(f"afl {args.command}") if getattr(args, "insecure", False) else None
    if refusal is not None:
        print(refusal, file=sys.stderr)
        return 2
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
