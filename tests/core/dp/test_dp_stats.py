"""Tests of the DP sufficient-statistics pipeline (docs/protocol.md §7)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from afl.core.dp.accounting import StatisticKind, statistic_sensitivity
from afl.core.dp.stats import (
    DPStatsError,
    NoiseScales,
    SufficientStatistics,
    add_noise,
    balanced_targets,
    clip_rows,
    floor_eigenvalues,
    label_weights,
    noise_ridge,
    patient_rows,
    regularised_gram,
    sufficient_statistics,
)

ZERO = NoiseScales(0.0, 0.0, 0.0, 0.0, 0.0)


def make_site(seed: int, n: int = 60, d: int = 5, c: int = 3):
    rng = np.random.default_rng(seed)
    h = np.abs(rng.normal(size=(n, d))) * 3
    y = (rng.random((n, c)) < 0.3).astype(np.float64)
    y[0], y[1] = 1.0, 0.0  # at least one positive and one negative per class
    return h, y


def test_clip_rows() -> None:
    h = np.array([[3.0, 4.0], [0.3, 0.4], [0.0, 0.0], [-6.0, 8.0]])
    out = clip_rows(h, clip_norm=1.0)
    np.testing.assert_allclose(out, [[0.6, 0.8], [0.3, 0.4], [0.0, 0.0], [-0.6, 0.8]])
    with pytest.raises(DPStatsError):
        clip_rows(h, clip_norm=0.0)


def test_statistics_match_loop_oracle() -> None:
    h, y = make_site(1)
    mask = np.ones_like(y, dtype=bool)
    mask[:10, 1] = False
    y_garbage = y.copy()
    y_garbage[:10, 1] = 7.0  # ignored where the mask says the label is missing
    stats = sufficient_statistics(h, y_garbage, label_mask=mask)
    n = h.shape[0]
    gram = sum(np.outer(h[i], h[i]) for i in range(n))
    np.testing.assert_allclose(stats.gram, gram, rtol=1e-12)
    for c in range(y.shape[1]):
        rows = [i for i in range(n) if mask[i, c]]
        pos = [i for i in rows if y[i, c] == 1]
        np.testing.assert_allclose(stats.positive_sum[c], h[pos].sum(axis=0), rtol=1e-12)
        np.testing.assert_allclose(stats.label_sum[c], h[rows].sum(axis=0), rtol=1e-12)
        assert stats.positive_count[c] == len(pos)
        assert stats.label_count[c] == len(rows)
    with pytest.raises(DPStatsError):
        sufficient_statistics(h, y_garbage)


def test_statistics_are_additive_across_sites() -> None:
    (h1, y1), (h2, y2) = make_site(2), make_site(3)
    both = sufficient_statistics(np.vstack([h1, h2]), np.vstack([y1, y2]))
    summed = sufficient_statistics(h1, y1) + sufficient_statistics(h2, y2)
    for name in ("gram", "positive_sum", "positive_count", "label_sum", "label_count"):
        np.testing.assert_allclose(getattr(summed, name), getattr(both, name), rtol=1e-12)


def pooled_balanced_b(h: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Oracle: paper eq. 7 labels (+1/N+, -1/N-) on the pooled rows, then b = Hᵀ y."""
    targets = np.where(y == 1, 1.0 / y.sum(axis=0), -1.0 / (1 - y).sum(axis=0))
    out: np.ndarray = h.T @ targets
    return out


def test_noise_free_path_equals_exact_balanced_b() -> None:
    (h1, y1), (h2, y2) = make_site(4), make_site(5)
    stats = sufficient_statistics(h1, y1) + sufficient_statistics(h2, y2)
    released = add_noise(stats, scales=ZERO, rng=np.random.default_rng(0))
    np.testing.assert_array_equal(released.gram, stats.gram)
    np.testing.assert_array_equal(released.positive_sum, stats.positive_sum)
    b = balanced_targets(released)
    np.testing.assert_allclose(b, pooled_balanced_b(np.vstack([h1, h2]), np.vstack([y1, y2])))
    # For a single site the pooled normalisation is the paper's per-client one.
    np.testing.assert_allclose(
        balanced_targets(sufficient_statistics(h1, y1)), pooled_balanced_b(h1, y1)
    )
    # Noise-free Gram + γI is already PD: the eigenvalue floor at γ leaves it unchanged.
    reg = regularised_gram(released.gram, gamma=1.0)
    np.testing.assert_allclose(reg, stats.gram + np.eye(stats.gram.shape[0]), rtol=1e-12)


def test_noisy_gram_is_symmetric_and_pd_fix_holds() -> None:
    h, y = make_site(6, d=12)
    stats = sufficient_statistics(clip_rows(h, clip_norm=1.0), y)
    scales = NoiseScales(
        gram=5.0, positive_sum=5.0, positive_count=5.0, label_sum=5.0, label_count=5.0
    )
    noisy = add_noise(stats, scales=scales, rng=np.random.default_rng(7))
    np.testing.assert_array_equal(noisy.gram, noisy.gram.T)
    assert np.linalg.eigvalsh(noisy.gram + 0.1 * np.eye(12))[0] < 0.1  # noise broke the floor
    reg = regularised_gram(noisy.gram, gamma=0.1)
    assert np.linalg.eigvalsh(reg)[0] >= 0.1 - 1e-10
    np.linalg.cholesky(reg)


