"""``afl-client`` command line: extract, merge, backbones, error exit codes."""

from __future__ import annotations

import numpy as np
import pytest

from afl.client.cli import build_parser, default_workers, main
from afl.core.data.featurecache import open_cache
from tests.client.imagegen import make_site, write_png

COMMON = ["--backbone", "resnet18", "--random-init", "--batch-size", "4", "--workers", "0"]


def test_extract_shards_then_merge_equals_single(tmp_path, capsys):
    manifest = str(make_site(tmp_path, 10, size=32))
    args = ["extract", "--manifest", manifest, *COMMON, "--no-progress", "--classes", "B"]
    assert main([*args, "--out", str(tmp_path / "one")]) == 0
    assert "RANDOM-INIT" in capsys.readouterr().out
    for i in range(2):
        assert main([*args, "--out", str(tmp_path / f"s{i}"), "--shard", f"{i}/2"]) == 0
    assert (
        main(["merge", str(tmp_path / "s0"), str(tmp_path / "s1"), "--out", str(tmp_path / "m")])
        == 0
    )
    one, merged = open_cache(tmp_path / "one"), open_cache(tmp_path / "m")
    assert one.meta.classes == ("B",) and one.meta.d == 512
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


def test_a_misspelt_manifest_column_is_refused_unless_declared(tmp_path, capsys):
    """a column ``Efusion`` would make a class whose labels never reach the
    federation's Effusion; declared with --classes it is the site's own class name."""
    manifest = make_site(tmp_path, 2, size=32)
    lines = manifest.read_text().splitlines()
    manifest.write_text("\n".join([lines[0].replace(",A", ",Efusion"), *lines[1:]]) + "\n")
    assert "Efusion" in manifest.read_text()
    args = ["extract", "--manifest", str(manifest), *COMMON, "--no-progress"]
    assert main([*args, "--out", str(tmp_path / "c")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "column 'Efusion' is not a known finding (did you mean 'Effusion'?)" in err
    assert "--classes" in err and not (tmp_path / "c").exists()
    assert main([*args, "--out", str(tmp_path / "d"), "--classes", "Efusion"]) == 0
    assert open_cache(tmp_path / "d").meta.classes == ("Efusion",)


def test_ctrl_c_during_extract_says_a_rerun_resumes(tmp_path, capsys, monkeypatch):
    """Ctrl-C after the first batch: one line (stopped, rerun resumes), exit
    130, no traceback; the rerun completes with the features of an uninterrupted run."""
    from afl.core.data.featurecache import FeatureCacheWriter

    manifest = str(make_site(tmp_path, 8, size=32))
    args = ["extract", "--manifest", manifest, *COMMON, "--no-progress", "--classes", "B"]
    assert main([*args, "--out", str(tmp_path / "whole")]) == 0
    original = FeatureCacheWriter.write_rows

    def then_ctrl_c(self, *a, **k):
        original(self, *a, **k)
        raise KeyboardInterrupt

    monkeypatch.setattr(FeatureCacheWriter, "write_rows", then_ctrl_c)
    capsys.readouterr()
    assert main([*args, "--out", str(tmp_path / "c")]) == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines()[-1] == (
        "afl-client extract: stopped (Ctrl-C); the images extracted so far are kept: run the "
        "same command again to resume where it stopped"
    )
    monkeypatch.setattr(FeatureCacheWriter, "write_rows", original)
    assert main([*args, "--out", str(tmp_path / "c")]) == 0
    whole, resumed = open_cache(tmp_path / "whole"), open_cache(tmp_path / "c")
    assert resumed.features.tobytes() == whole.features.tobytes()


def test_usage_and_backbone_list(capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["extract", "--backbone", "resnet18", "--out", "x"])
    assert exc.value.code == 2
    assert main(["backbones"]) == 0
    listing = capsys.readouterr().out
    assert "xrv-densenet121-mimic_ch" in listing and "efficientnet_b7" in listing


def _broken(manifest, count):
    """Overwrite the first ``count`` images of a make_site manifest with junk bytes."""
    for line in manifest.read_text().splitlines()[1 : count + 1]:
        (manifest.parent / line.split(",")[0]).write_bytes(b"not an image")


def test_no_readable_image_is_an_error(tmp_path, capsys):
    manifest = make_site(tmp_path, 3, size=32)
    _broken(manifest, 3)
    rc = main(
        [
            "extract",
            "--manifest",
            str(manifest),
            *COMMON,
            "--no-progress",
            "--out",
            str(tmp_path / "c"),
        ]
    )
    err = capsys.readouterr().err
    assert rc == 1 and "no image could be read: 3 unreadable" in err


def test_many_unreadable_images_warn_loudly_over_the_threshold(tmp_path, capsys):
    manifest = make_site(tmp_path, 10, size=32)
    _broken(manifest, 3)
    args = ["extract", "--manifest", str(manifest), *COMMON, "--no-progress"]
    assert main([*args, "--out", str(tmp_path / "c")]) == 0
    err = capsys.readouterr().err
    assert "WARNING: 3 of 10 images (30%) were UNREADABLE" in err and "unreadable.csv" in err
    assert main([*args, "--out", str(tmp_path / "d"), "--warn-unreadable", "0.5"]) == 0
    assert "UNREADABLE" not in capsys.readouterr().err


def test_missing_files_are_found_before_any_work(tmp_path, capsys, monkeypatch):
    def no_backbone(*args, **kwargs):
        raise AssertionError("the backbone was loaded before the pre-flight check")

    monkeypatch.setattr("afl.client.features.backbones.load_backbone", no_backbone)
    (tmp_path / "m.csv").write_text("path,A\nmissing1.png,1\nmissing2.png,0\n")
    rc = main(
        ["extract", "--manifest", str(tmp_path / "m.csv"), *COMMON, "--out", str(tmp_path / "c")]
    )
    assert rc == 1 and "none of the 2 listed image files exists" in capsys.readouterr().err


def test_a_partial_nih_folder_is_refused_unless_only_present(tmp_path, capsys, monkeypatch):
    """--images on a partial download used to plan every listed image and run for hours."""
    (tmp_path / "images").mkdir()
    rows = ["Image Index,Finding Labels,Follow-up #,Patient ID,View Position"]
    for i in range(5):
        rows.append(f"{i:08d}_000.png,{'Effusion' if i % 2 else 'No Finding'},0,{i},PA")
    for i in (0, 3):
        write_png(tmp_path / "images" / f"{i:08d}_000.png", np.full((32, 32), 40 * i, np.uint8))
    (tmp_path / "Data_Entry_2017_v2020.csv").write_text("\n".join(rows) + "\n")
    args = ["extract", "--images", str(tmp_path), *COMMON, "--no-progress"]
    with monkeypatch.context() as patch:  # the refusal comes before the backbone is loaded
        patch.setattr(
            "afl.client.features.backbones.load_backbone", lambda *a, **k: pytest.fail("loaded")
        )
        assert main([*args, "--out", str(tmp_path / "c")]) == 1
    err = capsys.readouterr().err
    assert "only 2 of the 5 images listed" in err and "--only-present" in err
    assert main([*args, "--out", str(tmp_path / "c"), "--only-present"]) == 0
    assert open_cache(tmp_path / "c").meta.n == 2


def test_default_workers_never_exceed_the_cpus(monkeypatch):
    argv = ["extract", "--manifest", "m", "--backbone", "b", "--random-init", "--out", "o"]
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    assert default_workers() == 2  # a 2-core machine: torch's DataLoader does not warn
    assert build_parser().parse_args(argv).workers == 2
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)))
    assert default_workers() == 4 and build_parser().parse_args(argv).workers == 4


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.startswith("afl-client ")


def test_help_says_what_each_command_does_in_full_sentences(capsys):
    """`afl-client --help` and `afl-client CMD --help` (docs/operations.md: no source to read)."""
    from afl.client.cli import SUBCOMMANDS

    with pytest.raises(SystemExit):
        main(["--help"])
    description = capsys.readouterr().out.split("\n\n")[1]
    assert description.rstrip().endswith("."), description
    for name, *_ in SUBCOMMANDS:
        with pytest.raises(SystemExit):
            main([name, "--help"])
        paragraphs = capsys.readouterr().out.split("\n\n")
        assert paragraphs[1].rstrip().endswith("."), (name, paragraphs[1])
        assert not paragraphs[1].startswith(("positional", "options")), name
