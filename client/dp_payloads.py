"""A site's DP-mode uploads: clipped additive statistics plus its discrete Gaussian noise share
(design §8, issue 6; the releases and their noise are set by :mod:`afl.server.dp_plan`).

1. Clip every feature row to ``‖h‖ ≤ L`` (``plan.dp.clip_norm``) and compute the additive
   statistics G, S+_c, T_c, n+_c, N_c over the site's labelled classes
   (:func:`afl.core.dp_stats.sufficient_statistics`; non-labelled classes are zeros).
2. For each release r the site is a member of, with grid 2^-f (``noise.frac_bits``), guaranteed σ
   (``noise.sigma``) and t (``noise.assumed_colluders``), its share in grid units is
   σ_int = σ/√(n_r - t)·2^f. Values are rounded to the grid and an integer discrete Gaussian
   N_Z(0, σ_int²) from the OS CSPRNG (:func:`afl.crypto.dgauss.discrete_gaussian`) is added:
   x̃ = (round(x·2^f) + Z)/2^f. The Gram uses a full d x d noise matrix, symmetrised
   (2·round(G·2^f) + Z + Zᵀ)/2^(f+1) (free post-processing, design §8), then packed.
3. The result is sent in the round's mode encoding (PLAINTEXT: float64, exact because every
   value is an integer multiple of 2^-(f+1) below 2^52 grid steps; larger values are refused).

:func:`site_epsilon` recomputes the site's ε from the plan's noise fields, so a site never relies
on the server's arithmetic alone: μ² = Σ_{r ∋ site} (Δ_r/σ_r)² with Δ_r at least the sensitivity
implied by the declared clip norm (GDP composition, :mod:`afl.core.dp_accounting`).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence

import numpy as np
from numpy.typing import NDArray

from afl.client.daemon_stats import PayloadError, SlotPayload
from afl.core.dp_accounting import epsilon_from_mu
from afl.core.dp_stats import SufficientStatistics, clip_rows, sufficient_statistics
from afl.core.packing import pack_upper
from afl.crypto.dgauss import discrete_gaussian
from afl.proto.v1 import common_pb2 as cpb

__all__ = ["dp_report", "dp_slot_payloads", "dp_statistics", "noisy_values", "site_epsilon"]

FloatArray = NDArray[np.float64]
_LIMIT = float(2**52)
_NOISED = (cpb.NOISE_MECHANISM_DISCRETE_GAUSSIAN, cpb.NOISE_MECHANISM_GAUSSIAN)


def dp_statistics(
    features: NDArray[np.floating],
    labels: NDArray[np.integer],
    *,
    labelled: NDArray[np.bool_],
    clip_norm: float,
) -> SufficientStatistics:
    """Step 1: clipped rows, additive statistics; ``labels`` (n, C) with -1 = missing."""
    h = clip_rows(np.asarray(features, dtype=np.float64), clip_norm=clip_norm)
    y = np.asarray(labels)
    mask = (y >= 0) & np.asarray(labelled, dtype=bool)[None, :]
    return sufficient_statistics(h, np.where(mask, y, 0), label_mask=mask)


def _share_sigma(release: cpb.Release) -> float:
    n, t = len(release.member_site_ids), int(release.noise.assumed_colluders)
    if not 0 <= t < n:
        raise PayloadError(f"release {release.name}: assumed_colluders {t} with {n} members")
    return float(release.noise.sigma) / math.sqrt(n - t)


def _to_grid(x: FloatArray, scale: float, what: str) -> NDArray[np.int64]:
    scaled = np.rint(np.asarray(x, dtype=np.float64) * scale)
    if not np.all(np.abs(scaled) < _LIMIT / 4):
        raise PayloadError(f"{what}: values exceed the exact range of the 2^-f grid")
    return scaled.astype(np.int64)


def noisy_values(release: cpb.Release, values: FloatArray) -> FloatArray:
    """Step 2 for one release: ``values`` in the release's logical shape, noise share added."""
    f = int(release.noise.frac_bits)
    if f > 60:
        raise PayloadError(f"release {release.name}: frac_bits {f} is out of range")
    scale = float(2**f)
    sigma_int = _share_sigma(release) * scale
    if release.noise.mechanism not in _NOISED:
        raise PayloadError(f"release {release.name}: a DP plan must noise every release")
    grid = _to_grid(values, scale, f"release {release.name}")
    if release.kind == cpb.STATISTIC_KIND_GRAM:
        z = discrete_gaussian(sigma_int, grid.shape)
        total = 2 * grid + z + z.T
        out: FloatArray = total.astype(np.float64) / (2.0 * scale)
        return out
    noisy = grid + discrete_gaussian(sigma_int, grid.shape)
    result: FloatArray = noisy.astype(np.float64) / scale
    return result


