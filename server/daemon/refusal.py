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
from collections.abc import Iterator
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from afl.proto import wire
from afl.server.errors import StateError

__all__ = ["RefuseEverything", "RefusedState", "attach_refusal", "refusal_message"]

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


def attach_refusal(
    server: grpc.Server, reason: str, *, service_names: tuple[str, ...] = ("",)
) -> None:
    """Make the not yet started ``server`` answer every call with the refusal and its health
    service NOT_SERVING for ``service_names``."""
    health_servicer = health.HealthServicer()
    for name in service_names:
        health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    server.add_generic_rpc_handlers((RefuseEverything(reason),))


class RefusedState(StateError):
    """The state is refused; ``server`` (bound to the listen address, not started) carries the
    refusal (:func:`attach_refusal`) for :meth:`serve`."""

    def __init__(self, reason: str, *, server: grpc.Server, port: int) -> None:
        super().__init__(reason)
        self.server, self.port = server, port

    def serve(self, *, seconds: float, stop: threading.Event) -> None:
        """Answer the sites with the reason for ``seconds`` or until ``stop`` is set."""
        self.server.start()
        log.warning(
            "refusing the state; answering every call with the reason",
            extra={"port": self.port, "seconds": seconds, "reason": str(self)},
        )
        try:
            stop.wait(seconds)
        finally:
            self.server.stop(1.0).wait()
