"""A site waiting after "enrolled": it logs what it waits for, a round that
listed it and was aborted before it took part ends its wait after ``linger_s`` (no day-long
wait), and the daemon then exits 4 (aborted) or 5 (left out), never 0 ("published and
verified"). The coordinator is a stub answering GetStatus from a script."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest

from afl.client.config import TimingConfig
from afl.client.daemon import rpc
from afl.client.daemon.loop import EXIT_ABORTED, EXIT_LEFT_OUT, EXIT_OK, ClientDaemon
from afl.client.daemon.transport import RetryPolicy
from afl.proto.v1 import coordinator_pb2 as pb

SITES = ["s1", "s2", "s3"]


class _Script:
    """GetStatus answers in order; the last one repeats."""

    def __init__(self, *answers: pb.StatusResponse) -> None:
        self.answers = list(answers)

    def GetStatus(self, request: Any, **kw: Any) -> pb.StatusResponse:
        return self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]


def _round(stage: pb.RoundStage.ValueType, reason: str = "") -> pb.StatusResponse:
    r = pb.RoundStatus(round_id="r1", round_number=1, stage=stage, participants=SITES)
    r.abort_reason = reason
    return pb.StatusResponse(enrolled=True, round=r)


def _client(stub: _Script) -> rpc.CoordinatorClient:
    timing = TimingConfig(poll_interval_s=0.001, max_poll_interval_s=0.001, linger_s=0.05)
    return rpc.CoordinatorClient(stub, site_id="s1", timing=timing, retry=RetryPolicy())


def test_a_waiting_site_says_what_it_waits_for_and_an_abort_ends_the_wait(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(rpc, "WAIT_LOG_INTERVAL_S", 0.0)  # every poll, instead of every minute
    stub = _Script(
        pb.StatusResponse(enrolled=True),
        _round(pb.ROUND_STAGE_WAITING_FOR_PARTICIPANTS),
        _round(pb.ROUND_STAGE_ABORTED, "site s2 refused the plan: max_epsilon"),
    )
    client = _client(stub)
    with caplog.at_level(logging.INFO, logger=rpc.log.name):
        # not lingering: without the abort this would wait max_wait_s (a day)
        assert client.wait_for_round(set(), lingering=False) is None
    text = caplog.text
    assert "site=s1 waiting for a round it takes part in: no round is open yet" in text
    assert "round r1 is waiting for its participants to enrol (s1, s2, s3)" in text
    assert client.passed == [
        (
            "r1",
            True,
            "round r1 was aborted before this site took part: site s2 refused the plan: "
            "max_epsilon",
        )
    ]
    daemon = SimpleNamespace(rpc=client, site_id="s1")
    with caplog.at_level(logging.ERROR):
        assert ClientDaemon._no_part(daemon, EXIT_OK) == EXIT_ABORTED  # type: ignore[arg-type]
    assert "took part in no round: round r1 was aborted" in caplog.text


def test_a_site_the_run_goes_on_without_exits_5_and_a_restarted_one_0() -> None:
    left_out = pb.StatusResponse(enrolled=True, note="backbone resnet18 differs from the run's")
    r = left_out.round
    r.CopyFrom(pb.RoundStatus(round_id="r1", stage=pb.ROUND_STAGE_UPLOAD, participants=SITES[1:]))
    client = _client(_Script(left_out))
    assert client.wait_for_round(set(), lingering=True) is None
    assert client.passed == [("r1", False, "backbone resnet18 differs from the run's")]
    daemon = SimpleNamespace(rpc=client, site_id="s1")
    assert ClientDaemon._no_part(daemon, EXIT_OK) == EXIT_LEFT_OUT  # type: ignore[arg-type]
    nothing = SimpleNamespace(rpc=_client(_Script(pb.StatusResponse(enrolled=True))), site_id="s1")
    assert ClientDaemon._no_part(nothing, EXIT_OK) == EXIT_OK  # type: ignore[arg-type]
