"""A coordinator killed (SIGKILL) at every stage of every mode and restarted on the same state:
each run resumes and publishes the same W as the in-process oracle, the next run completes, and
no restart exits non-zero (docs/operations.md "What survives what", docs/protocol.md §9).

One federation per mode; its sites serve runs until stopped. Run i is killed at crash point i by
a server started for that purpose (tests/e2e/faulty_server.py); the server started after the
kill is the one that kills itself at the next run's point, and the last one is a plain afl-server
on which one more run must complete. The same holds for a run's evaluation round
(``evaluate = true``, docs/operations.md §6.1): killed in its masked exchange or right after its
signed evaluation is stored, the restarted coordinator publishes the evaluation an uninterrupted
round gives (the pooled metrics of the sites' rows).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from afl.core.aggregation import federated_solve
from afl.core.evaluation.scorebins import DEFAULT_SCORE_BINS
from afl.proto.v1 import admin_pb2 as apb
from afl.proto.v1 import coordinator_pb2 as pb
from tests.e2e.faults.harness import federation, weights
from tests.e2e.loopback import SiteData, cached_statistics
from tests.e2e.processes import Daemons
from tests.helpers.evaluation_oracle import pooled_metrics_oracle, pooled_rows
from tests.helpers.numeric import relative_error

CLASSES = ("A", "B", "C")
DATA = SiteData(d=12, classes=len(CLASSES), rows=80, rows_step=10, positive_rate=0.4, seed=5)
SITES = 3

CRASH_POINTS = {
    "plaintext": ["ROUND_STAGE_PLAN_REVIEW", "upload:2", "ROUND_STAGE_SOLVING"],
    "mask": [
        "ROUND_STAGE_PLAN_REVIEW",
        "ROUND_STAGE_ADVERTISE_KEYS",
        "ROUND_STAGE_SHARE_KEYS",
        "upload:2",
        "ROUND_STAGE_CONSISTENCY_CHECK",
        "ROUND_STAGE_UNMASK",
        "ROUND_STAGE_SOLVING",
    ],
    "ckks": ["ROUND_STAGE_UPLOAD", "ROUND_STAGE_SOLVING", "decryption"],
}


def _federation(root: Path, mode: str, *, evaluate: bool = False) -> Any:
    return federation(root, mode, sites=SITES, data=DATA, serve=True, evaluate=evaluate)


def _killed_runs(daemons: Daemons, points: list[str]) -> Iterator[tuple[str, apb.RunInfo]]:
    """Run i is killed at ``points[i]`` (the server started after each kill is the one that
    kills itself in the next run; the last one is a plain afl-server); yields each point with its
    run once that has ended after the restart."""
    daemons.start_server(crash_at=(points[0], "run-1"))
    daemons.start_clients()
    for i, point in enumerate(points):
        run_id = f"run-{i + 1}"
        if i > 0:
            assert daemons.submit(name=f"after {points[i - 1]}").run_id == run_id
        code = daemons.wait_server_exit()
        assert code == -9, f"{run_id}: the server was to be killed at {point}, exit {code}"
        following = (points[i + 1], f"run-{i + 2}") if i + 1 < len(points) else None
        daemons.start_server(crash_at=following)
        info = daemons.wait_run(run_id)
        assert info.state == "published", (point, info, daemons.log_tail())
        yield point, info


@pytest.mark.parametrize("mode", sorted(CRASH_POINTS))
def test_killed_coordinator_resumes_every_stage_and_the_next_run_completes(
    tmp_path: Path, mode: str
) -> None:
    loop = _federation(tmp_path, mode)
    stats, _ = cached_statistics(loop, list(loop.site_ids))
    oracle, _ = federated_solve(stats, gamma=1.0, gram_scope="global")
    daemons = Daemons(loop)
    try:
        for point, info in _killed_runs(daemons, CRASH_POINTS[mode]):
            assert relative_error(weights(daemons.model(info.run_id)), oracle) <= 1e-9, point
        last = daemons.submit(name="after every restart")
        info = daemons.wait_run(last.run_id)
        assert info.state == "published", (info, daemons.log_tail())
        assert relative_error(weights(daemons.model(last.run_id)), oracle) <= 1e-9
    finally:
        server_code = daemons.stop()
    assert server_code == 0, daemons.log_tail()  # the last server was never killed
    assert "Traceback" not in daemons.server_logs()


EVALUATION_POINTS = [
    "evaluation-ROUND_STAGE_SHARE_KEYS",
    "evaluation-ROUND_STAGE_UNMASK",
    "evaluation-stored",
]


def test_killed_coordinator_resumes_the_evaluation_round(tmp_path: Path) -> None:
    loop = _federation(tmp_path, "mask", evaluate=True)
    _, caches = cached_statistics(loop, list(loop.site_ids))
    feats, labels = pooled_rows([(c.features, c.labels) for c in caches])
    sites = np.repeat(np.arange(len(caches)), [c.meta.n for c in caches])
    daemons = Daemons(loop)
    try:
        for point, info in _killed_runs(daemons, EVALUATION_POINTS):
            assert not info.reason and info.evaluation_round_id, (point, info)
            signed = daemons.call(daemons.admin.GetRunEvaluation, apb.RunRef(run_id=info.run_id))
            document = json.loads(pb.Evaluation.FromString(signed.evaluation).evaluation_json)
            oracle = pooled_metrics_oracle(
                feats,
                labels,
                weights=weights(daemons.model(info.run_id)),
                classes=CLASSES,
                edges=DEFAULT_SCORE_BINS.array,
                sites=sites,
                min_cohort=3,  # the sites' default min_cohort: they coarsen (§6.1)
            )
            for name, expected in oracle.items():
                got = document["per_class"][name]
                assert (got["n_pos"], got["n_neg"]) == (expected["n_pos"], expected["n_neg"])
                assert abs(got["auc"] - expected["auc"]) <= 1e-9, (point, name)
                assert abs(got["bacc"] - expected["bacc"]) <= 1e-9, (point, name)
            reports = daemons.wait_reports(info.evaluation_round_id)
            assert {r["outcome"] for r in reports.values()} == {"COMPLETED"}, point
            assert {r["evaluation"]["sha256"] for r in reports.values()} == {
                hashlib.sha256(signed.evaluation).hexdigest()
            }, point
    finally:
        server_code = daemons.stop()
    assert server_code == 0, daemons.log_tail()
    assert "Traceback" not in daemons.server_logs()
