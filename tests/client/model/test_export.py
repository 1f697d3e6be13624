"""The exported classifier (afl.client.model.export) against the project's own pipeline: PNG and DICOM
images written by the test -> ``extract_features`` (afl-client extract) -> σ(features · W)
(afl.core.metrics.predict_proba) must equal the TorchScript module's and the ONNX graph's
outputs (onnxruntime) to 1e-5; the model is used only with a valid signature; the card says what
the export knows; `afl-client predict` writes probabilities for a folder of PNG and DICOM files."""

from __future__ import annotations

import csv
import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from afl.client.cli import main as client_main
from afl.client.features.backbones import load_backbone
from afl.client.features.sitedata import read_image
from afl.client.model.export import (
    ExportError,
    build_classifier,
    export_classifier,
    load_exported,
    save_torchscript,
)
from afl.client.model.model_card import TrainingFacts
from afl.client.model.published import ModelFileError, load_published_model
from afl.core.evaluation.calibration import Calibration, ClassCalibration
from afl.core.evaluation.scorebins import DEFAULT_SCORE_BINS
from afl.crypto.identity.signatures import generate_identity_key, public_key_to_raw
from afl.ops.provisioning import ProvisionedFederation
from afl.server.solve.model import build_signed_model
from tests.helpers.federation import FederationSpec, rewrite_client_toml
from tests.helpers.modelproof import release_proof, site_keys
from tests.helpers.pipeline import (
    check_against_pipeline,
    manifest_names,
    pipeline_probabilities,
    weights_file,
    write_images,
)

FED_ID = "fed-export"
FEDERATION = FederationSpec(sites=["site-1", "site-2", "site-3"], port=50996, federation_id=FED_ID)
CLASSES = ("Effusion", "Mass", "Nodule")


def _signed_model(tmp: Path, key, weights: np.ndarray, backbone: str) -> Path:
    signed = build_signed_model(
        weights,
        identity_key=key,
        federation_id=FED_ID,
        round_id="r1-test",
        round_number=1,
        classes=CLASSES,
        gamma=1.0,
        backbone=backbone,
        contributors=["site-1", "site-2", "site-3"],
        plan_bytes=b"plan",
    )
    path = tmp / "r1-test.signed-model.pb"
    path.write_bytes(signed.SerializeToString())
    return path


def _head(rng: np.random.Generator, backbone, manifest: Path) -> np.ndarray:
    """W giving logits of order 1 on these images (so probabilities are not saturated)."""
    x = torch.stack([backbone.preprocess(read_image(manifest.parent / "a.png"))])
    with torch.inference_mode():
        scale = float(backbone.module(x).norm())
    return rng.normal(size=(backbone.dim, len(CLASSES))) / scale


@pytest.fixture(scope="module")
def resnet_export(tmp_path_factory, federation: ProvisionedFederation):
    tmp = tmp_path_factory.mktemp("export")
    key = generate_identity_key()
    manifest = write_images(tmp / "images")
    backbone = load_backbone("resnet18", weights=weights_file(tmp, "resnet18"))
    w = _head(np.random.default_rng(0), backbone, manifest)
    model_path = _signed_model(tmp, key, w, "resnet18")
    published = load_published_model(
        model_path, server_public_key=public_key_to_raw(key), federation_id=FED_ID
    )
    proof = release_proof(
        federation=FED_ID,
        coordinator=key,
        model_sha256=published.model_sha256,
        round_id="r1-test",
        witnesses=site_keys(federation.site_dirs),
    )
    card = export_classifier(
        published,
        backbone,
        tmp / "out",
        facts=TrainingFacts(source="test"),
        software_version="t",
        proof=proof,
    )
    config = rewrite_client_toml(
        federation.site_dirs["site-1"],
        tmp,
        client={"state_dir": str(tmp / "state")},
        identity={"server_public_key": public_key_to_raw(key).hex()},
    )
    return {
        "config": config,
        "tmp": tmp,
        "key": key,
        "manifest": manifest,
        "backbone": backbone,
        "w": w,
        "model_path": model_path,
        "published": published,
        "card": card,
        "out": tmp / "out",
    }


def test_torchscript_and_onnx_equal_the_project_pipeline(resnet_export) -> None:
    pytest.importorskip("onnxruntime")
    e = resnet_export
    expected = pipeline_probabilities(e["tmp"], e["backbone"], e["manifest"], e["w"])
    check_against_pipeline(e["out"], e["manifest"], expected)


