"""CKKS encodings of a DP plan (docs/protocol.md §4.3 and §7).

In DP mode the sites add their discrete Gaussian noise shares BEFORE encrypting (the distributed
noise of the mask mode, :mod:`afl.client.payloads.dp`), so what the decryptor releases is already
noised. Every noisy value lies on the half noise grid 2^-(f_n+1) (f_n = ``noise.frac_bits``; the
Gram is symmetrised as (2G + Z + Zᵀ)/2^(f_n+1)), and so does every sum. The plan makes the
decryptor's grid exactly that step, g = 2^-(f_n+1), with a pre-scale s fine enough that the CKKS
error is below half a step: with B_r the per-site bound of the mask mode
(:func:`afl.server.plan.dp_mask.dp_mask_bound`: N·L², N·L or N plus 8 share standard deviations and a
grid step, N = ``[round.dp] max_samples``) and K = n_r members,

    s = choose_prescale(B_r, K)  and  2·min_grid(s, K) ≤ g      (:mod:`afl.crypto.ckks.params`)

so the decrypted value y/s = S̃ + e with |e| ≤ min_grid < g/2 rounds to the exact noisy sum S̃:
the release is a function of S̃ alone (post-processing of the DP sum; the CKKS noise and the
encoding rounding of single sites never reach the output), and g ≥ min_grid still hides the CKKS
noise from the coordinator (Li–Micciancio). A plan where no pre-scale resolves the noise grid
(a large ε, a large N·L²) is refused with :class:`ValueError`.
"""

from __future__ import annotations

from afl.crypto.ckks import params as cp
from afl.crypto.errors import CryptoError
from afl.proto.v1 import common_pb2 as cpb
from afl.server.plan.dp_mask import dp_mask_bound

__all__ = ["dp_ckks_encoding", "dp_ckks_encodings"]


def dp_ckks_encoding(
    release: cpb.Release, *, max_samples: int, clip_norm: float
) -> cpb.CkksEncoding:
    """Pre-scale and grid of one DP release (module docstring); ValueError when none fits."""
    bound = dp_mask_bound(release, max_samples=max_samples, clip_norm=clip_norm)
    members = len(release.member_site_ids)
    grid = 2.0 ** -(int(release.noise.frac_bits) + 1)
    try:
        prescale = cp.choose_prescale(bound=bound, num_summands=members)
        finest = cp.min_grid(prescale=prescale, num_summands=members)
    except CryptoError as exc:
        raise ValueError(f"release {release.name}: {exc}") from exc
    if not 2.0 * finest <= grid:
        raise ValueError(
            f"release {release.name}: the CKKS pre-scale for bound {bound:.6g} resolves steps of "
            f"{2.0 * finest:.3g}, coarser than the noise grid {grid:.3g}; use a smaller epsilon or "
            "a smaller max_samples"
        )
    return cpb.CkksEncoding(prescale=prescale, grid_step=grid)


def dp_ckks_encodings(plan: cpb.ReleasePlan, *, max_samples: int) -> None:
    """Rewrite every release's CKKS pre-scale and grid in a DP CKKS ``plan`` (after
    :func:`afl.server.plan.dp.apply_dp`); ValueError when the noise grid does not fit."""
    if not plan.dp.enabled or max_samples < 1:
        raise ValueError("DP CKKS encodings need a DP plan and [round.dp] max_samples >= 1")
    for release in plan.releases:
        release.encoding.ckks.CopyFrom(
            dp_ckks_encoding(release, max_samples=max_samples, clip_norm=plan.dp.clip_norm)
        )
