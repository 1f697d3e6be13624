"""The validation gate through the daemons (docs/protocol.md §2, §6.2, [M-130] .. [M-133]).

afl-server and afl-client processes over loopback mutual TLS in MASK mode, every site with a
``[data] holdout`` cache, the run with ``[round.gate]`` (no class below chance, the default):

* one of four sites replaces its class vectors by −sign(b)·0.99·B, inside the per-entry
  fixed-point bound B masking enforces (tests/e2e/poisoning_client.py): every party completes the
  training round, but the candidate fails the gate, so no model is published; the run ends FAILED
  with the failing classes and the pooled AUCs in the audit log, in ``afl admin status`` and in
  every site's report. The candidate's sums were released, so they count in the federation's
  history (M-124): a re-run on the same federation without that site would difference to its
  statistics and is refused naming it; the same run over the three other sites publishes (the
  same ``Model`` bytes the sites scored as the candidate);
* a site whose label column is inverted by mistake (its features carrying a stronger signal, so
  its vectors outweigh the others') is caught the same way;
* a site without hold-out rows refuses to score the candidate, saying so, and the gate uses the
  others.
"""

from __future__ import annotations

import hashlib
import json
import time
import tomllib
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from numpy.typing import NDArray

from afl.client.policy.ledger import DpLedger
from afl.core.data.featurecache import CacheMeta, write_cache
from afl.lab.demo.federation import LoopbackFederation, prepare_loopback, run_loopback
from afl.proto.v1 import admin_pb2 as apb
from afl.proto.v1 import coordinator_pb2 as pb
from afl.server import toml_text
from afl.server.config import load_config
from afl.server.store import Store
from tests.e2e import poisoning_client
from tests.e2e.loopback import SiteData
from tests.e2e.processes import Daemons, admin_cli

CLASSES = ("A", "B", "C")
DATA = SiteData(d=8, classes=3, rows=80, rows_step=15, positive_rate=0.35, seed=31)
HOLDOUT_ROWS = 60
GATE = {"min_auc": 0.5, "min_macro_auc": 0.5, "min_sites": 2}


def _federation(
    root: Path,
    feats: list[NDArray[Any]],
    labels: list[NDArray[Any]],
    holdouts: list[tuple[NDArray[Any], NDArray[Any]] | None],
    *,
    serve: bool,
) -> LoopbackFederation:
    sites = len(feats)
    loop = prepare_loopback(
        root,
        classes=CLASSES,
        site_features=feats,
        site_labels=labels,
        active=np.ones((sites, len(CLASSES)), dtype=bool),
        test_features=feats[0][:20],
        test_labels=labels[0][:20],
        round_settings={"aggregation": "mask", "upload_timeout_s": 120.0},
        client_settings={"serve": serve},
    )
    doc = tomllib.loads(loop.server_config.read_text(encoding="utf-8"))
    doc["round"]["gate"] = dict(GATE)
    loop.server_config.write_text(toml_text.dumps(doc), encoding="utf-8")
    for site, holdout in zip(loop.site_ids, holdouts, strict=True):
        if holdout is None:
            continue
        folder = root / "data" / f"{site}-holdout"
        h, y = holdout
        write_cache(
            folder,
            meta=CacheMeta(n=len(y), d=DATA.d, classes=CLASSES, source="surrogate"),
            ids=[f"{site}-holdout-{i}" for i in range(len(y))],
            labels=y.astype(np.int8),
            features=h,
        )
        config = loop.client_configs[site]
        doc = tomllib.loads(config.read_text(encoding="utf-8"))
        doc["data"]["holdout"] = str(folder)
        config.write_text(toml_text.dumps(doc), encoding="utf-8")
    return loop


def _store(loop: LoopbackFederation) -> Store:
    config = load_config(loop.server_config)
    return Store(config.state_dir, federation_id=config.federation_id, read_only=True)


def _gate_records(store: Store) -> list[dict[str, Any]]:
    return [detail for _, event, detail, _, _ in store.audit_entries() if event == "gate"]


def _report(loop: LoopbackFederation, site: str, round_id: str) -> dict[str, Any]:
    """The site's report of ``round_id`` (a site writes it once it has the round's outcome,
    which may be after the run ended at the coordinator; generous limit, no timing asserted)."""
    path = loop.client_configs[site].parent / "state" / "reports" / f"{round_id}.json"
    deadline = time.monotonic() + 300
    while not path.is_file():
        assert time.monotonic() < deadline, f"{site} wrote no report of {round_id}"
        time.sleep(0.3)
    report: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return report


def _round(info: apb.RunInfo, number: int) -> apb.RoundSummary:
    """The last round ``number`` of a run (a refused plan's replacement keeps the number)."""
    return [r for r in info.round_history if r.round_number == number][-1]


