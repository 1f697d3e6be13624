"""A site's wait for a stage (afl.client.daemon.rpc): with the WatchRounds stream up, a wait that
reads only the stage ends on the stream's event of that stage without another GetStatus; a wait
that reads the caller's own fields asks GetStatus again; a stream that closes forgets what it
showed; an abort announced on the stream ends the wait with its reason; while the stream shows
the round at an earlier stage, a wait reads GetStatus only as the safety net (or, when it needs
the status, once the stream shows the stage). The coordinator is a stub
whose stream delivers the stage's event when the first GetStatus has been answered."""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

import grpc
import pytest

from afl.client.config import TimingConfig
from afl.client.daemon import rpc
from afl.client.daemon.transport import RetryPolicy
from afl.proto.v1 import coordinator_pb2 as pb


class _Stream:
    """A WatchRounds call: events put into ``queue`` in order; ``cancel`` ends it."""

    def __init__(self) -> None:
        self.queue: queue.Queue[pb.RoundEvent | None] = queue.Queue()

    def __iter__(self) -> _Stream:
        return self

    def __next__(self) -> pb.RoundEvent:
        item = self.queue.get(timeout=30)
        if item is None:
            raise StopIteration
        return item

    def cancel(self) -> None:
        self.queue.put(None)


class _GoneAway(grpc.RpcError):  # type: ignore[misc]
    """What a stream re-opened at a coordinator without WatchRounds raises."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNIMPLEMENTED


def _status(stage: pb.RoundStage.ValueType, reason: str = "") -> pb.RoundStatus:
    return pb.RoundStatus(round_id="r1", stage=stage, abort_reason=reason)


class _Coordinator:
    """GetStatus answers ``at`` (the caller's uploads listed); the first answer makes the stream
    announce ``then``, as a coordinator closing the stage right after the site asked."""

    def __init__(self, at: pb.RoundStatus, then: pb.RoundStatus) -> None:
        self.at, self.then = at, then
        self.status_calls = 0
        self.stream = _Stream()
        self.streams = 0

    def WatchRounds(self, request: Any, **kw: Any) -> _Stream:
        self.streams += 1
        if self.streams > 1:  # re-opened after it ended: the site polls from then on
            raise _GoneAway()
        return self.stream

    def GetStatus(self, request: Any, **kw: Any) -> pb.StatusResponse:
        self.status_calls += 1
        if self.status_calls == 1:
            self.stream.queue.put(pb.RoundEvent(sequence=1, status=self.then))
        answer = pb.StatusResponse(enrolled=True, round=self.at)
        answer.round.caller_uploads_complete.append("gram[all]")
        return answer


def _client(stub: _Coordinator) -> rpc.CoordinatorClient:
    # No safety-net poll within the test: only the stream's event can end a wait early.
    timing = TimingConfig(poll_interval_s=0.01, max_poll_interval_s=60.0, max_wait_s=60.0)
    client = rpc.CoordinatorClient(stub, site_id="s1", timing=timing, retry=RetryPolicy())
    watcher = client.watch()
    deadline = time.monotonic() + 30
    while not watcher.connected and time.monotonic() < deadline:
        time.sleep(0.01)
    assert watcher.connected
    return client


def test_a_stage_only_wait_ends_on_the_streamed_event_without_another_status_call() -> None:
    stub = _Coordinator(
        _status(pb.ROUND_STAGE_SHARE_KEYS), then=_status(pb.ROUND_STAGE_CONSISTENCY_CHECK)
    )
    client = _client(stub)
    try:
        r = client.await_stage("r1", at_least=pb.ROUND_STAGE_CONSISTENCY_CHECK, stage_only=True)
    finally:
        client.close()
    assert r.stage == pb.ROUND_STAGE_CONSISTENCY_CHECK
    assert stub.status_calls == 1  # the status read before the wait, none after the event


def test_a_wait_that_reads_its_own_fields_asks_the_coordinator() -> None:
    stub = _Coordinator(_status(pb.ROUND_STAGE_UPLOAD), then=_status(pb.ROUND_STAGE_UPLOAD))
    stub.at = _status(pb.ROUND_STAGE_PLAN_REVIEW)
    client = _client(stub)
    answers = [_status(pb.ROUND_STAGE_PLAN_REVIEW), _status(pb.ROUND_STAGE_UPLOAD)]

    def status(request: Any, **kw: Any) -> pb.StatusResponse:
        stub.at = answers.pop(0) if len(answers) > 1 else answers[0]
        return _Coordinator.GetStatus(stub, request)

    stub.GetStatus = status  # type: ignore[method-assign]
    try:
        r = client.await_stage("r1", at_least=pb.ROUND_STAGE_UPLOAD)
    finally:
        client.close()
    assert r.stage == pb.ROUND_STAGE_UPLOAD
    assert list(r.caller_uploads_complete) == ["gram[all]"]  # GetStatus's answer, not the event's
    assert stub.status_calls == 2


def test_an_abort_on_the_stream_ends_the_wait_with_its_reason() -> None:
    stub = _Coordinator(
        _status(pb.ROUND_STAGE_SHARE_KEYS),
        then=_status(pb.ROUND_STAGE_ABORTED, "too few survivors"),
    )
    client = _client(stub)
    try:
        with pytest.raises(rpc.RoundFailed, match="round aborted: too few survivors"):
            client.await_stage("r1", at_least=pb.ROUND_STAGE_UNMASK, stage_only=True)
    finally:
        client.close()
    assert stub.status_calls == 1


def test_a_closed_stream_forgets_what_it_showed() -> None:
    stub = _Coordinator(_status(pb.ROUND_STAGE_UNMASK), then=_status(pb.ROUND_STAGE_UNMASK))
    client = _client(stub)
    watcher = client.watcher
    assert watcher is not None
    try:
        stub.stream.queue.put(pb.RoundEvent(sequence=1, status=_status(pb.ROUND_STAGE_UNMASK)))
        deadline = time.monotonic() + 30
        while watcher.reached("r1", pb.ROUND_STAGE_UNMASK) is None:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert watcher.reached("r1", pb.ROUND_STAGE_PUBLISHED) is None  # an earlier stage
        assert watcher.reached("r2", pb.ROUND_STAGE_UNMASK) is None  # another round
        stub.stream.cancel()  # the coordinator went away: the stream ends, none is re-opened
        while not watcher.unavailable:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert not watcher.connected and not watcher.latest
        assert watcher.reached("r1", pb.ROUND_STAGE_UNMASK) is None
    finally:
        client.close()


class _Barrier(_Coordinator):
    """A coordinator whose stream has announced the round at SHARE_KEYS before the wait; it
    answers GetStatus with ``at`` and announces nothing more unless the test says so."""

    def __init__(self, at: pb.RoundStatus) -> None:
        super().__init__(at, then=at)
        self.stream.queue.put(pb.RoundEvent(sequence=1, status=_status(pb.ROUND_STAGE_SHARE_KEYS)))

    def GetStatus(self, request: Any, **kw: Any) -> pb.StatusResponse:
        self.status_calls += 1
        return pb.StatusResponse(enrolled=True, round=self.at)


def _shown(client: rpc.CoordinatorClient) -> rpc.RoundWatcher:
    watcher = client.watcher
    assert watcher is not None
    deadline = time.monotonic() + 30
    while not watcher.shows("r1"):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return watcher


@pytest.mark.parametrize("stage_only", [True, False])
def test_a_wait_on_a_round_the_stream_shows_reads_no_status_until_its_stage(
    stage_only: bool,
) -> None:
    """K sites waiting at a barrier do not each read GetStatus on every event: the stream shows
    the round, so its next stages arrive on it (the intermediate one included). A wait that needs
    the status (not ``stage_only``) reads it once, when the stream shows the stage."""
    stub = _Barrier(_status(pb.ROUND_STAGE_SHARE_KEYS))
    client = _client(stub)
    _shown(client)
    later = [pb.ROUND_STAGE_UPLOAD, pb.ROUND_STAGE_CONSISTENCY_CHECK]

    def announce() -> None:
        for number, stage in enumerate(later, start=2):
            time.sleep(0.2)
            stub.at = _status(stage)  # committed, then announced
            stub.stream.queue.put(pb.RoundEvent(sequence=number, status=_status(stage)))

    thread = threading.Thread(target=announce)
    thread.start()
    try:
        r = client.await_stage(
            "r1", at_least=pb.ROUND_STAGE_CONSISTENCY_CHECK, stage_only=stage_only
        )
    finally:
        thread.join()
        client.close()
    assert r.stage == pb.ROUND_STAGE_CONSISTENCY_CHECK
    assert stub.status_calls == (0 if stage_only else 1)


def test_a_stream_that_announces_nothing_more_is_backed_by_the_safety_net_poll() -> None:
    """The stream shows the round and then falls silent: the wait reads GetStatus once
    ``max_poll_interval_s`` after it began (never before: a lower bound, whatever the load)."""
    stub = _Barrier(_status(pb.ROUND_STAGE_CONSISTENCY_CHECK))  # the stage's event never comes
    reads: list[float] = []
    counted = stub.GetStatus

    def status(request: Any, **kw: Any) -> pb.StatusResponse:
        reads.append(time.monotonic())
        return counted(request, **kw)

    stub.GetStatus = status  # type: ignore[method-assign]
    timing = TimingConfig(poll_interval_s=0.01, max_poll_interval_s=0.5, max_wait_s=60.0)
    client = rpc.CoordinatorClient(stub, site_id="s1", timing=timing, retry=RetryPolicy())
    client.watch()
    _shown(client)
    began = time.monotonic()
    try:
        r = client.await_stage("r1", at_least=pb.ROUND_STAGE_CONSISTENCY_CHECK, stage_only=True)
    finally:
        client.close()
    assert r.stage == pb.ROUND_STAGE_CONSISTENCY_CHECK
    assert len(reads) == 1 and reads[0] - began >= 0.5


class _StoppedMeanwhile:
    """A coordinator whose WatchRounds is answered while the watcher is being stopped: the
    stop flag is set after the watcher checked it and before it holds the new call."""

    def __init__(self) -> None:
        self.watcher: rpc.RoundWatcher | None = None
        self.stream = _Stream()

    def WatchRounds(self, request: Any, **kw: Any) -> _Stream:
        assert self.watcher is not None
        self.watcher._stopped.set()  # what stop() does first, before it reads the call
        return self.stream


def test_a_stream_opened_while_the_watcher_stops_is_cancelled_and_let_go() -> None:
    """No WatchRounds thread outlives the daemon's stop: a thread left in a gRPC call when the
    interpreter finalizes would hang the daemon's exit (CHANGELOG, Fixed)."""
    stub = _StoppedMeanwhile()
    watcher = rpc.RoundWatcher(stub)
    stub.watcher = watcher
    watcher.start()
    watcher._thread.join(timeout=20)  # the stream would block for 30 s if nobody cancelled it
    assert not watcher._thread.is_alive()
    watcher.stop()
    assert watcher._call is None  # dropped while every thread runs, not at exit
