"""`afl simulate` on the embedded default at the real scale (67,310 PA images, d = 1024, 8 sites)."""

from __future__ import annotations

import json

from afl.lab.cli import main
from afl.lab.simulate.grid import CENTRAL, ORACLE


def test_missing_1_and_7_on_the_default(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert (
        main(
            [
                "simulate",
                "--setting",
                "missing-1",
                "--setting",
                "missing-7",
                "--out",
                str(out),
                "--quiet",
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "SURROGATE" in printed and "Theorem 1 check" in printed
    results = json.loads(out.read_text())
    data = results["data"]
    assert data["surrogate"] is True and "surrogate" in data["provenance"]
    assert data["n_pa_images"] == 67_310 and data["d"] == 1024
    assert data["n_test"] == 20_194 and sum(data["sites"].values()) == 8 * 5_889
    expected = {
        "analytic 1-round (per-class)",
        "analytic 2-round (per-class)",
        "analytic 1-round (global)",
        "analytic 2-round (global)",
        ORACLE,
    }
    for name in ("missing-1", "missing-7"):
        body = results["settings"][name]
        rows = {r["method"]: r for r in body["rows"]}
        assert set(rows) == expected
        for row in rows.values():
            macro = row["macro"]
            assert (
                0.5 < macro["auc"] < 1.0 and 0.0 < macro["map"] < 1.0 and 0.4 < macro["bacc"] < 1.0
            )
        # Theorem 1, shown as its own row: the independent pooled ridge equals the federated W.
        assert rows[ORACLE]["max_rel_diff_vs_federated_per_class"] <= 1e-9
        assert set(body["assignment"]) == set(data["sites"])
    missing7 = results["settings"]["missing-7"]["assignment"]
    assert sorted(len(v) for v in missing7.values()) == [1] * 8
    assert len({c for v in missing7.values() for c in v}) == 8
    assert results["centralised"]["method"] == CENTRAL
    assert results["params"]["gamma"] == 1.0 and results["params"]["tau"] == 0.7
