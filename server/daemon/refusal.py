"""A coordinator that refuses its state tells the sites why (docs/operations.md §8).

When the state folder is refused at start-up (:class:`afl.server.errors.StateError`: a rolled
back database, a missing payload, another federation's folder ...), afl-server does not just
exit: for ``[server] refusal_serve_s`` seconds (default 60; 0 = exit at once) it listens on its
address with its TLS kit and answers EVERY call with UNAVAILABLE, the reason as the details and
the trailing metadata :data:`afl.proto.wire.REFUSAL_TRAILER`; the gRPC health service reports
NOT_SERVING. A site that gets such an answer stops at once with the coordinator's reason instead
of retrying for its whole retry window. Then the server exits 2 (SIGTERM/SIGINT end the wait
early). With port 0 (tests) nothing could dial it, so it exits at once.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from afl.proto import wire

__all__ = ["RefuseEverything", "refusal_message", "serve_refusal"]

log = logging.getLogger("afl.server.daemon.refusal")


def refusal_message(reason: str) -> str:
    """What every refused call's details say."""
    return f"the coordinator refuses to start: {reason}"


class RefuseEverything(grpc.GenericRpcHandler):  # type: ignore[misc]
    """Answers every method (but the health service) with UNAVAILABLE and the refusal trailer."""

    def __init__(self, reason: str) -> None:
        self._message = refusal_message(reason)

    def service(self, handler_call_details: Any) -> grpc.RpcMethodHandler | None:
        if str(handler_call_details.method).startswith("/grpc.health."):
            return None
        return grpc.stream_stream_rpc_method_handler(self._refuse)

    def _refuse(self, requests: Any, context: grpc.ServicerContext) -> Iterator[bytes]:
        context.set_trailing_metadata(((wire.REFUSAL_TRAILER, "1"),))
        context.abort(grpc.StatusCode.UNAVAILABLE, self._message)
        yield b""  # pragma: no cover (abort raises)


def serve_refusal(
    bind: Callable[[grpc.Server], int],
    reason: str,
    *,
    seconds: float,
    stop: threading.Event,
    service_names: tuple[str, ...] = ("",),
) -> int:
    """Serve the refusal (module docstring) for ``seconds`` or until ``stop`` is set; ``bind``
    binds the listen address on the server it is given and returns the port. Returns the port
    it served on (0: not served)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    port = bind(server)
    health_servicer = health.HealthServicer()
    for name in service_names:
        health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    server.add_generic_rpc_handlers((RefuseEverything(reason),))
    server.start()
    log.warning(
        "refusing the state; answering every call with the reason",
        extra={"port": port, "seconds": seconds, "reason": reason},
    )
    try:
        stop.wait(seconds)
    finally:
        server.stop(1.0).wait()
    return port
