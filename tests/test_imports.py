"""Every command imports only what it uses (issue: commands that start in well under a second).

Each command runs in its own process, forked from one Python process that has imported the three
entry points' modules and nothing else (so a module-level import of a heavy package in any of them
shows in every command's modules), and calls its entry point exactly as its console script does;
at exit the process writes the names in ``sys.modules``, and the test checks that none of the heavy
packages a command does not need was loaded: torch, torchvision, scikit-learn, scipy, matplotlib
and TenSEAL for the help, version, operator (``afl ca``, ``afl admin``, ``afl verify-log``,
``afl audit-export``, ``afl log``) and status commands; torch, torchvision, scikit-learn,
matplotlib and TenSEAL for the coordinator daemon of a federation that does not use CKKS (scipy
solves its rounds, TenSEAL only serves CKKS). A module-level import of any of them on one of
these paths fails here, naming the command.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from afl.lab.demo.federation import free_port
from afl.ops.provisioning import ProvisionedFederation, provision

HEAVY = ("torch", "torchvision", "sklearn", "scipy", "matplotlib", "tenseal")
ENTRY = {
    "afl": "afl.lab.cli:main",
    "afl-client": "afl.client.cli:main",
    "afl-server": "afl.server.daemon.main:main",
}
# Runs an entry point as its console script does; at exit (SystemExit included) it writes the
# loaded modules' names to the file named by AFL_MODULES_OUT.
PROBE = """
import atexit, importlib, json, os, sys
def _written():
    with open(os.environ["AFL_MODULES_OUT"], "w", encoding="utf-8") as out:
        json.dump(sorted(sys.modules), out)
atexit.register(_written)
module, _, function = sys.argv[1].partition(":")
sys.argv = sys.argv[1:]
sys.exit(getattr(importlib.import_module(module), function)())
"""
# Imports every entry point's module once, then for each job line (JSON: argv, cwd, output file,
# modules file) forks a child that runs PROBE's body with the job's argv, cwd and stdout; answers
# each job with the child's exit code (one JSON line). Forking saves each command the start-up
# and the imports it shares with the others (the suite's CPU time).
FORKSERVER = """
import importlib, json, os, sys
for entry in sys.argv[1:]:
    importlib.import_module(entry.partition(":")[0])
