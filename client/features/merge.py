"""Merge shard caches of one site into a single cache in source order (docs/operations.md).

Each shard holds whole global batches (``afl.client.features.shards``), so the merged features are
byte-identical to those of a single run with the same batch size, and any statistic that is a sum
over rows (``G = Σ_i h_i h_iᵀ``, ``b = Σ_i h_i y_i``, docs/method.md §1) is the sum of the shards'
statistics. Shards must come from the same data list, backbone, weights and options.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from afl.client.features.shards import (
    ShardError,
    Unreadable,
    kept_rows,
    plan_batches,
    read_unreadable,
    write_unreadable,
)
from afl.core.data.featurecache import CacheMeta, FeatureCache, FeatureCacheWriter, open_cache

# Settings every shard must share; per-machine keys (device_type, channels_last, data path) are
# kept in the merged meta only where all shards agree.
_SHARED = (
    "backbone",
    "weights_sha256",
    "preprocess",
    "data_fingerprint",
    "source_n",
    "batch_size",
    "shard_mode",
    "bf16",
)
_PER_MACHINE = ("device_type", "channels_last", "data")


def _source_rows(cache: FeatureCache, unreadable: list[Unreadable]) -> list[int]:
    extra = cache.meta.extra
    index, count = extra["shard"]
    batches = plan_batches(
        int(extra["source_n"]),
        batch_size=int(extra["batch_size"]),
        shard=(int(index), int(count)),
        mode=str(extra["shard_mode"]),
    )
    rows = kept_rows(batches, unreadable)
    if len(rows) != cache.meta.n:
        raise ShardError(f"{cache.root}: {cache.meta.n} rows, its shard plan gives {len(rows)}")
    return rows


def merge_shards(
    shard_dirs: Sequence[str | os.PathLike[str]], out: str | os.PathLike[str]
) -> FeatureCache:
    """Merge complete shard caches ``i/n`` (all n of them, any order) into the cache ``out``."""
    if not shard_dirs:
        raise ShardError("no shard caches given")
    caches = [open_cache(d) for d in shard_dirs]
    first = caches[0].meta
    for c in caches:
        if "shard" not in c.meta.extra:
            raise ShardError(f"{c.root} is not an afl-client extraction cache")
        same = (c.meta.source, c.meta.classes, c.meta.random_init, c.meta.d) == (
            first.source,
            first.classes,
            first.random_init,
            first.d,
        )
        diff = [k for k in _SHARED if c.meta.extra.get(k) != first.extra.get(k)]
        if not same or diff:
            raise ShardError(f"{c.root} is not a shard of the same extraction (differs: {diff})")
    count = int(first.extra["shard"][1])
    got = sorted(int(c.meta.extra["shard"][0]) for c in caches)
    if [int(c.meta.extra["shard"][1]) for c in caches] != [count] * len(caches) or got != list(
        range(count)
    ):
        raise ShardError(f"need each shard 0..{count - 1} exactly once, got indices {got}")
    bad = [read_unreadable(c.root) for c in caches]
    rows = [_source_rows(c, u) for c, u in zip(caches, bad, strict=True)]
    order = sorted((r, s, p) for s, rr in enumerate(rows) for p, r in enumerate(rr))
    extra: dict[str, Any] = {k: first.extra.get(k) for k in _SHARED}
    for key in _PER_MACHINE:
        values = {repr(c.meta.extra.get(key)) for c in caches}
        if len(values) == 1:
            extra[key] = first.extra.get(key)
    unreadable = [u for items in bad for u in items]
    extra.update(shard=[0, 1], n_unreadable=len(unreadable), merged_from=count)
    meta = CacheMeta(
        n=len(order),
        d=first.d,
        classes=first.classes,
        source=first.source,
        random_init=first.random_init,
        surrogate=first.surrogate,
        extra=extra,
    )
    ids = [caches[s].ids[p] for _, s, p in order]
    patients = None
    if all(c.patients is not None for c in caches):
        patients = [(caches[s].patients or ())[p] for _, s, p in order]
    labels = np.stack([caches[s].labels[p] for _, s, p in order]) if order else None
    if labels is None:
        labels = np.zeros((0, len(first.classes)), dtype=np.int8)
    target = Path(out)
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    writer = FeatureCacheWriter.create_or_resume(
        tmp, meta=meta, ids=ids, labels=labels, patients=patients
    )
    shard_of = np.array([s for _, s, _ in order], dtype=np.int64)
    pos_of = np.array([p for _, _, p in order], dtype=np.int64)
    for start in range(0, len(order), 8192):
        sl = slice(start, start + 8192)
        block = np.empty((len(shard_of[sl]), first.d), dtype=np.float32)
        for s, cache in enumerate(caches):
            mask = shard_of[sl] == s
            if mask.any():
                block[mask] = cache.features[pos_of[sl][mask]]
        writer.write_rows(start, block)
    write_unreadable(tmp, unreadable)
    os.replace(tmp, target)
    return open_cache(target)
