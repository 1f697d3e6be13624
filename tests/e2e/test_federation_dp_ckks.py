"""End to end DP round in CKKS mode over loopback mTLS (docs/protocol.md §4.3, §7): afl-server
with ``aggregation = "ckks"`` and a patient-level [round.dp] table, a dedicated decryptor site and
one afl-client per data site. The sites add their discrete Gaussian shares BEFORE encrypting; the
plan's CKKS grid is the half noise grid with a pre-scale fine enough that the decryptor recovers
the noisy sums exactly, so the released W is within the DP noise bound of the noise-free pooled
solve (as in plaintext and mask mode), and every site's ε is the plan's and the audit log's."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from afl.crypto.ckks import params as cp
from afl.lab.demo.federation import ckks_round_settings, run_loopback
from tests.e2e.dp_scenario import (
    checked_dp_report,
    dp_budgets,
    dp_federation,
    pooled_solve,
    pooled_stats,
    server_store,
    signed_plans,
    site_data,
    w_error_bound,
)
from tests.helpers.audit_scan import statistics_in_audit

SITES = ["site-1", "site-2", "site-3"]


def test_dp_ckks_round_recovers_the_noisy_sums_exactly(tmp_path: Path) -> None:
    feats = site_data(len(SITES))[0]
    max_samples = int(max(len(f) for f in feats) * 1.05)
    loop = dp_federation(
        tmp_path,
        len(SITES),
        dp={"max_samples": max_samples, "tolerated": 1},
        round_settings={**ckks_round_settings(feats), "gram_scope": "global"},
        decryptor=True,
    )
    run = run_loopback(loop, timeout_s=300)
    assert all(run.client_rcs[s] == 0 for s in SITES), run.logs

    budgets = dp_budgets(loop.server_config)
    (plan,) = signed_plans(loop.server_config).values()
    assert plan.dp.enabled and plan.aggregation == 3  # AGGREGATION_MODE_CKKS
    for release in plan.releases:
        ck, n = release.encoding.ckks, len(release.member_site_ids)
        assert ck.grid_step == 2.0 ** -(release.noise.frac_bits + 1)
        assert 2 * cp.min_grid(prescale=ck.prescale, num_summands=n) <= ck.grid_step
        assert release.noise.assumed_colluders == 1
    w_ref, st = pooled_solve(loop.root, SITES)
    ws = []
    for site in SITES:
        report = run.final_report(site)
        dp = checked_dp_report(report, budgets, site, plan)
        assert report["bytes_sent"] > 4 * 100_000  # one ciphertext per release, not float64
        sig = {name: r["sigma"] for name, r in dp["releases"].items()}
        ws.append(np.asarray(np.load(report["model"]["path"]), dtype=np.float64))
        bound = w_error_bound(w_ref, st, sig, len(SITES))
        assert bound <= 0.05 * float(np.linalg.norm(w_ref))
        assert 0 < float(np.linalg.norm(ws[-1] - w_ref)) <= bound
    assert all(np.array_equal(w, ws[0]) for w in ws)
    # M-30 over every record type of a DP CKKS run (dp-budget, ckks-context-published,
    # ckks-decryption, ...): no statistic, noised or not
    records = [(e, d) for _, e, d, *_ in server_store(loop.server_config).audit_entries()]
    assert {"dp-budget", "ckks-decryption", "ckks-context-published"} <= {e for e, _ in records}
    stats = [v for k, v in pooled_stats(loop.root, SITES).items() if k != "h"]
    assert statistics_in_audit(records, statistics=[*stats, *ws]) == []
