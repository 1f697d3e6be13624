"""The site's witness of the coordinator's state (afl.client.daemon.witness; docs/protocol.md
M-142): a coordinator behind what the site has seen is named in one line and refused until its
operator acknowledges the restore; what the site has seen is on disk before it acts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from afl.client.daemon.witness import RestoreDetected, RoundIdReused, Witness
from afl.proto.v1 import coordinator_pb2 as pb

PUBLISHED, ABORTED, REVIEW = (
    pb.ROUND_STAGE_PUBLISHED,
    pb.ROUND_STAGE_ABORTED,
    pb.ROUND_STAGE_PLAN_REVIEW,
)


def _round(
    round_id: str, *, run: str = "run-1", number: int = 1, stage: int = REVIEW
) -> pb.RoundStatus:
    return pb.RoundStatus(round_id=round_id, run_id=run, round_number=number, stage=stage)  # type: ignore[arg-type]


def _status(
    r: pb.RoundStatus | None = None, *, latest: str = "", acks: int = 0
) -> pb.StatusResponse:
    response = pb.StatusResponse(latest_model_round_id=latest, restores_acknowledged=acks)
    if r is not None:
        response.round.CopyFrom(r)
    return response


def _completed_run(tmp_path: Path) -> Witness:
    witness = Witness(tmp_path, site_id="site-a")
    r1 = _round("r1-aaaa")
    witness.observe(_status(r1))
    witness.join(r1)
    witness.complete(r1)
    witness.observe(_status(_round("r1-aaaa", stage=PUBLISHED), latest="r1-aaaa"))
    return witness


def test_what_the_site_saw_is_on_disk_before_it_acts(tmp_path: Path) -> None:
    witness = Witness(tmp_path, site_id="site-a")
    witness.join(_round("r1-aaaa"))
    assert json.loads((tmp_path / "witness.json").read_text())["joined"] == {
        "r1-aaaa": ["run-1", 1]
    }
    witness.complete(_round("r1-aaaa"))
    witness.observe(_status(latest="r1-aaaa"))
    again = Witness(tmp_path, site_id="site-a")  # a restarted site knows it all
    assert again.completed == {"r1-aaaa": ["run-1", 1]} and again.models == ["r1-aaaa"]


@pytest.mark.parametrize(
    ("claimed", "named"),
    [
        (_status(_round("r1-aaaa", stage=REVIEW), latest=""), "holds no model"),
        (_status(_round("r1-aaaa", stage=REVIEW), latest="r1-aaaa"), "offers round r1-aaaa again"),
        (_status(_round("r1-bbbb"), latest="r1-aaaa"), "completed round 1 of that run as r1-aaaa"),
    ],
)
def test_a_coordinator_behind_what_the_site_saw_is_refused_in_one_line(
    tmp_path: Path, claimed: pb.StatusResponse, named: str
) -> None:
    witness = _completed_run(tmp_path)
    with pytest.raises(RestoreDetected, match=named) as info:
        witness.observe(claimed)
    assert "\n" not in str(info.value) and "afl-server ack-restore" in str(info.value)


def test_an_older_latest_model_is_a_regression(tmp_path: Path) -> None:
    witness = _completed_run(tmp_path)
    witness.observe(_status(latest="r1-cccc"))  # a later run's model
    with pytest.raises(RestoreDetected, match="latest model is that of round r1-aaaa"):
        witness.observe(_status(latest="r1-aaaa"))


def test_the_coordinator_going_forward_is_no_regression(tmp_path: Path) -> None:
    witness = _completed_run(tmp_path)
    witness.observe(_status(_round("r2-bbbb", number=2), latest="r1-aaaa"))
    witness.observe(_status(_round("r1-dddd", run="run-2"), latest="r1-aaaa"))
    witness.observe(_status(_round("r1-aaaa", stage=PUBLISHED), latest="r1-aaaa"))


def test_an_acknowledged_restore_lets_the_site_take_part_again(tmp_path: Path) -> None:
    witness = _completed_run(tmp_path)
    behind = _status(_round("r1-eeee"), latest="")
    with pytest.raises(RestoreDetected):
        witness.observe(behind)
    behind.restores_acknowledged = 1
    witness.observe(behind)  # the operator acknowledged: the run goes on in a new round
    assert Witness(tmp_path, site_id="site-a").acknowledged == 1
    witness.observe(_status(_round("r1-aaaa", stage=ABORTED), acks=1))  # aborted at the ack
    with pytest.raises(RestoreDetected, match="offers round r1-aaaa again"):
        witness.observe(_status(_round("r1-aaaa", stage=REVIEW), acks=1))  # never again


def test_a_round_id_offered_again_in_another_run_is_named_as_a_reuse(tmp_path: Path) -> None:
    """No restore explains a completed round's id in another run (a restore brings back the run
    too): the site stops naming both runs, and tells the operator to report it, not to
    acknowledge a restore, which would not let it take part anyway."""
    witness = _completed_run(tmp_path)
    with pytest.raises(RoundIdReused) as info:
        witness.observe(_status(_round("r1-aaaa", run="run-2"), latest="r1-aaaa"))
    line = str(info.value)
    assert "\n" not in line and "offers a round id it used before" in line
    assert "round r1-aaaa in run-2, and this site completed round r1-aaaa in run-1" in line
    assert "ack-restore" not in line and "report it" in line
    witness.observe(_status(_round("r1-aaaa", stage=PUBLISHED), latest="r1-aaaa"))  # run-1's
