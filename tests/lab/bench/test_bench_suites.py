"""`afl bench` stats, solve and scaling at tiny sizes: JSON keys, sane values, exact results.

No timed assertions: times are only required to be positive and finite; the numerical checks
(Gram vs raw product, W vs numpy.linalg.solve) are independent oracles.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import pytest
from threadpoolctl import threadpool_limits  # type: ignore[import-untyped]

from afl.lab.bench import cmd as bench_cmd
from afl.lab.bench.common import describe_machine, format_machine
from afl.lab.bench.scaling import run_scaling_bench
from afl.lab.bench.solve import coverage_with_sets, run_solve_bench
from afl.lab.bench.stats import run_stats_bench


def _positive(x: Any) -> bool:
    return isinstance(x, float) and math.isfinite(x) and x > 0


def test_machine_description_names_cpus_and_blas() -> None:
    info = describe_machine()
    assert info["cpu_count"] >= 1 and info["cpus_usable"] >= 1
    assert isinstance(info["blas"], list) and info["blas"]  # threadpoolctl is installed
    assert all("internal_api" in lib for lib in info["blas"])
    assert "BLAS:" in format_machine(info)


def test_stats_bench_ratios_and_exact_gram() -> None:
    bench = run_stats_bench(d=32, rows=300, batch_sizes=(64, 300), classes=3, repeats=1)
    assert bench["suite"] == "stats" and bench["d"] == 32 and bench["rows"] == 300
    raw = bench["raw"]
    assert _positive(raw["seconds"]) and _positive(raw["gflops"])
    assert raw["rows_per_s"] == pytest.approx(300 / raw["seconds"])
    assert [a["batch_size"] for a in bench["accumulator"]] == [64, 300]
    for a in bench["accumulator"]:
        assert _positive(a["seconds"]) and _positive(a["time_ratio_vs_raw"])
        assert a["time_ratio_vs_raw"] == pytest.approx(a["seconds"] / raw["seconds"])
        assert a["max_rel_diff_vs_raw"] <= 1e-12  # same float64 Gram, up to summation order


def test_coverage_with_sets_has_exactly_that_many_distinct_sets() -> None:
    for sets in (1, 3, 5):
        mask = coverage_with_sets(num_sites=4, num_classes=5, sets=sets)
        covers = {tuple(mask[:, c]) for c in range(5)}
        assert len(covers) == sets and all(any(c) for c in covers)
        assert mask[:, 0].all()  # set 0 is every site
    with pytest.raises(ValueError):
        coverage_with_sets(num_sites=2, num_classes=8, sets=4)  # only 3 non-empty subsets


def test_solve_bench_counts_factorisations_and_solves_exactly() -> None:
    bench = run_solve_bench(d=24, num_sites=4, classes=6, set_counts=(1, 3, 6), repeats=1)
    assert [r["distinct_sets"] for r in bench["per_class"]] == [1, 3, 6]
    assert bench["global"]["distinct_sets"] == 1 and bench["global"]["gram_scope"] == "global"
    for row in [*bench["per_class"], bench["global"]]:
        assert _positive(row["solve_seconds"]) and _positive(row["sum_seconds"])
        assert row["total_seconds"] == pytest.approx(row["sum_seconds"] + row["solve_seconds"])
        assert row["max_rel_diff_vs_numpy"] <= 1e-10


def test_scaling_bench_covers_the_grid() -> None:
    bench = run_scaling_bench(
        sites=(2, 4, 8),
        dims=(8, 16),
        d_for_sites=12,
        sites_for_dims=3,
        total_rows=200,
        classes=4,
        missing=1,
    )
    assert [r["num_sites"] for r in bench["by_sites"]] == [2, 4, 8]
    assert all(r["d"] == 12 for r in bench["by_sites"])
    assert [r["d"] for r in bench["by_dims"]] == [8, 16]
    assert all(r["num_sites"] == 3 for r in bench["by_dims"])
    for row in [*bench["by_sites"], *bench["by_dims"]]:
        assert row["rows_per_site"] == pytest.approx(200 / row["num_sites"])
        assert 1 <= row["distinct_sets"] <= 4
        for key in ("stats_seconds_mean", "stats_seconds_max", "server_sum_seconds"):
            assert _positive(row[key])
        assert row["stats_seconds_max"] >= row["stats_seconds_mean"]
        assert row["stats_seconds_total"] == pytest.approx(
            row["stats_seconds_mean"] * row["num_sites"]
        )


@pytest.mark.parametrize(
    ("suite", "argv", "files"),
    [
        (
            "stats",
            [
                "--dim",
                "16",
                "--rows",
                "64",
                "--batch-size",
                "32",
                "--repeats",
                "1",
                "--blas-threads",
                "1",
            ],
            ["stats.json", "stats_throughput.png"],
        ),
        (
            "solve",
            [
                "--dim",
                "8",
                "--sites",
                "3",
                "--classes",
                "4",
                "--sets",
                "1",
                "4",
                "--repeats",
                "1",
                "--rows-per-site",
                "16",
            ],
            ["solve.json", "solve_vs_sets.png"],
        ),
        (
            "scaling",
            [
                "--sites",
                "2",
                "4",
                "--dims",
                "8",
                "16",
                "--d-for-sites",
                "8",
                "--sites-for-dims",
                "2",
                "--total-rows",
                "64",
                "--classes",
                "3",
                "--missing",
                "1",
            ],
            ["scaling.json", "scaling_sites.png", "scaling_dims.png"],
        ),
    ],
)
def test_suites_are_registered_and_write_json_and_png(
    suite: str, argv: list[str], files: list[str], tmp_path: Path
) -> None:
    parser = argparse.ArgumentParser()
    bench_cmd.add_arguments(parser)
    args = parser.parse_args([suite, *argv, "--out-dir", str(tmp_path)])
    # The suite runs with one BLAS thread (tests/conftest.py): allow two, so that the
    # --blas-threads 1 check below sees the bench's own limit at work.
    with threadpool_limits(limits=2, user_api="blas"):
        assert bench_cmd.run(args) == 0
    for name in files:
        assert (tmp_path / name).stat().st_size > 0
    text = (tmp_path / files[0]).read_text(encoding="utf-8")
    assert "NaN" not in text and "Infinity" not in text
    data = json.loads(text)
    assert data["suite"] == suite and data["machine"]["cpu_count"] >= 1
    if "--blas-threads" in argv:
        assert data["blas_threads"] == 1
        assert all(lib["num_threads"] == 1 for lib in data["machine"]["blas"])
    png = (tmp_path / files[1]).read_bytes()
    assert png.startswith(b"\x89PNG")


def test_fedlog_bench_times_the_same_answers_from_the_list_and_the_kept_tree(
    tmp_path: Path,
) -> None:
    from afl.lab.bench import fedlog

    out = tmp_path / "fedlog.json"
    args = argparse.Namespace(sizes=[1, 37, 300], repeats=1, out=str(out))
    assert fedlog.run(args) == 0  # it raises when the tree and the list disagree
    doc = json.loads(out.read_text(encoding="utf-8"))
    assert doc["benchmark"] == "fedlog" and [r["size"] for r in doc["results"]] == [1, 37, 300]
    for row in doc["results"]:
        assert _positive(row["tree_append_seconds_per_leaf"])
        for name in ("root", "consistency_proof", "inclusion_proof"):
            assert _positive(row[name]["list_seconds"]) and _positive(row[name]["tree_seconds"])
