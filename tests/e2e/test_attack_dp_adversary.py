"""Attack: DP noise sized for the wrong adversary (docs/protocol.md §2, §7, [M-86]).

A patched coordinator (tests/e2e/t0_coordinator.py) runs a plaintext DP round whose noise is
split as if it saw only the sum (t = 0 assumed colluders: each site adds σ/√n) while the plan
states ε = 4 per site. It sees every upload alone, so a site's upload carries only its own share:
with n = 4 sites that is ε ≈ 9. Every honest, unmodified site recomputes its ε from the share it
adds, refuses the plan naming that ε (equal to an independent analytic-Gaussian computation), and
uploads nothing; the coordinator stores no statistic. (The honest plaintext plan, t = n - 1, is
accepted at the stated ε: tests/e2e/test_federation_dp.py.)"""

from __future__ import annotations

import math
from pathlib import Path

from afl.lab.demo.federation import run_loopback
from tests.e2e import t0_coordinator
from tests.e2e.dp_scenario import (
    DELTA,
    dp_federation,
    server_store,
    signed_plans,
)
from tests.helpers import dp_oracle

SITES = ["site-1", "site-2", "site-3", "site-4"]


def test_sites_refuse_plaintext_noise_sized_for_the_sum(tmp_path: Path) -> None:
    policy = {site: {"max_epsilon": 5.0} for site in SITES}
    loop = dp_federation(tmp_path, len(SITES), dp={"epsilon": 4.0}, policy=policy)
    run = run_loopback(loop, timeout_s=600, server_command=t0_coordinator.command())

    plans = signed_plans(loop.server_config)  # a refusal aborts; the others get a new plan
    for plan in plans.values():
        assert all(r.noise.assumed_colluders == 0 for r in plan.releases)  # the attack
        assert all(math.isclose(b.epsilon, 4.0, rel_tol=1e-6) for b in plan.budgets)
    # A site either refuses (exit 3) or finds its round aborted by a faster site's refusal
    # while it was refusing too (exit 4, too few sites left for another plan): every site's
    # decision on the plan it was shown is a refusal, and nothing was uploaded.
    assert {run.client_rcs[s] for s in SITES} <= {3, 4} and 3 in run.client_rcs.values()
    for site in SITES:
        report = run.final_report(site)
        assert report["outcome"] in ("REFUSED_PLAN", "ABORTED") and report["bytes_sent"] == 0
        assert report["plan"]["accepted"] is False
        plan = plans[report["round_id"]]
        # Oracle: the site's own share σ/√n on every release it is in, composed.
        share = [
            (r.noise.sensitivity, r.noise.sigma / math.sqrt(len(r.member_site_ids)))
            for r in plan.releases
            if site in r.member_site_ids
        ]
        real = dp_oracle.epsilon(dp_oracle.composed_mu(share), DELTA)
        assert real > (8.5 if len(plan.participants) == 4 else 5.0)
        reason = report["plan"]["reason"]
        assert "against the coordinator that sees its upload alone (plaintext)" in reason
        assert "the server states 4" in reason and "> policy max_epsilon 5" in reason
        stated = float(reason.split("ε = ")[1].split(" ")[0])
        assert math.isclose(stated, real, rel_tol=1e-5), (stated, real)
    store = server_store(loop.server_config)
    assert all(not store.uploads(r.round_id) for r in store.rounds())