@pytest.mark.slow
def test_xrv_densenet_export_equals_the_project_pipeline(tmp_path) -> None:
    """The default backbone (TorchXRayVision DenseNet-121, its own preprocessing)."""
    pytest.importorskip("onnxruntime")
    key = generate_identity_key()
    manifest = write_images(tmp_path / "images")
    backbone = load_backbone(
        "xrv-densenet121-all", weights=weights_file(tmp_path, "xrv-densenet121-all")
    )
    w = _head(np.random.default_rng(1), backbone, manifest)
    published = load_published_model(
        _signed_model(tmp_path, key, w, "xrv-densenet121-all"),
        server_public_key=public_key_to_raw(key),
        federation_id=FED_ID,
    )
    export_classifier(published, backbone, tmp_path / "out", facts=TrainingFacts(source="test"))
    check_against_pipeline(
        tmp_path / "out", manifest, pipeline_probabilities(tmp_path, backbone, manifest, w)
    )


def test_export_folder_card_and_checksums(resnet_export) -> None:
    e = resnet_export
    out, card = e["out"], e["card"]
    assert card["classes"] == list(CLASSES)
    assert card["model"]["model_sha256"] == hashlib.sha256(e["published"].signed.model).hexdigest()
    assert card["model"]["number_of_sites"] == 3
    assert card["backbone"]["weights_sha256"] == e["backbone"].weights_sha256
    assert card["must_not_be_used_for"] and card["training"]["training_images"]["total"] is None
    assert json.loads((out / "model_card.json").read_text()) == card
    assert load_exported(out / "model.ts").card == card
    assert "## Must not be used for" in (out / "model_card.md").read_text()
    for line in (out / "SHA256SUMS").read_text().splitlines():
        digest, name = line.split()
        assert hashlib.sha256((out / name).read_bytes()).hexdigest() == digest
    import onnx

    meta = {p.key: p.value for p in onnx.load(str(out / "model.onnx")).metadata_props}
    assert meta["afl.model_sha256"] == card["model"]["model_sha256"]


def test_only_a_model_signed_by_the_federations_server_is_exported(resnet_export, tmp_path) -> None:
    e = resnet_export
    other = public_key_to_raw(generate_identity_key())
    with pytest.raises(ModelFileError, match="not signed by this federation's server"):
        load_published_model(e["model_path"], server_public_key=other, federation_id=FED_ID)
    with pytest.raises(ModelFileError, match=r"of .fed-export."):
        load_published_model(
            e["model_path"], server_public_key=public_key_to_raw(e["key"]), federation_id="other"
        )
    tampered = tmp_path / "tampered.pb"
    signed = e["published"].signed
    blob = bytearray(signed.model)
    blob[-3] ^= 1
    signed2 = type(signed)(model=bytes(blob), signature=signed.signature)
    tampered.write_bytes(signed2.SerializeToString())
    with pytest.raises(ModelFileError, match="not signed"):
        load_published_model(
            tampered, server_public_key=public_key_to_raw(e["key"]), federation_id=FED_ID
        )


def test_export_refuses_a_wrong_backbone_a_used_folder_or_a_foreign_calibration(
    resnet_export, tmp_path
) -> None:
    e = resnet_export
    facts = TrainingFacts(source="test")
    vgg = load_backbone("vgg11", random_init=True)
    with pytest.raises(ExportError, match="d = 4096"):
        build_classifier(vgg, e["w"])
    with pytest.raises(ExportError, match="not empty"):
        export_classifier(e["published"], e["backbone"], e["out"], facts=facts)
    foreign = Calibration(
        "platt",
        "00" * 32,
        DEFAULT_SCORE_BINS,
        tuple(ClassCalibration(c, "platt", True, 1, 1, 1.0, 0.0) for c in CLASSES),
    )
    with pytest.raises(ExportError, match="fitted for model"):
        export_classifier(
            e["published"], e["backbone"], tmp_path / "x", facts=facts, calibration=foreign
        )
    assert not (tmp_path / "x").exists()


