"""The two statuses a site must read rightly, over loopback gRPC (docs/protocol.md M-141, M-143):

* "try later" (RESOURCE_EXHAUSTED with the trailer ``wire.TRY_LATER_TRAILER``, what the servicer
  sends for a full disk or a per-site stream limit) is retried with back-off and logged with its
  cause; RESOURCE_EXHAUSTED without it (a payload above the wire limits) stays final;
* a coordinator that refuses its state (:mod:`afl.server.daemon.refusal`) answers every call with
  its reason and the trailer ``wire.REFUSAL_TRAILER``: the site stops at once with that reason,
  however long its retry window; the health service says NOT_SERVING.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from afl.client.config import TimingConfig
from afl.client.daemon.rpc import CoordinatorClient
from afl.client.daemon.transport import CoordinatorRefused, RemoteCallError, RetryPolicy
from afl.proto import wire
from afl.proto.v1 import coordinator_pb2 as pb
from afl.proto.v1 import coordinator_pb2_grpc as pb_grpc
from afl.server.daemon.observability import ServerMetrics
from afl.server.daemon.refusal import RefusedState, attach_refusal
from afl.server.errors import DiskFullError
from afl.server.servicer import _Thin

PATIENT = RetryPolicy(attempts=50, initial_s=0.01, max_s=0.05, window_s=600.0)


class _Coordinator:
    metrics = ServerMetrics()


class _FullDisk(_Thin, pb_grpc.CoordinatorServicer):
    """GetStatus through the servicer's one error mapping: refused for a full disk ``full``
    times, then answered; ``error`` replaces DiskFullError (another RESOURCE_EXHAUSTED)."""

    def __init__(self, full: int, error: Exception | None = None) -> None:
        self.coordinator = _Coordinator()  # type: ignore[assignment]
        self.full, self.calls, self.error = full, 0, error

    def _identify(self, context: grpc.ServicerContext) -> str:
        return "site-a"

    def GetStatus(self, request: pb.StatusRequest, context: grpc.ServicerContext) -> Any:
        def body(site: str) -> pb.StatusResponse:
            self.calls += 1
            if self.calls <= self.full:
                raise self.error or DiskFullError("the coordinator's disk is full (test)")
            return pb.StatusResponse(site_id=site)

        return self._call("GetStatus", context, body)


def _client(port: int, policy: RetryPolicy) -> tuple[grpc.Channel, CoordinatorClient]:
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    rpc = CoordinatorClient(
        pb_grpc.CoordinatorStub(channel),
        site_id="site-a",
        timing=TimingConfig(rpc_timeout_s=10.0),
        retry=policy,
    )
    return channel, rpc


@pytest.fixture
def full_disk_server() -> Iterator[tuple[int, _FullDisk]]:
    servicer = _FullDisk(full=4)  # type: ignore[abstract]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_CoordinatorServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield port, servicer
    server.stop(None)


def test_a_full_disk_is_retried_with_its_cause_logged(
    full_disk_server: tuple[int, _FullDisk], caplog: pytest.LogCaptureFixture
) -> None:
    port, servicer = full_disk_server
    channel, rpc = _client(port, PATIENT)
    with channel, caplog.at_level(logging.WARNING, logger="afl.client"):
        assert rpc.status().site_id == "site-a"
    assert servicer.calls == 5
    retried = [r.getMessage() for r in caplog.records if "RESOURCE_EXHAUSTED" in r.getMessage()]
    assert len(retried) == 4 and all("disk is full" in m for m in retried)


def test_resource_exhausted_without_the_try_later_trailer_stays_final(
    full_disk_server: tuple[int, _FullDisk],
) -> None:
    port, servicer = full_disk_server
    servicer.error = wire.WireLimitError("the payload exceeds max_upload_bytes")
    channel, rpc = _client(port, PATIENT)
    with channel, pytest.raises(RemoteCallError, match="RESOURCE_EXHAUSTED: the payload exceeds"):
        rpc.status()
    assert servicer.calls == 1


def test_a_refused_state_stops_the_site_at_once_with_the_reason() -> None:
    reason = "state/server.sqlite3 holds 3 commits but state/anchor.json records 9"
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    port = server.add_insecure_port("127.0.0.1:0")
    attach_refusal(server, reason, service_names=("", "afl.proto.v1.Coordinator"))
    refused = RefusedState(reason, server=server, port=port)
    stop = threading.Event()
    thread = threading.Thread(
        target=refused.serve, kwargs={"seconds": 120.0, "stop": stop}, daemon=True
    )
    thread.start()
    try:
        channel, rpc = _client(port, PATIENT)  # a 600 s window: only the trailer stops it
        with channel:
            with pytest.raises(CoordinatorRefused, match=r"refuses to start: .*records 9"):
                rpc.status()
            with pytest.raises(CoordinatorRefused, match="refuses to start"):
                rpc.upload(b"x" * 10, round_id="r1-a", release_name="gram")
            health = health_pb2_grpc.HealthStub(channel)
            answer = health.Check(
                health_pb2.HealthCheckRequest(service="afl.proto.v1.Coordinator"), timeout=10
            )
            assert answer.status == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        stop.set()
        thread.join(timeout=30)
    assert not thread.is_alive()
