"""The DP end-to-end scenario shared by the test_federation_dp*.py modules: its constants, the
sites' data (labels driven by the first two features; patients holding three images each), the
server's [round.dp] table (patient level, m = 2 images per patient), the noise-free pooled solve
(the oracle: the first two images of every patient, label clipping k = 1, written out with numpy),
the tolerance on W derived from the plan's noise scales, and the accounting checks every DP run
passes (the site's report, the plan, the audit log, the rulebook and the independent
analytic-Gaussian accountant of tests/helpers/dp_oracle.py agree)."""

from __future__ import annotations

import math
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from afl.core.data.featurecache import open_cache
from afl.core.dp.accounting import GaussianRelease, epsilon_for_releases
from afl.lab.demo.federation import LoopbackFederation, prepare_loopback
from afl.proto.v1 import common_pb2 as cpb
from afl.server import toml_text
from afl.server.config import load_config
from afl.server.store import Store
from tests.helpers import dp_oracle

D = 8
CLASSES = ("A", "B")
CLIP = 3.0
EPSILON = 1e6  # huge: W must match the noise-free pooled solve to the derived tolerance
DELTA = 1e-6
IMAGES_PER_PATIENT = 2  # the plan's m; every patient holds 3 images, the third is left out
DP_TABLE: dict[str, toml_text.TomlValue] = {
    "epsilon": EPSILON,
    "delta": DELTA,
    "clip_norm": CLIP,
    "unit": "patient",
    "images_per_patient": IMAGES_PER_PATIENT,
}


def site_data(
    k: int,
) -> tuple[list[NDArray[np.float32]], list[NDArray[np.int8]], list[list[str]]]:
    """``k`` sites' features N(0, 1.5² I), labels y_c = [h_c + N(0, 1) > 1] (c = 0, 1) and
    patient ids: rows 3j, 3j+1, 3j+2 of a site belong to one patient."""
    rng = np.random.default_rng(11)
    feats, labels, patients = [], [], []
    for site in range(k):
        n = 120 + 21 * site
        h = rng.normal(size=(n, D)) * 1.5
        y = (h[:, :2] + rng.normal(size=(n, 2)) > 1.0).astype(np.int8)
        feats.append(h.astype(np.float32))
        labels.append(y)
        patients.append([f"site{site}-patient{i // 3}" for i in range(n)])
    return feats, labels, patients


def dp_federation(
    root: Path,
    sites: int,
    *,
    dp: Mapping[str, toml_text.TomlValue] | None = None,
    round_settings: Mapping[str, toml_text.TomlValue] | None = None,
    active: NDArray[np.bool_] | None = None,
    policy: Mapping[str, Mapping[str, toml_text.TomlValue]] | None = None,
    decryptor: bool = False,
) -> LoopbackFederation:
    """A loopback federation of ``sites`` sites holding :func:`site_data` (with patient ids;
    every site labels every class unless ``active`` says otherwise), the test set the first 30
    rows of site 1, and the [round.dp] table :data:`DP_TABLE` updated with ``dp``. The sites
    opt in to plaintext uploads when the run is a plaintext one (``round_settings``)."""
    plaintext = (round_settings or {}).get("aggregation", "plaintext") == "plaintext"
    feats, labels, patients = site_data(sites)
    loop = prepare_loopback(
        root,
        classes=CLASSES,
        site_features=feats,
        site_labels=labels,
        active=np.ones((sites, len(CLASSES)), dtype=bool) if active is None else active,
        test_features=feats[0][:30],
        test_labels=labels[0][:30],
        round_settings=round_settings,
        policy=policy,
        decryptor=decryptor,
        site_patients=patients,
        allow_plaintext=plaintext,
    )
    add_dp_table(loop.server_config, {**DP_TABLE, **(dp or {})})
    return loop


def add_dp_table(server_config: Path, table: Mapping[str, toml_text.TomlValue]) -> None:
    """Add ``[round.dp]`` = ``table`` to a provisioned server.toml."""
    doc = tomllib.loads(server_config.read_text(encoding="utf-8"))
    doc["round"]["dp"] = dict(table)
    server_config.write_text(toml_text.dumps(doc), encoding="utf-8")


def server_store(server_config: Path) -> Store:
    config = load_config(server_config)
    return Store(config.state_dir, federation_id=config.federation_id)


def dp_budgets(server_config: Path) -> list[Any]:
    """The server's ``dp-budget`` audit entries, after checking its audit chain holds some."""
    store = server_store(server_config)
    budgets: list[Any] = [e[2] for e in store.audit_entries() if e[1] == "dp-budget"]
    assert store.verify_audit_chain() and budgets
    return budgets


def signed_plans(server_config: Path) -> dict[str, cpb.ReleasePlan]:
    """Every stored plan, by round id."""
    rows = server_store(server_config).rounds()
    return {r.round_id: cpb.ReleasePlan.FromString(r.plan) for r in rows if r.plan is not None}


def kept_rows(n: int) -> NDArray[np.int64]:
    """The rows a site keeps: the first two of every patient's three (rows 3j and 3j+1)."""
    return np.flatnonzero(np.arange(n) % 3 < IMAGES_PER_PATIENT)


def kept_unit_rows(
    root: Path, sites: Sequence[str]
) -> tuple[NDArray[np.float64], NDArray[np.int8]]:
    """The kept rows of every site's cache (:func:`kept_rows`), unclipped, pooled in site order."""
    hs, ys = [], []
    for s in sites:
        cache = open_cache(root / "data" / s)
        keep = kept_rows(cache.meta.n)
        hs.append(np.asarray(cache.features, dtype=np.float64)[keep])
        ys.append(np.asarray(cache.labels)[keep])
    return np.vstack(hs), np.vstack(ys)


