"""The DP end-to-end scenario shared by test_federation_dp.py and test_federation_dp_mask.py: its
constants, the sites' data (labels driven by the first two features), the server's [round.dp]
table, the noise-free pooled solve (the oracle) and the tolerance on W derived from the plan's
noise scales."""

from __future__ import annotations

import math
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from afl.core.dp_stats import clip_rows, sufficient_statistics
from afl.core.featurecache import open_cache
from afl.server import toml_text
from afl.server.config import load_config
from afl.server.store import Store

D = 8
CLASSES = ("A", "B")
CLIP = 3.0
EPSILON = 1e6  # huge: W must match the noise-free pooled solve to the derived tolerance


def site_data(k: int) -> tuple[list[NDArray[np.float32]], list[NDArray[np.int8]]]:
    """``k`` sites' features N(0, 1.5² I) and labels y_c = [h_c + N(0, 1) > 1] (c = 0, 1)."""
    rng = np.random.default_rng(11)
    feats, labels = [], []
    for site in range(k):
        n = 120 + 20 * site
        h = rng.normal(size=(n, D)) * 1.5
        y = (h[:, :2] + rng.normal(size=(n, 2)) > 1.0).astype(np.int8)
        feats.append(h.astype(np.float32))
        labels.append(y)
    return feats, labels


def add_dp_table(server_config: Path, table: Mapping[str, toml_text.TomlValue]) -> None:
    """Add ``[round.dp]`` = ``table`` to a provisioned server.toml."""
    doc = tomllib.loads(server_config.read_text(encoding="utf-8"))
    doc["round"]["dp"] = table
    server_config.write_text(toml_text.dumps(doc), encoding="utf-8")


def dp_budgets(server_config: Path) -> list[Any]:
    """The server's ``dp-budget`` audit entries, after checking its audit chain holds some."""
    config = load_config(server_config)
    store = Store(config.state_dir, federation_id=config.federation_id)
    budgets: list[Any] = [e[2] for e in store.audit_entries() if e[1] == "dp-budget"]
    assert store.verify_audit_chain() and budgets
    return budgets


def pooled_solve(root: Path, sites: Sequence[str]) -> tuple[Any, Any]:
    """Noise-free W from the sites' pooled, clipped rows (γ = 1), and the pooled statistics."""
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


def w_error_bound(w_ref: NDArray[np.float64], st: Any, sig: dict[str, float], k: int) -> float:
    """First-order bound of tests/client/test_dp_payloads.py (6 standard deviations)."""
    n_min = float(min(st.positive_count.min(), (st.label_count - st.positive_count).min()))
    b_norm = float(np.linalg.norm((st.gram + np.eye(D)) @ w_ref, axis=0).max())
    e_g = 6 * sig["gram[all]"] * 2 * math.sqrt(D * k)
    inv_norm = 1.0 / (float(np.linalg.eigvalsh(st.gram).min()) + 1.0 - e_g)
    db = 6 * math.sqrt(D * k) * (sig["s_pos"] + sig["t_sum"]) * 2 / n_min
    db += b_norm * 6 * math.sqrt(k) * sig["counts"] * 2 / n_min
    return inv_norm * (e_g * float(np.linalg.norm(w_ref, 2)) + math.sqrt(2) * db)


def checked_dp_report(report: dict[str, Any], budgets: list[Any], site: str) -> dict[str, Any]:
    """The ``dp`` part of a site's final report, after the checks every DP round passes: the round
    completed; δ as configured and ε within the budget; ε recomputed by the site equal to the
    server's and to the budget in the server's audit log."""
    assert report["outcome"] == "COMPLETED"
    dp: dict[str, Any] = report["dp"]
    assert dp["delta"] == 1e-6 and dp["epsilon"] <= EPSILON * (1 + 1e-6)
    assert math.isclose(dp["epsilon"], dp["epsilon_server"], rel_tol=1e-6)
    assert math.isclose(budgets[-1]["sites"][site]["epsilon"], dp["epsilon"], rel_tol=1e-6)
    return dp
