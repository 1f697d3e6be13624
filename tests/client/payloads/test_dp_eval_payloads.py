"""Evaluation releases under DP (docs/protocol.md §6.1, [M-98]): the coordinator's noise for an
evaluation round (afl.server.plan.dp.calibrate_evaluation), the site's own accounting of it
(afl.client.policy.dp) and its noisy evaluation payloads (afl.client.payloads.evaluation). Oracles:
the independent analytic-Gaussian accountant (tests/helpers/dp_oracle.py), the exact evaluation
statistics of the unit's rows, and the fixed-point codec of the plan's mask encoding."""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import numpy as np
import pytest

from afl.client.config import LocalPolicy
from afl.client.payloads.evaluation import evaluation_slot_payloads
from afl.client.policy.dp import DpContext, assess_plan
from afl.core.data.featurecache import CacheMeta, write_cache
from afl.core.dp.evaluation import evaluation_sensitivity
from afl.core.evaluation.federated import evaluation_statistics
from afl.crypto.fixedpoint import FixedPointCodec
from afl.proto.v1 import common_pb2 as cpb
from afl.proto.wire import read_evaluation
from afl.server.plan.dp import DpSettings, apply_dp, calibrate_evaluation
from afl.server.plan.dp_ckks import dp_ckks_encodings
from afl.server.plan.dp_mask import dp_mask_encodings
from afl.server.plan.release import build_plan
from afl.server.solve.evaluation import CONFUSION, HISTOGRAMS, evaluation_releases
from tests.helpers import dp_oracle

SITES = ["s1", "s2", "s3", "s4"]
CLASSES = ("A", "B", "C")
MODEL = hashlib.sha256(b"model").digest()
D = 4
N_MAX = 64


def _plan(mode: int, *, tolerated: int, m: int = 1) -> cpb.ReleasePlan:
    releases = evaluation_releases(classes=CLASSES, participants=SITES, model_sha256=MODEL)
    plan = build_plan(
        federation_id="f", round_id="e3", round_number=3, participants=SITES,
        gram_scope="global", releases=releases,
    )  # fmt: skip
    plan.aggregation = mode  # type: ignore[assignment]
    settings = DpSettings(
        epsilon=2.0, delta=1e-5, clip_norm=1.0, tolerated=tolerated, eval_epsilon=1.0,
        images_per_patient=m,
    )  # fmt: skip
    cal = calibrate_evaluation(
        releases, settings, participants=SITES, plaintext=mode == cpb.AGGREGATION_MODE_PLAINTEXT
    )
    apply_dp(plan, cal)
    if mode == cpb.AGGREGATION_MODE_MASK:
        dp_mask_encodings(plan, max_samples=N_MAX)
    elif mode == cpb.AGGREGATION_MODE_CKKS:
        dp_ckks_encodings(plan, max_samples=N_MAX)
    return plan


@pytest.mark.parametrize("mode", [cpb.AGGREGATION_MODE_MASK, cpb.AGGREGATION_MODE_CKKS])
def test_an_evaluation_plan_costs_its_stated_epsilon_by_the_sites_own_accounting(
    mode: int,
) -> None:
    plan = _plan(mode, tolerated=2, m=2)  # t = 2 covers the default floor ⌈4/3⌉
    assert plan.dp.enabled and plan.dp.epsilon == 1.0
    assert {r.name for r in plan.releases} == {HISTOGRAMS, CONFUSION}
    delta_l2 = 2 * math.sqrt(len(CLASSES))  # m·√C, one patient of 2 rows in 3 classes
    assert all(r.noise.sensitivity == pytest.approx(delta_l2) for r in plan.releases)
    oracle = dp_oracle.epsilon(
        dp_oracle.composed_mu([(delta_l2, r.noise.sigma) for r in plan.releases]), 1e-5
    )
    assert oracle == pytest.approx(1.0, rel=1e-6)
    assert all(b.epsilon == pytest.approx(oracle, rel=1e-6) for b in plan.budgets)
    policy = LocalPolicy(max_epsilon=1.05, allowed_aggregation=("mask", "ckks"))
    ok = assess_plan(plan, site_id="s1", policy=policy, context=DpContext(has_patient_ids=True))
    assert ok.refusal == "" and ok.epsilon == pytest.approx(oracle, rel=1e-6)
    # A plan sized for t = 0: the site's floor (2 colluders of 4) puts it above 1.05.
    trusting = _plan(mode, tolerated=0, m=2)
    refused = assess_plan(
        trusting, site_id="s1", policy=policy, context=DpContext(has_patient_ids=True)
    )
    honest_shares = [
        (delta_l2, r.noise.sigma / math.sqrt(len(SITES)) * math.sqrt(len(SITES) - 2))
        for r in trusting.releases
    ]
    real = dp_oracle.epsilon(dp_oracle.composed_mu(honest_shares), 1e-5)
    assert refused.epsilon == pytest.approx(real, rel=1e-6) and real > 1.3
    assert f"ε = {real:g}" in refused.refusal


