"""`afl-server --config server.toml [--insecure]`: the coordinator daemon (docs/operations.md,
docs/architecture.md §2).

Mutual TLS by default (the kit's ca.pem, server.pem, server.key; clients must present a
certificate of the federation CA); ``--insecure`` serves plaintext gRPC for development only and
prints a loud warning (the caller's site id then comes from a metadata header). Also serves the
gRPC health service, Prometheus metrics on ``[server] metrics_port`` (or ``--metrics-port``),
optionally the health service alone on a plaintext port (``--health-port``: the kubelet's gRPC
probes speak no TLS; nothing but ``grpc.health.v1.Health`` is served there), JSON-lines logs on stderr, and stops gracefully on SIGTERM/SIGINT. State lives in
``[server] state_dir``; a restarted server resumes the open round.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from collections.abc import Sequence
from concurrent import futures
from dataclasses import replace
from pathlib import Path
from types import FrameType
from typing import Any

import grpc
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from afl.core.about import afl_version
from afl.core.aggregation import load_solver
from afl.core.devmode import insecure_refusal
from afl.core.memory import map_large_blocks
from afl.crypto.errors import KeyFormatError
from afl.crypto.identity.signatures import load_private_key_pem, public_key_to_raw
from afl.proto.v1 import admin_pb2_grpc, coordinator_pb2_grpc
from afl.server.config import ServerConfig, load_config
from afl.server.coordinator import Coordinator
from afl.server.daemon.observability import ServerMetrics, configure_logging, start_metrics_http
from afl.server.daemon.ports import port_in_use
from afl.server.daemon.refusal import RefusedState, attach_refusal
from afl.server.errors import ConfigError, StateError
from afl.server.limits import worker_threads
from afl.server.servicer import AdminServicer, CoordinatorServicer
from afl.server.store import Store, backup_state

__all__ = ["SERVICE_NAME", "CoordinatorServer", "load_identity_key", "main"]

SERVICE_NAME = "afl.proto.v1.Coordinator"
INSECURE_WARNING = (
    "WARNING: afl-server is running with --insecure: NO TLS, NO client authentication; any "
    "caller can claim any site id. Statistics cross the network in the clear. Development only."
)
log = logging.getLogger("afl.server.daemon.main")


def load_identity_key(config: ServerConfig) -> Ed25519PrivateKey:
    """The coordinator's identity key, checked against server.toml's [identity] public_key
    (:class:`ConfigError` with the cause)."""
    try:
        key = load_private_key_pem(config.identity_key.read_bytes())
    except (OSError, KeyFormatError) as exc:
        raise ConfigError(f"cannot load the identity key {config.identity_key}: {exc}") from exc
    if public_key_to_raw(key) != config.identity_public_key:
        raise ConfigError("[identity] public_key does not match the identity key file")
    return key


class CoordinatorServer:
    """One afl-server: gRPC server, coordinator, store, timeout ticker and metrics."""

    def __init__(
        self,
        config: ServerConfig,
        *,
        insecure: bool = False,
        tick_s: float = 0.5,
        health_listen: str = "",
    ) -> None:
        self.config, self.insecure, self._tick_s = config, insecure, tick_s
        key = load_identity_key(config)
        self.metrics = ServerMetrics()
        # Both ports are bound before any state is touched: a port in use fails the start with
        # one line and leaves the state folder as it was (no round is created).
        self._grpc = grpc.server(
            futures.ThreadPoolExecutor(
                max_workers=worker_threads(config.limits, sites=len(config.sites))
            ),
            options=[("grpc.so_reuseport", 0)],  # a second server on the same port must fail
        )
        self.port = self._bind(config.listen)
        self._metrics_http: Any = None
        self._health = health.HealthServicer()
        self._health_grpc: Any = None
        self.health_port = 0
        try:
            if health_listen:
                self._health_grpc, self.health_port = self._bind_health(health_listen)
            self._metrics_http = self._bind_metrics() if config.metrics_port else None
            # A finished run's payload files are erased off the coordinator's lock (M-140).
            self.store = Store(
                config.state_dir, federation_id=config.federation_id, background_erase=True
            )
            swept = self.store.sweep_payloads()  # the port is ours: no other server writes
            if swept:
                log.warning(
                    "removed payload files an interrupted purge or upload left behind "
                    "(audit record payloads-swept)",
                    extra={"files": len(swept)},
                )
            self.coordinator = Coordinator(config, self.store, key, metrics=self.metrics)
        except StateError as exc:
            self._close_store()
            self._close_metrics()
            if self._health_grpc is not None:
                self._health_grpc.stop(None)  # the probes fail: the pod does not serve
            if config.refusal_serve_s <= 0 or config.listen.endswith(":0"):
                self._grpc.stop(None)
                raise
            # Tell the sites why, on the port already bound (afl.server.daemon.refusal).
            attach_refusal(self._grpc, str(exc), service_names=("", SERVICE_NAME))
            raise RefusedState(str(exc), server=self._grpc, port=self.port) from exc
        except BaseException:
            self._close_store()
            self._close_metrics()
            if self._health_grpc is not None:
                self._health_grpc.stop(None)
            self._grpc.stop(None)
            raise
        self._stopped = threading.Event()  # a stop began: refuse new work, end the ticker
        self._finished = threading.Event()  # a stop ended: the store is closed
        servicer = CoordinatorServicer(
            self.coordinator, insecure=insecure, stopping=self._stopped.is_set
        )
        coordinator_pb2_grpc.add_CoordinatorServicer_to_server(servicer, self._grpc)
        admin_pb2_grpc.add_AdminServicer_to_server(
            AdminServicer(self.coordinator, insecure=insecure), self._grpc
        )
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._grpc)
        self._ticker = threading.Thread(target=self._tick_loop, name="afl-ticker", daemon=True)

    def _bind(self, listen: str) -> int:
        busy = port_in_use(listen)
        if busy:
            raise ConfigError(f"cannot listen on {listen}: {busy}")
        try:
            if self.insecure:
                port = int(self._grpc.add_insecure_port(listen))
            else:
                credentials = grpc.ssl_server_credentials(
                    [(self.config.key.read_bytes(), self.config.cert.read_bytes())],
                    root_certificates=self.config.ca_cert.read_bytes(),
                    require_client_auth=True,
                )
                port = int(self._grpc.add_secure_port(listen, credentials))
        except RuntimeError as exc:  # grpc: "Failed to bind to address ..."
            raise ConfigError(f"cannot listen on {listen}: {exc}") from exc
        if port == 0:
            raise ConfigError(f"cannot listen on {listen}")
        return port

    def _bind_health(self, listen: str) -> tuple[Any, int]:
        """A plaintext gRPC server with the health service only (for the kubelet's probes)."""
        busy = port_in_use(listen)
        if busy:
            raise ConfigError(f"cannot serve health checks on {listen}: {busy}")
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=2), options=[("grpc.so_reuseport", 0)]
        )
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        try:
            port = int(server.add_insecure_port(listen))
        except RuntimeError as exc:
            raise ConfigError(f"cannot serve health checks on {listen}: {exc}") from exc
        if port == 0:
            raise ConfigError(f"cannot serve health checks on {listen}")
        return server, port

    def _bind_metrics(self) -> Any:
        where = f"{self.config.metrics_address}:{self.config.metrics_port}"
        try:
            return start_metrics_http(
                self.metrics, port=self.config.metrics_port, host=self.config.metrics_address
            )
        except OSError as exc:
            raise ConfigError(
                f"cannot serve metrics on {where}: {exc.strerror or exc} (another afl-server or "
                "service holds it? set [server] metrics_port, or --metrics-port 0 to turn it off)"
            ) from exc

    def _close_store(self) -> None:
        """A start that failed after the store opened closes it (its database connection)."""
        store = getattr(self, "store", None)
        if store is not None:
            store.close()

    def _close_metrics(self) -> None:
        http = self._metrics_http
        http_server = http[0] if isinstance(http, tuple) else None
        if http_server is not None:
            http_server.shutdown()
            http_server.server_close()
        self._metrics_http = None

    def _tick_loop(self) -> None:
        while not self._stopped.wait(self._tick_s):
            try:
                self.coordinator.tick()
            except Exception:  # keep serving; the failure is logged
                log.exception("timeout tick failed")

    def start(self) -> int:
        """Start serving; returns the bound port."""
        self._grpc.start()
        if self._health_grpc is not None:
            self._health_grpc.start()
        for service in ("", SERVICE_NAME):
            self._health.set(service, health_pb2.HealthCheckResponse.SERVING)
        self._ticker.start()
        # The first solve's scipy import is done while the sites enrol, not under the lock.
        threading.Thread(target=load_solver, name="afl-load-solver", daemon=True).start()
        log.info(
            "afl-server started",
            extra={
                "port": self.port,
                "insecure": self.insecure,
                "federation_id": self.config.federation_id,
            },
        )
        return self.port

    def stop(self, grace: float | None = 2.0) -> None:
        """Stop accepting calls, finish in-flight ones within ``grace`` s, close the store."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        try:
            try:
                try:
                    self._health.enter_graceful_shutdown()
                    self.store.log_changes.close()  # held GetCheckpoint calls answer at once
                finally:
                    self._grpc.stop(grace).wait()
                if self._health_grpc is not None:
                    self._health_grpc.stop(None)
                if self._ticker.is_alive():
                    self._ticker.join(timeout=5)
                self._close_metrics()
            finally:
                # gRPC lets a handler run on past the grace period: close between its
                # transactions; closing waits for the payload eraser (M-140).
                with self.coordinator.lock:
                    self.store.close()
            log.info("afl-server stopped")
        finally:
            self._finished.set()

    def wait(self) -> None:
        """Block until a :meth:`stop` has ended: the in-flight calls are done and the store is
        closed. (Returning when the stop only began let the process exit while the signal's stop
        thread was still inside gRPC's shutdown: the interpreter's teardown then crashed it,
        SIGSEGV, exit -11.)"""
        self._finished.wait()


def _version() -> str:
    return f"afl-server {afl_version()}"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="afl-server",
        description=(
            "The afl coordinator: enrols the federation's sites, publishes signed release "
            "plans, aggregates under the configured protection and publishes the signed model. "
            "Before starting, `afl-server check --config server.toml` checks the kit, state "
            "folder, ports and round settings; `afl-server status --config server.toml` shows "
            "enrolment, the current round and the last error."
        ),
    )
    parser.add_argument("--version", action="version", version=_version())
    parser.add_argument("--config", required=True, help="server.toml from `afl provision`")
    parser.add_argument(
        "--insecure", action="store_true", help="DEVELOPMENT ONLY: no TLS, no client auth"
    )
    parser.add_argument("--listen", default=None, help="override [server] listen (host:port)")
    parser.add_argument("--metrics-port", type=int, default=None, help="Prometheus port (0 = off)")
    parser.add_argument("--metrics-address", default=None, help="override [server] metrics_address")
    parser.add_argument(
        "--refusal-serve-s",
        type=float,
        default=None,
        help="override [server] refusal_serve_s: seconds a refused state is reported to the "
        "sites before exit 2 (0 = exit at once)",
    )
    parser.add_argument(
        "--health-port",
        type=int,
        default=0,
        help="also serve the gRPC health service alone, in plaintext, on this port (Kubernetes "
        "gRPC probes; 0 = off)",
    )
    parser.add_argument(
        "--health-address", default="0.0.0.0", help="address of --health-port (default 0.0.0.0)"
    )
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING"])
    return parser


def _tool_parser(name: str, description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"afl-server {name}", description=description)
    parser.add_argument("--version", action="version", version=_version())
    parser.add_argument("--config", required=True, help="server.toml")
    if name == "check":
        parser.add_argument("--insecure", action="store_true", help="skip the TLS kit checks")
    if name == "backup":
        parser.add_argument("--out", required=True, help="a new, empty folder for the copy")
    if name == "ack-restore":
        parser.add_argument("--by", required=True, help="who acknowledges (in the audit log)")
        parser.add_argument("--reason", required=True, help="why the state was restored")
    if name == "offboard":
        parser.add_argument("--site", required=True, help="the site id that leaves")
        parser.add_argument("--by", required=True, help="who offboards it (in the audit log)")
        parser.add_argument("--reason", required=True, help="why (in the audit log)")
    return parser


_TOOLS = {
    "check": "Check server.toml, the TLS kit, the identity key, the state folder, the ports and "
    "the round settings before starting; exit status 0 when no PROBLEM is found.",
    "status": "The coordinator's state on one screen (enrolment, current round and stage, last "
    "model, last error), read from the state folder; safe while the server runs.",
    "backup": "Copy the coordinator's state folder consistently (the server may be running): the "
    "database by SQLite's online backup, the payloads it names, the CKKS context and a matching "
    "anchor. Restore by replacing the state folder with the copy while the server is stopped "
    "(docs/operations.md).",
    "ack-restore": "Acknowledge that the state folder was restored from an older backup (the "
    "server must be stopped): the runs still in flight in the restored state are aborted (submit "
    "them again), the acknowledgement is recorded in the audit log, and sites that saw a later "
    "state take part again (docs/operations.md §9).",
    "offboard": "A site leaves the federation (the server must be stopped; revoke its "
    "certificate first with `afl ca revoke`): delete every payload file, protocol message, "
    "report and declaration the coordinator holds from it, record what was deleted by SHA-256 in "
    "the audit record site-offboarded, and leave no deleted byte in the database files. Its "
    "enrolment, plan decisions and audit records stay (docs/operations.md §10.1).",
}


def _offboard(config: ServerConfig, *, site: str, by: str, reason: str) -> int:
    """`afl-server offboard` (docs/operations.md §10.1): with the server stopped and no run in
    flight, :meth:`Store.purge_site` the site; print what was deleted."""
    busy = port_in_use(config.listen)
    if busy:
        raise ConfigError(
            f"cannot offboard while afl-server runs on {config.listen} ({busy}): stop it first"
        )
    store = Store(config.state_dir, federation_id=config.federation_id)
    try:
        if site not in config.sites and store.enrolment(site) is None:
            raise ConfigError(f"site {site!r} is neither in server.toml [sites] nor enrolled")
        active = [r.run_id for r in store.runs(state="active")]
        if active:
            raise ConfigError(
                f"run {active[0]} is in flight: let it end (or `afl admin abort {active[0]}`), "
                "stop the server, then offboard"
            )
        detail = store.purge_site(site, by=by, reason=reason)
    finally:
        store.close()
    wal = store.path.with_name(f"{store.path.name}-wal")  # closing may have emptied it after all
    pending = store.scrub_pending and wal.is_file() and wal.stat().st_size > 0
    counts = {key: len(detail[key]) for key in ("payloads", "messages", "reports")}  # type: ignore[arg-type]
    print(
        f"site {site} offboarded by {by}: {counts['payloads']} payload file(s), "
        f"{counts['messages']} message(s), {counts['reports']} report(s) deleted and listed by "
        "SHA-256 in the audit record site-offboarded; its enrolment and audit records stay"
    )
    if site in config.sites:
        print(f"  next: remove [sites.{site}] from server.toml (and revoke its certificate)")
    if pending:
        print(
            f"afl-server offboard: another process was reading {store.path}, so its "
            "write-ahead log may still hold the deleted rows' bytes (M-175): stop it (afl-server "
            f"status, a backup tool) and run `afl-server offboard --site {site}` again",
            file=sys.stderr,
        )
        return 1
    return 0


def _ack_restore(config: ServerConfig, *, by: str, reason: str) -> int:
    """`afl-server ack-restore`: with the server stopped, abort the runs still in flight in the
    restored state (the sites may have completed their rounds: no round id of them is offered
    again), then count the acknowledgement with its audit record (docs/operations.md §9)."""
    busy = port_in_use(config.listen)
    if busy:
        raise ConfigError(
            f"cannot acknowledge a restore while afl-server runs on {config.listen} ({busy}): "
            "stop it first"
        )
    store = Store(config.state_dir, federation_id=config.federation_id)
    try:
        coordinator = Coordinator(config, store, load_identity_key(config))
        why = f"the coordinator's state was restored from a backup: {reason}"
        with coordinator.lock:
            active = [r.run_id for r in store.runs() if r.state == "active"]
            for run_id in active:
                coordinator.machine.abort_run(run_id, reason=why, by=by)
            count = store.acknowledge_restore(by=by, reason=reason, aborted_runs=active)
    finally:
        store.close()
    print(
        f"restore {count} acknowledged by {by} (audit record restore-acknowledged); runs "
        f"aborted: {', '.join(active) or 'none'}"
    )
    return 0


def _tool(name: str, argv: Sequence[str]) -> int:
    from afl.crypto.identity.kit_check import PROBLEM, report_lines
    from afl.server.daemon.check import check_server
    from afl.server.daemon.status import status_lines

    args = _tool_parser(name, _TOOLS[name]).parse_args(argv)
    refusal = insecure_refusal(f"afl-server {name}") if getattr(args, "insecure", False) else None
    if refusal is not None:
        print(refusal, file=sys.stderr)
        return 2
    try:
        config = load_config(args.config)
        if name == "status":
            print("\n".join(status_lines(config)))
            return 0
        if name == "ack-restore":
            return _ack_restore(config, by=args.by, reason=args.reason)
        if name == "offboard":
            return _offboard(config, site=args.site, by=args.by, reason=args.reason)
        if name == "backup":
            anchor = backup_state(config.state_dir, Path(args.out))
            print(
                f"backed up {config.state_dir} to {args.out}: {anchor['commits']} commits, "
                f"{anchor['audit_count']} audit records, head {str(anchor['audit_head'])[:16]}"
            )
            return 0
    except (ConfigError, StateError) as exc:
        print(f"afl-server {name}: {exc}", file=sys.stderr)
        return 2
    findings = check_server(config, insecure=args.insecure)
    print(f"afl-server check {config.path}")
    print("\n".join(report_lines(findings)))
    problems = sum(f.level == PROBLEM for f in findings)
    print(f"{problems} problem(s) found" if problems else "ready to start")
    return 1 if problems else 0


def _refuse(refused: RefusedState, *, seconds: float) -> None:
    """Serve the refusal for ``seconds`` (SIGTERM/SIGINT end it early)."""
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    refused.serve(seconds=seconds, stop=stop)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``afl-server`` console script; returns the exit code."""
    given = list(sys.argv[1:] if argv is None else argv)
    if given and given[0] in _TOOLS:
        return _tool(given[0], given[1:])
    args = _parser().parse_args(given)
    refusal = insecure_refusal("afl-server") if args.insecure else None
    if refusal is not None:
        print(refusal, file=sys.stderr)
        return 2
    configure_logging(getattr(logging, args.log_level))
    map_large_blocks()  # freed upload buffers go back to the OS (afl.core.memory)
    config: ServerConfig | None = None
    try:
        config = load_config(args.config)
        if args.listen:
            config = replace(config, listen=args.listen)
        if args.metrics_port is not None:
            config = replace(config, metrics_port=args.metrics_port)
        if args.metrics_address:
            config = replace(config, metrics_address=args.metrics_address)
        if args.insecure:
            print(INSECURE_WARNING, file=sys.stderr, flush=True)
            log.warning(INSECURE_WARNING)
        if args.refusal_serve_s is not None:
            config = replace(config, refusal_serve_s=args.refusal_serve_s)
        health_listen = f"{args.health_address}:{args.health_port}" if args.health_port else ""
        server = CoordinatorServer(config, insecure=args.insecure, health_listen=health_listen)
    except StateError as exc:
        print(f"afl-server: {exc}", file=sys.stderr, flush=True)
        if isinstance(exc, RefusedState) and config is not None:
            _refuse(exc, seconds=config.refusal_serve_s)
        return 2
    except ConfigError as exc:
        print(f"afl-server: {exc}", file=sys.stderr)
        return 2

    def on_signal(signum: int, frame: FrameType | None) -> None:
        log.info("signal received; stopping", extra={"signal": signum})
        threading.Thread(target=server.stop, daemon=True).start()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    port = server.start()
    print(f"afl-server listening on port {port}", file=sys.stderr, flush=True)
    server.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
