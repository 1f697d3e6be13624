"""Round-2 pseudo-label refinement (eq. 16-22) against direct definitions and Ridge."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.special import expit
from sklearn.linear_model import Ridge

from afl.core.refinement import RefinementParams, pseudo_label_projection, solve_round2


def _direct_pseudo_targets(h, w, params):
    p = expit(h @ w)
    pos, neg = p > params.tau, p < 1 - params.tau
    n_pp, n_pn = pos.sum(), neg.sum()
    if n_pp < params.delta_pos or n_pn < params.delta_neg:
        return np.zeros(len(h)), False
    return np.where(pos, 1.0 / n_pp, np.where(neg, -1.0 / n_pn, 0.0)), True


@pytest.mark.parametrize("batch", [7, 1000])
def test_pseudo_projection_matches_eq_17_19(batch):
    rng = np.random.default_rng(11)
    h = rng.normal(size=(300, 6))
    w = rng.normal(size=(6, 3)) * 2.0
    params = RefinementParams(tau=0.7, delta_pos=5, delta_neg=20)
    missing = np.array([True, False, True])
    out = pseudo_label_projection(h, weights=w, missing=missing, params=params, batch_size=batch)
    for c in range(3):
        if not missing[c]:
            assert not out.contributes[c]
            np.testing.assert_array_equal(out.b[:, c], 0.0)
            continue
        target, ok = _direct_pseudo_targets(h, w[:, c], params)
        assert out.contributes[c] == ok
        np.testing.assert_allclose(out.b[:, c], h.T @ target, rtol=1e-12, atol=1e-14)


def test_min_count_filter_blocks_unconfident_clients():
    h = np.full((100, 2), 0.01)
    out = pseudo_label_projection(
        h, weights=np.zeros((2, 1)), missing=np.array([True]), params=RefinementParams()
    )
    assert not out.contributes[0]
    assert out.n_pseudo_pos[0] == 0 and out.n_pseudo_neg[0] == 0


def test_round2_solve_equals_ridge_on_all_rows():
    rng = np.random.default_rng(5)
    clients = [rng.normal(size=(n, 5)) for n in (40, 55, 70)]
    real = [rng.normal(size=len(h)) * (k != 2) for k, h in enumerate(clients)]  # client 2 misses it
    pseudo = [rng.normal(size=len(h)) * (k == 2) for k, h in enumerate(clients)]
    alpha, gamma = 0.5, 1.0
    gram = np.sum([h.T @ h for h in clients], axis=0)
    b_real = np.sum([h.T @ y for h, y in zip(clients, real, strict=True)], axis=0)[:, None]
    b_pseudo = np.sum([h.T @ y for h, y in zip(clients, pseudo, strict=True)], axis=0)[:, None]
    w = solve_round2(gram_total=gram, b_real=b_real, b_pseudo=b_pseudo, alpha=alpha, gamma=gamma)
    rows = np.vstack(clients)
    target = np.concatenate(real) + alpha * np.concatenate(pseudo)
    oracle = Ridge(alpha=gamma, fit_intercept=False, solver="svd").fit(rows, target).coef_
    assert np.linalg.norm(w[:, 0] - oracle) / np.linalg.norm(oracle) <= 1e-9


def test_alpha_zero_reduces_to_real_labels_only():
    rng = np.random.default_rng(1)
    gram = np.eye(3) * 4
    b_real, b_pseudo = rng.normal(size=(3, 2)), rng.normal(size=(3, 2))
    w0 = solve_round2(gram_total=gram, b_real=b_real, b_pseudo=b_pseudo, alpha=0.0, gamma=1.0)
    np.testing.assert_allclose(w0, b_real / 5.0)


def test_params_validated():
    with pytest.raises(ValueError):
        RefinementParams(tau=0.3)
    with pytest.raises(ValueError):
        RefinementParams(alpha=1.5)
