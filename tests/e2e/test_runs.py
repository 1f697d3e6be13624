"""Many runs on one federation, driven by `afl admin`, without restarting any daemon; a site that
never answers the plan does not stop the others; sites follow rounds by stream, and by polling
when the server offers no stream (docs/operations.md "Runs and the admin interface")."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

from afl.core.aggregation import federated_solve
from afl.lab.demo.federation import mask_round_settings, prepare_loopback, run_loopback
from afl.proto.v1 import coordinator_pb2 as pb
from tests.e2e import vanishing_client
from tests.e2e.loopback import SiteData, cached_statistics
from tests.e2e.processes import Daemons, admin_cli
from tests.helpers.numeric import relative_error

CLASSES = ("A", "B", "C")
DATA = SiteData(d=12, classes=len(CLASSES), rows=90, rows_step=10, positive_rate=0.4, seed=8)


def _federation(root: Path, sites: int, *, serve: bool = True, **round_settings: Any) -> Any:
    feats, labels = DATA.draw(sites)
    settings: dict[str, Any] = {
        "gram_scope": "global",
        "upload_timeout_s": 300.0,
        **mask_round_settings(feats),
        **round_settings,
    }
    return prepare_loopback(
        root,
        classes=CLASSES,
        site_features=feats,
        site_labels=labels,
        active=np.ones((sites, len(CLASSES)), dtype=bool),
        test_features=feats[0][:20],
        test_labels=labels[0][:20],
        round_settings=settings,
        client_settings={"serve": serve},
    )


def test_three_runs_through_afl_admin_without_restarting_a_daemon(tmp_path: Path) -> None:
    loop = _federation(tmp_path, 3)
    stats, _ = cached_statistics(loop, list(loop.site_ids))
    daemons = Daemons(loop)
    try:
        daemons.start_server()
        daemons.start_clients()
        assert daemons.wait_run("run-1").state == "published"
        second = tmp_path / "second.toml"
        second.write_text('classes = ["A", "B"]\n', encoding="utf-8")
        assert "submitted run-2" in admin_cli(loop, "submit", str(second), "--name", "two classes")
        third = tmp_path / "third.toml"
        third.write_text("[round]\nrounds = 2\n", encoding="utf-8")
        assert "submitted run-3" in admin_cli(loop, "submit", str(third), "--name", "refined")
        for run_id in ("run-2", "run-3"):
            assert daemons.wait_run(run_id).state == "published", daemons.log_tail()
        listing = admin_cli(loop, "ls").splitlines()
        assert len(listing) == 3 and all(" published " in line for line in listing), listing
        for run_id, line in zip(("run-1", "run-2", "run-3"), listing, strict=True):
            digest = hashlib.sha256(
                pb.Model.FromString(daemons.model(run_id).model).SerializeToString()
            )
            assert line.startswith(run_id) and f"sha256:{digest.hexdigest()[:16]}" in line
        status = admin_cli(loop, "status", "run-3")
        assert "round 1" in status and "round 2" in status and "PUBLISHED" in status
        out = tmp_path / "run-2.model"
        assert "signature verified" in admin_cli(loop, "download-model", "run-2", "--out", str(out))
        model = pb.Model.FromString(pb.SignedModel.FromString(out.read_bytes()).model)
        assert list(model.class_names) == ["A", "B"]
        w = np.frombuffer(model.weights.data, dtype="<f8").reshape(tuple(model.weights.shape))
        two = [  # the oracle on classes A and B
            dataclasses.replace(
                s, b=s.b[:, :2], contributes=s.contributes[:2], n_pos=s.n_pos[:2], n_neg=s.n_neg[:2]
            )
            for s in stats
        ]
        oracle, _ = federated_solve(two, gamma=1.0, gram_scope="global")
        assert relative_error(w, oracle) <= 1e-9
        logs = [
            json.loads(line) for line in admin_cli(loop, "logs", "run-2", "--json").splitlines()
        ]
        rounds = {r.round_id for r in daemons.wait_run("run-2").round_history}
        assert logs and all(
            r["detail"].get("run_id") == "run-2" or r["detail"].get("round_id") in rounds
            for r in logs
        )
        assert any(r["event"] == "run-finished" for r in logs)
    finally:
        code = daemons.stop()
    assert code == 0, daemons.log_tail()


def test_a_site_silent_at_plan_review_does_not_stop_the_others(tmp_path: Path) -> None:
    loop = _federation(tmp_path, 4, serve=False, upload_timeout_s=20.0, min_participants=3)
    silent = {"site-4": vanishing_client.command("plan-review")}
    run = run_loopback(loop, timeout_s=300, client_commands=silent)
    assert run.client_rcs["site-4"] == vanishing_client.EXIT_CODE, run.logs
    rest = ["site-1", "site-2", "site-3"]
    assert all(run.client_rcs[s] == 0 for s in rest), run.logs
    stats, _ = cached_statistics(loop, rest)
    oracle, _ = federated_solve(stats, gamma=1.0, gram_scope="global")
    for site in rest:
        report = run.final_report(site)
        assert report["model"]["contributors"] == rest
        assert relative_error(np.load(report["model"]["path"]), oracle) <= 1e-9


def test_sites_follow_rounds_by_stream_and_by_polling_without_one(tmp_path: Path) -> None:
    for stream in (True, False):
        loop = _federation(tmp_path / str(stream), 3)
        daemons = Daemons(loop)
        try:
            daemons.start_server(crash_at=None if stream else ("no-watch-rounds", ""))
            daemons.start_clients()
            info = daemons.wait_run("run-1")
            assert info.state == "published", daemons.log_tail()
            reports = daemons.wait_reports(info.round_history[-1].round_id)
        finally:
            daemons.stop()
        for site, report in reports.items():
            assert report["outcome"] == "COMPLETED", (site, report)
            events = report["round_events_by_stream"]
            assert (events > 0) if stream else (events == 0), (stream, site, events)
