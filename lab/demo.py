"""`afl demo` (what `make demo` runs).

Until the gRPC daemons exist (issue 4) the demo is the in-process federation of `afl simulate` on
the embedded default (SURROGATE features on the real NIH PA labels, 8 sites, Missing-3), one and two
rounds under both Gram scopes, with the Theorem-1 oracle row.
"""

from __future__ import annotations

import argparse

from afl.lab import simulate_cmd


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--setting", default="missing-3", help="Missing-m setting (default missing-3)")
    p.add_argument("--out", metavar="FILE", help="write the results as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    sim_parser = argparse.ArgumentParser()
    simulate_cmd.add_arguments(sim_parser)
    argv = ["--setting", args.setting]
    if args.out:
        argv += ["--out", args.out]
    if args.quiet:
        argv.append("--quiet")
    print("afl demo: in-process federation on the embedded default (network daemons: issue 4)\n")
    return simulate_cmd.run(sim_parser.parse_args(argv))
