"""`afl bench ckks` helpers: the decrypted sums match the plaintext sums within the derived bound,
and the report carries the cost fields the docs cite (no timed assertions)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from afl.lab.bench.ckks import add_arguments, run, run_ckks_bench


def test_bench_row_is_accurate_and_complete() -> None:
    """Site 2's uploads are made from encryptions of zero drawn ahead, sites 1 and 3's on the
    spot: every sum holds both, within the same bound."""
    row = run_ckks_bench(d=12, num_sites=3, classes=2, rows=20)
    for name, length in (("gram", 12 * 13 // 2), ("b", 24)):
        acc = row["accuracy"][name]
        assert acc["length"] == length and acc["ciphertexts"] == 1
        # error_bound is derived in afl.crypto.ckks.params (scale, K, pre-scale, grid).
        assert acc["max_abs_error"] <= acc["error_bound"]
        assert acc["max_rel_error"] <= 1e-9
    assert set(row["ckks"]) >= {
        "encrypt_seconds_mean",
        "server_seconds",
        "decrypt_seconds",
        "round_seconds_parallel",
        "bytes_per_site",
        "draw_ahead_seconds_mean",
        "encrypt_drawn_ahead_seconds_mean",
    }
    # One ciphertext per block at N = 8192: ~131 KB each, far above 8 bytes a value.
    assert row["ckks"]["bytes_per_site"] > 2 * 100_000
    assert row["plaintext_bytes_per_site"] == 8 * (78 + 24)


def test_cli_writes_json(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    out = tmp_path / "bench.json"
    args = parser.parse_args(
        ["--sites", "2", "3", "--dim", "4", "--classes", "1", "--rows", "5", "--out", str(out)]
    )
    assert run(args) == 0
    data = json.loads(out.read_text(encoding="utf-8"))
    assert data["benchmark"] == "ckks"
    assert [r["num_sites"] for r in data["results"]] == [2, 3]
