"""`afl report EXPORT_DIR`: the deployed-round view (model card, evaluations, calibration) is one
self-contained HTML file; its tables carry the card's values, its plots decode as PNGs, and
(when Chromium is installed) it renders in headless Chromium."""

from __future__ import annotations

import argparse
import base64
import json
import re
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from afl.client.model.model_card import TrainingFacts, card_markdown, model_card
from afl.core.evaluation.calibration import calibration_document, fit_calibration
from afl.core.evaluation.federated import (
    FEDERATED_EVALUATION_FORMAT,
    evaluation_statistics,
    federated_evaluation_document,
)
from afl.core.evaluation.local import bootstrap_evaluation
from afl.core.evaluation.scorebins import DEFAULT_SCORE_BINS
from afl.lab.report.cmd import add_arguments, run
from afl.lab.report.deployed import render_deployed_report
from afl.lab.report.simulation import ReportError
from tests.helpers.browser import (
    CHROMIUM,
    SKIP_REASON,
    blank_tail_fraction,
    full_page_screenshot,
    headless_flags,
    shot_path,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
IMG_RE = re.compile(r'<img src="data:image/png;base64,([A-Za-z0-9+/=]+)"')
CLASSES = ("Effusion", "<script>alert(1)</script>")
MODEL = "ab" * 32


def _export_folder(root: Path) -> Path:
    rng = np.random.default_rng(0)
    feats = rng.normal(size=(600, 4))
    labels = (rng.random((600, 2)) < 0.3).astype(np.int8)
    feats[:, 0] += 1.5 * labels[:, 0]
    w = np.zeros((4, 2))
    w[0, 0], w[1, 1] = 3e-4, 1e-4
    stats = evaluation_statistics(
        feats, labels, weights=w, classes=CLASSES, bins=DEFAULT_SCORE_BINS
    )
    calibration = fit_calibration(stats, model_sha256=MODEL)
    probs = 1 / (1 + np.exp(-(feats @ w)))
    local = bootstrap_evaluation(
        probs, labels, classes=CLASSES, labelled=np.array([True, True]), n_boot=40
    )
    federated = federated_evaluation_document(stats, model_sha256=MODEL)
    card = model_card(
        model={"federation_id": "fed", "round_id": "r1-x", "model_sha256": MODEL,
               "contributors": ["a", "b", "c"], "decision_threshold": 0.5,
               "created_unix_ms": 1795716651548, "shape": [4, 2]},
        classes=CLASSES,
        facts=TrainingFacts(
            source="test", aggregation="mask", surrogate=True, training_images={"a": 12}
        ),
        backbone={"name": "resnet18", "trained_on": "surrogate", "random_init": True,
                  "preprocessing": "Preprocessor(kind='xrv', crop_size=224, resize_size=224, "
                  "interpolation='bilinear')"},
        files={"torchscript": "model.ts", "calibration": "calibration.json"},
        metrics={
            "local evaluation (site-1)": {
                **local.to_json(), "model_sha256": MODEL, "in_sample": True,
                "data": "training cache /srv/site-1/cache (in-sample)",
            },
            "federated evaluation": federated,
        },
        calibration={"method": "platt", "file": "calibration.json"},
    )  # fmt: skip
    folder = root / "export"
    folder.mkdir()
    (folder / "model_card.json").write_text(json.dumps(card))
    (folder / "calibration.json").write_text(json.dumps(calibration_document(calibration, stats)))
    (folder / "SHA256SUMS").write_text("00  model.ts\n")
    return folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _export_folder(tmp_path_factory.mktemp("deployed"))


def test_deployed_view_shows_card_evaluations_and_calibration(folder: Path) -> None:
    html = render_deployed_report(folder)
    card = json.loads((folder / "model_card.json").read_text())
    assert "<script>alert" not in html and "&lt;script&gt;" in html  # escaped
    assert 'class="banner surrogate"' in html and "SURROGATE" in html
    assert "Must not be used for" in html and MODEL in html
    local = card["metrics"]["local evaluation (site-1)"]["per_class"]["Effusion"]["auc"]
    assert f"{local['estimate']:.4f} [{local['low']:.3f}, {local['high']:.3f}]" in html
    fed_auc = card["metrics"]["federated evaluation"]["per_class"]["Effusion"]["auc"]
    assert f"{fed_auc:.4f}" in html
    pngs = [base64.b64decode(m) for m in IMG_RE.findall(html)]
    assert len(pngs) == 4  # two evaluation plots, the reliability diagrams, the maps
    assert all(p.startswith(PNG_MAGIC) for p in pngs)
    assert "http://" not in html and "https://" not in html and "<link" not in html


def test_report_command_dispatches_on_an_export_folder(folder: Path, tmp_path: Path) -> None:
    p = argparse.ArgumentParser()
    add_arguments(p)
    assert run(p.parse_args([str(folder)])) == 0
    written = folder.with_name(folder.name + ".report.html")
    assert written.read_text().startswith("<!DOCTYPE html>")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "model_card.json").write_text("{}")
    with pytest.raises(ReportError, match="not an afl model card"):
        render_deployed_report(bad)
    assert run(p.parse_args([str(bad)])) == 2


