"""`afl-server status` (afl.server.daemon.status) after what an operator did:
a deliberate abort followed by a run that published is history, not the last error; uploads
whose payload files retention deleted are not counted as stored."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from afl.ops.provisioning import ProvisionedFederation
from afl.proto.v1 import coordinator_pb2 as pb
from afl.server.config import load_config
from afl.server.daemon.main import main as server_main
from afl.server.daemon.status import status_lines
from afl.server.store import Store
from tests.helpers.federation import FederationSpec

SITES = ["s1", "s2", "s3"]
FEDERATION = FederationSpec(
    sites=SITES,
    federation_id="fed-status",
    round_settings={"classes": ["A", "B"], "feature_dim": 4},
)


def _round(store: Store, round_id: str, *, stage: int, reason: str = "") -> None:
    store.create_round(
        round_id=round_id, run_id=f"run-{round_id}", number=1, parent_round_id="",
        stage=pb.ROUND_STAGE_WAITING_FOR_PARTICIPANTS, participants=SITES, deadline_ms=0,
    )  # fmt: skip
    store.update_round(round_id, stage=stage, deadline_ms=0, abort_reason=reason)


def test_an_old_abort_is_not_the_last_error_and_purged_uploads_are_not_stored(
    federation: ProvisionedFederation, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = replace(load_config(federation.server_dir / "server.toml"), state_dir=tmp_path)
    store = Store(tmp_path, federation_id="fed-status")
    try:
        _round(store, "r1-aborted", stage=pb.ROUND_STAGE_ABORTED, reason="aborted by admin alice")
        lines = "\n".join(status_lines(config))
        assert "last error: round r1-aborted ABORTED: aborted by admin alice" in lines
        _round(store, "r2-published", stage=pb.ROUND_STAGE_PUBLISHED)
        for site in SITES:
            store.put_upload("r2-published", site, "gram[all]", data=b"x", sha256=bytes(32))
        store.put_model("r2-published", model=b"m", signature=b"s")
        lines = "\n".join(status_lines(config))
        assert "s1                   no decision; 1 upload(s) stored\n" in lines + "\n"
        assert store.purge_payloads(["r2-published"]) == 3  # [retention] payload_days
    finally:
        store.close()
    text = "\n".join(status_lines(config))
    assert "last error: none" in text and "ABORTED" not in text
    assert "s1                   no decision; 0 upload(s) stored; 1 deleted by retention" in text
    path = federation.server_dir / "status.toml"
    path.write_text(
        (federation.server_dir / "server.toml")
        .read_text()
        .replace('state_dir = "state"', f'state_dir = "{tmp_path}"')
    )
    assert server_main(["status", "--config", str(path)]) == 0
    assert "last error: none" in capsys.readouterr().out
