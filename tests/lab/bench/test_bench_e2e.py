"""`afl bench ckks --e2e` on a tiny federation: both modes complete, the CKKS W matches the
plaintext W, ciphertexts cost more bytes than float64, and the decryptor's timings and every
daemon's peak memory are read; the peak is the kernel's high-water mark, not a sample."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from afl.lab.bench.daemons.e2e import combine_repetitions, memory_summary, run_e2e_bench
from afl.lab.bench.daemons.scaling_e2e import PeakMemory, cpu_seconds, rss_mib


@pytest.mark.slow
def test_e2e_bench_row_is_complete_and_consistent() -> None:
    row = run_e2e_bench(
        num_sites=3, d=8, rows=60, modes=("plaintext", "ckks"), standing_s=1.0, repeats=2
    )
    assert row["ckks_w_relative_difference"] < 1e-6 and row["standing_s"] == 1.0
    assert [len(row[m]["repetitions"]) for m in ("plaintext", "ckks")] == [2, 2]
    per_round = row["ckks_round_seconds_ratio_per_repetition"]
    assert len(per_round) == 2 and min(per_round) <= row["ckks_round_seconds_ratio"] * 1.0001
    assert max(per_round) >= row["ckks_round_seconds_ratio"] * 0.9999
    # 3 sites × (Gram + 8 class vectors); how many came from zeros drawn ahead depends on timing
    assert row["ckks"]["ckks_ciphertexts"] == 27 and 0 <= row["ckks"]["ckks_drawn_ahead"] <= 27
    assert row["ckks_bytes_sent_per_site_ratio"] > 10  # one ciphertext per block vs 8 B/value
    assert row["ckks"]["jobs"] == 1 + 8  # gram[all] and one b[c] per class
    assert row["ckks"]["decrypt_seconds"] > 0
    assert "mask" not in row
    for mode in ("plaintext", "ckks"):  # every daemon's peak resident memory is reported
        assert row[mode]["server_peak_rss_mib"] > 0 and row[mode]["site_peak_rss_mib"] > 0
    assert (
        row["ckks"]["decryptor_peak_rss_mib"] > 0
        and "decryptor_peak_rss_mib" not in row["plaintext"]
    )
    assert "ckks server" in memory_summary(row) and "decryptor" in memory_summary(row)
    for mode in ("plaintext", "ckks"):  # CPU seconds: every process, and each daemon's
        figures = row[mode]
        assert figures["cpu_seconds"] >= figures["server_cpu_seconds"] > 0
        assert figures["site_cpu_seconds"] > 0 and len(figures["load_average"]) == 2
    assert row["ckks"]["decryptor_cpu_seconds"] > 0 and row["ckks_cpu_seconds_ratio"] > 0


def test_repetitions_combine_into_medians_and_keep_each_round() -> None:
    runs = [
        {
            "round_seconds": r,
            "server_peak_rss_mib": None if r == 3.0 else 100.0,
            "site_timings_s_median": {"upload": u, **({"wait_model": 0.5} if r == 1.0 else {})},
            "load_average": [l0, l1],
            "label": "x",
            "calls": {"publish": [int(r), u]},  # `afl bench log`'s counts and seconds per method
        }
        for r, u, l0, l1 in ((2.0, 0.4, 1.0, 2.0), (1.0, 0.2, 3.0, 4.0), (3.0, 0.9, 5.0, 6.0))
    ]
    out = combine_repetitions(runs)
    assert out["round_seconds"] == 2.0
    assert out["site_timings_s_median"] == {"upload": 0.4, "wait_model": 0.0}  # not the mean
    assert out["server_peak_rss_mib"] is None  # one round could not read it
    assert out["load_average"] == [1.0, 6.0] and out["label"] == "x"
    assert out["calls"] == {"publish": [2, 0.4]}  # not numbers: the first round's, as it was
    assert [r["round_seconds"] for r in out["repetitions"]] == [2.0, 1.0, 3.0]
    assert combine_repetitions(runs[:1]) == runs[0]  # one round: its figures as they were
    with pytest.raises(ValueError, match="repeats"):
        run_e2e_bench(num_sites=3, d=4, modes=("plaintext", "mask"), repeats=0)


def test_e2e_bench_needs_plaintext_and_another_mode() -> None:
    with pytest.raises(ValueError, match="plaintext and another mode"):
        run_e2e_bench(num_sites=3, d=4, modes=("ckks",))
    with pytest.raises(ValueError, match="plaintext and another mode"):
        run_e2e_bench(num_sites=3, d=4, modes=("plaintext",))


def _probe(code: str) -> subprocess.Popen[str]:
    """A Python process running ``code``, once it printed "ready" (it then waits for stdin)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def test_peak_memory_is_the_high_water_mark_not_a_sample() -> None:
    """A process that touched 256 MiB and freed it before it is watched: its peak still shows
    them (VmHWM), though its resident memory is back down."""
    code = (
        "import sys, numpy as np; a = np.ones(32 * 1024 * 1024); del a; "
        "print('ready', flush=True); sys.stdin.read()"
    )
    proc = _probe(code)
    try:
        memory = PeakMemory(interval_s=0.05)
        memory.watch({"probe": proc.pid})
        while "probe" not in memory.peaks:
            time.sleep(0.05)
        memory.stop()
        status = Path(f"/proc/{proc.pid}/status").read_text(encoding="ascii")
        resident = int(next(x for x in status.splitlines() if x.startswith("VmRSS:")).split()[1])
        assert memory.peaks["probe"] >= 256 > resident / 1024
        assert rss_mib(proc.pid) == memory.peaks["probe"]
    finally:
        proc.communicate("", timeout=60)
    assert rss_mib(proc.pid) is None  # gone: nothing to read


def test_cpu_seconds_are_the_processs_own_account() -> None:
    """A process that used at least 0.3 s of CPU (by its own clock, whatever the load) shows at
    least that, less one clock tick, and at most what its parent is told after it exits."""
    code = (
        "import sys, time\n"
        "while time.process_time() < 0.3: pass\n"
        "print('ready', flush=True); sys.stdin.read()"
    )
    proc = _probe(code)
    try:
        used = cpu_seconds(proc.pid)
        assert used is not None and used >= 0.3 - 0.02
    finally:
        proc.communicate("", timeout=60)
    assert cpu_seconds(proc.pid) is None