def pooled_stats(root: Path, sites: Sequence[str]) -> dict[str, NDArray[np.float64]]:
    """The noise-free pooled statistics of the kept, clipped rows (label clipping k = 1: a row
    positive in p classes weighs 1/√p in the positive sums and counts), with numpy only."""
    h, y = kept_unit_rows(root, sites)
    norms = np.linalg.norm(h, axis=1, keepdims=True)
    h = h * np.minimum(1.0, CLIP / np.maximum(norms, 1e-300))
    mask = y >= 0
    pos = np.where(mask, y, 0).astype(np.float64)
    weighted = pos / np.sqrt(np.maximum(pos.sum(axis=1, keepdims=True), 1.0))
    return {
        "gram": h.T @ h,
        "s_pos": h.T @ weighted,
        "n_pos": weighted.sum(axis=0),
        "t_sum": h.T @ mask,
        "n": mask.sum(axis=0).astype(np.float64),
        "h": h,
    }


def balanced(st: Mapping[str, NDArray[np.float64]]) -> NDArray[np.float64]:
    """Pooled balanced targets b_c = S+/n+ - (T - S+)/(N - n+) (d, C)."""
    s_pos, n_pos = st["s_pos"], st["n_pos"]
    out: NDArray[np.float64] = s_pos / n_pos - (st["t_sum"] - s_pos) / (st["n"] - n_pos)
    return out


def pooled_solve(root: Path, sites: Sequence[str]) -> tuple[Any, Any]:
    """Noise-free W from the sites' pooled statistics (γ = 1), and those statistics."""
    st = pooled_stats(root, sites)
    return np.linalg.solve(st["gram"] + np.eye(D), balanced(st)), st


def w_error_bound(w_ref: NDArray[np.float64], st: Any, sig: dict[str, float], k: int) -> float:
    """First-order bound of tests/client/payloads/test_dp_payloads.py (6 standard deviations), with the
    solve's ridge raised by √(2d)·σ_G (afl.core.dp.stats.noise_ridge)."""
    n_min = float(min(st["n_pos"].min(), (st["n"] - st["n_pos"]).min()))
    b_norm = float(np.linalg.norm((st["gram"] + np.eye(D)) @ w_ref, axis=0).max())
    gram_sigma = next(v for name, v in sig.items() if name.startswith("gram"))
    e_g = 6 * gram_sigma * 2 * math.sqrt(D * k) + math.sqrt(2 * D) * gram_sigma
    inv_norm = 1.0 / (float(np.linalg.eigvalsh(st["gram"]).min()) + 1.0 - e_g)
    db = 6 * math.sqrt(D * k) * (sig["s_pos"] + sig["t_sum"]) * 2 / n_min
    db += b_norm * 6 * math.sqrt(k) * sig["counts"] * 2 / n_min
    return inv_norm * (e_g * float(np.linalg.norm(w_ref, 2)) + math.sqrt(2) * db)


def checked_dp_report(
    report: dict[str, Any],
    budgets: list[Any],
    site: str,
    plan: cpb.ReleasePlan,
    *,
    earlier: Sequence[cpb.ReleasePlan] = (),
    epsilon: float = EPSILON,
) -> dict[str, Any]:
    """The ``dp`` part of a site's final report, after the checks every DP round passes: the round
    completed with a patient-level guarantee; δ as configured; the site's ε (and its run's, with
    the ``earlier`` plans of the run) equal to the plan's budgets, to the server's audit log, to
    the rulebook's composition of the plan's (Δ, σ) and to the independent analytic-Gaussian
    accountant; the run's ε within the target."""
    assert report["outcome"] == "COMPLETED", report.get("reason")
    dp: dict[str, Any] = report["dp"]
    assert dp["guarantee"] == "patient-level (ε, δ)" and dp["unit"] == "patient"
    assert dp["images_per_patient"] == IMAGES_PER_PATIENT and dp["delta"] == DELTA
    assert plan.dp.unit == cpb.PRIVACY_UNIT_PATIENT
    assert plan.dp.images_per_patient == IMAGES_PER_PATIENT

    def pairs(p: cpb.ReleasePlan) -> list[tuple[float, float]]:
        return [
            (r.noise.sensitivity, r.noise.sigma) for r in p.releases if site in r.member_site_ids
        ]

    mine, run = pairs(plan), [x for p in (*earlier, plan) for x in pairs(p)]
    oracle = dp_oracle.epsilon(dp_oracle.composed_mu(mine), DELTA)
    oracle_run = dp_oracle.epsilon(dp_oracle.composed_mu(run), DELTA)
    rulebook = epsilon_for_releases([GaussianRelease("r", s, g) for s, g in mine], delta=DELTA)
    (budget,) = [b for b in plan.budgets if b.site_id == site]
    entry = [b for b in budgets if b["round_id"] == plan.round_id][-1]
    logged = entry["sites"][site]
    for value in (dp["epsilon"], dp["epsilon_server"], budget.epsilon, logged["epsilon"], rulebook):
        assert math.isclose(value, oracle, rel_tol=1e-6), (value, oracle)
    for value in (dp["epsilon_run"], dp["epsilon_server_run"], budget.epsilon_run):
        assert math.isclose(value, oracle_run, rel_tol=1e-6), (value, oracle_run)
    assert math.isclose(logged["epsilon_run"], oracle_run, rel_tol=1e-6)
    assert entry["guarantee"] == "patient-level (ε, δ)"
    assert oracle_run <= epsilon * (1 + 1e-6)
    return dp
