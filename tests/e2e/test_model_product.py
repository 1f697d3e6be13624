"""The model as a product, from a demo-style federation (afl-server + afl-client processes over
loopback mTLS, mask aggregation, surrogate features, as `afl demo --keep DIR` leaves them):

* the coordinator keeps the signed model as a file and the PUBLISHED audit record holds its
  SHA-256, the digest every site recorded for its own verified copy;
* `afl export` at a site and at the coordinator writes TorchScript + ONNX + model card, and both
  artefacts give the project's own pipeline's probabilities on PNG and DICOM images written here;
* `afl-client evaluate` writes per-class metrics with bootstrap intervals into the site's report
  (scikit-learn on the same rows as the oracle), and the next export's card carries them;
* `afl-client predict` writes probabilities for a folder of PNG and DICOM files."""

from __future__ import annotations

import csv
import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from sklearn.metrics import average_precision_score, roc_auc_score

from afl.client.cli import main as client_main
from afl.client.config import load_client_config
from afl.client.features.backbones import load_backbone
from afl.core.data.featurecache import open_cache
from afl.core.evaluation.federated import (
    evaluation_statistics,
    federated_evaluation_document,
    sum_statistics,
)
from afl.core.evaluation.scorebins import DEFAULT_SCORE_BINS
from afl.lab.cli import main as lab_main
from afl.lab.demo.federation import mask_round_settings, prepare_loopback, run_loopback
from afl.proto.v1 import coordinator_pb2 as pb
from afl.server.config import load_config
from afl.server.store import Store
from tests.e2e.loopback import SiteData
from tests.helpers.pipeline import (
    check_against_pipeline,
    pipeline_probabilities,
    weights_file,
    write_images,
)

D = 512  # resnet18's feature dimension: the export pairs the head with it
CLASSES = ("A", "B", "C")
DATA = SiteData(d=D, classes=3, rows=220, rows_step=30, positive_rate=0.35, seed=11)
ACTIVE = np.array([[1, 1, 0], [1, 0, 1], [0, 1, 1]], dtype=bool)


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("demo")
    feats, labels = DATA.draw(4)  # three sites and a held-out block
    loop = prepare_loopback(
        root / "fed",
        classes=CLASSES,
        site_features=feats[:3],
        site_labels=labels[:3],
        active=ACTIVE,
        test_features=feats[3],
        test_labels=labels[3],
        round_settings=mask_round_settings(feats[:3]),
    )
    run = run_loopback(loop, timeout_s=300)
    assert run.client_rcs == dict.fromkeys(loop.site_ids, 0), run.logs
    site_cfg = load_client_config(loop.client_configs["site-1"])
    report = run.final_report("site-1")
    return {
        "root": root,
        "loop": loop,
        "run": run,
        "site_cfg": site_cfg,
        "round_id": report["round_id"],
        "site_model": site_cfg.state_dir / "models" / f"{report['round_id']}.signed-model.pb",
        "weights": weights_file(root, "resnet18"),
        "manifest": write_images(root / "images"),
    }


def test_coordinator_keeps_the_model_file_and_the_audit_anchors_every_copy(demo) -> None:
    loop, run, round_id = demo["loop"], demo["run"], demo["round_id"]
    server = load_config(loop.server_config)
    coordinator_file = server.state_dir / "models" / f"{round_id}.signed-model.pb"
    signed = pb.SignedModel.FromString(coordinator_file.read_bytes())
    digest = hashlib.sha256(signed.model).hexdigest()
    store = Store(server.state_dir, federation_id=server.federation_id)
    try:
        published = [
            detail
            for _, event, detail, _, _ in store.audit_entries()
            if event == "stage" and detail.get("stage") == "ROUND_STAGE_PUBLISHED"
        ]
        assert store.verify_audit_chain()
    finally:
        store.close()
    assert [(d["round_id"], d["model_sha256"]) for d in published] == [(round_id, digest)]
    for site in loop.site_ids:
        assert run.final_report(site)["model"]["sha256"] == digest
        cfg = load_client_config(loop.client_configs[site])
        site_copy = cfg.state_dir / "models" / f"{round_id}.signed-model.pb"
        assert site_copy.read_bytes() == coordinator_file.read_bytes()


@pytest.fixture(scope="module")
def site_export(demo) -> Path:
    """`afl export` at site-1, with the ONNX graph and the model's proof from the federation log
    the operator exported (`afl log export`)."""
    out: Path = demo["root"] / "export-site"
    log = demo["root"] / "federation-log.json"
    server = str(demo["loop"].server_config)
    assert lab_main(["log", "export", "--config", server, "--out", str(log)]) == 0
    args = ["export", "--model", str(demo["site_model"]), "--weights", str(demo["weights"])]
    args += ["--config", str(demo["loop"].client_configs["site-1"]), "--backbone", "resnet18"]
    assert lab_main([*args, "--log", str(log), "--out", str(out)]) == 0
    assert (out / "log-proof.json").is_file()
    return out


