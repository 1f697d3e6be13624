"""CKKS encodings of a DP plan (afl.server.plan.dp_ckks, docs/protocol.md §7 [M-87]): the decryptor's
grid is the half noise grid and the pre-scale resolves it, so the decryptor returns the sites'
noisy sum EXACTLY (oracle: the float64 sum of the noisy values, which lie on the grid); a plan
whose pre-scale cannot resolve the noise grid is refused."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from afl.client.payloads.dp import noisy_values
from afl.crypto.ckks import params as cp
from afl.crypto.ckks import scheme as ckks
from afl.crypto.ckks.decrypt import decrypt_release
from afl.proto.v1 import common_pb2 as cpb
from afl.server.plan.dp import DpSettings, apply_dp, calibrate, dp_releases
from afl.server.plan.dp_ckks import dp_ckks_encoding, dp_ckks_encodings
from afl.server.plan.dp_mask import dp_mask_bound
from afl.server.plan.release import build_plan

SITES = ["a", "b", "c"]
D, N, CLIP = 6, 200, 2.0


def _plan(epsilon: float) -> cpb.ReleasePlan:
    releases = dp_releases(
        classes=["x", "y"], participants=SITES, coverage={}, gram_scope="global", d=D
    )
    plan = build_plan(
        federation_id="f", round_id="r", round_number=1, participants=SITES,
        gram_scope="global", releases=releases,
    )  # fmt: skip
    plan.aggregation = cpb.AGGREGATION_MODE_CKKS
    settings = DpSettings(epsilon=epsilon, delta=1e-5, clip_norm=CLIP, tolerated=1)
    apply_dp(plan, calibrate(releases, settings, participants=SITES, plaintext=False))
    return plan


def test_the_decryptor_returns_the_noisy_sum_exactly(private_ctx: Any, public_ctx: Any) -> None:
    plan = _plan(epsilon=3.0)
    dp_ckks_encodings(plan, max_samples=N)
    release = next(r for r in plan.releases if r.name == "s_pos")
    ck = release.encoding.ckks
    assert ck.grid_step == 2.0 ** -(release.noise.frac_bits + 1)
    assert 2 * cp.min_grid(prescale=ck.prescale, num_summands=3) <= ck.grid_step
    bound = dp_mask_bound(release, max_samples=N, clip_norm=CLIP)
    assert bound * ck.prescale * 3 <= cp.SUM_SLOT_BOUND
    rng = np.random.default_rng(0)
    uploads, exact, tags = [], np.zeros(D * 2), []
    for _ in SITES:  # each site: a clipped sum of N rows at most, plus its noise share
        values = rng.uniform(-N * CLIP, N * CLIP, size=(D, 2)) * 0.9
        noisy = noisy_values(release, values).ravel()
        exact = exact + noisy
        tags.append(ckks.new_tag(num_summands=3))
        uploads.append(
            ckks.encrypt_block(
                public_ctx, noisy, prescale=ck.prescale, num_summands=3, tag=tags[-1]
            )
        )
    summed = ckks.sum_ciphertexts(public_ctx, uploads, length=D * 2)
    out = decrypt_release(
        private_ctx, summed, member_tags=tags, length=D * 2,
        prescale=ck.prescale, num_summands=3, grid=ck.grid_step,
    )  # fmt: skip
    assert np.array_equal(out, exact)  # the grid holds the noisy sum: nothing of CKKS is left


def test_a_noise_grid_the_pre_scale_cannot_resolve_is_refused() -> None:
    plan = _plan(epsilon=3.0)
    release = next(r for r in plan.releases if r.name == "gram[all]")
    release.noise.frac_bits = 30  # a grid of 2^-31 for values up to N·L² = 800
    with pytest.raises(ValueError, match="coarser than the noise grid"):
        dp_ckks_encoding(release, max_samples=N, clip_norm=CLIP)
    with pytest.raises(ValueError, match="max_samples"):
        dp_ckks_encodings(_plan(epsilon=3.0), max_samples=0)
