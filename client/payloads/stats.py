"""The site's statistics for a round, computed once from its feature cache and kept in the
daemon's state folder (docs/architecture.md §8: a restart never re-extracts or recomputes), and the payload of
every release the site is a member of.

Round 1: ``LocalStats`` (raw Gram ``G_k = H_kᵀH_k`` and balanced ``b_{k,c}``, paper eq. 7, 11-12)
via :func:`afl.core.stats.local_statistics`. Round 2: pseudo-label projections (paper eq. 16-19)
via :func:`afl.core.refinement.pseudo_label_projection` for the classes the site does not label.

Payloads (PLAINTEXT encoding): a GRAM release carries ``G_k`` (packed upper triangle, or dense),
a CLASS_VECTOR release ``b_k[:, class_names]`` (d, C_r) row-major, a PSEUDO_CLASS_VECTOR release
``b_pseudo_k[:, class_names]``; classes the site does not contribute to are zero columns (global
scope: the sum is over all participants and non-labellers send zeros, docs/protocol.md §6).

The statistics cache key is the SHA-256 of the cache's meta.json and labels.npy, the size and
mtime of features.npy, and the labelled-class mask: a changed cache is recomputed, an unchanged one
never is.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from numpy.typing import NDArray

from afl.core.data.featurecache import FeatureCache
from afl.core.packing import pack_upper
from afl.core.refinement import PseudoStats, RefinementParams, pseudo_label_projection
from afl.core.stats import LocalStats, local_statistics
from afl.core.suggest import unknown_names
from afl.crypto.identity.pki import make_private_dir, write_private_file
from afl.proto.v1 import common_pb2 as cpb

__all__ = [
    "PayloadError",
    "RoundClasses",
    "RoundOne",
    "SlotPayload",
    "cache_fingerprint",
    "dump_json",
    "encode_float64",
    "encode_slots",
    "labelled_mask",
    "load_or_compute_pseudo",
    "load_or_compute_stats",
    "release_values",
    "round_classes",
    "slot_payloads",
]


class PayloadError(ValueError):
    """A release cannot be filled from this site's statistics (bad shape, unknown class...)."""


@dataclass(frozen=True)
class SlotPayload:
    """What goes into one upload slot: the encoded bytes and the releases they feed."""

    slot: str
    releases: tuple[str, ...]
    payload: bytes
    sha256: str


def cache_fingerprint(cache: FeatureCache, *, active: NDArray[np.bool_], extra: str = "") -> str:
    """Key of the statistics computed from ``cache`` (see the module docstring)."""
    h = hashlib.sha256()
    for name in ("meta.json", "labels.npy", "ids.txt"):
        h.update(hashlib.sha256((cache.root / name).read_bytes()).digest())
    st = os.stat(cache.root / "features.npy")
    h.update(f"{st.st_size}:{st.st_mtime_ns}:{cache.rows_done}".encode())
    h.update(np.asarray(active, dtype=np.uint8).tobytes())
    h.update(extra.encode())
    return h.hexdigest()


def _atomic_save(path: Path, arrays: Mapping[str, NDArray[np.generic]]) -> None:
    """The site's statistics (as sensitive as its features): folders 0700, file 0600, atomic."""
    make_private_dir(path.parent)
    tmp = path.with_name(path.name + ".tmp.npz")
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as handle:
        np.savez(handle, **arrays)  # type: ignore[arg-type]
    os.replace(tmp, path)


def load_or_compute_stats(
    cache: FeatureCache, *, active: NDArray[np.bool_], state_dir: Path
) -> tuple[LocalStats, bool]:
    """Round-1 statistics; returns (stats, True if read back from ``state_dir``)."""
    key = cache_fingerprint(cache, active=active)
    path = state_dir / "stats" / f"local-{key[:32]}.npz"
    if path.exists():
        with np.load(path, allow_pickle=False) as z:
            stats = LocalStats(
                n=int(z["n"]),
                gram=np.asarray(z["gram"], dtype=np.float64),
                b=np.asarray(z["b"], dtype=np.float64),
                contributes=np.asarray(z["contributes"], dtype=bool),
                n_pos=np.asarray(z["n_pos"], dtype=np.int64),
                n_neg=np.asarray(z["n_neg"], dtype=np.int64),
                skipped=tuple(str(s) for s in z["skipped"]),
            )
        return stats, True
    stats = local_statistics(cache.features, cache.labels, active=active)
    _atomic_save(
        path,
        {
            "n": np.asarray(stats.n),
            "gram": stats.gram,
            "b": stats.b,
            "contributes": stats.contributes,
            "n_pos": stats.n_pos,
            "n_neg": stats.n_neg,
            "skipped": np.asarray(list(stats.skipped), dtype=str),
        },
    )
    return stats, False


