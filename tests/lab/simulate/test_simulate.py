"""`afl simulate` on small synthetic federations: grid shape, Theorem-1 row, saving, caches."""

from __future__ import annotations

import json

import numpy as np
import pytest

from afl.core.data.assignment import CoverageSpec
from afl.core.metrics import evaluate, predict_proba
from afl.lab.cli import main
from afl.lab.report import tables
from afl.lab.simulate.dataset import load_dataset, save_dataset
from afl.lab.simulate.grid import (
    CENTRAL,
    ORACLE,
    SimulationConfig,
    coverage_setting,
    missing_settings,
    simulate,
)
from tests.lab.synthetic import CLASSES, small_federation


def test_grid_rows_and_theorem1_row():
    fed = small_federation()
    settings = missing_settings([1, 3], num_sites=4, num_classes=4, seed=5)
    results = simulate(fed, SimulationConfig(settings=settings), progress=False)
    assert list(results["settings"]) == ["missing-1", "missing-3"]
    for body in results["settings"].values():
        methods = [r["method"] for r in body["rows"]]
        assert methods == [
            "analytic 1-round (per-class)",
            "analytic 2-round (per-class)",
            "analytic 1-round (global)",
            "analytic 2-round (global)",
            ORACLE,
        ]
        rows = {r["method"]: r for r in body["rows"]}
        oracle = rows[ORACLE]
        assert oracle["max_rel_diff_vs_federated_per_class"] <= 1e-9
        assert oracle["macro"] == pytest.approx(
            rows["analytic 1-round (per-class)"]["macro"], abs=1e-9
        )
        for row in body["rows"]:
            assert set(row["macro"]) == {"bacc", "auc", "map"}
            assert set(row["per_class"]) == set(CLASSES)
    m1 = results["settings"]["missing-1"]["assignment"]
    assert all(len(classes) == 3 for classes in m1.values())
    m3 = results["settings"]["missing-3"]["assignment"]
    assert all(len(classes) == 1 for classes in m3.values())
    assert results["centralised"]["method"] == CENTRAL
    text = tables.table_ii(results)
    assert "missing-1" in text and ORACLE in text and "SURROGATE" in text


def test_global_scope_learns_only_one_gram_and_differs_from_per_class_when_covers_differ():
    fed = small_federation(1)
    active = np.array([[1, 1, 0, 0], [1, 0, 1, 0], [0, 1, 0, 1], [1, 0, 0, 1]], dtype=bool)
    spec = CoverageSpec(classes=CLASSES, sites=fed.site_names, active=active)
    config = SimulationConfig(
        settings=(coverage_setting(spec, fed),), rounds=(1,), oracle=False, centralised=False
    )
    seen: dict[str, np.ndarray] = {}
    simulate(fed, config, progress=False, on_weights=lambda s, m, w: seen.__setitem__(m, w))
    assert not np.allclose(seen["analytic 1-round (per-class)"], seen["analytic 1-round (global)"])


def test_saved_weights_recheck_independently(tmp_path):
    fed = small_federation(2)
    out = tmp_path / "r.json"
    root = tmp_path / "caches"
    save_dataset(fed, root)
    code = main(
        [
            "simulate",
            "--features",
            str(root),
            "--setting",
            "missing-2",
            "--rounds",
            "1",
            "--out",
            str(out),
            "--save-dir",
            str(tmp_path / "save"),
            "--quiet",
        ]
    )
    assert code == 0
    results = json.loads(out.read_text())
    row = results["settings"]["missing-2"]["rows"][0]
    weights = np.load(results["saved"]["weights"]["missing-2/analytic 1-round (per-class)"])
    reloaded = load_dataset(
        [tmp_path / "save" / "data" / n for n in fed.site_names],
        tmp_path / "save" / "data" / "test",
    )
    m = evaluate(
        predict_proba(reloaded.test_features, weights), reloaded.test_labels, classes=CLASSES
    )
    assert m.macro_auc == pytest.approx(row["macro"]["auc"], abs=1e-12)


def test_bad_cli_input_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit, match="one cache per site"):
        main(["simulate", "--features", str(tmp_path)])
    save_dataset(small_federation(3), tmp_path / "c")
    with pytest.raises(SystemExit, match="missing-M"):
        main(["simulate", "--features", str(tmp_path / "c"), "--setting", "missing"])
    with pytest.raises(SystemExit, match="--rounds"):
        main(
            [
                "simulate",
                "--features",
                str(tmp_path / "c"),
                "--setting",
                "missing-1",
                "--rounds",
                "x",
            ]
        )
    assert main(["simulate", "--features", str(tmp_path / "c"), "--setting", "missing-7"]) == 2
    assert "missing must be in [0, 3]" in capsys.readouterr().err


def test_baselines_and_communication_rows():
    from afl.lab.simulate.baselines import BaselineConfig

    fed = small_federation(5)
    settings = missing_settings([1], num_sites=4, num_classes=4, seed=1)
    config = SimulationConfig(
        settings=settings,
        rounds=(1, 2),
        oracle=False,
        centralised=False,
        baselines=("fedavg", "fedavg-masked"),
        baseline_config=BaselineConfig(rounds=3),
    )
    results = simulate(fed, config, progress=False)
    rows = {r["method"]: r for r in results["settings"]["missing-1"]["rows"]}
    assert rows["fedavg"]["communication"]["rounds"] == 3
    assert rows["fedavg-masked"]["macro"]["auc"] is not None
    per_class = rows["analytic 1-round (per-class)"]["communication"]
    glob = rows["analytic 1-round (global)"]["communication"]
    d = fed.d
    # per-class: packed Gram + b for the 3 labelled classes; global: b for all 4 classes.
    assert per_class["bytes_up_per_site"] == 8 * (d * (d + 1) // 2 + 3 * d)
    assert glob["bytes_up_per_site"] == 8 * (d * (d + 1) // 2 + 4 * d)
    assert (
        rows["analytic 2-round (global)"]["communication"]["bytes_down_per_site"] == 2 * 8 * d * 4
    )


def test_progress_lines_without_a_terminal_and_silence_with_quiet(tmp_path, capsys):
    """Under a pipe or a log (no TTY) `afl simulate` says what it is doing; --quiet hides it."""
    save_dataset(small_federation(), tmp_path / "c")
    argv = ["simulate", "--features", str(tmp_path / "c"), "--setting", "missing-1"]
    assert main([*argv, "--setting", "missing-3", "--no-oracle"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("afl simulate: loading the data")
    assert any(line.startswith("afl simulate: data ready in") for line in err)
    assert "afl simulate: setting 1/2: missing-1" in err
    assert "afl simulate: setting 2/2: missing-3" in err
    assert main([*argv, "--quiet"]) == 0
    assert capsys.readouterr().err == ""


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.startswith("afl ")
