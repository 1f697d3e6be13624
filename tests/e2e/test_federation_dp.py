"""End to end DP round over loopback gRPC with mutual TLS (docs/protocol.md §7): afl-server with a
patient-level [round.dp] table and one afl-client process per site, whose caches hold three
images per patient. A site whose max_epsilon is below the round's budget refuses the plan and
its report says why; the coordinator re-plans with the other three, whose reports state the
patient-level ε and δ (recomputed by each site, equal to the plan's budgets, the server's audit
log and an independent analytic-Gaussian computation), whose ledgers record the release, and
whose W equals the noise-free pooled solve over the first two images of each patient to a
tolerance derived from the plan's noise scales."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from afl.client.policy.ledger import DpLedger
from afl.lab.demo.federation import run_loopback
from tests.e2e.dp_scenario import (
    checked_dp_report,
    dp_budgets,
    dp_federation,
    pooled_solve,
    signed_plans,
    w_error_bound,
)


def test_dp_round_completes_and_a_site_over_budget_refuses(tmp_path: Path) -> None:
    loop = dp_federation(tmp_path, 4, policy={"site-4": {"max_epsilon": 1e5}})
    run = run_loopback(loop, timeout_s=180)

    assert run.client_rcs["site-4"] == 3, run.logs
    refusal = run.final_report("site-4")
    assert refusal["outcome"] == "REFUSED_PLAN" and refusal["bytes_sent"] == 0
    assert "patient-level ε = 1e+06" in refusal["reason"]
    assert "> policy max_epsilon 100000" in refusal["reason"]
    assert refusal["plan"]["audit"]["covered_by_dp"] is False

    remaining = ["site-1", "site-2", "site-3"]
    assert all(run.client_rcs[s] == 0 for s in remaining), run.logs
    w_ref, st = pooled_solve(loop.root, remaining)
    budgets = dp_budgets(loop.server_config)
    plans = signed_plans(loop.server_config)
    for site in remaining:
        report = run.final_report(site)
        dp = checked_dp_report(report, budgets, site, plans[report["round_id"]])
        assert {u["slot"] for u in report["uploads"]} == {"gram[all]", "s_pos", "t_sum", "counts"}
        w = np.asarray(np.load(report["model"]["path"]), dtype=np.float64)
        sig = {name: r["sigma"] for name, r in dp["releases"].items()}
        err = float(np.linalg.norm(w - w_ref))
        bound = w_error_bound(w_ref, st, sig, len(remaining))
        assert 0 < err <= bound, (err, bound)
        assert bound <= 0.05 * float(np.linalg.norm(w_ref))
        # The lifetime ledger holds this round (the refused first round uploaded nothing).
        state = loop.client_configs[site].parent / "state"
        (entry,) = DpLedger(state / "dp-ledger").entries()
        assert entry.round_id == report["round_id"] and entry.unit == "patient"
        assert math.isclose(entry.epsilon, dp["epsilon"], rel_tol=1e-12)