def load_or_compute_pseudo(
    cache: FeatureCache,
    *,
    weights: NDArray[np.float64],
    missing: NDArray[np.bool_],
    params: RefinementParams,
    state_dir: Path,
) -> tuple[PseudoStats, bool]:
    """Round-2 pseudo-label projections (eq. 16-19) for the ``missing`` classes, cached."""
    extra = hashlib.sha256(np.ascontiguousarray(weights, dtype="<f8").tobytes()).hexdigest()
    extra += repr((params.tau, params.alpha, params.delta_pos, params.delta_neg))
    key = cache_fingerprint(cache, active=missing, extra=extra)
    path = state_dir / "stats" / f"pseudo-{key[:32]}.npz"
    if path.exists():
        with np.load(path, allow_pickle=False) as z:
            pseudo = PseudoStats(
                b=np.asarray(z["b"], dtype=np.float64),
                contributes=np.asarray(z["contributes"], dtype=bool),
                n_pseudo_pos=np.asarray(z["n_pp"], dtype=np.int64),
                n_pseudo_neg=np.asarray(z["n_pn"], dtype=np.int64),
            )
        return pseudo, True
    pseudo = pseudo_label_projection(
        cache.features, weights=weights, missing=missing, params=params
    )
    _atomic_save(
        path,
        {
            "b": pseudo.b,
            "contributes": pseudo.contributes,
            "n_pp": pseudo.n_pseudo_pos,
            "n_pn": pseudo.n_pseudo_neg,
        },
    )
    return pseudo, False


def release_values(
    release: cpb.Release,
    *,
    class_names: Sequence[str],
    stats: LocalStats,
    pseudo: PseudoStats | None,
) -> NDArray[np.float64]:
    """The site's contribution to ``release`` as a flat float64 vector (packing applied)."""
    d = stats.d
    if release.kind == cpb.STATISTIC_KIND_GRAM:
        if tuple(release.shape) != (d, d):
            raise PayloadError(
                f"release {release.name}: Gram shape {list(release.shape)} != {[d, d]}"
            )
        if release.encoding.packing == cpb.PACKING_UPPER_TRIANGLE:
            return pack_upper(stats.gram)
        if release.encoding.packing == cpb.PACKING_DENSE:
            return np.ascontiguousarray(stats.gram, dtype=np.float64).ravel()
        raise PayloadError(
            f"release {release.name}: unsupported packing {release.encoding.packing}"
        )
    if release.kind == cpb.STATISTIC_KIND_CLASS_VECTOR:
        source = stats.b
    elif release.kind == cpb.STATISTIC_KIND_PSEUDO_CLASS_VECTOR:
        if pseudo is None:
            raise PayloadError(f"release {release.name}: pseudo-label statistics need round 2")
        source = pseudo.b
    else:
        kind = cpb.StatisticKind.Name(release.kind)
        raise PayloadError(f"release {release.name}: statistic {kind} is not supported")
    index = {c: i for i, c in enumerate(class_names)}
    unknown = [c for c in release.class_names if c not in index]
    if unknown or not release.class_names:
        raise PayloadError(f"release {release.name}: unknown or no classes {unknown}")
    want = (d, len(release.class_names))
    if tuple(release.shape) != want:
        raise PayloadError(f"release {release.name}: shape {list(release.shape)} != {list(want)}")
    if release.encoding.packing not in (cpb.PACKING_DENSE, cpb.PACKING_UNSPECIFIED):
        raise PayloadError(f"release {release.name}: class vectors must be dense")
    cols = [index[c] for c in release.class_names]
    return np.ascontiguousarray(source[:, cols], dtype=np.float64).ravel()


def encode_float64(values: NDArray[np.float64]) -> bytes:
    """Little-endian IEEE-754 binary64 bytes (PLAINTEXT wire format); refuses NaN/inf."""
    if not np.isfinite(values).all():
        raise PayloadError("statistics contain NaN or inf")
    return np.ascontiguousarray(values, dtype="<f8").tobytes()


def slot_payloads(
    plan: cpb.ReleasePlan,
    *,
    site_id: str,
    class_names: Sequence[str],
    stats: LocalStats,
    pseudo: PseudoStats | None,
    encode: Callable[[cpb.Release, NDArray[np.float64]], bytes],
) -> list[SlotPayload]:
    """One payload per upload slot the site feeds, encoded by the round's mode (``encode``);
    releases sharing a slot must agree on its payload."""
    return encode_slots(
        (
            (r, release_values(r, class_names=class_names, stats=stats, pseudo=pseudo))
            for r in plan.releases
            if site_id in r.member_site_ids
        ),
        encode=encode,
    )


def encode_slots(
    items: Iterable[tuple[cpb.Release, NDArray[np.float64]]],
    *,
    encode: Callable[[cpb.Release, NDArray[np.float64]], bytes],
) -> list[SlotPayload]:
    """Encode each (release, values) and group them by upload slot; releases sharing a slot
    must agree on its payload."""
    slots: dict[str, tuple[list[str], bytes]] = {}
    for release, values in items:
        data = encode(release, values)
        slot = release.upload_name or release.name
        if slot in slots:
            names, existing = slots[slot]
            if existing != data:
                raise PayloadError(
                    f"releases {names[0]} and {release.name} share upload slot {slot} but need "
                    "different payloads; the plan is inconsistent"
                )
            names.append(release.name)
        else:
            slots[slot] = ([release.name], data)
    return [
        SlotPayload(slot, tuple(names), data, hashlib.sha256(data).hexdigest())
        for slot, (names, data) in slots.items()
    ]


