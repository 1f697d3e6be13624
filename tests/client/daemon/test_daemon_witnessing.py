"""When a site witnesses the federation log on its status answers (``ClientDaemon._observe``,
docs/protocol.md §11a): at once on a new round, stage (outside its own round) or published model,
again every ``IDLE_WITNESS_S`` while a quorum may wait on it (waiting for a round, its plan
review, after the model), and not again during the exchange of a round it takes part in, where
no site's quorum waits until the model; while the site runs that round, not at its solve or model
either (its own release check witnesses then), nor right after it on the answers that show that
round published (the release check witnessed the checkpoint that holds its release)."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

from afl.client.daemon.loop import ClientDaemon, witness_key
from afl.client.daemon.transparency import IDLE_WITNESS_S
from afl.proto.v1 import coordinator_pb2 as pb

S = pb.RoundStage


def _answer(stage: int, participants: tuple[str, ...] = ("s1", "s2"), model: str = "") -> Any:
    r = pb.RoundStatus(round_id="r1", round_number=1, stage=stage, participants=participants)  # type: ignore[arg-type]
    return pb.StatusResponse(enrolled=True, round=r, latest_model_round_id=model)


class _Site(SimpleNamespace):
    """The attributes ``_observe`` reads, and a record of each witnessing."""

    def __init__(self) -> None:
        super().__init__(
            site_id="s1", _witnessed_key=None, _witnessed_at=0.0, calls=[], _running_round=""
        )
        self.witness = SimpleNamespace(observe=lambda response: None)

    def _witness_log(self, now: float | None = None) -> None:
        self.calls.append(now)
        self._witnessed_at = 0.0 if now is None else now

    def observe(self, answer: Any, *, later: bool = True) -> bool:
        """Whether this status answer made the site witness; ``later``: as if the idle
        interval had passed since it last did."""
        if later:
            self._witnessed_at -= 2 * IDLE_WITNESS_S
        before = len(self.calls)
        ClientDaemon._observe(self, answer)  # type: ignore[arg-type]
        return len(self.calls) > before


def test_a_site_rewitnesses_while_a_quorum_may_wait_on_it_and_not_in_its_exchange() -> None:
    site = _Site()
    assert site.observe(_answer(S.ROUND_STAGE_WAITING_FOR_PARTICIPANTS))  # a new round
    assert not site.observe(_answer(S.ROUND_STAGE_PLAN_REVIEW), later=False)
    assert site.observe(_answer(S.ROUND_STAGE_PLAN_REVIEW))  # others' plan checks may wait
    for stage in (S.ROUND_STAGE_ADVERTISE_KEYS, S.ROUND_STAGE_UPLOAD, S.ROUND_STAGE_UNMASK):
        assert not site.observe(_answer(stage)), stage  # its own exchange: no quorum waits
    assert site.observe(_answer(S.ROUND_STAGE_SOLVING))  # the model's release follows
    assert site.observe(_answer(S.ROUND_STAGE_PUBLISHED, model="r1"))
    assert site.observe(_answer(S.ROUND_STAGE_PUBLISHED, model="r1"))  # idle again


def test_a_site_outside_the_round_witnesses_every_stage_and_every_interval() -> None:
    site = _Site()
    outside = ("s2", "s3")
    assert site.observe(_answer(S.ROUND_STAGE_PLAN_REVIEW, outside))
    assert site.observe(_answer(S.ROUND_STAGE_UPLOAD, outside), later=False)  # a new stage
    assert not site.observe(_answer(S.ROUND_STAGE_UPLOAD, outside), later=False)
    assert site.observe(_answer(S.ROUND_STAGE_UPLOAD, outside))  # the interval passed


def test_a_site_running_its_round_leaves_the_model_to_its_release_check() -> None:
    """While ``run_round`` waits for the model, neither the solve nor the published model is
    witnessed on the status answer it waits for (the round's release check witnesses right
    after, off that answer); once the round is over the model is witnessed as usual."""
    site = _Site()
    site._running_round = "r1"
    assert site.observe(_answer(S.ROUND_STAGE_PLAN_REVIEW))  # its plan review: quorums wait
    for stage in (S.ROUND_STAGE_UPLOAD, S.ROUND_STAGE_SOLVING, S.ROUND_STAGE_VALIDATING):
        assert not site.observe(_answer(stage)), stage
    assert not site.observe(_answer(S.ROUND_STAGE_PUBLISHED, model="r1"))
    site._running_round = ""  # the round is over
    assert site.observe(_answer(S.ROUND_STAGE_PUBLISHED, model="r1"), later=False)
    outside = ("s2", "s3")  # another run's round, while this site runs r1: witnessed
    site._running_round = "r1"
    other = _answer(S.ROUND_STAGE_UPLOAD, outside)
    other.round.round_id = "r2"
    assert site.observe(other, later=False)


def test_after_its_release_check_the_published_round_is_witnessed_after_the_interval() -> None:
    """The model step records the key of the round's published status (``witness_key`` of the
    status it waited for, as ``run_round`` does once its release check passed): the status
    answers after the round that show it published add no witnessing step until
    ``IDLE_WITNESS_S`` passed; a new round, or another model, is witnessed at once."""
    site = _Site()
    published = _answer(S.ROUND_STAGE_PUBLISHED, model="r1")
    site._witnessed_key = witness_key(published.round, "r1", site_id="s1")
    site._witnessed_at = time.monotonic()
    assert not site.observe(published, later=False)
    assert site.observe(published)  # the interval passed
    site._witnessed_key = witness_key(published.round, "r1", site_id="s1")
    nxt = _answer(S.ROUND_STAGE_WAITING_FOR_PARTICIPANTS, model="r1")
    nxt.round.round_id = "r2"
    assert site.observe(nxt, later=False)
    site._witnessed_key = witness_key(published.round, "r1", site_id="s1")
    assert site.observe(_answer(S.ROUND_STAGE_PUBLISHED, model="r0"), later=False)
