"""A site's DP-mode uploads: clipped additive statistics plus its discrete Gaussian noise share
(docs/protocol.md §7; the releases and their noise are set by :mod:`afl.server.plan.dp` with the
rulebook :mod:`afl.core.dp.accounting`).

0. The privacy unit (``plan.dp.unit``): for a patient-level plan the site keeps the first
   ``images_per_patient`` rows of each patient of its feature cache
   (:func:`afl.core.dp.stats.patient_rows`); a cache without patient ids cannot take part.
1. Clip every kept row to ``‖h‖ ≤ L`` (``plan.dp.clip_norm``) and compute the additive
   statistics G, S+_c, T_c, n+_c, N_c over the site's labelled classes
   (:func:`afl.core.dp.stats.sufficient_statistics`, label clipping at ``max_positive_labels``;
   non-labelled classes are zeros). Round 2 (pseudo kinds): the same statistics of the rows the
   round-1 model scores p = σ(h·w_c) > τ (pseudo-positive) or < 1 - τ (pseudo-negative), for the
   classes the site does not label (:func:`pseudo_statistics`).
2. For each release r the site is a member of, with grid 2^-f (``noise.frac_bits``), guaranteed σ
   (``noise.sigma``) and t (``noise.assumed_colluders``), its share in grid units is
   σ_int = σ/√(n_r - t)·2^f (:func:`afl.core.dp.accounting.noise_share`). Values are rounded to
   the grid and an integer discrete Gaussian N_Z(0, σ_int²) from the OS CSPRNG
   (:func:`afl.crypto.dgauss.discrete_gaussian`) is added: x̃ = (round(x·2^f) + Z)/2^f. The Gram
   uses a full d x d noise matrix, symmetrised (2·round(G·2^f) + Z + Zᵀ)/2^(f+1) (free
   post-processing), then packed.
3. The result is sent in the round's mode encoding (PLAINTEXT: float64, exact because every
   value is an integer multiple of 2^-(f+1) below 2^52 grid steps; larger values are refused;
   MASK and CKKS: encodings that keep the noise grid exactly, checked before the site accepts
   the plan by :func:`afl.client.policy.dp.plan_problems`).

The site's own accounting of a plan (μ, ε with its colluder floor, the unit rules) is the
policy's (:mod:`afl.client.policy.dp`); this module only builds what is sent.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

import numpy as np
from numpy.typing import NDArray

from afl.client.payloads.stats import PayloadError, RoundOne, SlotPayload
from afl.client.policy.dp import (
    MAX_FRAC_BITS,
    NOISED_MECHANISMS,
    images_per_patient,
    patient_level,
)
from afl.core.data.featurecache import FeatureCache
from afl.core.dp.accounting import AccountingError, base_kind, noise_share
from afl.core.dp.stats import (
    SufficientStatistics,
    clip_rows,
    label_weights,
    patient_rows,
    sufficient_statistics,
)
from afl.core.packing import pack_upper
from afl.core.refinement import pseudo_labels
from afl.crypto.dgauss import discrete_gaussian
from afl.proto.v1 import common_pb2 as cpb
from afl.proto.wire import DP_STATISTIC_NAMES

__all__ = [
    "dp_round_payloads",
    "dp_rows",
    "dp_slot_payloads",
    "dp_statistics",
    "noisy_values",
    "pseudo_statistics",
]

FloatArray = NDArray[np.float64]
_LIMIT = float(2**52)


def dp_rows(plan: cpb.ReleasePlan, *, n: int, patients: Sequence[str] | None) -> NDArray[np.int64]:
    """Step 0: the rows this site may use under the plan's unit (all of them image-level)."""
    if not patient_level(plan):
        return np.arange(n, dtype=np.int64)
    if patients is None:
        raise PayloadError(
            "the plan asks for patient-level DP but this site's feature cache has no patient ids "
            "(extract from a manifest with a 'patient' column, or NIH's Patient ID)"
        )
    return patient_rows(np.asarray(patients), cap=images_per_patient(plan))


def dp_statistics(
    features: NDArray[np.floating],
    labels: NDArray[np.integer],
    *,
    labelled: NDArray[np.bool_],
    clip_norm: float,
    max_positive_labels: int = 0,
) -> SufficientStatistics:
    """Step 1: clipped rows, additive statistics; ``labels`` (n, C) with -1 = missing."""
    h = clip_rows(np.asarray(features, dtype=np.float64), clip_norm=clip_norm)
    y = np.asarray(labels)
    mask = (y >= 0) & np.asarray(labelled, dtype=bool)[None, :]
    return sufficient_statistics(
        h, np.where(mask, y, 0), label_mask=mask, max_positive_labels=max_positive_labels
    )