def test_noisy_evaluation_payloads_sum_to_the_exact_counts_plus_the_plans_noise(
    tmp_path: Path,
) -> None:
    plan = _plan(cpb.AGGREGATION_MODE_MASK, tolerated=2, m=1)
    rng = np.random.default_rng(3)
    w = rng.normal(size=(D, len(CLASSES)))
    hist = next(r for r in plan.releases if r.name == HISTOGRAMS)
    conf = next(r for r in plan.releases if r.name == CONFUSION)
    sums: dict[str, np.ndarray] = {}
    exact: dict[str, np.ndarray] = {}
    for site in SITES:
        n = 40
        labels = (rng.random((n, len(CLASSES))) < 0.4).astype(np.int8)
        feats = rng.normal(size=(n, D)).astype(np.float32)
        patients = [f"{site}-p{i // 2}" for i in range(n)]  # 2 images per patient
        cache = write_cache(
            tmp_path / site,
            meta=CacheMeta(n=n, d=D, classes=CLASSES, source="test"),
            ids=[f"{site}-{i}" for i in range(n)],
            labels=labels,
            features=feats,
            patients=patients,
        )
        payloads = evaluation_slot_payloads(
            plan, site_id=site, cache=cache, labelled=np.ones(len(CLASSES), dtype=bool),
            weights=w, model_classes=CLASSES, model_sha256=MODEL.hex(), encode=lambda r, v: v.astype("<f8").tobytes(),
        )  # fmt: skip
        unit_rows = np.arange(0, n, 2)  # m = 1: the first image of each patient
        stats = evaluation_statistics(
            feats[unit_rows].astype(np.float64), labels[unit_rows], weights=w, classes=CLASSES,
            bins=read_evaluation(hist).bins,
        )  # fmt: skip
        want = {HISTOGRAMS: stats.histograms.ravel(), CONFUSION: stats.confusion.ravel()}
        for p in payloads:
            (name,) = p.releases
            values = np.frombuffer(p.payload, dtype="<f8")
            release = hist if name == HISTOGRAMS else conf
            step = 2.0 ** -int(release.noise.frac_bits)
            assert np.allclose(values / step, np.rint(values / step))  # on the noise grid
            assert not np.array_equal(values, want[name])  # noised
            codec = FixedPointCodec(
                bound=release.encoding.fixed_point.bound,
                frac_bits=release.encoding.fixed_point.frac_bits,
                max_summands=len(SITES),
            )
            assert np.array_equal(codec.decode(codec.encode(values)), values)  # mask keeps it
            sums[name] = sums.get(name, 0) + values
            exact[name] = exact.get(name, 0) + want[name].astype(np.float64)
    for name, release in ((HISTOGRAMS, hist), (CONFUSION, conf)):
        share = release.noise.sigma / math.sqrt(len(SITES) - release.noise.assumed_colluders)
        total_sd = share * math.sqrt(len(SITES))
        z = (sums[name] - exact[name]) / total_sd
        # the pooled noise is N(0, n·σ_s²) per count: its sample sd is near 1 and no count is
        # beyond 6 sd (probability < 1e-8 over these counts)
        assert np.max(np.abs(z)) < 6.0
        if z.size > 500:
            assert 0.9 < float(np.std(z)) < 1.1
    assert evaluation_sensitivity(n_classes=len(CLASSES)) == pytest.approx(math.sqrt(3))