@settings(max_examples=50, deadline=None)
@given(
    a=hnp.arrays(np.float64, (6, 6), elements=st.floats(-100, 100)),
    floor=st.floats(min_value=1e-3, max_value=10.0),
)
def test_floor_eigenvalues_property(a, floor) -> None:
    out = floor_eigenvalues(a, floor=floor)
    np.testing.assert_array_equal(out, out.T)
    scale = max(1.0, float(np.abs(a).max()))
    assert np.linalg.eigvalsh(out)[0] >= floor - 1e-10 * scale
    # Eigenvalues already above the floor are kept.
    sym = (a + a.T) / 2
    before, after = np.linalg.eigvalsh(sym), np.linalg.eigvalsh(out)
    np.testing.assert_allclose(after, np.maximum(before, floor), atol=1e-9 * scale)


def test_empirical_noise_variance() -> None:
    d, c, draws = 30, 4, 40
    stats = SufficientStatistics(
        gram=np.zeros((d, d)),
        positive_sum=np.zeros((c, d)),
        positive_count=np.zeros(c),
        label_sum=np.zeros((c, d)),
        label_count=np.zeros(c),
    )
    scales = NoiseScales(
        gram=2.0, positive_sum=3.0, positive_count=0.5, label_sum=1.5, label_count=4.0
    )
    rng = np.random.default_rng(12345)
    samples = [add_noise(stats, scales=scales, rng=rng) for _ in range(draws)]
    grams = np.stack([s.gram for s in samples])
    diag = grams[:, np.arange(d), np.arange(d)].ravel()
    off = grams[:, *np.triu_indices(d, k=1)].ravel()
    # Symmetrised noise σ(Z + Zᵀ)/2: variance σ² on the diagonal, σ²/2 off it.
    assert diag.var() == pytest.approx(4.0, rel=0.2)
    assert off.var() == pytest.approx(2.0, rel=0.1)
    assert abs(off.mean()) < 0.1
    for name, sigma in [("positive_sum", 3.0), ("label_sum", 1.5)]:
        values = np.stack([getattr(s, name) for s in samples]).ravel()
        assert values.var() == pytest.approx(sigma**2, rel=0.15)
    for name, sigma in [("positive_count", 0.5), ("label_count", 4.0)]:
        values = np.stack([getattr(s, name) for s in samples]).ravel()
        assert values.var() == pytest.approx(sigma**2, rel=0.35)


@settings(max_examples=50, deadline=None)
@given(
    rows=hnp.arrays(np.float64, (5, 5), elements=st.floats(-50, 50)),
    labels=hnp.arrays(np.float64, (5, 3), elements=st.sampled_from([0.0, 1.0])),
    clip=st.floats(min_value=0.1, max_value=10.0),
    m=st.integers(1, 3),
)
def test_one_row_changes_statistics_within_sensitivity(rows, labels, clip, m) -> None:
    # Removing one individual's m rows moves each released statistic (the four releases of the
    # rulebook: gram, s_pos, t_sum and counts = (n+, N)) by at most its declared sensitivity.
    h = clip_rows(rows, clip_norm=clip)
    with_rows = sufficient_statistics(h, labels)
    without = sufficient_statistics(h[m:], labels[m:])
    diff: dict[StatisticKind, np.ndarray] = {
        "gram": with_rows.gram - without.gram,
        "s_pos": with_rows.positive_sum - without.positive_sum,
        "t_sum": with_rows.label_sum - without.label_sum,
        "counts": np.stack([with_rows.positive_count, with_rows.label_count])
        - np.stack([without.positive_count, without.label_count]),
    }
    for kind, delta in diff.items():
        sens = statistic_sensitivity(kind, clip_norm=clip, n_classes=3, rows_per_individual=m)
        assert np.linalg.norm(delta) <= sens * (1 + 1e-9)


def _released(h: np.ndarray, y: np.ndarray, k: int) -> dict[StatisticKind, np.ndarray]:
    st = sufficient_statistics(h, y, max_positive_labels=k)
    return {
        "gram": st.gram,
        "s_pos": st.positive_sum,
        "t_sum": st.label_sum,
        "counts": np.stack([st.positive_count, st.label_count]),
    }


