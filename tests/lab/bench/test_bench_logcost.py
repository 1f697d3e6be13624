"""`afl bench log` at a tiny size (K = 3, d = 8, one repetition): both variants run through the
daemons, the ratios are computed from their figures, the shipped sites witnessed the log and
the unlogged baseline did not, and the log changes no number of the model. No timed assertion:
times are only required to be present and non-negative."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from afl.lab.bench import cmd as bench_cmd
from afl.lab.bench.daemons import unlogged
from afl.lab.bench.daemons.logcost import GOAL, run_log_bench


def test_log_bench_has_both_variants_and_their_ratio(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    bench_cmd.add_arguments(parser)
    out = tmp_path / "log.json"
    args = parser.parse_args(
        ["log", "--sites", "3", "--dim", "8", "--rows", "40", "--repeats", "1", "--out", str(out)]
    )
    assert bench_cmd.run(args) == 0
    doc = json.loads(out.read_text(encoding="utf-8"))
    assert doc["benchmark"] == "log"
    row = doc["results"][0]
    assert (row["num_sites"], row["d"], row["repeats"]) == (3, 8, 1)
    shipped, baseline = row["shipped"], row["unlogged"]
    for variant in (shipped, baseline):
        assert len(variant["runs"]) == 1
        assert variant["median"]["round_seconds"] == variant["runs"][0]["round_seconds"] > 0
        assert len(variant["runs"][0]["log_witness_seconds_per_site"]) == 3
        assert len(variant["runs"][0]["site_log_seconds_per_process"]) == 3  # a process each
        assert len(variant["runs"][0]["load_average"]) == 2
    ratio = shipped["median"]["round_seconds"] / baseline["median"]["round_seconds"]
    assert row["round_ratio"] == pytest.approx(ratio)
    assert row["round_ratio_per_repetition"] == [pytest.approx(ratio)]
    assert row["round_overhead"] == pytest.approx(ratio - 1)
    assert row["meets_goal"] == (ratio - 1 <= GOAL)
    cpu = shipped["median"]["cpu_seconds"] / baseline["median"]["cpu_seconds"]
    assert row["cpu_ratio"] == pytest.approx(cpu)
    assert row["w_relative_difference"] < 1e-12  # the log changes no number of the model
    assert row["machine"]["cpu_count"] >= 1 and len(row["load_average_start"]) == 3

    # The shipped sites witnessed (calls summed over the 3 sites): each checked the plan in the
    # log once and published its DP ledger's entry there; every site cosigned checkpoints.
    sites, server = (
        shipped["runs"][0]["site_log_calls"],
        shipped["runs"][0]["coordinator_log_calls"],
    )
    assert sites["ClientDaemon._logged"][0] == 3 and sites["LedgerAnchor.publish"][0] == 3
    assert sites["LogWitness.check_release"][0] == 3  # the published round's release statement
    # Cosignatures and DP-ledger statements commit in batches, and count (and time) with theirs:
    # at least one for the 3 statements, which are the publications the sites counted above.
    assert server["GroupCommit._commit"][0] >= 1 and server["FederationLog.checkpoint"][0] >= 1
    # The baseline: the same calls reach only no-ops; no checkpoint is signed or cosigned.
    sites, server = (
        baseline["runs"][0]["site_log_calls"],
        baseline["runs"][0]["coordinator_log_calls"],
    )
    assert sites["LedgerAnchor.publish"][0] == 0
    assert server["FederationLog.cosign"][0] == server["FederationLog.checkpoint"][0] == 0
    assert server["FederationLog.record_dp_release"][0] == server["GroupCommit._commit"][0] == 0
    assert baseline["median"]["coordinator_log_seconds"] >= 0


@pytest.mark.slow
def test_log_bench_with_hosted_sites_and_the_sparse_graph() -> None:
    """The many-site layout (`afl bench scaling --e2e`'s): the sites of one run-many process,
    the sparse graph; the host's timings cover its sites."""
    row = run_log_bench(num_sites=4, d=8, rows=40, repeats=1, graph="sparse", hosts=1)
    assert (row["graph"], row["hosts"]) == ("sparse", 1)
    for variant in ("shipped", "unlogged"):
        runs = row[variant]["runs"][0]
        assert len(runs["site_log_seconds_per_process"]) == 1
        assert runs["site_log_seconds_mean_per_site"] == pytest.approx(
            runs["site_log_seconds_per_process"][0] / 4
        )
    assert row["shipped"]["runs"][0]["site_log_calls"]["ClientDaemon._logged"][0] == 4
    assert row["unlogged"]["runs"][0]["coordinator_log_calls"]["FederationLog.cosign"][0] == 0
    assert row["w_relative_difference"] < 1e-12


def test_log_bench_refuses_a_size_it_cannot_run() -> None:
    with pytest.raises(ValueError, match="sites >= 3"):
        run_log_bench(num_sites=2, d=8, repeats=1)
    with pytest.raises(ValueError, match="repeats >= 1"):
        run_log_bench(num_sites=3, d=8, repeats=0)
    with pytest.raises(ValueError, match="masking graph"):
        run_log_bench(num_sites=3, d=8, repeats=1, graph="ring")


def test_the_unlogged_wrapper_refuses_unknown_roles(capsys: pytest.CaptureFixture[str]) -> None:
    assert unlogged.main(["site", "unlogged", "t.json", "run"]) == 2
    assert unlogged.main(["client", "off", "t.json", "run"]) == 2
    assert "usage:" in capsys.readouterr().err


def test_log_timer_counts_outermost_calls_once() -> None:
    """A timed method that calls another timed method counts once, under its own name."""
    timer = unlogged.LogTimer()

    def inner(x: int) -> int:
        return x + 1

    wrapped_inner = timer.wrap("inner", inner)
    outer = timer.wrap("outer", lambda x: wrapped_inner(x) * 2)
    assert outer(1) == 4 and wrapped_inner(1) == 2
    summary = timer.summary()
    assert summary["calls"]["outer"][0] == 1 and summary["calls"]["inner"][0] == 1
    assert summary["seconds"] == pytest.approx(
        summary["calls"]["outer"][1] + summary["calls"]["inner"][1]
    )
