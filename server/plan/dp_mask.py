"""Fixed-point encodings of a DP plan in MASK mode (docs/protocol.md §5 and §7).

In DP mode a site uploads clipped additive statistics plus its discrete Gaussian noise share
(:mod:`afl.client.payloads.dp`), so the declared MASK bounds of balanced class vectors do not
apply. With N = ``mask_max_samples`` (rows per site), L = ``clip_norm`` and the share's standard
deviation σ_s = σ_r/√(n_r - t_r) of release r (:func:`afl.core.dp.accounting.noise_share`), one
site's values satisfy, with probability ≥ 1 - 10^-15 per coordinate (|Z| ≤ 8σ_s):

    |G_ij| ≤ N·L² + 8σ_s + 2^-f_n,  |S+|, |T| ≤ N·L + 8σ_s + 2^-f_n,  |n+|, |N| ≤ N + 8σ_s + 2^-f_n

(2^-f_n: rounding to the noise grid; the same for the pseudo-label statistics of round 2; the
CKKS encodings of a DP plan use the same bounds, :mod:`afl.server.plan.dp_ckks`). A value beyond its
bound is refused by the site (never clipped), so the round fails rather than leaks. Every value lies on the grid 2^-(f_n+1) (the
Gram is symmetrised as (2G + Z + Zᵀ)/2^(f_n+1)), so the encoding is exact iff its fractional
bits f ≥ f_n + 1; f is the most bits with m_r·B_r·2^f < 2^63 and a plan where that is below
f_n + 1 is refused with :class:`ValueError`.

The release threshold becomes t_R = max(t_R, n_r - t_r): a sum over fewer surviving members
than n_r - t_r would carry less noise than σ_r even with no colluder, so it is never unmasked.
"""

from __future__ import annotations

from afl.core.dp.accounting import AccountingError, noise_share
from afl.crypto.errors import CryptoError
from afl.crypto.secagg.config import ReleaseSpec
from afl.proto.v1 import common_pb2 as cpb

__all__ = ["NOISE_TAIL", "dp_mask_bound", "dp_mask_encodings"]

#: Noise standard deviations covered by a bound (P(|Z| > 8σ) ≈ 1.2e-15 per coordinate).
NOISE_TAIL = 8.0
_SUMS = (
    cpb.STATISTIC_KIND_POSITIVE_SUM,
    cpb.STATISTIC_KIND_FEATURE_SUM,
    cpb.STATISTIC_KIND_PSEUDO_POSITIVE_SUM,
    cpb.STATISTIC_KIND_PSEUDO_FEATURE_SUM,
)
_COUNTS = (
    cpb.STATISTIC_KIND_COUNT,
    cpb.STATISTIC_KIND_PSEUDO_COUNT,
    cpb.STATISTIC_KIND_SCORE_HISTOGRAM,  # an evaluation round's counts (|count| <= N)
    cpb.STATISTIC_KIND_CONFUSION_COUNTS,
)


def dp_mask_bound(release: cpb.Release, *, max_samples: int, clip_norm: float) -> float:
    """B_r of one DP release (module docstring); ``release.noise`` must be set."""
    n, t = len(release.member_site_ids), int(release.noise.assumed_colluders)
    try:
        share = noise_share(float(release.noise.sigma), members=n, colluders=t)
    except AccountingError as exc:
        raise ValueError(f"release {release.name}: {exc}") from exc
    noise = NOISE_TAIL * share + 2.0 ** -int(release.noise.frac_bits)
    if release.kind == cpb.STATISTIC_KIND_GRAM:
        return max_samples * clip_norm**2 + noise
    if release.kind in _SUMS:
        return max_samples * clip_norm + noise
    if release.kind in _COUNTS:
        return float(max_samples) + noise
    raise ValueError(f"release {release.name}: kind {release.kind} is not a DP statistic")


def dp_mask_encodings(plan: cpb.ReleasePlan, *, max_samples: int) -> None:
    """Rewrite every release's fixed-point bound, f and t_R in a DP MASK ``plan`` (after
    :func:`afl.server.plan.dp.apply_dp`); ValueError when the grid does not fit Z_2^64."""
    if not plan.dp.enabled or max_samples < 1:
        raise ValueError("DP MASK encodings need a DP plan and mask_max_samples >= 1")
    for release in plan.releases:
        fp = release.encoding.fixed_point
        bound = dp_mask_bound(release, max_samples=max_samples, clip_norm=plan.dp.clip_norm)
        n = len(release.member_site_ids)
        floor = n - int(release.noise.assumed_colluders)
        threshold = max(int(fp.min_survivors), floor)
        try:
            spec = ReleaseSpec(
                name=release.name,
                members=tuple(release.member_site_ids),
                length=1,
                bound=bound,
                threshold=threshold,
            )
        except CryptoError as exc:
            raise ValueError(f"release {release.name}: {exc}") from exc
        need = int(release.noise.frac_bits) + 1
        frac = spec.codec().frac_bits
        if frac < need:
            raise ValueError(
                f"release {release.name}: the mask encoding has {frac} fractional bits for "
                f"bound {bound:.6g}, fewer than the noise grid needs ({need}); use a smaller "
                "epsilon or fewer mask_max_samples"
            )
        fp.bound, fp.frac_bits, fp.min_survivors = bound, frac, spec.min_survivors
