"""A small synthetic federation for the afl.lab tests (simulate, report, bench privacy)."""

from __future__ import annotations

import numpy as np

from afl.lab.simulate.dataset import FederatedDataset

CLASSES = ("a", "b", "c", "d")


def small_federation(seed: int = 0, *, sites: int = 4, d: int = 16) -> FederatedDataset:
    """``sites`` sites of 150-249 rows and a 400-row test set; features carry class signal."""
    rng = np.random.default_rng(seed)
    directions = rng.normal(size=(len(CLASSES), d))

    def draw(n: int, shift: float) -> tuple[np.ndarray, np.ndarray]:
        labels = (rng.random((n, len(CLASSES))) < 0.25).astype(np.int8)
        feats = np.abs(rng.normal(size=(n, d)) + labels @ directions + shift)
        return feats.astype(np.float32), labels

    site_data = [draw(int(rng.integers(150, 250)), 0.1 * k) for k in range(sites)]
    test_f, test_l = draw(400, 0.0)
    return FederatedDataset(
        classes=CLASSES,
        site_names=tuple(f"s{k}" for k in range(sites)),
        site_features=tuple(f for f, _ in site_data),
        site_labels=tuple(y for _, y in site_data),
        test_features=test_f,
        test_labels=test_l,
        provenance="synthetic test data",
        surrogate=True,
    )
