"""A run's federated evaluation and calibration through the daemons (docs/protocol.md §6.1,
docs/operations.md §6.1): afl-server and four afl-client processes over loopback mutual TLS in
MASK mode, ``evaluate = true``, the count bounds from the sites' declared row counts; site-1
evaluates on its ``[data] holdout`` cache, the others on their training caches (in-sample).

* the federated metrics equal scikit-learn's on the pooled evaluated rows (AUC and AP of the binned
  scores, BACC at σ(z) > 0.5) to 1e-9, and every site and the admin hold the coordinator's signed
  evaluation, whose SHA-256 the audit log records;
* the federated calibration equals a calibration fitted on the pooled rows' histograms (same
  bins) to 1e-9;
* the coordinator's state (every file, every database row, the audit log) holds no site's own
  histogram or confusion counts, in any encoding a site's upload could have, while the sum it
  unmasks from that state equals the sum of the sites' counts;
* in CKKS mode (integer grid) and in plaintext mode the released counts are exact too.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import sqlite3
import tomllib
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from afl.client.cli import main as client_main
from afl.client.config import load_client_config
from afl.client.model.model_card import TrainingFacts, card_markdown, model_card
from afl.client.payloads.evaluation import evaluation_values
from afl.core.data.featurecache import CacheMeta, open_cache, write_cache
from afl.core.evaluation.calibration import Calibration, fit_calibration
from afl.core.evaluation.federated import EvaluationStats
from afl.core.evaluation.scorebins import DEFAULT_SCORE_BINS, ScoreBins
from afl.crypto.identity import signatures
from afl.lab.cli import main as lab_main
from afl.lab.demo.federation import prepare_loopback, run_loopback
from afl.lab.report.deployed import render_deployed_report
from afl.proto.v1 import admin_pb2 as apb
from afl.proto.v1 import common_pb2 as cpb
from afl.proto.v1 import coordinator_pb2 as pb
from afl.server import toml_text
from afl.server.config import load_config
from afl.server.coordinator import Coordinator
from afl.server.store import Store
from tests.e2e.loopback import SiteData
from tests.e2e.processes import Daemons
from tests.helpers.evaluation_oracle import coarsened_bins, pooled_metrics_oracle, pooled_rows

CLASSES = ("A", "B", "C")
DATA = SiteData(d=8, classes=3, rows=80, rows_step=15, positive_rate=0.35, seed=23)
ACTIVE = np.array([[1, 1, 0], [1, 0, 1], [0, 1, 1], [1, 1, 1]], dtype=bool)
HOLDOUT_ROWS = 60


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("evaluation")
    feats, labels = DATA.draw(6)  # four sites, site-1's hold-out, a test block
    loop = prepare_loopback(
        root,
        classes=CLASSES,
        site_features=feats[:4],
        site_labels=labels[:4],
        active=ACTIVE,
        test_features=feats[5],
        test_labels=labels[5],
        # mask bounds from the sites' declared row counts and norms; payloads kept for the scan
        round_settings={"aggregation": "mask", "evaluate": True, "upload_timeout_s": 120.0},
        server_tables={"retention": {"payload_days": 30}},
    )
    holdout_labels = np.where(ACTIVE[0], labels[4][:HOLDOUT_ROWS], -1).astype(np.int8)
    write_cache(
        root / "data" / "site-1-holdout",
        meta=CacheMeta(n=HOLDOUT_ROWS, d=DATA.d, classes=CLASSES, source="surrogate"),
        ids=[f"holdout-{i}" for i in range(HOLDOUT_ROWS)],
        labels=holdout_labels,
        features=feats[4][:HOLDOUT_ROWS],
    )
    config = loop.client_configs["site-1"]
    doc = tomllib.loads(config.read_text(encoding="utf-8"))
    doc["data"]["holdout"] = str(root / "data" / "site-1-holdout")
    config.write_text(toml_text.dumps(doc), encoding="utf-8")
    run = run_loopback(loop, timeout_s=300)
    assert run.client_rcs == dict.fromkeys(loop.site_ids, 0), run.logs
    server = load_config(loop.server_config)
    (model_file,) = (server.state_dir / "models").glob("*.signed-model.pb")
    (evaluation_file,) = (server.state_dir / "evaluations").glob("*.signed-evaluation.pb")
    signed_model = pb.SignedModel.FromString(model_file.read_bytes())
    model = pb.Model.FromString(signed_model.model)
    signed = pb.SignedEvaluation.FromString(evaluation_file.read_bytes())
    evaluation = pb.Evaluation.FromString(signed.evaluation)
    rows = {"site-1": open_cache(root / "data" / "site-1-holdout")}
    rows |= {s: open_cache(root / "data" / s) for s in loop.site_ids[1:]}
    return {
        "root": root,
        "loop": loop,
        "run": run,
        "server": server,
        "model_sha256": hashlib.sha256(signed_model.model).hexdigest(),
        "weights": np.frombuffer(model.weights.data, dtype="<f8").reshape(
            tuple(model.weights.shape)
        ),
        "signed": signed,
        "evaluation": evaluation,
        "rows": rows,  # what each site evaluated on
    }


#: The sites' [policy] min_cohort (the default): every bin they release holds 0 or ≥ 3 rows.
MIN_COHORT = 3


def _pooled(evaluated: dict[str, Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The pooled evaluated rows and each row's site (0, 1, ...)."""
    caches = list(evaluated["rows"].values())
    feats, labels = pooled_rows([(c.features, c.labels) for c in caches])
    return feats, labels, np.repeat(np.arange(len(caches)), [c.meta.n for c in caches])