def _release_block(
    release: cpb.Release, stats: SufficientStatistics, class_names: Sequence[str]
) -> FloatArray:
    d = stats.gram.shape[0]
    if release.kind == cpb.STATISTIC_KIND_GRAM:
        if tuple(release.shape) != (d, d):
            raise PayloadError(f"release {release.name}: shape {list(release.shape)} != {[d, d]}")
        return stats.gram
    index = {c: i for i, c in enumerate(class_names)}
    unknown = [c for c in release.class_names if c not in index]
    if unknown or not release.class_names:
        raise PayloadError(f"release {release.name}: unknown or no classes {unknown}")
    cols = [index[c] for c in release.class_names]
    if release.kind == cpb.STATISTIC_KIND_POSITIVE_SUM:
        block = stats.positive_sum[cols].T
    elif release.kind == cpb.STATISTIC_KIND_FEATURE_SUM:
        block = stats.label_sum[cols].T
    elif release.kind == cpb.STATISTIC_KIND_COUNT:
        block = np.stack([stats.positive_count[cols], stats.label_count[cols]])
    else:
        raise PayloadError(f"release {release.name}: {release.kind} is not a DP statistic")
    if tuple(release.shape) != block.shape:
        raise PayloadError(f"release {release.name}: shape {list(release.shape)} != {block.shape}")
    out: FloatArray = np.ascontiguousarray(block, dtype=np.float64)
    return out


def dp_slot_payloads(
    plan: cpb.ReleasePlan,
    *,
    site_id: str,
    class_names: Sequence[str],
    stats: SufficientStatistics,
    encode: Callable[[cpb.Release, FloatArray], bytes],
) -> list[SlotPayload]:
    """One payload per DP release the site is a member of (fresh noise for each)."""
    out = []
    for release in plan.releases:
        if site_id not in release.member_site_ids:
            continue
        block = noisy_values(release, _release_block(release, stats, class_names))
        if release.kind == cpb.STATISTIC_KIND_GRAM and (
            release.encoding.packing == cpb.PACKING_UPPER_TRIANGLE
        ):
            flat = pack_upper(block)
        else:
            flat = block.ravel()
        data = encode(release, flat)
        slot = release.upload_name or release.name
        out.append(SlotPayload(slot, (release.name,), data, hashlib.sha256(data).hexdigest()))
    return out


def _min_sensitivity(release: cpb.Release, clip_norm: float) -> float:
    c_r = float(len(release.class_names))
    if release.kind == cpb.STATISTIC_KIND_GRAM:
        return clip_norm**2
    if release.kind == cpb.STATISTIC_KIND_COUNT:
        return math.sqrt(2.0 * c_r)
    return math.sqrt(c_r) * clip_norm


def site_epsilon(plan: cpb.ReleasePlan, site_id: str) -> float:
    """ε of ``site_id`` in this round, recomputed from the plan (inf without DP noise)."""
    if not plan.dp.enabled or not 0 < plan.dp.delta < 1 or not plan.dp.clip_norm > 0:
        return math.inf
    mu_sq = 0.0
    for r in plan.releases:
        if site_id not in r.member_site_ids:
            continue
        if r.noise.mechanism not in _NOISED or not r.noise.sigma > 0:
            return math.inf
        sens = max(float(r.noise.sensitivity), _min_sensitivity(r, plan.dp.clip_norm))
        mu_sq += (sens / float(r.noise.sigma)) ** 2
    return epsilon_from_mu(mu=math.sqrt(mu_sq), delta=plan.dp.delta)


def dp_report(plan: cpb.ReleasePlan, site_id: str) -> dict[str, object]:
    """The DP part of the site's round report: ε, δ claimed by the server and recomputed."""
    claimed = [b.epsilon for b in plan.budgets if b.site_id == site_id]
    return {
        "epsilon": site_epsilon(plan, site_id),
        "epsilon_server": max(claimed) if claimed else None,
        "delta": plan.dp.delta,
        "clip_norm": plan.dp.clip_norm,
        "epsilon_target": plan.dp.epsilon,
        "releases": {
            r.name: {
                "sigma": r.noise.sigma,
                "sensitivity": r.noise.sensitivity,
                "assumed_colluders": r.noise.assumed_colluders,
                "share_sigma": _share_sigma(r),  # this site's noise share σ/√(n - t)
            }
            for r in plan.releases
            if site_id in r.member_site_ids
        },
    }