def test_predict_writes_probabilities_for_png_and_dicom(resnet_export, tmp_path, capsys) -> None:
    e = resnet_export
    folder = e["manifest"].parent
    (folder / "broken.dcm").write_bytes(b"\0" * 128 + b"DICM" + b"garbage")
    calib = Calibration(
        "platt",
        e["card"]["model"]["model_sha256"],
        DEFAULT_SCORE_BINS,
        tuple(ClassCalibration(c, "platt", True, 1, 1, 2.0, -1.0) for c in CLASSES),
    )
    calib_path = calib.save(tmp_path / "calibration.json")
    out = tmp_path / "pred.csv"
    argv = ["predict", "--model", str(e["out"]), "--images", str(folder), "--out", str(out)]
    argv += ["--config", str(e["config"])]
    code = client_main([*argv, "--calibration", str(calib_path), "--no-progress"])
    assert code == 0
    captured = capsys.readouterr()
    assert "verified: signed by the coordinator" in captured.out
    err = captured.err
    assert "broken.dcm" in err and "skipped unreadable" in err
    with open(out, encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh))
    assert sorted(r["id"] for r in rows) == ["a.png", "b.png", "c.dcm", "d.dcm"]
    expected = pipeline_probabilities(tmp_path, e["backbone"], e["manifest"], e["w"])
    order = manifest_names(e["manifest"])
    for row in rows:
        want = expected[order.index(row["id"])]
        got = np.array([float(row[f"p_{c}"]) for c in CLASSES])
        np.testing.assert_allclose(got, want, atol=1e-5)
        assert [int(row[f"decision_{c}"]) for c in CLASSES] == [int(p > 0.5) for p in got]
        logits = np.log(got / (1 - got))
        cal = np.array([float(row[f"calibrated_{c}"]) for c in CLASSES])
        np.testing.assert_allclose(cal, 1 / (1 + np.exp(-(2 * logits - 1))), atol=1e-6)
    with open(f"{out}.unreadable.csv", encoding="utf-8") as fh:
        bad = list(csv.DictReader(fh))
    assert [b["id"] for b in bad] == ["broken.dcm"]
    # JSON output from a manifest; a foreign calibration is refused with one line
    out_json = tmp_path / "pred.json"
    argv = ["predict", "--model", str(e["out"]), "--manifest", str(e["manifest"])]
    argv += ["--config", str(e["config"])]
    assert client_main([*argv, "--out", str(out_json), "--no-progress"]) == 0
    doc = json.loads(out_json.read_text())
    assert len(doc["predictions"]) == 4 and doc["classes"] == list(CLASSES)
    foreign = tmp_path / "foreign.json"
    foreign.write_text(json.dumps({**calib.to_json(), "model_sha256": "11" * 32}))
    code = client_main([*argv, "--out", str(out_json), "--calibration", str(foreign)])
    assert code == 1 and "fitted for model" in capsys.readouterr().err
    (folder / "broken.dcm").unlink()


def test_predict_refuses_a_fake_or_altered_export_unless_overridden(
    resnet_export, tmp_path, capsys
) -> None:
    """M-199: a TorchScript folder with a made-up digest (no signed model, no log proof) and an
    export whose head was replaced are refused with one line; --unverified-model scores the
    fake one and warns."""
    e = resnet_export
    assert e["card"]["files"]["log_proof"] == "log-proof.json"
    assert e["card"]["federation_log"]["cosigned_by"] == ["site-1", "site-2", "site-3"]
    folder = e["manifest"].parent
    fake = tmp_path / "fake"
    fake.mkdir()
    card = {**e["card"], "model": {**e["card"]["model"], "model_sha256": "ab" * 32}}
    clf = build_classifier(e["backbone"], e["w"] * 2)
    save_torchscript(clf, fake / "model.ts", card=card)
    base = ["predict", "--images", str(folder), "--no-progress", "--config", str(e["config"])]
    out = str(tmp_path / "p.csv")
    assert client_main([*base, "--model", str(fake), "--out", out]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "not an export of this federation" in err, err
    # the genuine signed model and proof beside an altered classifier
    altered = tmp_path / "altered"
    shutil.copytree(e["out"], altered)
    (altered / "model.ts").unlink()
    shutil.copy(fake / "model.ts", altered / "model.ts")
    assert client_main([*base, "--model", str(altered), "--out", out]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "head differs from the signed model" in err, err
    # without the kit there is nothing to verify with
    argv = ["predict", "--images", str(folder), "--model", str(e["out"]), "--out", out]
    assert client_main(argv) == 1
    assert "--config is required" in capsys.readouterr().err
    # the override scores the fake export, with a warning
    assert client_main([*base, "--model", str(fake), "--out", out, "--unverified-model"]) == 0
    err = capsys.readouterr().err
    assert "WARNING" in err and "NOT verified" in err
