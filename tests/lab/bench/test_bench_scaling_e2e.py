"""`afl bench scaling --e2e` (docs/benchmarks.md §3c): the fitted growth exponent, and one tiny
sweep through the real daemons whose masked W matches the plaintext W and whose figures are
complete (no timing is asserted)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from afl.lab.bench.daemons.scaling_e2e import growth_exponent, run_scaling_e2e


@pytest.mark.parametrize("exponent", [0.5, 1.0, 1.3, 2.0])
def test_growth_exponent_recovers_a_power_law(exponent: float) -> None:
    ks = [8, 16, 32, 64, 128]
    values = [3.0 * k**exponent for k in ks]
    fitted = growth_exponent(ks, values)
    assert fitted is not None and math.isclose(fitted, exponent, abs_tol=1e-9)
    assert growth_exponent([8], [1.0]) is None  # one point fits nothing


def test_a_tiny_sweep_runs_both_graphs_through_the_daemons(tmp_path: Path) -> None:
    bench = run_scaling_e2e(
        sites=(6,), graphs=("full", "sparse"), d=8, rows=20, hosts=2, timeout_s=300.0,
        work_dir=str(tmp_path),
    )  # fmt: skip
    assert bench["w_matches_plaintext"], bench["points"]
    by_graph = {p["graph"]: p for p in bench["points"]}
    assert set(by_graph) == {"full", "sparse"}
    assert by_graph["full"]["degree"] == 5
    assert by_graph["sparse"]["degree"] == 4  # k = 4 < n - 1 for 6 sites at the defaults
    for point in by_graph.values():
        assert point["w_relative_error"] <= 1e-9
        assert point["bytes_sent_per_site"] > 0 and point["host_processes"] == 2
