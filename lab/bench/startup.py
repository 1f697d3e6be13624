"""`afl bench startup`: how long the commands operators and sites type take to answer.

Each command runs as a fresh process, ``repeats`` times, against a federation provisioned in a
temporary folder (no CKKS) whose ``afl-server`` runs for ``afl admin ls``. Reported per command
(medians over the repeats):

    wall_seconds   from start to exit
    cpu_seconds    user + system CPU of the process (less sensitive to other jobs than wall time)

With ``baseline_bin`` (the ``bin`` folder of another afl install, e.g. an older checkout's
virtual environment) the same commands run from there too, interleaved with this install's so
both see the same load, with the ratios this / baseline. The load average at start and end is
recorded: on a shared machine wall times are noisy, CPU seconds much less so.
"""

from __future__ import annotations

import argparse
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from afl.lab.bench.common import emit_json

__all__ = ["COMMANDS", "run_startup_bench"]

#: (name, argv); ``{admin}`` is the admin kit's admin.toml.
COMMANDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("afl --version", ("afl", "--version")),
    ("afl-client --help", ("afl-client", "--help")),
    ("afl-server --help", ("afl-server", "--help")),
    ("afl admin ls", ("afl", "admin", "--config", "{admin}", "ls")),
)


def _timed(argv: Sequence[str]) -> tuple[float, float]:
    """(wall, CPU) seconds of one run of ``argv``; RuntimeError naming it if it fails."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {proc.returncode}: {proc.stderr.strip()}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def _serve(root: Path) -> tuple[subprocess.Popen[str], Path]:
    """A provisioned federation under ``root`` with its afl-server running; the admin kit."""
    from afl.lab.demo.federation import free_port
    from afl.ops.provisioning import provision

    federation = provision(
        root / "federation",
        sites=["site-a", "site-b", "site-c"],
        port=free_port(),
        round_settings={
            "classes": ["A", "B"],
            "feature_dim": 8,
            "backbone": "xrv-densenet121-all",
            "backbone_sha256": "0" * 64,
            "allow_random_init": True,
        },
    )
    server = subprocess.Popen(
        [sys.executable, "-m", "afl.server.daemon.main", "--config", "server.toml"],
        cwd=federation.server_dir,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert server.stderr is not None
    for line in server.stderr:
        if "afl-server listening on port" in line:
            return server, federation.root / "admins" / "operator" / "admin.toml"
    raise RuntimeError(f"afl-server exited with {server.wait()} before listening")


def run_startup_bench(*, repeats: int = 3, baseline_bin: Path | None = None) -> dict[str, Any]:
    """The figures of the module docstring for :data:`COMMANDS`."""
    if repeats < 1:
        raise ValueError("repeats must be at least 1")
    installs = {"this": Path(sys.executable).parent}
    if baseline_bin is not None:
        installs["baseline"] = Path(baseline_bin)
    for name, folder in installs.items():
        missing = [c for c in ("afl", "afl-client", "afl-server") if not (folder / c).is_file()]
        if missing:
            raise ValueError(f"{folder} ({name}) has no {', '.join(missing)}")
    out: dict[str, Any] = {"repeats": repeats, "load_average_start": os.getloadavg()}
    times: dict[tuple[str, str], list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="afl-bench-startup-") as tmp:
        server, admin = _serve(Path(tmp))
        try:
            for _ in range(repeats):
                for name, argv in COMMANDS:
                    for install, folder in installs.items():
                        args = [str(folder / argv[0])]
                        args += [a.format(admin=admin) for a in argv[1:]]
                        times.setdefault((name, install), []).append(_timed(args))
        finally:
            server.send_signal(signal.SIGTERM)
            server.communicate(timeout=120)
    out["load_average_end"] = os.getloadavg()
    rows = []
    for name, _ in COMMANDS:
        row: dict[str, Any] = {"command": name}
        for install in installs:
            runs = times[(name, install)]
            row[install] = {
                "wall_seconds": statistics.median(w for w, _ in runs),
                "cpu_seconds": statistics.median(c for _, c in runs),
                "wall_seconds_all": [w for w, _ in runs],
            }
        if "baseline" in installs:
            for key in ("wall_seconds", "cpu_seconds"):
                row[f"{key}_ratio"] = row["this"][key] / row["baseline"][key]
        rows.append(row)
    out["commands"] = rows
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repeats", type=int, default=3, help="runs per command (median)")
    parser.add_argument(
        "--baseline-bin",
        type=Path,
        default=None,
        help="the bin folder of another afl install to compare with (interleaved runs)",
    )
    parser.add_argument("--out", metavar="FILE", help="write JSON here (default: stdout)")


def run(args: argparse.Namespace) -> int:
    try:
        result = run_startup_bench(repeats=args.repeats, baseline_bin=args.baseline_bin)
    except (ValueError, RuntimeError) as exc:
        print(f"afl bench startup: {exc}", file=sys.stderr)
        return 2
    for row in result["commands"]:
        text = f"{row['command']:<20} {row['this']['wall_seconds']:6.2f} s wall"
        text += f" {row['this']['cpu_seconds']:6.2f} s CPU"
        if "baseline" in row:
            text += (
                f"  (baseline {row['baseline']['wall_seconds']:.2f} s wall "
                f"{row['baseline']['cpu_seconds']:.2f} s CPU)"
            )
        print(text, file=sys.stderr)
    emit_json({"benchmark": "startup", "results": [result]}, args.out)
    return 0