def test_masked_evaluation_equals_the_pooled_metrics_of_the_evaluated_rows(
    evaluated: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    evaluation, loop, run = evaluated["evaluation"], evaluated["loop"], evaluated["run"]
    document = json.loads(evaluation.evaluation_json)
    assert document["model_sha256"] == evaluated["model_sha256"] == evaluation.model_sha256.hex()
    assert document["members"] == list(evaluation.members) == list(loop.site_ids)
    feats, labels, sites = _pooled(evaluated)
    edges = np.asarray(_plan(evaluated).releases[0].evaluation.score_bin_edges)
    oracle = pooled_metrics_oracle(
        feats, labels, weights=evaluated["weights"], classes=CLASSES, edges=edges,
        sites=sites, min_cohort=MIN_COHORT,
    )  # fmt: skip
    for name, expected in oracle.items():
        got = document["per_class"][name]
        assert (got["n_pos"], got["n_neg"]) == (expected["n_pos"], expected["n_neg"])
        for metric in ("auc", "ap", "bacc"):
            assert abs(got[metric] - expected[metric]) <= 1e-9, (name, metric)
    # every site kept the coordinator's signed evaluation, and says what it evaluated on
    for site in loop.site_ids:
        (report,) = [r for r in run.reports[site].values() if "evaluation" in r]
        assert report["outcome"] == "COMPLETED"
        kept = Path(report["evaluation"]["files"]["signed"]).read_bytes()
        assert kept == evaluated["signed"].SerializeToString()
        assert report["evaluation"]["in_sample"] == (site != "site-1")
        assert report["evaluation"]["rows"] == evaluated["rows"][site].meta.n
        calibration = Calibration.load(report["evaluation"]["files"]["calibration"])
        calibration.check_model(evaluated["model_sha256"], CLASSES)  # what predict checks
    # `afl-client evaluate` without --cache uses the same hold-out as the evaluation round
    config = loop.client_configs["site-1"]
    assert client_main(["evaluate", "--config", str(config), "--bootstrap", "20"]) == 0
    local = json.loads(
        (config.parent / "state" / "reports" / f"{evaluation.model_round_id}.json").read_text()
    )
    assert (
        not local["local_evaluation"]["in_sample"]
        and "site-1-holdout" in local["local_evaluation"]["data"]
    )
    # the PUBLISHED record of the evaluation round anchors the stored bytes
    store = Store(evaluated["server"].state_dir, federation_id=evaluated["server"].federation_id)
    try:
        records = [
            d
            for _, event, d, _, _ in store.audit_entries()
            if event == "stage" and d["round_id"] == evaluation.round_id
            and d["stage"] == "ROUND_STAGE_PUBLISHED"
        ]  # fmt: skip
        reports = {
            s: pb.ClientReport.FromString(b) for s, b in store.reports(evaluation.round_id).items()
        }
        assert store.verify_audit_chain()
    finally:
        store.close()
    assert [r["evaluation_sha256"] for r in records] == [
        hashlib.sha256(evaluated["signed"].evaluation).hexdigest()
    ]
    assert (
        records[0]["calibration_sha256"] == hashlib.sha256(evaluation.calibration_json).hexdigest()
    )
    in_sample = {s for s, r in reports.items() if any("in-sample" in w for w in r.warnings)}
    assert in_sample == set(loop.site_ids[1:])
    # an admin downloads the same documents from the restarted coordinator, verified with its
    # kit's server key
    admin = loop.provisioned.root / "admins" / "operator" / "admin.toml"
    out = tmp_path / "download"
    daemons = Daemons(loop)
    daemons.start_server()
    try:
        served = daemons.call(daemons.admin.GetRunEvaluation, apb.RunRef(run_id="run-1"))
        assert served == evaluated["signed"]
        argv = ["admin", "--config", str(admin), "download-evaluation", "run-1", "--out", str(out)]
        capsys.readouterr()
        assert lab_main(argv) == 0
        said = capsys.readouterr().out
    finally:
        assert daemons.stop() == 0
    # afl admin says which figures are in-sample (site-1 alone scored a hold-out)
    assert "IN-SAMPLE FIGURES at site-2, site-3, site-4" in said, said
    stem = evaluation.model_round_id
    assert (out / f"{stem}.evaluation.json").read_bytes() == evaluation.evaluation_json
    assert (out / f"{stem}.calibration.json").read_bytes() == evaluation.calibration_json


def _plan(evaluated: dict[str, Any]) -> cpb.ReleasePlan:
    store = Store(evaluated["server"].state_dir, federation_id=evaluated["server"].federation_id)
    try:
        (row,) = [r for r in store.rounds() if r.round_id == evaluated["evaluation"].round_id]
    finally:
        store.close()
    return cpb.ReleasePlan.FromString(row.plan or b"")


def test_federated_calibration_equals_the_pooled_fit(evaluated: dict[str, Any]) -> None:
    federated = Calibration.from_json(json.loads(evaluated["evaluation"].calibration_json))
    feats, labels, sites = _pooled(evaluated)
    pooled = _coarsened_pooled(feats, labels, sites, evaluated["weights"], federated.bins)
    refit = fit_calibration(pooled, model_sha256=evaluated["model_sha256"], method="platt")
    assert federated.method == "platt" and federated.model_sha256 == evaluated["model_sha256"]
    for fed, ref in zip(federated.classes, refit.classes, strict=True):
        assert fed.fitted and ref.fitted and (fed.n_pos, fed.n_neg) == (ref.n_pos, ref.n_neg)
        assert abs(fed.slope - ref.slope) <= 1e-9 * max(1.0, abs(ref.slope))
        assert abs(fed.intercept - ref.intercept) <= 1e-9 * max(1.0, abs(ref.intercept))


def _coarsened_pooled(
    feats: np.ndarray, labels: np.ndarray, sites: np.ndarray, w: np.ndarray, bins: ScoreBins
) -> EvaluationStats:
    """The pooled histograms of the rows each site released, in the bins the oracle moves them
    to (tests/helpers/evaluation_oracle.py), and the confusion counts they determine."""
    edge = int(np.searchsorted(bins.array, 0.0, side="left")) + 1
    z = feats @ w
    hist = np.zeros((len(CLASSES), 2, bins.num_bins), dtype=np.int64)
    for c in range(len(CLASSES)):
        index = bins.index(z[:, c])
        for site in np.unique(sites):
            for label in (0, 1):
                pick = (sites == site) & (labels[:, c] == label)
                moved = coarsened_bins(index[pick], k=MIN_COHORT, edge=edge)
                hist[c, label] += np.bincount(moved[moved >= 0], minlength=bins.num_bins)
    pos, neg = hist[:, 1], hist[:, 0]
    conf = np.stack(
        [pos[:, edge:].sum(1), pos[:, :edge].sum(1), neg[:, edge:].sum(1), neg[:, :edge].sum(1)],
        axis=1,
    )
    return EvaluationStats(CLASSES, bins, 0.5, hist, conf)


def _stored_values(state: Path) -> list[bytes]:
    """Every file under the coordinator's state folder and every value of every row of its
    database (the audit log, journal, uploads, evaluations ...)."""
    values = [p.read_bytes() for p in state.rglob("*") if p.is_file()]
    db = sqlite3.connect(f"file:{state / 'server.sqlite3'}?mode=ro", uri=True)
    try:
        tables = [t for (t,) in db.execute("SELECT name FROM sqlite_master WHERE type='table'")]
        for table in tables:
            for row in db.execute(f"SELECT * FROM {table}"):
                values += [v if isinstance(v, bytes) else str(v).encode() for v in row]
    finally:
        db.close()
    return values


def _encodings(values: np.ndarray, frac_bits: int) -> list[bytes]:
    """How one site's counts could be stored: float64, int64, the plan's fixed-point ring
    elements (what the site would upload unmasked), JSON text."""
    ring = np.round(values * 2.0**frac_bits).astype(np.int64).astype("<u8")
    return [
        values.astype("<f8").tobytes(),
        values.astype("<i8").tobytes(),
        ring.tobytes(),
        json.dumps([int(v) for v in values]).encode(),
    ]


def test_the_coordinator_stores_no_single_sites_counts(
    evaluated: dict[str, Any], tmp_path: Path
) -> None:
    plan, server = _plan(evaluated), evaluated["server"]
    loop, evaluation = evaluated["loop"], evaluated["evaluation"]
    sites: dict[str, dict[str, np.ndarray]] = {}
    for site in loop.site_ids:
        cfg = load_client_config(loop.client_configs[site])
        cache = evaluated["rows"][site]
        labelled = np.isin(CLASSES, cfg.data.classes)
        sites[site] = {
            r.name: evaluation_values(
                r,
                cache=cache,
                labelled=labelled,
                weights=evaluated["weights"],
                model_classes=CLASSES,
                model_sha256=evaluated["model_sha256"],
                min_mass=cfg.policy.min_cohort,
            )
            for r in plan.releases
        }
    stored = _stored_values(server.state_dir)
    uploads = list((server.state_dir / "payloads" / evaluation.round_id).rglob("*.bin"))
    assert len(uploads) == len(loop.site_ids) * len(plan.releases)  # the masked uploads, kept
    for site, releases in sites.items():
        for release in plan.releases:
            counts = releases[release.name]
            assert counts.sum() > 0, (site, release.name)  # a site with something to hide
            for encoded in _encodings(counts, release.encoding.fixed_point.frac_bits):
                assert not any(encoded in value for value in stored), (site, release.name)
    # ... while the sum the coordinator unmasks from that state is the sum of the sites' counts
    copy = tmp_path / "state"
    shutil.copytree(server.state_dir, copy)
    key = signatures.load_private_key_pem(server.identity_key.read_bytes())
    config = dataclasses.replace(server, state_dir=copy)
    coordinator = Coordinator(config, Store(copy, federation_id=server.federation_id), key)
    try:
        with coordinator.lock:
            sums = coordinator.machine.sums(coordinator.find(evaluation.round_id))
    finally:
        coordinator.store.close()
    assert sums is not None
    for release in plan.releases:
        total = sum(sites[s][release.name] for s in loop.site_ids)
        np.testing.assert_array_equal(np.ravel(sums[release.name]), total)


@pytest.mark.parametrize("mode", ["ckks", "plaintext"])
def test_the_other_modes_release_the_exact_pooled_counts(tmp_path: Path, mode: str) -> None:
    """CKKS decrypts the counts onto the integer grid; plaintext (sites that opted in) sums them
    in the clear: both give the pooled metrics of the sites' training rows."""
    feats, labels = DATA.draw(3)
    settings: dict[str, Any] = {"aggregation": mode, "evaluate": True, "upload_timeout_s": 120.0}
    loop = prepare_loopback(
        tmp_path,
        classes=CLASSES,
        site_features=feats,
        site_labels=labels,
        active=ACTIVE[:3],
        test_features=feats[0][:10],
        test_labels=labels[0][:10],
        round_settings=settings,
        decryptor=mode == "ckks",
        allow_plaintext=mode == "plaintext",
    )
    run = run_loopback(loop, timeout_s=300)
    assert run.client_rcs == dict.fromkeys(loop.site_ids, 0), run.logs
    reports = [r for s in loop.site_ids for r in run.reports[s].values() if "evaluation" in r]
    assert len(reports) == 3 and {r["evaluation"]["in_sample"] for r in reports} == {True}
    document = json.loads(Path(reports[0]["evaluation"]["files"]["evaluation"]).read_text())
    model = pb.Model.FromString(
        pb.SignedModel.FromString(
            next((loop.server_config.parent / "state" / "models").iterdir()).read_bytes()
        ).model
    )
    weights = np.frombuffer(model.weights.data, dtype="<f8").reshape(tuple(model.weights.shape))
    caches = [open_cache(tmp_path / "data" / s) for s in loop.site_ids]
    pooled = pooled_rows([(c.features, c.labels) for c in caches])
    sites = np.repeat(np.arange(len(caches)), [c.meta.n for c in caches])
    oracle = pooled_metrics_oracle(
        *pooled, weights=weights, classes=CLASSES, edges=DEFAULT_SCORE_BINS.array, sites=sites,
        min_cohort=MIN_COHORT,
    )  # fmt: skip
    for name, expected in oracle.items():
        got = document["per_class"][name]
        assert (got["n_pos"], got["n_neg"]) == (expected["n_pos"], expected["n_neg"])
        for metric in ("auc", "ap", "bacc"):
            assert abs(got[metric] - expected[metric]) <= 1e-9, (name, metric)


def test_the_signed_evaluation_marks_each_members_rows_and_the_report_shows_them(
    evaluated: dict[str, Any], tmp_path: Path
) -> None:
    """M-210: each member's signed acceptance states the rows it scores; the signed evaluation
    carries them per member, and the card (Markdown) and `afl report`'s HTML mark the
    in-sample figures in words a clinician cannot miss."""
    evaluation = evaluated["evaluation"]
    document = json.loads(evaluation.evaluation_json)
    assert document["in_sample"] == {
        "site-1": False,
        "site-2": True,
        "site-3": True,
        "site-4": True,
    }
    assert "IN-SAMPLE: site-2, site-3, site-4 scored the images" in document["warning"]
    # the journaled decisions the flags come from carry the sites' signatures
    store = Store(evaluated["server"].state_dir, federation_id=evaluated["server"].federation_id)
    try:
        decisions = [
            pb.PlanDecision.FromString(m.data)
            for m in store.messages(evaluation.round_id)
            if m.kind == "plan-decision"
        ]
    finally:
        store.close()
    assert sorted(d.evaluation_rows for d in decisions) == ["held-out", *["in-sample"] * 3]
    card = model_card(
        model={"federation_id": "fed", "round_id": evaluation.model_round_id,
               "model_sha256": evaluated["model_sha256"], "contributors": list(CLASSES),
               "decision_threshold": 0.5, "created_unix_ms": 1795716651548, "shape": [8, 3]},
        classes=CLASSES,
        facts=TrainingFacts(
            source="test", aggregation="mask", surrogate=True, training_images={"site-1": 80}
        ),
        backbone={"name": "resnet18", "trained_on": "surrogate", "random_init": True},
        files={},
        metrics={"federated evaluation": document},
    )  # fmt: skip
    folder = tmp_path / "export"
    folder.mkdir()
    (folder / "model_card.json").write_text(json.dumps(card))
    (folder / "SHA256SUMS").write_text("00  model.ts\n")
    html = render_deployed_report(folder)
    federated = html.split("Federated evaluation")[1].split("<h2>")[0]
    assert "IN-SAMPLE FIGURES (at site-2, site-3, site-4)" in federated
    assert "NOT a measure of how the model performs on new patients" in federated
    assert "IN-SAMPLE: computed on the images the model was trained on" in card_markdown(card)