probe = compile(json.loads(sys.stdin.readline()), "<probe>", "exec")
for line in sys.stdin:
    job = json.loads(line)
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:
        os.chdir(job["cwd"])
        fd = os.open(job["output"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        os.environ["AFL_MODULES_OUT"] = job["modules"]
        sys.argv = ["-c", *job["argv"]]
        exec(probe, {"__name__": "__main__"})
    _, status = os.waitpid(pid, 0)
    print(json.dumps(os.waitstatus_to_exitcode(status)), flush=True)
"""
CLASSES = ["A", "B"]


def _heavy(modules: Sequence[str], allowed: Sequence[str] = ()) -> list[str]:
    return sorted({m.partition(".")[0] for m in modules} & set(HEAVY) - set(allowed))


def _start(command: Sequence[str], out: Path, cwd: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "AFL_MODULES_OUT": str(out)}
    return subprocess.Popen(
        [sys.executable, "-c", PROBE, ENTRY[command[0]], *command[1:]],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


class Commands:
    """The fork server of FORKSERVER: runs commands one at a time, each in a forked child."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.count = 0
        self.proc = subprocess.Popen(
            [sys.executable, "-c", FORKSERVER, *ENTRY.values()],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(PROBE) + "\n")

    def loaded(self, command: Sequence[str], cwd: Path) -> tuple[int, str, list[str]]:
        """``command``'s exit code, output and loaded modules."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.count += 1
        output, modules = (
            self.tmp / f"output-{self.count}.txt",
            self.tmp / f"modules-{self.count}.json",
        )
        job = {
            "argv": [ENTRY[command[0]], *command[1:]],
            "cwd": str(cwd),
            "output": str(output),
            "modules": str(modules),
        }
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline()
        assert answer, f"the fork server exited with {self.proc.wait()}"
        text = output.read_text(encoding="utf-8", errors="replace")
        return int(json.loads(answer)), text, json.loads(modules.read_text(encoding="utf-8"))

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        assert self.proc.wait(timeout=120) == 0


@pytest.fixture(scope="module")
def commands(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Commands]:
    runner = Commands(tmp_path_factory.mktemp("commands"))
    try:
        yield runner
    finally:
        runner.close()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProvisionedFederation]:
    """A provisioned federation (no CKKS) whose coordinator daemon runs (its own modules are
    checked when it stops) with one site's state folder for ``afl-client status``."""
    root = tmp_path_factory.mktemp("imports")
    federation = provision(
        root / "federation",
        sites=["site-a", "site-b", "site-c"],
        port=free_port(),
        round_settings={
            "classes": CLASSES,
            "feature_dim": 8,
            "backbone": "xrv-densenet121-all",
            "backbone_sha256": "0" * 64,
            "allow_random_init": True,
        },
    )
    out = root / "daemon-modules.json"
    daemon = _start(
        ["afl-server", "--config", str(federation.server_dir / "server.toml")],
        out,
        federation.server_dir,
    )
    assert daemon.stdout is not None
    deadline = time.monotonic() + 300  # generous: the machine may be loaded
    for line in daemon.stdout:
        if "afl-server listening on port" in line:
            break
        assert time.monotonic() < deadline, "afl-server did not start"
    else:
        pytest.fail(f"afl-server exited with {daemon.wait()} before listening")
    try:
        yield federation
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.communicate(timeout=120)
    assert daemon.returncode == 0
    loaded = json.loads(out.read_text(encoding="utf-8"))
    assert _heavy(loaded, allowed=("scipy",)) == [], "afl-server (no CKKS) loaded them"


def _commands(federation: ProvisionedFederation) -> list[list[str]]:
    server_toml = str(federation.server_dir / "server.toml")
    admin = str(federation.root / "admins" / "operator" / "admin.toml")
    client_toml = str(federation.site_dirs["site-a"] / "client.toml")
    return [
        ["afl", "--version"],
        ["afl", "--help"],
        ["afl", "ca", "--help"],
        ["afl", "admin", "--help"],
        ["afl-client", "--help"],
        ["afl-client", "--version"],
        ["afl-server", "--help"],
        ["afl-server", "--version"],
        ["afl-server", "status", "--config", server_toml],
        ["afl-server", "check", "--config", server_toml],
        ["afl-client", "status", "--config", client_toml],
        ["afl", "admin", "--config", admin, "ls"],
        ["afl", "admin", "--config", admin, "status", "run-1"],
        ["afl", "verify-log", str(federation.server_dir / "state")],
        ["afl", "audit-export", "--config", server_toml, "--out", str(federation.root / "audit")],
        ["afl", "audit-export", "--verify", str(federation.root / "audit")],
        ["afl", "log", "export", "--config", server_toml, "--out", str(federation.root / "l.json")],
        ["afl", "log", "verify", str(federation.root / "l.json")],
    ]


def test_commands_load_none_of_the_heavy_packages(
    served: ProvisionedFederation, commands: Commands
) -> None:
    for command in _commands(served):
        code, output, modules = commands.loaded(command, served.server_dir)
        # `check` finds the running server's port in use (a PROBLEM, exit 1): the path ran.
        assert code in (0, 1) if command[1] == "check" else code == 0, (command, output)
        assert _heavy(modules) == [], f"`{' '.join(command[:3])}` loaded them"


def test_the_operators_ca_commands_load_none_of_the_heavy_packages(
    tmp_path: Path, commands: Commands
) -> None:
    """Production provisioning as the operator and the coordinator host run it (docs/operations.md
    §2 steps 1, 2 and 4, with a site's step 3 to have a request to sign)."""
    steps = [
        ["afl", "ca", "init", "--out", "ca", "--federation-id", "fed-x", "--no-passphrase"],
        ["afl", "ca", "server-init", "--kit", "server", "--host", "localhost", "--port", "50051"],
        ["afl-client", "init", "--kit", "site", "--site-id", "site-a"],
    ]
    for command in steps:
        code, output, modules = commands.loaded(command, tmp_path)
        assert code == 0, (command, output)
        assert _heavy(modules) == [], f"`{' '.join(command[:3])}` loaded them"
    requests = [str(tmp_path / "server" / "server.request.json")]
    requests.append(str(tmp_path / "site" / "site-a.request.json"))
    command = ["afl", "ca", "sign", "--ca", "ca", "--out", "signed", *requests]
    code, output, modules = commands.loaded(command, tmp_path)
    assert code == 0, output
    assert _heavy(modules) == [], "`afl ca sign` loaded them"
