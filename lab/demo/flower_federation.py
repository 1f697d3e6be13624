"""A loopback federation run as afl's Flower app (docs/flower.md; used by the Flower tests and
``afl bench flower``): the kits and caches of :func:`afl.lab.demo.federation.prepare_loopback`,
run by Flower instead of afl's daemons, on one of three engines:

    python       the simulation engine started from Python (``flwr.simulation.run_simulation``)
    simulation   ``flwr run`` against a local ``flower-superlink --simulation``
    deployment   ``flwr run`` against a local ``flower-superlink`` with one ``flower-supernode``
                 per site, each given its site's client.toml (node config ``afl-client-config``)

The Flower processes run with ``FLWR_HOME`` under the federation's folder and listen on free
loopback ports (insecure: loopback only). Every process started here is stopped at the end,
with the Flower processes each of them started in turn. The result is a
:class:`~afl.lab.demo.federation.LoopbackRun` (``server_rc``: the exit status of ``flwr run``,
0 for ``python``) with the sites' own round reports.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

from afl.lab.demo.federation import LoopbackFederation, LoopbackRun, free_port, site_reports

__all__ = ["APP_DIR", "ENGINES", "SuperLink", "flower_run_config", "run_flower", "site_kits"]

ENGINES = ("python", "simulation", "deployment")
#: The Flower App of afl (what ``flwr run`` builds and submits).
APP_DIR = Path(__file__).resolve().parents[2] / "flower" / "app"


def site_kits(fed: LoopbackFederation) -> dict[str, Path]:
    """Every Flower node's client.toml: the sites in order, then the CKKS decryptor if any."""
    kits = {site: fed.client_configs[site].resolve() for site in fed.site_ids}
    if fed.decryptor_config is not None:
        kits["decryptor"] = fed.decryptor_config.resolve()
    return kits


def flower_run_config(fed: LoopbackFederation) -> dict[str, str]:
    """The app's run config for ``fed``: the coordinator's server.toml, the nodes' client.toml in
    :func:`site_kits` order (node ``partition-id`` k is the k+1-th)."""
    return {
        "afl-server-config": str(fed.server_config.resolve()),
        "afl-client-configs": ",".join(str(p) for p in site_kits(fed).values()),
    }


def _env(home: Path) -> dict[str, str]:
    bin_dir = str(Path(sys.executable).parent)
    return {
        **os.environ,
        "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""),
        "FLWR_HOME": str(home),
        "FLWR_DISABLE_UPDATE_CHECK": "1",
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0",
        "PYTHONUNBUFFERED": "1",
    }


def _children_of(pid: int) -> list[int]:
    """Processes a Flower process started for itself: they name it with ``--parent-pid``."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            args = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"--parent-pid" in args:
            at = args.index(b"--parent-pid")
            if at + 1 < len(args) and args[at + 1] == str(pid).encode():
                out.append(int(entry.name))
    return out


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """Stop a process started here and the Flower processes it started."""
    children = _children_of(proc.pid)
    for pid in [proc.pid, *children]:
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 10
    for pid in children:
        while time.monotonic() < deadline and Path(f"/proc/{pid}").exists():
            time.sleep(0.1)
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _wait_listening(port: int, proc: subprocess.Popen[bytes], log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"flower-superlink exited with {proc.returncode}; see {log}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError(f"flower-superlink did not listen on 127.0.0.1:{port}; see {log}")


@dataclass(frozen=True)
class SuperLink:
    """A local SuperLink: its address and the Flower connection that names it."""

    address: str
    connection: str
    home: Path


@contextmanager
def _process(
    args: Sequence[str], *, env: Mapping[str, str], log: Path
) -> Iterator[subprocess.Popen[bytes]]:
    """Run ``args`` in the log's folder (whatever a Flower process writes to its working
    directory stays with the federation), stopped on exit."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            list(args),
            stdout=out,
            stderr=subprocess.STDOUT,
            env=dict(env),
            cwd=log.parent,
            start_new_session=True,
        )
        try:
            yield proc
        finally:
            _stop(proc)


