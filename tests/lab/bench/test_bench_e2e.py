"""`afl bench ckks --e2e` on a tiny federation: both modes complete, the CKKS W matches the
plaintext W, ciphertexts cost more bytes than float64, and the decryptor's timings are read."""

from __future__ import annotations

import pytest

from afl.lab.bench.e2e import run_e2e_bench


@pytest.mark.slow
def test_e2e_bench_row_is_complete_and_consistent() -> None:
    row = run_e2e_bench(num_sites=3, d=8, rows=60, modes=("plaintext", "ckks"))
    assert row["ckks_w_relative_difference"] < 1e-6
    assert row["ckks_bytes_sent_per_site_ratio"] > 10  # one ciphertext per block vs 8 B/value
    assert row["ckks"]["jobs"] == 1 + 8  # gram[all] and one b[c] per class
    assert row["ckks"]["decrypt_seconds"] > 0
    assert "mask" not in row


def test_e2e_bench_needs_plaintext_and_another_mode() -> None:
    with pytest.raises(ValueError, match="plaintext and another mode"):
        run_e2e_bench(num_sites=3, d=4, modes=("ckks",))
    with pytest.raises(ValueError, match="plaintext and another mode"):
        run_e2e_bench(num_sites=3, d=4, modes=("plaintext",))
