"""`afl-server --config server.toml [--insecure]`: the coordinator daemon (docs/operations.md,
docs/architecture.md §2).

Mutual TLS by default (the kit's ca.pem, server.pem, server.key; clients must present a
certificate of the federation CA); ``--insecure`` serves plaintext gRPC for development only and
prints a loud warning (the caller's site id then comes from a metadata header). Also serves the
gRPC health service, Prometheus metrics on ``[server] metrics_port`` (or ``--metrics-port``),
JSON-lines logs on stderr, and stops gracefully on SIGTERM/SIGINT. State lives in
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
from types import FrameType
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from afl.crypto.errors import KeyFormatError
from afl.crypto.signatures import load_private_key_pem, public_key_to_raw
from afl.proto.v1 import coordinator_pb2_grpc
from afl.server.config import ServerConfig, load_config
from afl.server.coordinator import Coordinator
from afl.server.errors import ConfigError, StateError
from afl.server.limits import worker_threads
from afl.server.observability import ServerMetrics, configure_logging, start_metrics_http
from afl.server.servicer import CoordinatorServicer
from afl.server.store import Store

__all__ = ["SERVICE_NAME", "CoordinatorServer", "main"]

SERVICE_NAME = "afl.proto.v1.Coordinator"
INSECURE_WARNING = (
    "WARNING: afl-server is running with --insecure: NO TLS, NO client authentication; any "
    "caller can claim any site id. Statistics cross the network in the clear. Development only."
)
log = logging.getLogger("afl.server.daemon")


class CoordinatorServer:
    """One afl-server: gRPC server, coordinator, store, timeout ticker and metrics."""

    def __init__(
        self, config: ServerConfig, *, insecure: bool = False, tick_s: float = 0.5
    ) -> None:
        self.config, self.insecure, self._tick_s = config, insecure, tick_s
        try:
            key = load_private_key_pem(config.identity_key.read_bytes())
        except (OSError, KeyFormatError) as exc:
            raise ConfigError(f"cannot load the identity key {config.identity_key}: {exc}") from exc
        if public_key_to_raw(key) != config.identity_public_key:
            raise ConfigError("[identity] public_key does not match the identity key file")
        self.metrics = ServerMetrics()
        self.store = Store(config.state_dir, federation_id=config.federation_id)
        self.coordinator = Coordinator(config, self.store, key, metrics=self.metrics)
        self._stopped = threading.Event()
        self._health = health.HealthServicer()
        workers = worker_threads(config.limits, sites=len(config.sites))
        self._grpc = grpc.server(futures.ThreadPoolExecutor(max_workers=workers))
        servicer = CoordinatorServicer(
            self.coordinator, insecure=insecure, stopping=self._stopped.is_set
        )
        coordinator_pb2_grpc.add_CoordinatorServicer_to_server(servicer, self._grpc)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._grpc)
        self.port = self._bind(config.listen)
        self._ticker = threading.Thread(target=self._tick_loop, name="afl-ticker", daemon=True)
        self._metrics_http: Any = None

    def _bind(self, listen: str) -> int:
        if self.insecure:
            port = int(self._grpc.add_insecure_port(listen))
        else:
            credentials = grpc.ssl_server_credentials(
                [(self.config.key.read_bytes(), self.config.cert.read_bytes())],
                root_certificates=self.config.ca_cert.read_bytes(),
                require_client_auth=True,
            )
            port = int(self._grpc.add_secure_port(listen, credentials))
        if port == 0:
            raise ConfigError(f"cannot listen on {listen}")
        return port

    def _tick_loop(self) -> None:
        while not self._stopped.wait(self._tick_s):
            try:
                self.coordinator.tick()
            except Exception:  # keep serving; the failure is logged
                log.exception("timeout tick failed")

    def start(self) -> int:
        """Start serving; returns the bound port."""
        self._grpc.start()
        for service in ("", SERVICE_NAME):
            self._health.set(service, health_pb2.HealthCheckResponse.SERVING)
        self._ticker.start()
        if self.config.metrics_port:
            self._metrics_http = start_metrics_http(self.metrics, port=self.config.metrics_port)
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
        self._health.enter_graceful_shutdown()
        self._grpc.stop(grace).wait()
        if self._ticker.is_alive():
            self._ticker.join(timeout=5)
        if self._metrics_http is not None:
            http_server = self._metrics_http[0] if isinstance(self._metrics_http, tuple) else None
            if http_server is not None:
                http_server.shutdown()
        self.store.close()
        log.info("afl-server stopped")

    def wait(self) -> None:
        """Block until :meth:`stop` is called."""
        self._stopped.wait()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="afl-server",
        description=(
            "The afl coordinator: enrols the federation's sites, publishes signed release "
            "plans, aggregates under the configured protection and publishes the signed model."
        ),
    )
    parser.add_argument("--config", required=True, help="server.toml from `afl provision`")
    parser.add_argument(
        "--insecure", action="store_true", help="DEVELOPMENT ONLY: no TLS, no client auth"
    )
    parser.add_argument("--listen", default=None, help="override [server] listen (host:port)")
    parser.add_argument("--metrics-port", type=int, default=None, help="Prometheus port")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING"])
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``afl-server`` console script; returns the exit code."""
    args = _parser().parse_args(argv)
    configure_logging(getattr(logging, args.log_level))
    try:
        config = load_config(args.config)
        if args.listen:
            config = replace(config, listen=args.listen)
        if args.metrics_port is not None:
            config = replace(config, metrics_port=args.metrics_port)
        if args.insecure:
            print(INSECURE_WARNING, file=sys.stderr, flush=True)
            log.warning(INSECURE_WARNING)
        server = CoordinatorServer(config, insecure=args.insecure)
    except (ConfigError, StateError) as exc:
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
