"""Shared by the loopback end-to-end tests: synthetic site data with class signal, and the local
statistics of the caches a loopback federation wrote (the in-process oracle's input)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from afl.core.data.featurecache import FeatureCache, open_cache
from afl.core.stats import LocalStats, local_statistics
from afl.lab.demo.federation import LoopbackFederation


@dataclass(frozen=True)
class SiteData:
    """Blocks of rows whose features carry class signal: block k has ``rows + rows_step·k`` rows,
    labels ~ Bernoulli(``positive_rate``) per class, features N(0, I) + ``signal``·(y @ D) + 0.3·k
    with one random direction D[c] per class (so round 2 finds confident pseudo-labels)."""

    d: int
    classes: int
    rows: int
    rows_step: int
    positive_rate: float
    seed: int
    signal: float = 1.0

    def draw(self, blocks: int) -> tuple[list[NDArray[np.float32]], list[NDArray[np.int8]]]:
        """``blocks`` (features, labels) blocks, the same for the same spec."""
        rng = np.random.default_rng(self.seed)
        directions = rng.normal(size=(self.classes, self.d))
        feats, labels = [], []
        for k in range(blocks):
            n = self.rows + self.rows_step * k
            y = (rng.random((n, self.classes)) < self.positive_rate).astype(np.int8)
            h = rng.normal(size=(n, self.d)) + self.signal * (y @ directions) + 0.3 * k
            feats.append(h.astype(np.float32))
            labels.append(y)
        return feats, labels


def cached_statistics(
    loop: LoopbackFederation, sites: Sequence[str]
) -> tuple[list[LocalStats], list[FeatureCache]]:
    """Each site's local statistics over the classes it labels, from the cache it ran on."""
    stats, caches = [], []
    for site in sites:
        cache = open_cache(loop.root / "data" / site)
        stats.append(
            local_statistics(cache.features, cache.labels, active=np.all(cache.labels >= 0, axis=0))
        )
        caches.append(cache)
    return stats, caches
