"""``afl-client`` command line: extract, merge, backbones, error exit codes."""

from __future__ import annotations

import numpy as np
import pytest

from afl.client.cli import build_parser, main
from afl.core.featurecache import open_cache
from tests.client.imagegen import make_site

COMMON = ["--backbone", "resnet18", "--random-init", "--batch-size", "4", "--workers", "0"]


def test_extract_shards_then_merge_equals_single(tmp_path, capsys):
    manifest = str(make_site(tmp_path, 10, size=32))
    args = ["extract", "--manifest", manifest, *COMMON, "--no-progress", "--classes", "B,Z"]
    assert main([*args, "--out", str(tmp_path / "one")]) == 0
    assert "RANDOM-INIT" in capsys.readouterr().out
    for i in range(2):
        assert main([*args, "--out", str(tmp_path / f"s{i}"), "--shard", f"{i}/2"]) == 0
    assert (
        main(["merge", str(tmp_path / "s0"), str(tmp_path / "s1"), "--out", str(tmp_path / "m")])
        == 0
    )
    one, merged = open_cache(tmp_path / "one"), open_cache(tmp_path / "m")
    assert one.meta.classes == ("B", "Z") and one.meta.d == 512
    assert (one.labels[:, 1] == -1).all()  # class Z has no column: not labelled
    assert one.features.tobytes() == merged.features.tobytes() and one.ids == merged.ids
    np.testing.assert_array_equal(one.labels, merged.labels)


def test_errors_exit_one_with_message(tmp_path, capsys):
    manifest = str(make_site(tmp_path, 2, size=32))
    rc = main(
        ["extract", "--manifest", manifest, "--backbone", "xrv-densenet121-all",
         "--weights", str(tmp_path), "--out", str(tmp_path / "c")]
    )  # fmt: skip
    err = capsys.readouterr().err
    assert rc == 1 and "densenet121-d121-tw-lr001-rot45-tr15-sc15-seed0-best.pt" in err
    assert main(["extract", "--manifest", manifest, *COMMON, "--shard", "3/2", "--out", "x"]) == 1
    assert "shard" in capsys.readouterr().err


def test_usage_and_backbone_list(capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["extract", "--backbone", "resnet18", "--out", "x"])
    assert exc.value.code == 2
    assert main(["backbones"]) == 0
    listing = capsys.readouterr().out
    assert "xrv-densenet121-mimic_ch" in listing and "efficientnet_b7" in listing
