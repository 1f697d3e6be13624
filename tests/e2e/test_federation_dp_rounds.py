"""A two-round DP run end to end over loopback mTLS (docs/protocol.md §7), then a restart.

Run 1: afl-server with ``rounds = 2`` and a patient-level [round.dp] table; site-1 does not label
class B, so round 2 releases its pseudo-labels for B. Round 1 reserves round 2's share of the
budget; round 2's plan, each site's report and the audit log state the run's composed ε (round
1 + round 2), equal to the rulebook's and to an independent analytic-Gaussian composition of both
plans' (Δ, σ), and within the target; round 2's W equals the noise-free refinement (eq. 20-22,
pooled normalisation) computed from the published round-1 model within a bound derived from both
plans' noise scales.

Run 2 (restarted daemons on the same site state, a fresh coordinator): site-1's lifetime budget
now lies below what a second run would bring its ledger to; it refuses the plan naming its
lifetime ε, its ledger still holds run 1's two releases, and `afl-client budget` shows them."""

from __future__ import annotations

import math
import shutil
import tomllib
from pathlib import Path

import numpy as np
import pytest
from numpy.typing import NDArray
from scipy.special import expit

from afl.client import cli
from afl.client.policy.ledger import DpLedger
from afl.core.data.featurecache import open_cache
from afl.core.dp.accounting import compose_mu, epsilon_from_mu
from afl.lab.demo.federation import run_loopback
from afl.server import toml_text
from tests.e2e.dp_scenario import (
    CLASSES,
    CLIP,
    DELTA,
    EPSILON,
    D,
    balanced,
    checked_dp_report,
    dp_budgets,
    dp_federation,
    kept_rows,
    pooled_stats,
    signed_plans,
)
from tests.helpers import dp_oracle

SITES = ["site-1", "site-2", "site-3"]
TAU, ALPHA = 0.5, 0.5  # τ = 0.5: every scored row is pseudo-labelled (round 2 has content)


def _pseudo_oracle(root: Path, w1: NDArray[np.float64]) -> dict[str, NDArray[np.float64]]:
    """Noise-free pooled statistics of the rows pseudo-labelled with the published W1, for the
    class each site does not label (site-1: B), written out with numpy."""
    s_pos, n_pos, t_sum, n = np.zeros((D, 2)), np.zeros(2), np.zeros((D, 2)), np.zeros(2)
    for site in SITES:
        cache = open_cache(root / "data" / site)
        h = np.asarray(cache.features, dtype=np.float64)[kept_rows(cache.meta.n)]
        h = h * np.minimum(1.0, CLIP / np.maximum(np.linalg.norm(h, axis=1, keepdims=True), 1e-300))
        for c in np.flatnonzero((np.asarray(cache.labels) < 0).all(axis=0)):
            p = expit(h @ w1[:, c])
            pos, lab = p > TAU, (p > TAU) | (p < 1 - TAU)
            s_pos[:, c] += h[pos].sum(axis=0)
            n_pos[c] += pos.sum()
            t_sum[:, c] += h[lab].sum(axis=0)
            n[c] += lab.sum()
    return {"s_pos": s_pos, "n_pos": n_pos, "t_sum": t_sum, "n": n}


def _targets_error(st: dict[str, NDArray[np.float64]], sig: dict[str, float], k: int) -> float:
    """Bound on ‖Δb‖ (all columns) of pooled balanced targets from noisy sums and counts with
    σ_S, σ_T, σ_counts, summed over k members (6 standard deviations, first order)."""
    ok = st["n"] > 0
    n_min = float(min(st["n_pos"][ok].min(), (st["n"] - st["n_pos"])[ok].min()))
    b_norm = float(np.linalg.norm(balanced(st)[:, ok], axis=0).max())
    per_class = 6 * math.sqrt(D * k) * (sig["s_pos"] + sig["t_sum"]) * 2 / n_min
    per_class += b_norm * 6 * math.sqrt(k) * sig["counts"] * 2 / n_min
    return math.sqrt(len(CLASSES)) * per_class


