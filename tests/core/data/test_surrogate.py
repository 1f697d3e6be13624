"""Surrogate features (docs/method.md §2): determinism, shape, scale, signal and the tuning
target."""

from __future__ import annotations

import numpy as np
import pytest
from numpy.typing import NDArray
from sklearn.metrics import roc_auc_score

from afl.core.data import nih
from afl.core.data import surrogate as sg


def balanced_ridge_auc(
    h: NDArray[np.float32], y: NDArray[np.int8], train: NDArray[np.int64], test: NDArray[np.int64]
) -> NDArray[np.float64]:
    """Central balanced ridge head (gamma = 1, eq. 7 targets) -> per-class test AUC."""
    htr = h[train].astype(np.float64)
    pos = y[train].sum(axis=0)
    targets = np.where(y[train] == 1, 1.0 / pos, -1.0 / (len(train) - pos))
    w = np.linalg.solve(htr.T @ htr + np.eye(h.shape[1]), htr.T @ targets)
    scores = h[test].astype(np.float64) @ w
    return np.array([roc_auc_score(y[test, c], scores[:, c]) for c in range(y.shape[1])])


def small(pa: nih.NihLabels, n: int = 3000) -> tuple[NDArray[np.int8], NDArray[np.int64]]:
    return pa.labels[:n], np.arange(n, dtype=np.int64) % 8


def test_shape_dtype_scale_nonnegative(pa: nih.NihLabels) -> None:
    y, site = small(pa)
    h = sg.surrogate_features(labels=y, site=site, d=1024, seed=0, classes=pa.classes)
    assert h.shape == (3000, 1024) and h.dtype == np.float32
    assert np.isfinite(h).all() and (h >= 0).all()
    assert 0.05 < float(h.mean()) < 1.0 and float(h.max()) < 10.0  # O(0.1-1), like features2
    assert sg.SURROGATE_LABEL == "surrogate"


def test_deterministic_block_and_prefix_independent(pa: nih.NihLabels) -> None:
    y, site = small(pa, 5000)
    a = sg.surrogate_features(labels=y, site=site, d=64, seed=3)
    b = sg.surrogate_features(labels=y, site=site, d=64, seed=3, block_rows=1)
    assert np.array_equal(a, b)
    prefix = sg.surrogate_features(labels=y[:2500], site=site[:2500], d=64, seed=3)
    assert np.array_equal(a[:2500], prefix)
    blocks = list(sg.iter_surrogate_blocks(labels=y, site=site, d=64, seed=3, block_rows=3000))
    assert [s for s, _ in blocks] == [0, 4096]  # rounded up to whole chunks
    assert np.array_equal(np.concatenate([blk for _, blk in blocks]), a)
    other = sg.surrogate_features(labels=y, site=site, d=64, seed=4)
    assert not np.allclose(a, other)


def test_small_scale_signal(pa: nih.NihLabels) -> None:
    n = 6000
    y, site = small(pa, n)
    train, test = nih.split_train_test(n, seed=2023)
    h = sg.surrogate_features(labels=y, site=site, d=256, seed=0, classes=pa.classes)
    auc = balanced_ridge_auc(h, y, train, test)
    assert 0.65 < auc.mean() < 0.85
    flat = sg.surrogate_features(labels=y, site=site, d=256, seed=0, latent_auc=[0.5] * 8)
    chance = balanced_ridge_auc(flat, y, train, test)
    assert abs(chance.mean() - 0.5) < 0.06  # no class signal -> chance level


def test_site_shift_is_non_iid(pa: nih.NihLabels) -> None:
    y, site = small(pa, 4096)

    def spread(cfg: sg.SurrogateConfig) -> float:
        h = sg.surrogate_features(labels=y, site=site, d=128, seed=0, config=cfg)
        means = np.stack([h[site == k].mean(axis=0) for k in range(8)])
        return float(np.linalg.norm(means - means.mean(axis=0), axis=1).mean())

    assert spread(sg.SurrogateConfig()) > 3 * spread(sg.SurrogateConfig(site_shift=0.0))
    neutral = sg.surrogate_features(labels=y, site=np.full(4096, -1), d=128, seed=0)
    unshifted = sg.surrogate_features(
        labels=y, site=site, d=128, seed=0, config=sg.SurrogateConfig(site_shift=0.0)
    )
    assert np.array_equal(neutral, unshifted)  # site -1 = no shift


def test_class_separations() -> None:
    delta = sg.class_separations(num_classes=2, classes=["Cardiomegaly", "Infiltration"], gain=1.0)
    assert delta[0] > delta[1] > 0
    np.testing.assert_allclose(
        sg.class_separations(num_classes=1, latent_auc=[0.5]), [0.0], atol=1e-12
    )
    with pytest.raises(sg.SurrogateError, match="3 class"):
        sg.class_separations(num_classes=2, latent_auc=[0.7, 0.7, 0.7])


@pytest.mark.parametrize(
    ("labels", "site", "msg"),
    [
        (np.array([[1, -1]]), np.array([0]), "complete 0/1"),
        (np.array([1, 0]), np.array([0, 0]), r"\(N, C\)"),
        (np.array([[1, 0]]), np.array([0, 1]), "site must be"),
        (np.array([[1, 0]]), np.array([-2]), ">= 0"),
    ],
)
def test_bad_inputs(labels: NDArray[np.int64], site: NDArray[np.int64], msg: str) -> None:
    with pytest.raises(sg.SurrogateError, match=msg):
        sg.surrogate_features(labels=labels, site=site, d=8)


@pytest.mark.slow
def test_full_scale_tuning_target(pa: nih.NihLabels) -> None:
    """Design §4: central balanced ridge on the 7:3 image split, macro AUC in [0.75, 0.85]."""
    train, test = nih.split_train_test(pa, mode="image", seed=2023)
    site = np.full(pa.n, -1, dtype=np.int64)  # the central test set carries no site shift
    for k, part in enumerate(nih.iid_partition(len(train), num_clients=8, seed=1037)):
        site[train[part]] = k
    h = sg.surrogate_features(labels=pa.labels, site=site, d=1024, seed=0, classes=pa.classes)
    auc = balanced_ridge_auc(h, pa.labels, train, test)
    print("per-class AUC", dict(zip(pa.classes, auc.round(4).tolist(), strict=True)))
    print("macro AUC", round(float(auc.mean()), 4))
    assert 0.75 <= auc.mean() <= 0.85
    assert auc.max() - auc.min() > 0.1  # classes differ in difficulty
    rarest = int(np.argmin(pa.labels.sum(axis=0)))  # Pneumonia, 0.94 %
    assert auc[rarest] < np.median(auc)