def pseudo_statistics(
    features: NDArray[np.floating],
    *,
    weights: NDArray[np.float64],
    missing: NDArray[np.bool_],
    tau: float,
    clip_norm: float,
    max_positive_labels: int = 0,
    batch_size: int = 4096,
) -> SufficientStatistics:
    """Step 1 of round 2: the statistics of the pseudo-labelled rows (module docstring).

    Row i is pseudo-positive for a ``missing`` class c when σ(h_i·w_c) > τ and pseudo-negative
    when σ(h_i·w_c) < 1 - τ (h_i clipped); S+ and n+ weigh rows by the label clipping weight of
    their pseudo-positives, T and N count every pseudo-labelled row. Classes not ``missing``
    get zeros. Streamed over row blocks (the features may be memory-mapped).
    """
    d, c = weights.shape
    cols = np.flatnonzero(np.asarray(missing, dtype=bool))
    out = SufficientStatistics(
        gram=np.zeros((d, d)),
        positive_sum=np.zeros((c, d)),
        positive_count=np.zeros(c),
        label_sum=np.zeros((c, d)),
        label_count=np.zeros(c),
    )
    for start in range(0, features.shape[0], batch_size):
        h = clip_rows(
            np.asarray(features[start : start + batch_size], dtype=np.float64), clip_norm=clip_norm
        )
        pos, neg = pseudo_labels(h, weights[:, cols], tau=tau)
        labelled = pos + neg
        y = np.zeros((h.shape[0], c))
        y[:, cols] = pos * label_weights(pos, max_positive_labels=max_positive_labels)[:, None]
        lab = np.zeros((h.shape[0], c))
        lab[:, cols] = labelled
        out = out + SufficientStatistics(
            gram=np.zeros((d, d)),
            positive_sum=y.T @ h,
            positive_count=y.sum(axis=0),
            label_sum=lab.T @ h,
            label_count=lab.sum(axis=0),
        )
    return out


def _share_sigma(release: cpb.Release) -> float:
    """This site's noise share σ/√(n - t) (:func:`afl.core.dp.accounting.noise_share`)."""
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
    if f > MAX_FRAC_BITS:
        raise PayloadError(f"release {release.name}: frac_bits {f} is out of range")
    scale = float(2**f)
    sigma_int = _share_sigma(release) * scale
    if release.noise.mechanism not in NOISED_MECHANISMS:
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
    kind = DP_STATISTIC_NAMES.get(int(release.kind))
    if kind is None:
        raise PayloadError(f"release {release.name}: {release.kind} is not a DP statistic")
    base = base_kind(kind)
    if base == "gram":
        if tuple(release.shape) != (d, d):
            raise PayloadError(f"release {release.name}: shape {list(release.shape)} != {[d, d]}")
        return stats.gram
    index = {c: i for i, c in enumerate(class_names)}
    unknown = [c for c in release.class_names if c not in index]
    if unknown or not release.class_names:
        raise PayloadError(f"release {release.name}: unknown or no classes {unknown}")
    cols = [index[c] for c in release.class_names]
    if base == "s_pos":
        block = stats.positive_sum[cols].T
    elif base == "t_sum":
        block = stats.label_sum[cols].T
    else:
        block = np.stack([stats.positive_count[cols], stats.label_count[cols]])
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
    """One payload per DP release the site is a member of (fresh noise for each); ``stats``
    are the round's statistics (round 1's, or round 2's :func:`pseudo_statistics`)."""
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


def dp_round_payloads(
    plan: cpb.ReleasePlan,
    *,
    site_id: str,
    cache: FeatureCache,
    class_names: Sequence[str],
    labels: NDArray[np.int8],
    labelled: NDArray[np.bool_],
    encode: Callable[[cpb.Release, FloatArray], bytes],
    round_one: RoundOne | None = None,
) -> list[SlotPayload]:
    """Steps 0-3 for one round from the site's feature cache: the unit's rows, the round's
    statistics (round 2: of the rows the round-1 model of ``round_one`` pseudo-labels at its τ
    for the classes the site does not label, ``labelled`` False) and a noisy payload per release.
    ``labels`` (n, C_round) and ``labelled`` (C_round) are the cache's in the round's class order
    ``class_names`` (:class:`afl.client.payloads.stats.RoundClasses`)."""
    rows = dp_rows(plan, n=cache.meta.n, patients=cache.patients)
    features = np.asarray(cache.features[rows], dtype=np.float64)
    k = int(plan.dp.max_positive_labels)
    if any(r.kind == cpb.STATISTIC_KIND_PSEUDO_POSITIVE_SUM for r in plan.releases):
        if round_one is None:
            raise PayloadError("a round-2 DP plan needs the verified round-1 model")
        stats = pseudo_statistics(
            features,
            weights=np.asarray(round_one.weights, dtype=np.float64),
            missing=~np.asarray(labelled, dtype=bool),
            tau=round_one.refinement.tau,
            clip_norm=plan.dp.clip_norm,
            max_positive_labels=k,
        )
    else:
        stats = dp_statistics(
            features,
            np.asarray(labels)[rows],
            labelled=labelled,
            clip_norm=plan.dp.clip_norm,
            max_positive_labels=k,
        )
    return dp_slot_payloads(
        plan, site_id=site_id, class_names=list(class_names), stats=stats, encode=encode
    )