def test_two_round_dp_run_composes_and_a_restarted_site_keeps_its_ledger(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    active = np.ones((len(SITES), len(CLASSES)), dtype=bool)
    active[0, 1] = False  # site-1 does not label B
    settings: dict[str, toml_text.TomlValue] = {
        "rounds": 2, "tau": TAU, "alpha": ALPHA, "delta_pos": 5, "delta_neg": 5,
        "gram_scope": "global",
    }  # fmt: skip
    loop = dp_federation(tmp_path, len(SITES), round_settings=settings, active=active)
    run = run_loopback(loop, timeout_s=300)
    assert all(run.client_rcs[s] == 0 for s in SITES), run.logs

    plans = signed_plans(loop.server_config)
    first, second = sorted(plans.values(), key=lambda p: p.round_number)
    assert (first.round_number, second.round_number) == (1, 2)
    assert first.dp.run_rounds == 2 and second.dp.noise_multiplier == first.dp.noise_multiplier
    assert [r.name for r in second.releases] == ["pseudo_s_pos", "pseudo_t_sum", "pseudo_counts"]
    budgets = dp_budgets(loop.server_config)
    for site in SITES:
        reports = run.reports[site]
        r1 = checked_dp_report(reports[first.round_id], budgets, site, first)
        r2 = checked_dp_report(reports[second.round_id], budgets, site, second, earlier=[first])
        assert r1["epsilon_run"] < EPSILON  # round 1 keeps round 2's share back
        assert math.isclose(r2["epsilon_run"], EPSILON, rel_tol=1e-3)  # the run spends it all

    # Round 2's W: the noise-free refinement from the published W1, within the noise bound.
    w1 = np.load(run.reports["site-1"][first.round_id]["model"]["path"])
    w2 = np.load(run.reports["site-1"][second.round_id]["model"]["path"])
    st1, pseudo = pooled_stats(loop.root, SITES), _pseudo_oracle(loop.root, w1)
    keep = (pseudo["n_pos"] >= 5) & (pseudo["n"] - pseudo["n_pos"] >= 5)
    assert keep.tolist() == [False, True]  # only B, from site-1's pseudo-labels
    b_pseudo = np.zeros((D, len(CLASSES)))
    b_pseudo[:, keep] = balanced({k: v[..., keep] for k, v in pseudo.items()})
    a = st1["gram"] + np.eye(D)
    w_ref = np.linalg.solve(a, balanced(st1) + ALPHA * b_pseudo)
    sig1 = {r.name.split("[")[0]: r.noise.sigma for r in first.releases}
    sig2 = {r.name.removeprefix("pseudo_"): r.noise.sigma for r in second.releases}
    e_g = sig1["gram"] * (12 * math.sqrt(D * len(SITES)) + math.sqrt(2 * D))
    inv = 1.0 / (float(np.linalg.eigvalsh(st1["gram"]).min()) + 1.0 - e_g)
    pseudo_ok = {k: v[..., keep] for k, v in pseudo.items()}
    bound = inv * (
        e_g * float(np.linalg.norm(w_ref, 2))
        + _targets_error(st1, sig1, len(SITES))
        + ALPHA * _targets_error(pseudo_ok, sig2, len(SITES))
    )
    err = float(np.linalg.norm(w2 - w_ref))
    assert 0 < err <= bound, (err, bound)
    assert bound <= 0.1 * float(np.linalg.norm(w_ref)), (err, bound)  # not vacuous

    # The ledger: both rounds, one run, recorded before their uploads.
    state = loop.client_configs["site-1"].parent / "state"
    entries = DpLedger(state / "dp-ledger").entries()
    assert first.run_id and second.run_id == first.run_id  # the coordinator's run
    assert [(e.round_id, e.run_id) for e in entries] == [
        (first.round_id, first.run_id),
        (second.round_id, first.run_id),
    ]
    run_mu = compose_mu(e.mu for e in entries)
    assert epsilon_from_mu(mu=run_mu, delta=DELTA) == pytest.approx(
        dp_oracle.epsilon(run_mu, DELTA), rel=1e-9
    )

    # Restart: a fresh coordinator, the same sites' state; site-1's lifetime budget is below
    # what another run would bring it to.
    shutil.rmtree(loop.server_config.parent / "state")
    for site_config in loop.client_configs.values():
        # A new coordinator for the federation, not a restored one: without this the sites'
        # witness of the old coordinator refuses it (tests/e2e/faults/test_restore.py).
        (site_config.parent / "state" / "witness.json").unlink(missing_ok=True)
        # and the checkpoint of the old coordinator's federation log it cosigned (a new log is
        # not an extension of it: docs/protocol.md §11a)
        (site_config.parent / "state" / "log-witness.json").unlink(missing_ok=True)
    config = loop.client_configs["site-1"]
    doc = tomllib.loads(config.read_text(encoding="utf-8"))
    doc["policy"] = {**doc.get("policy", {}), "lifetime_epsilon": 1.5 * EPSILON}
    config.write_text(toml_text.dumps(doc), encoding="utf-8")
    again = run_loopback(loop, timeout_s=180)
    assert again.client_rcs["site-1"] == 3, again.logs
    (refusal,) = [r for rid, r in again.reports["site-1"].items() if rid not in plans]
    assert refusal["outcome"] == "REFUSED_PLAN" and refusal["bytes_sent"] == 0
    assert "lifetime ε over 3 recorded release(s) would be" in refusal["reason"]
    assert "> policy lifetime_epsilon 1.5e+06" in refusal["reason"]
    assert [e.round_id for e in DpLedger(state / "dp-ledger").entries()] == [
        first.round_id,
        second.round_id,
    ]
    capsys.readouterr()
    assert cli.main(["budget", "--config", str(config)]) == 0
    shown = capsys.readouterr().out
    assert first.round_id in shown and second.round_id in shown
    assert f"lifetime: ε = {epsilon_from_mu(mu=run_mu, delta=1e-5):.4g} at δ = 1e-05" in shown
