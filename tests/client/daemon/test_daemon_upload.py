"""Chunked uploads with digests and retries (afl.client.daemon.transport; the framing itself is
tested in tests/proto/test_wire.py) against a tiny fake
Coordinator servicer on loopback gRPC."""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest

from afl.client.daemon.transport import (
    RemoteCallError,
    RetryPolicy,
    UploadError,
    upload_payload,
    with_retry,
)
from afl.proto.v1 import coordinator_pb2 as pb
from afl.proto.v1 import coordinator_pb2_grpc as pb_grpc
from afl.proto.wire import MAX_CHUNK_BYTES

FAST = RetryPolicy(attempts=4, initial_s=0.001, max_s=0.01)


class FakeCoordinator(pb_grpc.CoordinatorServicer):
    """Reassembles uploads like the real server: headers fixed, indices in order, digest checked;
    idempotent by (round, release, digest); fails the first ``fail_first`` calls UNAVAILABLE."""

    def __init__(self, fail_first: int = 0) -> None:
        self.fail_first = fail_first
        self.calls = 0
        self.stored: dict[tuple[str, str], bytes] = {}
        self.chunk_sizes: list[int] = []
        self.lock = threading.Lock()

    def Upload(self, request_iterator: Iterator[pb.UploadChunk], context: grpc.ServicerContext):
        with self.lock:
            self.calls += 1
            fail = self.calls <= self.fail_first
        chunks = list(request_iterator)
        if fail:
            context.abort(grpc.StatusCode.UNAVAILABLE, "try later")
        first = chunks[0]
        data = b""
        for i, c in enumerate(chunks):
            header = (c.round_id, c.release_name, c.total_chunks, c.total_bytes, c.kind)
            if c.chunk_index != i or header != (
                first.round_id, first.release_name, first.total_chunks, first.total_bytes,
                first.kind,
            ):  # fmt: skip
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "malformed chunks")
            self.chunk_sizes.append(len(c.data))
            data += c.data
        if len(chunks) != first.total_chunks or len(data) != first.total_bytes:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "truncated")
        digest = hashlib.sha256(data).digest()
        if chunks[-1].sha256 != digest:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "digest mismatch")
        key = (first.round_id, first.release_name)
        duplicate = False
        with self.lock:
            if key in self.stored:
                if self.stored[key] != data:
                    context.abort(grpc.StatusCode.ALREADY_EXISTS, "different payload")
                duplicate = True
            self.stored[key] = data
        return pb.UploadReceipt(
            round_id=first.round_id,
            release_name=first.release_name,
            sha256=digest,
            bytes_received=len(data),
            duplicate=duplicate,
        )


@pytest.fixture
def fake() -> Iterator[tuple[FakeCoordinator, pb_grpc.CoordinatorStub]]:
    servicer = FakeCoordinator()  # type: ignore[abstract]  # only Upload is needed
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_CoordinatorServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield servicer, pb_grpc.CoordinatorStub(channel)
    finally:
        channel.close()
        server.stop(None)


def test_upload_of_three_mib_uses_one_mib_chunks(fake) -> None:
    servicer, stub = fake
    payload = bytes(range(256)) * (3 * 4096 + 10)  # just over 3 MiB
    receipt = upload_payload(
        stub, payload, round_id="r1", release_name="gram[all]", policy=FAST, timeout_s=10
    )
    assert receipt.sha256 == hashlib.sha256(payload).digest() and not receipt.duplicate
    assert servicer.stored[("r1", "gram[all]")] == payload
    assert servicer.chunk_sizes == [MAX_CHUNK_BYTES] * 3 + [len(payload) - 3 * MAX_CHUNK_BYTES]


def test_retry_is_idempotent_and_conflict_is_refused(fake) -> None:
    servicer, stub = fake
    servicer.fail_first = 2
    receipt = upload_payload(
        stub, b"abc", round_id="r", release_name="b[A]", policy=FAST, timeout_s=5
    )
    assert servicer.calls == 3 and not receipt.duplicate
    again = upload_payload(
        stub, b"abc", round_id="r", release_name="b[A]", policy=FAST, timeout_s=5
    )
    assert again.duplicate and again.sha256 == receipt.sha256
    with pytest.raises(UploadError, match="already holds a different payload"):
        upload_payload(stub, b"abd", round_id="r", release_name="b[A]", policy=FAST, timeout_s=5)


def test_retries_run_out(fake) -> None:
    servicer, stub = fake
    servicer.fail_first = 100
    with pytest.raises(RemoteCallError, match="UNAVAILABLE: try later"):
        upload_payload(stub, b"abc", round_id="r", release_name="x", policy=FAST, timeout_s=5)
    assert servicer.calls == FAST.attempts


class _Rpc(grpc.RpcError):  # type: ignore[misc]
    def __init__(self, code: grpc.StatusCode) -> None:
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return "nope"


def test_with_retry_backs_off_exponentially_and_stops_on_final_codes() -> None:
    pauses: list[float] = []
    attempts = iter([grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, None])

    def call() -> str:
        code = next(attempts)
        if code is not None:
            raise _Rpc(code)
        return "ok"

    policy = RetryPolicy(attempts=5, initial_s=1.0, max_s=100.0, multiplier=2.0)
    assert with_retry(call, what="x", policy=policy, sleep=pauses.append) == "ok"
    assert 0.5 <= pauses[0] <= 1.0 and 1.0 <= pauses[1] <= 2.0

    def denied() -> str:
        raise _Rpc(grpc.StatusCode.PERMISSION_DENIED)

    with pytest.raises(RemoteCallError, match="PERMISSION_DENIED: nope"):
        with_retry(denied, what="x", policy=policy, sleep=pauses.append)
    assert len(pauses) == 2


def test_retries_last_for_the_window_so_a_restart_is_outlived(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A call keeps being retried for ``window_s`` even after ``attempts`` (a coordinator
    restart takes seconds); without a window the attempts are the budget."""
    clock = [0.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])

    def flaky(failures: int) -> Any:
        left = [failures]

        def call() -> str:
            if left[0]:
                left[0] -= 1
                raise _Rpc(grpc.StatusCode.UNAVAILABLE)
            return "ok"

        return call

    def sleep(seconds: float) -> None:
        clock[0] += seconds

    window = RetryPolicy(attempts=2, initial_s=1.0, max_s=2.0, window_s=30.0)
    assert with_retry(flaky(12), what="x", policy=window, sleep=sleep) == "ok"
    assert clock[0] >= 10.0  # well past two attempts, still inside the window
    with pytest.raises(RemoteCallError, match="UNAVAILABLE"):
        with_retry(flaky(100), what="x", policy=window, sleep=sleep)
    with pytest.raises(RemoteCallError):
        with_retry(flaky(3), what="x", policy=RetryPolicy(attempts=2), sleep=sleep)
