"""End to end DP round over loopback gRPC with mutual TLS (issue 6, design §8): afl-server with a
[round.dp] table and one afl-client process per site. A site whose max_epsilon is below the
round's budget refuses the plan and its report says why; the coordinator re-plans with the other
three, whose reports state ε and δ (recomputed by each site, equal to the server's budget and to
the server's audit log), and whose W equals the noise-free pooled solve to a tolerance derived
from the plan's noise scales."""

from __future__ import annotations

import math
import tomllib
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from afl.core.dp_stats import clip_rows, sufficient_statistics
from afl.core.featurecache import open_cache
from afl.lab.demo_federation import prepare_loopback, run_loopback
from afl.server import toml_text
from afl.server.config import load_config
from afl.server.store import Store

D = 8
CLASSES = ("A", "B")
CLIP = 3.0
EPSILON = 1e6  # huge: W must match the noise-free pooled solve to the derived tolerance


def _data(k: int) -> tuple[list[NDArray[np.float32]], list[NDArray[np.int8]]]:
    rng = np.random.default_rng(11)
    feats, labels = [], []
    for site in range(k):
        n = 120 + 20 * site
        h = rng.normal(size=(n, D)) * 1.5
        y = (h[:, :2] + rng.normal(size=(n, 2)) > 1.0).astype(np.int8)
        feats.append(h.astype(np.float32))
        labels.append(y)
    return feats, labels


def _pooled(root: Path, sites: list[str]) -> tuple[Any, Any]:
    caches = [open_cache(root / "data" / s) for s in sites]
    h = clip_rows(
        np.vstack([np.asarray(c.features, dtype=np.float64) for c in caches]), clip_norm=CLIP
    )
    y = np.vstack([c.labels for c in caches]).astype(np.int64)
    mask = y >= 0
    st = sufficient_statistics(h, np.where(mask, y, 0), label_mask=mask)
    npos, nneg = st.positive_count, st.label_count - st.positive_count
    b = (st.positive_sum / npos[:, None] - (st.label_sum - st.positive_sum) / nneg[:, None]).T
    return np.linalg.solve(st.gram + np.eye(D), b), st


def _bound(w_ref: NDArray[np.float64], st: Any, sig: dict[str, float], k: int) -> float:
    """First-order bound of tests/client/test_dp_payloads.py (6 standard deviations)."""
    n_min = float(min(st.positive_count.min(), (st.label_count - st.positive_count).min()))
    b_norm = float(np.linalg.norm((st.gram + np.eye(D)) @ w_ref, axis=0).max())
    e_g = 6 * sig["gram[all]"] * 2 * math.sqrt(D * k)
    inv_norm = 1.0 / (float(np.linalg.eigvalsh(st.gram).min()) + 1.0 - e_g)
    db = 6 * math.sqrt(D * k) * (sig["s_pos"] + sig["t_sum"]) * 2 / n_min
    db += b_norm * 6 * math.sqrt(k) * sig["counts"] * 2 / n_min
    return inv_norm * (e_g * float(np.linalg.norm(w_ref, 2)) + math.sqrt(2) * db)


def test_dp_round_completes_and_a_site_over_budget_refuses(tmp_path: Path) -> None:
    feats, labels = _data(4)
    active = np.ones((4, len(CLASSES)), dtype=bool)
    loop = prepare_loopback(
        tmp_path,
        classes=CLASSES,
        site_features=feats,
        site_labels=labels,
        active=active,
        test_features=feats[0][:30],
        test_labels=labels[0][:30],
        policy={"site-4": {"max_epsilon": 1e5}},
    )
    doc = tomllib.loads(loop.server_config.read_text(encoding="utf-8"))
    doc["round"]["dp"] = {"epsilon": EPSILON, "delta": 1e-6, "clip_norm": CLIP}
    loop.server_config.write_text(toml_text.dumps(doc), encoding="utf-8")
    run = run_loopback(loop, timeout_s=180)

    assert run.client_rcs["site-4"] == 3, run.logs
    refusal = run.final_report("site-4")
    assert refusal["outcome"] == "REFUSED_PLAN" and refusal["bytes_sent"] == 0
    assert "ε = 1e+06 > policy max_epsilon 100000" in refusal["reason"]
    assert refusal["plan"]["audit"]["covered_by_dp"] is False

    remaining = ["site-1", "site-2", "site-3"]
    assert all(run.client_rcs[s] == 0 for s in remaining), run.logs
    w_ref, st = _pooled(loop.root, remaining)
    config = load_config(loop.server_config)
    store = Store(config.state_dir, federation_id=config.federation_id)
    budgets: list[Any] = [e[2] for e in store.audit_entries() if e[1] == "dp-budget"]
    assert store.verify_audit_chain() and budgets
    for site in remaining:
        report = run.final_report(site)
        assert report["outcome"] == "COMPLETED"
        dp = report["dp"]
        assert dp["delta"] == 1e-6 and dp["epsilon"] <= EPSILON * (1 + 1e-6)
        assert math.isclose(dp["epsilon"], dp["epsilon_server"], rel_tol=1e-6)
        assert math.isclose(budgets[-1]["sites"][site]["epsilon"], dp["epsilon"], rel_tol=1e-6)
        assert {u["slot"] for u in report["uploads"]} == {"gram[all]", "s_pos", "t_sum", "counts"}
        w = np.asarray(np.load(report["model"]["path"]), dtype=np.float64)
        sig = {name: r["sigma"] for name, r in dp["releases"].items()}
        err = float(np.linalg.norm(w - w_ref))
        bound = _bound(w_ref, st, sig, len(remaining))
        assert 0 < err <= bound, (err, bound)
        assert bound <= 0.05 * float(np.linalg.norm(w_ref))