def test_deployed_view_speaks_to_a_clinician(folder: Path) -> None:
    """in-sample figures are marked where they appear, an evaluation that does
    not say is marked as not shown to be out-of-sample, DP reads as the Markdown card says, and
    dates, names and units replace field names and raw JSON."""
    html = render_deployed_report(folder)
    text = re.sub(r"<[^>]+>", " ", re.sub(r'src="data:[^"]+"', "", html))
    local = html.split("Local evaluation (site-1)")[1].split("<h3>")[0]
    assert "IN-SAMPLE FIGURES: computed on the same images the model was trained on" in local
    assert "NOT a measure of how the model performs on new patients" in local
    federated = html.split("Federated evaluation")[1].split("<h2>")[0]
    assert "NOT SHOWN TO BE OUT-OF-SAMPLE" in federated
    assert "RANDOM (UNTRAINED) BACKBONE WEIGHTS" in html
    markdown = card_markdown(json.loads((folder / "model_card.json").read_text()))
    assert "| differential privacy | none (no differential privacy) |" in markdown
    row = '<td class="name">Differential privacy</td><td>none (no differential privacy)</td>'
    assert row in html  # as the Markdown card says it, not "unknown"
    assert "IN-SAMPLE" in markdown
    assert "Published" in text and "November 2026" in text  # 1795716651548 ms = 26 Nov 2026
    assert "4 features × 2 classes" in text and "12 images" in text
    assert "224 × 224 pixels" in text
    for raw in ("created_unix_ms", "training_images", "Preprocessor(", "differential_privacy",
                '{"', "model_sha256", "surrogate_features"):  # fmt: skip
        assert raw not in text, raw


def test_export_records_a_sites_in_sample_evaluation_round(tmp_path: Path) -> None:
    """A site's export marks a federated evaluation with what its report of that evaluation
    round says (the figures are in-sample where it evaluated its training cache)."""
    from afl.ops.export import _mark_in_sample

    (tmp_path / "reports").mkdir()
    report = {"evaluation": {"model_sha256": MODEL, "in_sample": True, "rows": 12}}
    (tmp_path / "reports" / "r2-eval.json").write_text(json.dumps(report))
    metrics: dict[str, Any] = {"federated evaluation": {"format": FEDERATED_EVALUATION_FORMAT,
                                        "model_sha256": MODEL, "members": ["site-1", "site-2"]}}  # fmt: skip
    _mark_in_sample(metrics, state_dir=tmp_path, site_id="site-1")
    assert metrics["federated evaluation"]["in_sample"] == {"site-1": True}


@pytest.mark.skipif(CHROMIUM is None, reason=SKIP_REASON)
def test_deployed_view_renders_in_headless_chromium(folder: Path, tmp_path: Path) -> None:
    assert CHROMIUM is not None
    probe = (
        '<pre id="probe"></pre><script>const i=[...document.images];'
        "document.getElementById('probe').textContent=JSON.stringify({n:i.length,"
        "ok:i.filter(x=>x.complete&&x.naturalWidth>0).length});</script>"
    )
    page = tmp_path / "page.html"
    page.write_text(render_deployed_report(folder).replace("</body>", probe + "</body>"))
    dom = subprocess.run(
        [CHROMIUM, *headless_flags(tmp_path / "profile"), "--dump-dom", page.as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    found = re.search(r'<pre id="probe">(.*?)</pre>', dom, re.S)
    assert found is not None
    result = json.loads(found.group(1))
    assert result["n"] == result["ok"] == 4
    plain = tmp_path / "deployed.html"
    plain.write_text(render_deployed_report(folder), encoding="utf-8")
    shot = full_page_screenshot(
        CHROMIUM, plain, shot_path(tmp_path, "deployed-report.png"), profile=tmp_path / "shot"
    )
    assert shot.read_bytes().startswith(PNG_MAGIC)
    assert blank_tail_fraction(shot) < 0.05  # the page ends where its content ends


def test_a_dp_evaluation_says_its_figures_are_noised(tmp_path: Path) -> None:
    folder = _export_folder(tmp_path)
    card = json.loads((folder / "model_card.json").read_text())
    card["metrics"]["federated evaluation"]["dp"] = {"epsilon": 2.0, "delta": 1e-6}
    (folder / "model_card.json").write_text(json.dumps(card))
    federated = render_deployed_report(folder).split("Federated evaluation")[1].split("<h2>")[0]
    assert "differentially private evaluation: ε = 2.0, δ = 1e-06 per site" in federated
