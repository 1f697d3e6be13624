"""Numerical comparisons shared by the tests that check a federated W against an oracle."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
from numpy.typing import NDArray

from afl.core.data.featurecache import open_cache


def relative_error(a: NDArray[np.float64], b: NDArray[np.float64]) -> float:
    """‖a - b‖ / ‖b‖ in the Frobenius (vector 2-) norm: ``b`` is the reference."""
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def pooled_ridge(
    caches: Iterable[Path], *, classes: Sequence[str], gamma: float
) -> NDArray[np.float64]:
    """The `global`-scope model from the sites' feature caches, in numpy:
    W = (Σ_k H_kᵀH_k + γI)⁻¹ Σ_{k labels c} H_kᵀ y_{k,c}, y = +1/N⁺ or −1/N⁻ (paper eq. 7); a site
    contributes to the classes its cache labels."""
    opened = [open_cache(path) for path in caches]
    d = opened[0].meta.d
    gram = gamma * np.eye(d)
    b = np.zeros((d, len(classes)))
    for cache in opened:
        h = np.asarray(cache.features, dtype=np.float64)
        gram += h.T @ h
        for j, name in enumerate(classes):
            if name not in cache.meta.classes:
                continue
            y = cache.labels[:, cache.meta.classes.index(name)]
            target = np.where(y == 1, 1.0 / (y == 1).sum(), -1.0 / (y == 0).sum())
            b[:, j] += h.T @ target
    return np.asarray(np.linalg.solve(gram, b), dtype=np.float64)