def labelled_mask(
    cache: FeatureCache, classes: Sequence[str]
) -> tuple[NDArray[np.bool_], list[str]]:
    """Mask of the configured labelled classes (``[]`` = every fully labelled column).

    Raises :class:`PayloadError` if a configured class is not in the cache or has -1 labels.
    """
    names = list(cache.meta.classes)
    if not classes:
        mask = (cache.labels >= 0).all(axis=0) if cache.meta.n else np.zeros(len(names), bool)
        return np.asarray(mask, dtype=bool), [names[i] for i in np.flatnonzero(mask)]
    unknown = [c for c in classes if c not in names]
    if unknown:
        raise PayloadError(
            f"[data] classes {unknown_names(unknown, names)} are not columns of the cache "
            f"{cache.root}: its classes are {names}"
        )
    mask = np.isin(names, list(classes))
    partial = [names[i] for i in np.flatnonzero(mask) if (cache.labels[:, i] < 0).any()]
    if partial:
        raise PayloadError(f"[data] classes {partial} have unlabelled (-1) rows in the cache")
    return mask, [c for c in names if c in classes]


@dataclass(frozen=True, kw_only=True)
class RoundOne:
    """What a round 2 computes its pseudo-labels from: round 1's verified W and the round's
    refinement parameters (τ, α, δ)."""

    weights: NDArray[np.float64]
    refinement: RefinementParams


@dataclass(frozen=True)
class RoundClasses:
    """This site's statistics in a round's class order (the round's classes may be any superset
    or subset of the cache's): a class the cache does not hold, or the site does not label, has a
    zero column and does not contribute (global scope: the site sends zeros for it; per-class:
    the plan does not make it a member, docs/protocol.md §6)."""

    stats: LocalStats
    labelled: NDArray[np.bool_]  # over the round's classes
    columns: tuple[int | None, ...]  # cache column of each round class (None: not in the cache)
    note: str  # one line explaining a class-list mismatch ("" when the lists agree)

    def labels(self, labels: NDArray[np.int8]) -> NDArray[np.int8]:
        """The cache's (n, C_cache) labels as (n, C_round); -1 (not labelled) for absent classes."""
        out = np.full((labels.shape[0], len(self.columns)), -1, dtype=np.int8)
        for j, col in enumerate(self.columns):
            if col is not None:
                out[:, j] = labels[:, col]
        return out


def round_classes(
    stats: LocalStats,
    *,
    cache_classes: Sequence[str],
    labelled: NDArray[np.bool_],
    round_classes: Sequence[str],
) -> RoundClasses:
    """:class:`RoundClasses` of ``stats`` (over ``cache_classes``) for ``round_classes``."""
    index = {c: i for i, c in enumerate(cache_classes)}
    columns = tuple(index.get(c) for c in round_classes)
    c_round = len(round_classes)
    b = np.zeros((stats.d, c_round), dtype=np.float64)
    contributes = np.zeros(c_round, dtype=bool)
    n_pos = np.zeros(c_round, dtype=np.int64)
    n_neg = np.zeros(c_round, dtype=np.int64)
    mine = np.zeros(c_round, dtype=bool)
    for j, col in enumerate(columns):
        if col is not None:
            b[:, j] = stats.b[:, col]
            contributes[j], n_pos[j], n_neg[j] = (
                stats.contributes[col],
                stats.n_pos[col],
                stats.n_neg[col],
            )
            mine[j] = labelled[col]
    view = replace(stats, b=b, contributes=contributes, n_pos=n_pos, n_neg=n_neg)
    return RoundClasses(
        view, mine, columns, _mismatch(cache_classes, labelled, round_classes, mine)
    )


def _mismatch(
    cache_classes: Sequence[str],
    labelled: NDArray[np.bool_],
    round_classes: Sequence[str],
    mine: NDArray[np.bool_],
) -> str:
    absent = [c for c, on in zip(round_classes, mine, strict=True) if not on]
    unused = [
        c for c, on in zip(cache_classes, labelled, strict=True) if on and c not in round_classes
    ]
    if not absent and not unused:
        return ""
    text = f"this site labels {int(mine.sum())} of the round's {len(round_classes)} classes"
    if absent:
        text += f"; it contributes nothing for {absent} (zeros, or no release, per the plan)"
    if unused:
        text += f"; labelled cache classes the round does not use: {unknown_names(unused, round_classes)}"
    return text


def dump_json(path: Path, document: Mapping[str, object]) -> None:
    """Write JSON atomically (reports, history), mode 0600 in a 0700 folder."""
    make_private_dir(path.parent)
    text = json.dumps(document, indent=2, sort_keys=True)
    write_private_file(path, text.encode("utf-8"))
