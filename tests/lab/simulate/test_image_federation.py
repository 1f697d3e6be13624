"""`afl simulate --images DIR`: the real-image path end to end on a tiny generated NIH folder."""

from __future__ import annotations

import json

import numpy as np
import pytest

from afl.core.data.nih import PAPER_CLASSES
from afl.lab.cli import main
from tests.client.imagegen import write_png

HEADER = (
    "Image Index,Finding Labels,Follow-up #,Patient ID,Patient Age,Patient Gender,View Position"
)


def make_nih_folder(root, *, n_pa=36, n_ap=4, seed=0):
    rng = np.random.default_rng(seed)
    (root / "images").mkdir(parents=True)
    lines = [HEADER]
    for i in range(n_pa + n_ap):
        name = f"{i:08d}_000.png"
        found = [c for c in PAPER_CLASSES if rng.random() < 0.35] or ["No Finding"]
        view = "PA" if i < n_pa else "AP"
        lines.append(f"{name},{'|'.join(found)},0,{i},50,M,{view}")
        write_png(root / "images" / name, rng.integers(0, 256, (64, 64), dtype=np.uint8))
    (root / "images" / f"{3:08d}_000.png").write_bytes(b"not a png")  # one unreadable image
    (root / "Data_Entry_2017_v2020.csv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return root


def test_simulate_on_images_with_random_init_backbone(tmp_path):
    images = make_nih_folder(tmp_path / "nih")
    out = tmp_path / "r.json"
    argv = [
        "simulate", "--images", str(images), "--random-init", "--sites", "2",
        "--setting", "missing-1", "--rounds", "1", "--no-oracle", "--no-centralised",
        "--cache-dir", str(tmp_path / "cache"), "--workers", "0", "--batch-size", "8",
        "--out", str(out), "--quiet",
    ]  # fmt: skip
    assert main(argv) == 0
    results = json.loads(out.read_text())
    data = results["data"]
    assert data["surrogate"] is False and "RANDOM-INIT" in data["provenance"]
    assert data["n_pa_images"] == 36 and data["unreadable_or_missing_images"] == 1
    assert data["d"] == 1024
    # 35 readable PA images: the FedMLP split of the 36 rows minus the unreadable one; two IID
    # sites of equal size drop at most one training image.
    assert 35 - data["n_test"] - sum(data["sites"].values()) in (0, 1)
    assert data["n_test"] in (10, 11)
    rows = results["settings"]["missing-1"]["rows"]
    assert [r["method"] for r in rows] == [
        "analytic 1-round (per-class)",
        "analytic 1-round (global)",
    ]
    # A second run resumes from the complete cache instead of extracting again.
    assert main(argv) == 0


def test_images_without_weights_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="--weights FILE"):
        main(["simulate", "--images", str(tmp_path)])