def test_a_site_flipping_its_class_vectors_in_mask_is_not_published_and_the_run_without_it_is(
    tmp_path: Path,
) -> None:
    feats, labels = DATA.draw(9)  # four sites, their hold-outs, a spare block
    holdouts = [(feats[4 + k][:HOLDOUT_ROWS], labels[4 + k][:HOLDOUT_ROWS]) for k in range(4)]
    loop = _federation(tmp_path / "four", feats[:4], labels[:4], list(holdouts), serve=True)
    daemons = Daemons(loop)
    try:
        daemons.start_server()
        daemons.start_clients(commands={"site-4": poisoning_client.command()})
        failed = daemons.wait_run("run-1")
        assert failed.state == "failed", daemons.log_tail()
        assert failed.reason.startswith("validation gate failed: classes below min_auc 0.5")
        assert all(f"{c} AUC 0." in failed.reason for c in CLASSES), failed.reason
        assert not failed.model_round_id  # no model published
        store = _store(loop)
        try:
            (record,) = _gate_records(store)
            assert record["passed"] is False and record["failing_classes"] == list(CLASSES)
            assert all(record["per_class_auc"][c] < 0.5 for c in CLASSES), record
            assert record["macro_auc"] < 0.5 and record["scored_by"] == 4
            training = _round(failed, 1)
            assert training.stage == pb.ROUND_STAGE_ABORTED
            assert store.model(training.round_id) is None
            assert store.candidate(training.round_id) is not None  # solved, kept, not published
        finally:
            store.close()
        config = load_config(loop.server_config)
        assert not list((config.state_dir / "models").glob("*.signed-model.pb"))
        status = admin_cli(loop, "status", "run-1")
        assert "failed" in status and "VALIDATING" not in status
        assert all(f"{c} AUC" in status for c in CLASSES), status
        gate_round = _round(failed, 2).round_id
        for site in loop.site_ids:  # every site names the reason in its report, keeps no model
            report = _report(loop, site, gate_round)
            assert report["outcome"] == "FAILED" and report["reason"] == failed.reason
            assert report["evaluation"]["gate"]["failing_classes"] == list(CLASSES)
            assert report["evaluation"]["in_sample"] is False
            state = loop.client_configs[site].parent / "state"
            assert not list((state / "models").glob("*.signed-model.pb"))
            assert list((state / "candidates").glob("*.signed-model.pb"))
            entry = DpLedger(state / "dp-ledger").entry_for(gate_round)  # the gate's releases
            assert entry is not None and {r["name"] for r in entry.releases} == {
                "eval_hist[all]",
                "eval_confusion[all]",
            }
        # A re-run here without site-4 would difference to its statistics (the candidate's sums
        # were released): refused at submission, naming it; no run is stored.
        with pytest.raises(grpc.RpcError) as refused:
            daemons.submit('participants = ["site-1", "site-2", "site-3"]\n', name="rerun")
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "M-124" in refused.value.details() and "site-4" in refused.value.details()
        runs = daemons.call(daemons.admin.ListRuns, apb.ListRunsRequest()).runs
        assert [r.run_id for r in runs] == ["run-1"]
    finally:
        daemons.stop()
    # The same run without the poisoning site (a federation of the three others) publishes.
    loop = _federation(tmp_path / "three", feats[:3], labels[:3], list(holdouts[:3]), serve=False)
    run = run_loopback(loop, timeout_s=300)
    assert run.client_rcs == dict.fromkeys(loop.site_ids, 0), run.logs
    store = _store(loop)
    try:
        (record,) = _gate_records(store)
        assert record["passed"] is True and record["scored_by"] == 3
        assert all(a >= 0.5 for a in record["per_class_auc"].values())
        (run_row,) = store.runs()
        published = store.model()
        candidate = store.candidate(published[0]) if published is not None else None
    finally:
        store.close()
    assert run_row.state == "published" and published is not None and candidate is not None
    digest = hashlib.sha256(published[1]).hexdigest()
    assert hashlib.sha256(candidate[0]).hexdigest() == digest  # the candidate, now signed "model"
    for site in loop.site_ids:
        (report,) = [  # the gate round's (a refused gate plan's replacement has another id)
            r for r in run.reports[site].values() if r["round_id"] == record["gate_round_id"]
        ]
        assert report["outcome"] == "COMPLETED" and report["evaluation"]["gate"]["passed"]
        # the model the site kept is the candidate it scored
        assert report["evaluation"]["model_sha256"] == report["model"]["sha256"] == digest


def test_a_site_with_inverted_labels_is_caught_by_the_gate(tmp_path: Path) -> None:
    feats, labels = DATA.draw(8)
    strong, _ = SiteData(**{**DATA.__dict__, "signal": 4.0}).draw(4)  # same directions
    feats[3] = strong[3]
    labels[3] = (1 - labels[3]).astype(np.int8)  # the mistake: its label column is inverted
    holdouts: list[tuple[NDArray[Any], NDArray[Any]] | None] = [
        (feats[4 + k][:HOLDOUT_ROWS], labels[4 + k][:HOLDOUT_ROWS]) for k in range(3)
    ]
    holdouts.append(None)  # the inverting site has no hold-out rows: the gate uses the others
    loop = _federation(tmp_path, feats[:4], labels[:4], holdouts, serve=False)
    run = run_loopback(loop, timeout_s=300)
    store = _store(loop)
    try:
        (record,) = _gate_records(store)
        runs = store.runs()
        decisions = {
            site: why
            for r in store.rounds()
            for site, (ok, why) in store.decisions(r.round_id).items()
            if not ok
        }
    finally:
        store.close()
    assert runs[0].state == "failed" and runs[0].reason == record["reason"], run.logs
    assert record["passed"] is False and record["failing_classes"], record
    assert record["scored_by"] == 3
    refused = {"site-4"}
    assert set(decisions) == refused
    assert all("no hold-out rows to score the candidate" in why for why in decisions.values())
    for site in set(loop.site_ids) - refused:
        assert run.client_rcs[site] == 1  # FAILED: the gate refused the model
        (report,) = [  # the gate round's (a refused gate plan's replacement has another id)
            r for r in run.reports[site].values() if r["round_id"] == record["gate_round_id"]
        ]
        assert report["outcome"] == "FAILED" and report["reason"] == record["reason"]
        (training,) = [r for r in run.reports[site].values() if "candidate" in r]
        assert "model" not in training  # the site kept the candidate only
