"""Every command imports only what it uses (issue: commands that start in well under a second).

Each entry point runs in its own Python process exactly as its console script runs it; at exit
the process writes the names in ``sys.modules``, and the test checks that none of the heavy
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


def _loaded(command: Sequence[str], tmp: Path, cwd: Path) -> tuple[int, str, list[str]]:
    out = tmp / f"modules-{len(list(tmp.glob('modules-*')))}.json"
    proc = _start(command, out, cwd)
    output, _ = proc.communicate(timeout=300)
    return proc.returncode, output, json.loads(out.read_text(encoding="utf-8"))


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
    served: ProvisionedFederation, tmp_path: Path
) -> None:
    for command in _commands(served):
        code, output, modules = _loaded(command, tmp_path, served.server_dir)
        # `check` finds the running server's port in use (a PROBLEM, exit 1): the path ran.
        assert code in (0, 1) if command[1] == "check" else code == 0, (command, output)
        assert _heavy(modules) == [], f"`{' '.join(command[:3])}` loaded them"


def test_the_operators_ca_commands_load_none_of_the_heavy_packages(tmp_path: Path) -> None:
    """Production provisioning as the operator and the coordinator host run it (docs/operations.md
    §2 steps 1, 2 and 4, with a site's step 3 to have a request to sign)."""
    steps = [
        ["afl", "ca", "init", "--out", "ca", "--federation-id", "fed-x", "--no-passphrase"],
        ["afl", "ca", "server-init", "--kit", "server", "--host", "localhost", "--port", "50051"],
        ["afl-client", "init", "--kit", "site", "--site-id", "site-a"],
    ]
    for command in steps:
        code, output, modules = _loaded(command, tmp_path, tmp_path)
        assert code == 0, (command, output)
        assert _heavy(modules) == [], f"`{' '.join(command[:3])}` loaded them"
    requests = [str(tmp_path / "server" / "server.request.json")]
    requests.append(str(tmp_path / "site" / "site-a.request.json"))
    command = ["afl", "ca", "sign", "--ca", "ca", "--out", "signed", *requests]
    code, output, modules = _loaded(command, tmp_path, tmp_path)
    assert code == 0, output
    assert _heavy(modules) == [], "`afl ca sign` loaded them"
