"""A loopback federation whose daemons the test starts, kills and restarts one by one, and an
admin connection to its server: the harness of the restart, runs and liveness tests.

Sites run in ``serve`` mode (they keep taking part in new runs until stopped), so one federation
lives through several runs and several coordinator restarts. Nothing here measures time: every
wait has a generous limit and fails with the daemons' logs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import grpc

from afl.lab.demo.federation import CLIENT_COMMAND, LoopbackFederation
from afl.ops.admin import connect, load_admin_kit
from afl.proto.v1 import admin_pb2 as apb
from afl.proto.v1 import admin_pb2_grpc
from afl.proto.v1 import coordinator_pb2 as pb

T = TypeVar("T")
HERE = Path(__file__).resolve().parent
SERVER_COMMAND = (sys.executable, "-m", "afl.server.daemon.main")
ENDED = ("published", "aborted", "failed")


def admin_command(loop: LoopbackFederation, *args: str) -> subprocess.CompletedProcess[str]:
    """``afl admin ARGS`` with the operator's admin kit, as an operator types it."""
    kit = loop.provisioned.root / "admins" / "operator" / "admin.toml"
    cmd = [sys.executable, "-m", "afl.lab.cli", "admin", "--config", str(kit), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def admin_cli(loop: LoopbackFederation, *args: str) -> str:
    """``afl admin ARGS``'s stdout (the command must succeed)."""
    proc = admin_command(loop, *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


class Daemons:
    """The processes of one loopback federation (module docstring)."""

    def __init__(self, loop: LoopbackFederation) -> None:
        self.loop = loop
        self.logs = loop.root / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.server: subprocess.Popen[bytes] | None = None
        self.servers_started = 0
        self.clients: dict[str, subprocess.Popen[bytes]] = {}
        self._handles: list[Any] = []
        kit = load_admin_kit(loop.provisioned.root / "admins" / "operator" / "admin.toml")
        self._channel, _ = connect(kit)
        self.admin = admin_pb2_grpc.AdminStub(self._channel)

    def _spawn(self, name: str, argv: Sequence[str]) -> subprocess.Popen[bytes]:
        handle = open(self.logs / f"{name}.log", "ab")  # noqa: SIM115 (closed in stop())
        self._handles.append(handle)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        return subprocess.Popen(list(argv), stdout=handle, stderr=subprocess.STDOUT, env=env)

    def start_server(
        self, *, crash_at: tuple[str, str] | None = None, command: Sequence[str] | None = None
    ) -> None:
        """Start afl-server (or one with a fault, ``crash_at`` = (point, run id): see
        tests/e2e/faulty_server.py; or the program ``command`` with the same arguments, e.g. a
        patched, attacking coordinator of tests/adversarial/malicious_server.py)."""
        assert self.server is None or self.server.poll() is not None
        program: tuple[str, ...] = SERVER_COMMAND if command is None else tuple(command)
        if crash_at is not None:
            program = (sys.executable, str(HERE / "faulty_server.py"), *crash_at)
        self.servers_started += 1
        args = ["--config", str(self.loop.server_config), "--log-level", "INFO"]
        self.server = self._spawn(f"server-{self.servers_started}", [*program, *args])

    def start_clients(
        self,
        *,
        commands: Mapping[str, Sequence[str]] | None = None,
        crash_at: Mapping[str, str] | None = None,
    ) -> None:
        """Start every site and the decryptor; ``commands`` maps a site to a program run instead
        of ``afl-client`` with the same arguments (e.g. a patched, attacking site), ``crash_at``
        a site (or "decryptor") to a fault of tests/e2e/faults/faulty_client.py."""
        for site in self._configs():
            self.start_client(
                site, crash_at=(crash_at or {}).get(site), command=(commands or {}).get(site)
            )

    def _configs(self) -> dict[str, Path]:
        configs = dict(self.loop.client_configs)
        if self.loop.decryptor_config is not None:
            configs["decryptor"] = self.loop.decryptor_config
        return configs

    def start_client(
        self, site: str, *, crash_at: str | None = None, command: Sequence[str] | None = None
    ) -> None:
        """(Re)start one site (or "decryptor"), with the fault ``crash_at`` or the program
        ``command`` if given."""
        program: tuple[str, ...] = tuple(command) if command is not None else CLIENT_COMMAND
        if crash_at is not None:
            program = (sys.executable, str(HERE / "faults" / "faulty_client.py"), crash_at)
        argv = [*program, "run", "--config", str(self._configs()[site]), "--log-level", "INFO"]
        self.clients[site] = self._spawn(site, argv)

    def wait_server_exit(self, *, timeout_s: float = 300.0) -> int:
        """The running server's exit code (it must exit, e.g. killed by its crash point)."""
        assert self.server is not None
        try:
            return self.server.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the server did not exit in time\n{self.log_tail()}") from None

    def call(self, method: Callable[..., T], request: Any, *, timeout_s: float = 300.0) -> T:
        """An Admin call, retried while the server is down or starting."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return method(request, timeout=20)
            except grpc.RpcError as exc:
                if exc.code() not in (
                    grpc.StatusCode.UNAVAILABLE,
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                ):
                    raise
                if time.monotonic() > deadline:
                    raise AssertionError(
                        f"the Admin service did not answer\n{self.log_tail()}"
                    ) from exc
                time.sleep(0.5)

    def submit(self, settings_toml: str = "", *, name: str = "") -> apb.RunInfo:
        request = apb.SubmitRunRequest(name=name, settings_toml=settings_toml)
        info: apb.RunInfo = self.call(self.admin.SubmitRun, request)
        return info

    def wait_run(self, run_id: str, *, timeout_s: float = 400.0) -> apb.RunInfo:
        """The run once it has ended (published or aborted)."""
        deadline = time.monotonic() + timeout_s
        while True:
            info: apb.RunInfo = self.call(self.admin.GetRun, apb.RunRef(run_id=run_id))
            if info.state in ENDED:
                return info
            if self.server is not None and self.server.poll() is not None:
                raise AssertionError(f"the server exited during {run_id}\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"{run_id} did not end: {info}\n{self.log_tail()}")
            time.sleep(0.3)

    def wait_reports(
        self, round_id: str, *, timeout_s: float = 300.0, sites: Sequence[str] | None = None
    ) -> dict[str, dict[str, Any]]:
        """Every site's (or those of ``sites``) local report of ``round_id`` (the sites write
        it after the model)."""
        deadline = time.monotonic() + timeout_s
        configs = {s: c for s, c in self.loop.client_configs.items() if sites is None or s in sites}
        while True:
            reports = {}
            for site, config in configs.items():
                path = config.parent / "state" / "reports" / f"{round_id}.json"
                if path.is_file():
                    reports[site] = json.loads(path.read_text(encoding="utf-8"))
            if len(reports) == len(configs):
                return reports
            if time.monotonic() > deadline:
                raise AssertionError(f"reports of {round_id} missing\n{self.log_tail()}")
            time.sleep(0.3)

    def wait_logged(
        self, text: str, *, sites: Sequence[str], timeout_s: float = 300.0
    ) -> dict[str, str]:
        """Every one of ``sites``' logs once each holds ``text`` (by site)."""
        deadline = time.monotonic() + timeout_s
        while True:
            logs = {
                s: (self.logs / f"{s}.log").read_text(encoding="utf-8", errors="replace")
                for s in sites
            }
            if all(text in log for log in logs.values()):
                return logs
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"{text!r} not logged by every one of {sites}\n{self.log_tail()}"
                )
            time.sleep(0.3)

    def model(self, run_id: str) -> pb.SignedModel:
        signed: pb.SignedModel = self.call(self.admin.GetRunModel, apb.RunRef(run_id=run_id))
        return signed

    def stop_clients(self) -> dict[str, int]:
        codes = {}
        for proc in self.clients.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for site, proc in self.clients.items():
            try:
                codes[site] = proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                codes[site] = proc.wait()
        return codes

    def stop(self) -> int | None:
        """Stop every daemon; the server's exit code (None if it was not running)."""
        self.stop_clients()
        code = None
        if self.server is not None and self.server.poll() is None:
            self.server.send_signal(signal.SIGTERM)
            try:
                code = self.server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.server.kill()
                code = self.server.wait()
        self._channel.close()
        for handle in self._handles:
            handle.close()
        return code

    def log_tail(self, lines: int = 25) -> str:
        out = []
        for path in sorted(self.logs.glob("*.log")):
            text = path.read_text(encoding="utf-8", errors="replace").splitlines()
            out.append(f"--- {path.name}\n" + "\n".join(text[-lines:]))
        return "\n".join(out)

    def server_logs(self) -> str:
        return "\n".join(
            p.read_text(encoding="utf-8", errors="replace")
            for p in sorted(self.logs.glob("server-*.log"))
        )