@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    n=st.integers(2, 24),
    patients=st.integers(1, 6),
    clip=st.floats(min_value=0.1, max_value=10.0),
    m=st.integers(1, 4),
    k=st.integers(0, 3),
)
def test_one_patient_with_several_images_changes_statistics_within_sensitivity(
    data, n, patients, clip, m, k
) -> None:
    # Patients hold several images each (ids drawn with repeats, in any order). The site keeps
    # the first m of each patient (patient_rows); removing one patient from the data set and
    # re-applying the cap moves each release by at most the rulebook's patient-level
    # sensitivity (m images, label clipping k), computed independently as the norm of the
    # difference. Without the cap a patient's images can exceed it (the cap is what holds it).
    rows = data.draw(hnp.arrays(np.float64, (n, 4), elements=st.floats(-20, 20)))
    labels = data.draw(hnp.arrays(np.float64, (n, 3), elements=st.sampled_from([0.0, 1.0])))
    ids = np.array(data.draw(st.lists(st.integers(0, patients - 1), min_size=n, max_size=n)))
    victim = int(ids[0])
    h = clip_rows(rows, clip_norm=clip)
    keep = patient_rows(ids, cap=m)
    rest = np.flatnonzero(ids != victim)
    keep_rest = rest[patient_rows(ids[rest], cap=m)]
    assert set(keep_rest) == set(keep) - set(np.flatnonzero(ids == victim))
    full = _released(h[keep], labels[keep], k)
    without = _released(h[keep_rest], labels[keep_rest], k)
    for kind, block in full.items():
        sens = statistic_sensitivity(
            kind, clip_norm=clip, n_classes=3, rows_per_individual=m, max_positive_labels=k
        )
        assert np.linalg.norm(block - without[kind]) <= sens * (1 + 1e-9), kind


def test_an_uncapped_patient_exceeds_the_one_image_sensitivity() -> None:
    # The failing case the cap prevents: one patient with 5 images at the clip norm.
    h = np.tile([[2.0, 0.0]], (5, 1))
    y = np.ones((5, 1))
    ids = np.zeros(5, dtype=np.int64)
    one = statistic_sensitivity("gram", clip_norm=2.0)
    assert np.linalg.norm(sufficient_statistics(h, y).gram) == pytest.approx(5 * one)
    capped = patient_rows(ids, cap=1)
    assert np.linalg.norm(sufficient_statistics(h[capped], y[capped]).gram) == pytest.approx(one)


def test_patient_rows_keeps_the_first_m_images_of_each_patient() -> None:
    ids = np.array(["p2", "p1", "p2", "p3", "p2", "p1"])
    assert patient_rows(ids, cap=1).tolist() == [0, 1, 3]
    assert patient_rows(ids, cap=2).tolist() == [0, 1, 2, 3, 5]
    assert patient_rows(ids, cap=9).tolist() == list(range(6))
    with pytest.raises(DPStatsError):
        patient_rows(ids, cap=0)


def test_label_weights_bound_each_row() -> None:
    y = np.array([[1, 1, 1, 1], [1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 0, 0]], dtype=float)
    w = label_weights(y, max_positive_labels=1)
    np.testing.assert_allclose(w, [0.5, 1.0, 1.0, 1 / np.sqrt(2)])
    assert np.all(np.linalg.norm(y * w[:, None], axis=1) <= 1.0 + 1e-12)
    np.testing.assert_allclose(label_weights(y, max_positive_labels=0), 1.0)


def test_noise_ridge_is_about_the_noise_spectral_norm() -> None:
    # Oracle: the largest eigenvalue of a drawn symmetrised noise matrix σ(Z + Zᵀ)/2.
    d, sigma = 200, 3.0
    z = np.random.default_rng(0).standard_normal((d, d))
    top = float(np.abs(np.linalg.eigvalsh(sigma * (z + z.T) / 2)).max())
    assert noise_ridge(sigma_gram=sigma, d=d) == pytest.approx(top, rel=0.1)


def test_sensitivity_is_attained() -> None:
    # The bounds are tight: one row at the clip norm, positive in every class.
    clip, c = 2.0, 4
    h = np.zeros((1, 3))
    h[0, 0] = clip
    stats = sufficient_statistics(h, np.ones((1, c)))
    assert np.linalg.norm(stats.gram) == pytest.approx(
        statistic_sensitivity("gram", clip_norm=clip)
    )
    sums: list[tuple[StatisticKind, np.ndarray]] = [
        ("s_pos", stats.positive_sum),
        ("t_sum", stats.label_sum),
    ]
    for kind, block in sums:
        sens = statistic_sensitivity(kind, clip_norm=clip, n_classes=c)
        assert np.linalg.norm(block) == pytest.approx(sens)
    counts = np.stack([stats.positive_count, stats.label_count])
    assert np.linalg.norm(counts) == pytest.approx(
        statistic_sensitivity("counts", clip_norm=clip, n_classes=c)
    )


def test_balanced_targets_floor_noisy_counts() -> None:
    stats = SufficientStatistics(
        gram=np.eye(2),
        positive_sum=np.array([[1.0, 2.0]]),
        positive_count=np.array([-3.0]),
        label_sum=np.array([[5.0, 6.0]]),
        label_count=np.array([0.5]),
    )
    b = balanced_targets(stats, min_count=1.0)
    # n+ -> 1, n- = 0.5 - (-3) = 3.5: b = S+/1 - (T - S+)/3.5
    np.testing.assert_allclose(b[:, 0], [1.0 - 4.0 / 3.5, 2.0 - 4.0 / 3.5])
    with pytest.raises(DPStatsError):
        balanced_targets(stats, min_count=0.0)
