"""``afl bench extract`` on a tiny CPU run: the report has both rates and their ratio."""

from __future__ import annotations

import argparse
import json

import pytest

from afl.lab.bench.extract import add_arguments, run, run_extract_bench


def test_bench_reports_pipeline_and_forward_rates():
    res = run_extract_bench(
        backbone="resnet18", device="cpu", batch_size=4, num_images=8, workers=0, image_size=64
    )
    assert res["random_init"] is True and res["device"] == "cpu"
    assert res["pipeline_images_per_s"] > 0 and res["forward_images_per_s"] > 0
    assert res["ratio"] == pytest.approx(res["pipeline_images_per_s"] / res["forward_images_per_s"])


def test_bench_cli_writes_json(tmp_path):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    out = tmp_path / "b.json"
    args = parser.parse_args(
        ["--backbone", "resnet18", "--device", "cpu", "--batch-size", "2", "--num-images", "4",
         "--workers", "0", "--image-size", "48", "--json", str(out)]
    )  # fmt: skip
    assert run(args) == 0
    assert json.loads(out.read_text())["num_images"] == 4