def test_export_at_a_site_and_at_the_coordinator(demo, site_export, capsys) -> None:
    root, loop, out = demo["root"], demo["loop"], site_export
    args = ["export", "--model", str(demo["site_model"]), "--weights", str(demo["weights"])]
    site_args = [*args, "--config", str(loop.client_configs["site-1"])]
    # the demo's model was trained on surrogate features: no backbone without --backbone
    assert lab_main([*site_args, "--out", str(root / "x")]) == 2
    assert "surrogate" in capsys.readouterr().err
    card = json.loads((out / "model_card.json").read_text())
    training = card["training"]
    assert (training["aggregation"], training["gram_scope"]) == ("mask", "global")
    assert training["participants"] == list(loop.site_ids)
    assert training["training_images"]["known"] == {"site-1": 220}
    assert training["surrogate_features"] and card["backbone"]["trained_on"] == "surrogate"
    assert card["model"]["number_of_sites"] == 3
    assert "SURROGATE" in card["must_not_be_used_for"][1]
    # TorchScript and ONNX equal the project's own pipeline on PNG and DICOM images
    published = pb.Model.FromString(
        pb.SignedModel.FromString(demo["site_model"].read_bytes()).model
    )
    w = np.frombuffer(published.weights.data, dtype="<f8").reshape(D, len(CLASSES))
    backbone = load_backbone("resnet18", weights=demo["weights"])
    expected = pipeline_probabilities(root, backbone, demo["manifest"], w)
    check_against_pipeline(out, demo["manifest"], expected, onnx=_has_onnxruntime())
    # the coordinator exports the same model from its own file, with its own facts
    server = load_config(loop.server_config)
    coordinator_model = server.state_dir / "models" / demo["site_model"].name
    out2 = root / "export-coordinator"
    coordinator_args = [
        "export",
        "--model",
        str(coordinator_model),
        "--weights",
        str(demo["weights"]),
    ]
    coordinator_args += ["--config", str(loop.server_config), "--backbone", "resnet18"]
    assert lab_main([*coordinator_args, "--out", str(out2), "--no-onnx"]) == 0
    card2 = json.loads((out2 / "model_card.json").read_text())
    assert card2["model"]["model_sha256"] == card["model"]["model_sha256"]
    assert card2["training"]["facts_from"].startswith("coordinator: signed plan")
    assert card2["training"]["aggregation"] == "mask"
    assert card2["training"]["training_images"]["known"] == {}


def _has_onnxruntime() -> bool:
    try:
        import onnxruntime  # noqa: F401
    except ImportError:
        return False
    return True


def test_site_evaluation_goes_into_its_report_and_the_card(demo, capsys) -> None:
    loop, cfg = demo["loop"], demo["site_cfg"]
    config = str(loop.client_configs["site-1"])
    argv = ["evaluate", "--config", config, "--cache", str(loop.test_cache), "--bootstrap", "60"]
    assert client_main(argv) == 0
    assert "written into the site's report" in capsys.readouterr().out
    report = json.loads((cfg.state_dir / "reports" / f"{demo['round_id']}.json").read_text())
    assert report["outcome"] == "COMPLETED"  # the daemon's report, extended
    local = report["local_evaluation"]
    assert local["model_sha256"] == report["model"]["sha256"]
    assert sorted(local["per_class"]) == ["A", "B"]  # the classes site-1 labels
    test = open_cache(loop.test_cache)
    published = pb.Model.FromString(
        pb.SignedModel.FromString(demo["site_model"].read_bytes()).model
    )
    w = np.frombuffer(published.weights.data, dtype="<f8").reshape(D, len(CLASSES))
    p = 1 / (1 + np.exp(-(np.asarray(test.features, dtype=np.float64) @ w)))
    for name, row in local["per_class"].items():
        c = CLASSES.index(name)
        y = test.labels[:, c] == 1
        assert row["auc"]["estimate"] == pytest.approx(roc_auc_score(y, p[:, c]), abs=1e-12)
        assert row["ap"]["estimate"] == pytest.approx(
            average_precision_score(y, p[:, c]), abs=1e-12
        )
        assert row["auc"]["low"] <= row["auc"]["estimate"] <= row["auc"]["high"]
    # a federated evaluation of the same model (the sites' summed statistics, in process here)
    caches = [open_cache(loop.root / "data" / s) for s in loop.site_ids]
    summed = sum_statistics(
        [
            evaluation_statistics(
                c.features, c.labels, weights=w, classes=CLASSES, bins=DEFAULT_SCORE_BINS
            )
            for c in caches
        ]
    )
    fed_doc = federated_evaluation_document(summed, model_sha256=local["model_sha256"])
    fed_path = demo["root"] / "federated-evaluation.json"
    fed_path.write_text(json.dumps(fed_doc))
    out = demo["root"] / "export-evaluated"
    args = ["export", "--model", str(demo["site_model"]), "--weights", str(demo["weights"])]
    args += ["--config", config, "--backbone", "resnet18", "--no-onnx"]
    assert lab_main([*args, "--evaluation", str(fed_path), "--out", str(out)]) == 0
    card = json.loads((out / "model_card.json").read_text())
    assert card["metrics"]["local evaluation (site-1)"]["per_class"] == local["per_class"]
    assert card["metrics"]["federated evaluation"]["per_class"] == fed_doc["per_class"]
    assert "### local evaluation (site-1)" in (out / "model_card.md").read_text()
    # an evaluation of another model is refused
    fed_path.write_text(json.dumps({**fed_doc, "model_sha256": "00" * 32}))
    assert lab_main([*args, "--evaluation", str(fed_path), "--out", str(out) + "-x"]) == 2
    assert "evaluates another model" in capsys.readouterr().err


def test_predict_on_a_folder_of_png_and_dicom(demo, site_export, tmp_path) -> None:
    out = tmp_path / "predictions.csv"
    folder = demo["manifest"].parent
    argv = ["predict", "--model", str(site_export), "--images", str(folder), "--out", str(out)]
    argv += ["--config", str(demo["loop"].client_configs["site-1"])]
    assert client_main([*argv, "--no-progress"]) == 0
    with open(out, encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh))
    assert sorted(r["id"] for r in rows) == ["a.png", "b.png", "c.dcm", "d.dcm"]
    for row in rows:
        probs = [float(row[f"p_{c}"]) for c in CLASSES]
        assert all(0.0 < v < 1.0 for v in probs)
        assert [int(row[f"decision_{c}"]) for c in CLASSES] == [int(v > 0.5) for v in probs]
