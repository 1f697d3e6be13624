"""`afl bench secagg` helpers: the masked round's decoded sums match the plaintext sums, and the
report carries the cost fields the lead's docs cite (no timed assertions)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from afl.lab.bench.secagg import add_arguments, run, run_secagg_bench


def test_bench_row_is_accurate_and_complete() -> None:
    row = run_secagg_bench(num_sites=5, d=8, classes=2, dropouts=1)
    assert row["values_per_site"] == 8 * 9 // 2 + 16
    assert row["threshold"] == 3 and row["dropouts"] == 1
    assert row["max_relative_error"] <= 1e-9
    for side in ("masked", "plaintext"):
        assert set(row[side]) >= {
            "client_seconds_mean",
            "server_seconds",
            "round_seconds_parallel",
            "bytes_up_per_site",
        }
    # Masked uploads carry 8-byte words like float64 plus keys, shares and signatures.
    assert row["masked"]["bytes_up_per_site"] > row["plaintext"]["bytes_up_per_site"]
    assert row["bytes_up_per_site_ratio"] > 1.0


def test_cli_writes_json(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    out = tmp_path / "bench.json"
    args = parser.parse_args(
        ["--sites", "3", "4", "--dim", "4", "--classes", "1", "--out", str(out)]
    )
    assert run(args) == 0
    data = json.loads(out.read_text(encoding="utf-8"))
    assert [r["num_sites"] for r in data["results"]] == [3, 4]
    assert all(r["max_relative_error"] <= 1e-9 for r in data["results"])
