"""End to end DP round in MASK mode over loopback gRPC with mutual TLS (docs/protocol.md §4.2, §7):
afl-server with ``aggregation = "mask"`` and a [round.dp] table, one afl-client per site. With a
huge ε the masked DP W matches the plaintext DP W and the noise-free pooled solve within a tolerance
derived from the plan's noise scales; every site reports its ε (equal to the server's budget); the
plan's noise split assumes t = min(tolerated, n - 1) colluders, so each site's share has variance
σ²/(n - t), and each release's fixed-point grid is fine enough for the noise grid."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from afl.lab.demo.federation import (
    LoopbackFederation,
    LoopbackRun,
    mask_round_settings,
    run_loopback,
)
from afl.proto.v1 import common_pb2 as cpb
from afl.server.config import load_config
from afl.server.plan.dp_mask import dp_mask_bound
from tests.e2e.dp_scenario import (
    CLIP,
    checked_dp_report,
    dp_budgets,
    dp_federation,
    pooled_solve,
    signed_plans,
    site_data,
    w_error_bound,
)

SITES = ["site-1", "site-2", "site-3", "site-4"]
TOLERATED = 2  # the sites' default colluder floor ⌈4/3⌉ (docs/protocol.md M-126)


def _federation(root: Path, *, mask: bool) -> tuple[LoopbackFederation, LoopbackRun]:
    settings: dict[str, Any] = {"gram_scope": "global", "upload_timeout_s": 120.0}
    if mask:
        settings.update(mask_round_settings(site_data(len(SITES))[0]))
    loop = dp_federation(root, len(SITES), dp={"tolerated": TOLERATED}, round_settings=settings)
    return loop, run_loopback(loop, timeout_s=600)


def _w(run: LoopbackRun, site: str) -> NDArray[np.float64]:
    return np.asarray(np.load(run.final_report(site)["model"]["path"]), dtype=np.float64)


def test_dp_mask_round_matches_plaintext_and_pooled(tmp_path: Path) -> None:
    loop, run = _federation(tmp_path / "mask", mask=True)
    assert all(run.client_rcs[s] == 0 for s in SITES), run.logs
    _, plain = _federation(tmp_path / "plain", mask=False)
    assert all(plain.client_rcs[s] == 0 for s in SITES), plain.logs
    w_ref, st = pooled_solve(loop.root, SITES)

    config = load_config(loop.server_config)
    budgets = dp_budgets(loop.server_config)
    (plan,) = signed_plans(loop.server_config).values()
    assert plan.aggregation == cpb.AGGREGATION_MODE_MASK and plan.dp.enabled
    n = len(SITES)
    t = min(TOLERATED, n - 1)
    assert config.round.mask is not None
    for release in plan.releases:
        fp = release.encoding.fixed_point
        assert fp.frac_bits >= release.noise.frac_bits + 1
        assert fp.min_survivors >= n - t
        assert fp.bound == dp_mask_bound(
            release, max_samples=config.round.mask.max_samples, clip_norm=CLIP
        )

    sigmas: dict[str, float] = {}
    for site in SITES:
        dp = checked_dp_report(run.final_report(site), budgets, site, plan)
        assert set(dp["releases"]) == {"gram[all]", "s_pos", "t_sum", "counts"}
        for r in dp["releases"].values():
            assert r["assumed_colluders"] == t
            assert math.isclose(r["share_sigma"] ** 2, r["sigma"] ** 2 / (n - t), rel_tol=1e-12)
        sigmas = {name: r["sigma"] for name, r in dp["releases"].items()}
        assert np.array_equal(_w(run, site), _w(run, SITES[0]))

    # Plaintext DP noise is local (t = n - 1): the guaranteed σ is the same, the shares larger.
    plain_dp = plain.final_report(SITES[0])["dp"]
    assert all(r["assumed_colluders"] == n - 1 for r in plain_dp["releases"].values())
    plain_sig = {name: r["sigma"] for name, r in plain_dp["releases"].items()}
    for name, sigma in sigmas.items():
        assert math.isclose(sigma, plain_sig[name], rel_tol=1e-3)  # grids may differ

    bound = w_error_bound(w_ref, st, sigmas, n)
    assert bound <= 0.05 * float(np.linalg.norm(w_ref))
    w_mask, w_plain = _w(run, SITES[0]), _w(plain, SITES[0])
    assert 0 < float(np.linalg.norm(w_mask - w_ref)) <= bound
    assert 0 < float(np.linalg.norm(w_plain - w_ref)) <= bound
    assert float(np.linalg.norm(w_mask - w_plain)) <= 2 * bound