@contextmanager
def local_superlink(root: Path, *, simulation: bool) -> Iterator[SuperLink]:
    """A ``flower-superlink`` on free loopback ports, with ``FLWR_HOME`` = ``root/flwr-home``
    holding a Flower configuration whose connection ``afl`` names it."""
    home = root / "flwr-home"
    home.mkdir(parents=True, exist_ok=True)
    port = free_port()
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "afl"\n\n[superlink.afl]\naddress = "127.0.0.1:{port}"\n'
        "insecure = true\n",
        encoding="utf-8",
    )
    args = ["flower-superlink", "--insecure", "--isolation", "subprocess"]
    # One HTTP address, --host:--port, serves the Control, Fleet and runtime APIs (flwr 1.42;
    # docs/flower.md §4). Flower's in-memory state (its default name ":flwr-in-memory:").
    args += ["--host", "127.0.0.1", "--port", str(port), "--database", ":flwr-in-memory:"]
    args += ["--health-server-address", f"127.0.0.1:{free_port()}"]
    args += ["--simulation"] if simulation else []
    log = root / "logs" / "superlink.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with _process(args, env=_env(home), log=log) as proc:
        _wait_listening(port, proc, log, timeout_s=120)
        yield SuperLink(f"127.0.0.1:{port}", "afl", home)


def _toml_string(value: str) -> str:
    return "'" + value.replace("'", "") + "'"


def _flwr_run(
    link: SuperLink,
    *,
    run_config: Mapping[str, str],
    federation_config: Mapping[str, int] | None,
    log: Path,
    timeout_s: float,
) -> int:
    args = ["flwr", "run", str(APP_DIR), link.connection, "--stream"]
    args += ["--run-config", " ".join(f"{k}={_toml_string(v)}" for k, v in run_config.items())]
    if federation_config:
        args += ["--federation-config", " ".join(f"{k}={v}" for k, v in federation_config.items())]
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            args,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=_env(link.home),
            cwd=log.parent,
            start_new_session=True,
        )
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _stop(proc)
            return -1


def _python_engine(fed: LoopbackFederation, *, num_cpus: float) -> int:
    from flwr.simulation import run_simulation

    from afl.flower import client_app, server_app

    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")  # quiets a Ray notice
    config = flower_run_config(fed)
    run_simulation(
        server_app.make_app(config),
        client_app.make_app(config),
        num_supernodes=len(site_kits(fed)),
        backend_config={"client_resources": {"num_cpus": num_cpus}},
    )
    return 0


def run_flower(
    fed: LoopbackFederation,
    *,
    engine: str = "simulation",
    timeout_s: float = 900.0,
    num_cpus: float = 1.0,
) -> LoopbackRun:
    """Run the federation's active afl run as the Flower app on ``engine`` (module docstring);
    logs under ``fed.root/logs``."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    logs = fed.root / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    paths = {"flwr": logs / "flwr-run.log"}
    if engine == "python":
        rc = _python_engine(fed, num_cpus=num_cpus)
    else:
        with ExitStack() as stack:
            link = stack.enter_context(local_superlink(fed.root, simulation=engine == "simulation"))
            run_config = flower_run_config(fed)
            federation = None
            if engine == "simulation":
                federation = {"num-supernodes": len(site_kits(fed))}
            else:
                run_config.pop("afl-client-configs")
                for k, (site, kit) in enumerate(site_kits(fed).items()):
                    path = paths[site] = logs / f"supernode-{site}.log"
                    node_config = f"afl-client-config={_toml_string(str(kit))}"
                    args = ["flower-supernode", "--insecure", "--superlink", link.address]
                    args += ["--node-config", node_config, "--port", str(free_port())]
                    args += ["--health-server-address", f"127.0.0.1:{free_port()}"]
                    env = _env(link.home / f"supernode-{k}")
                    stack.enter_context(_process(args, env=env, log=path))
            rc = _flwr_run(
                link,
                run_config=run_config,
                federation_config=federation,
                log=paths["flwr"],
                timeout_s=timeout_s,
            )
    wall = time.perf_counter() - start
    return LoopbackRun(rc, {}, site_reports(fed), wall, paths)
