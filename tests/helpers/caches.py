"""A site's surrogate feature cache for daemon tests: random features, and labels where every
class has positives and negatives (rows 0-1 all positive, rows 2-3 all negative)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from afl.core.data.featurecache import CacheMeta, write_cache


def write_surrogate_cache(
    folder: Path,
    *,
    site: str,
    classes: Sequence[str],
    d: int,
    rng: np.random.Generator,
    n: int = 40,
) -> None:
    labels = (rng.random((n, len(classes))) < 0.4).astype(np.int8)
    labels[:2], labels[2:4] = 1, 0
    meta = CacheMeta(n=n, d=d, classes=tuple(classes), source="test", surrogate=True)
    ids = [f"{site}-{i}" for i in range(n)]
    write_cache(folder, meta=meta, ids=ids, labels=labels, features=rng.normal(size=(n, d)))
