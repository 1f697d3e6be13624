"""`afl demo`'s progress: the stage of the federation read from the
coordinator's state, as the demo prints it on a terminal while the daemons run."""

from __future__ import annotations

from pathlib import Path

from afl.lab.demo.cmd import federation_stage
from afl.proto.v1 import coordinator_pb2 as pb
from afl.server.config import load_config
from afl.server.store import Store
from tests.e2e.loopback import SiteData
from tests.helpers.flower_nodes import CLASSES, small_federation

DATA = SiteData(d=8, classes=len(CLASSES), rows=40, rows_step=10, positive_rate=0.4, seed=3)


def test_the_stage_follows_the_coordinators_state(tmp_path: Path) -> None:
    fed = small_federation(tmp_path, DATA, k=3, mode="plaintext", allow_plaintext=True)
    assert federation_stage(fed) == "starting the coordinator and the sites"
    config = load_config(fed.server_config)
    store = Store(config.state_dir, federation_id=config.federation_id)
    try:
        assert federation_stage(fed) == "0 of 3 sites enrolled"
        store.create_round(
            round_id="r1-x", run_id="run-1", number=1, parent_round_id="",
            stage=pb.ROUND_STAGE_WAITING_FOR_PARTICIPANTS, participants=fed.site_ids,
            deadline_ms=0,
        )  # fmt: skip
        assert federation_stage(fed) == (
            "round 1 (r1-x): waiting for participants (0 of 3 sites enrolled)"
        )
        store.update_round("r1-x", stage=pb.ROUND_STAGE_UPLOAD, deadline_ms=0)
        assert federation_stage(fed) == "round 1 (r1-x): upload"
    finally:
        store.close()
