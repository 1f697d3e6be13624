"""A site's DP-mode uploads: clipped additive statistics plus its discrete Gaussian noise share
(docs/protocol.md §7; the releases and their noise are set by :mod:`afl.server.dp_plan` with the
rulebook :mod:`afl.core.dp_accounting`).

1. Clip every feature row to ``‖h‖ ≤ L`` (``plan.dp.clip_norm``) and compute the additive
   statistics G, S+_c, T_c, n+_c, N_c over the site's labelled classes
   (:func:`afl.core.dp_stats.sufficient_statistics`; non-labelled classes are zeros).
2. For each release r the site is a member of, with grid 2^-f (``noise.frac_bits``), guaranteed σ
   (``noise.sigma``) and t (``noise.assumed_colluders``), its share in grid units is
   σ_int = σ/√(n_r - t)·2^f (:func:`afl.core.dp_accounting.noise_share`). Values are rounded to
   the grid and an integer discrete Gaussian N_Z(0, σ_int²) from the OS CSPRNG
   (:func:`afl.crypto.dgauss.discrete_gaussian`) is added: x̃ = (round(x·2^f) + Z)/2^f. The Gram
   uses a full d x d noise matrix, symmetrised (2·round(G·2^f) + Z + Zᵀ)/2^(f+1) (free
   post-processing), then packed.
3. The result is sent in the round's mode encoding (PLAINTEXT: float64, exact because every
   value is an integer multiple of 2^-(f+1) below 2^52 grid steps; larger values are refused).

:func:`site_epsilon` recomputes the site's ε from the plan's noise fields, so a site never relies
on the server's arithmetic alone: μ² = Σ_{r ∋ site} (Δ_r/σ_r)² with Δ_r at least the sensitivity
implied by the declared clip norm for one row per individual (the plan does not carry m), composed
by :func:`afl.core.dp_accounting.epsilon_for_releases`.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence

import numpy as np
from numpy.typing import NDArray

from afl.client.daemon_stats import PayloadError, SlotPayload
from afl.core.dp_accounting import (
    AccountingError,
    GaussianRelease,
    StatisticKind,
    epsilon_for_releases,
    noise_share,
    statistic_sensitivity,
)
from afl.core.dp_stats import SufficientStatistics, clip_rows, sufficient_statistics
from afl.core.packing import pack_upper
from afl.crypto.dgauss import discrete_gaussian
from afl.proto.v1 import common_pb2 as cpb

__all__ = ["dp_report", "dp_slot_payloads", "dp_statistics", "noisy_values", "site_epsilon"]

FloatArray = NDArray[np.float64]
_LIMIT = float(2**52)
_NOISED = (cpb.NOISE_MECHANISM_DISCRETE_GAUSSIAN, cpb.NOISE_MECHANISM_GAUSSIAN)
_KINDS: dict[int, StatisticKind] = {
    cpb.STATISTIC_KIND_GRAM: "gram",
    cpb.STATISTIC_KIND_POSITIVE_SUM: "s_pos",
    cpb.STATISTIC_KIND_FEATURE_SUM: "t_sum",
    cpb.STATISTIC_KIND_COUNT: "counts",
}


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
    """This site's noise share σ/√(n - t) (:func:`afl.core.dp_accounting.noise_share`)."""
    n, t = len(release.member_site_ids), int(release.noise.assumed_colluders)
    try:
        return noise_share(float(release.noise.sigma), members=n, colluders=t)
    except AccountingError as exc:
        raise PayloadError(f"release {release.name}: {exc}") from exc


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
    """The release's sensitivity at the declared clip norm, one row per individual
    (:func:`afl.core.dp_accounting.statistic_sensitivity`); another class-vector kind is taken as
    a d x C_r sum of rows like ``s_pos``, and a vector release with no classes as 0."""
    kind = _KINDS.get(int(release.kind), "s_pos")
    if kind != "gram" and not release.class_names:
        return 0.0
    return statistic_sensitivity(kind, clip_norm=clip_norm, n_classes=len(release.class_names))


def site_epsilon(plan: cpb.ReleasePlan, site_id: str) -> float:
    """ε of ``site_id`` in this round, recomputed from the plan (inf without DP noise)."""
    if not plan.dp.enabled or not 0 < plan.dp.delta < 1 or not plan.dp.clip_norm > 0:
        return math.inf
    mine = []
    for r in plan.releases:
        if site_id not in r.member_site_ids:
            continue
        if r.noise.mechanism not in _NOISED or not r.noise.sigma > 0:
            return math.inf
        sens = max(float(r.noise.sensitivity), _min_sensitivity(r, plan.dp.clip_norm))
        mine.append(GaussianRelease(r.name, sens, float(r.noise.sigma)))
    return epsilon_for_releases(mine, delta=plan.dp.delta)


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
