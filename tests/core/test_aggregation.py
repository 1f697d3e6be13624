"""Theorem 1 against an independent oracle (scikit-learn Ridge) and partition invariance."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn.linear_model import Ridge

from afl.core.aggregation import (
    AggregationError,
    federated_solve,
    plan_aggregation,
    solve_from_sums,
)
from afl.core.labels import balanced_targets
from afl.core.stats import local_statistics
from tests.helpers.numeric import relative_error


def _make_clients(rng, *, num_clients, d, num_classes, rows=(30, 90)):
    feats, labels, actives = [], [], []
    for _ in range(num_clients):
        n = int(rng.integers(*rows))
        h = np.abs(rng.normal(size=(n, d))) + 0.1 * rng.normal(size=(1, d))
        y = (rng.random((n, num_classes)) < 0.3).astype(np.int8)
        y[0], y[1] = 1, 0  # every class has a positive and a negative at every client
        active = rng.random(num_classes) < 0.6
        active[rng.integers(num_classes)] = True
        y[:, ~active] = -1
        feats.append(h)
        labels.append(y)
        actives.append(active)
    return feats, labels, actives


def _ridge_oracle(feats, labels, actives, *, cls, members, gamma):
    rows = np.vstack([feats[k] for k in members])
    target = np.concatenate(
        [balanced_targets(labels[k], active=actives[k]).targets[:, cls] for k in members]
    )
    model = Ridge(alpha=gamma, fit_intercept=False, solver="svd").fit(rows, target)
    return model.coef_


@pytest.mark.parametrize("gamma", [1.0, 0.01])
def test_theorem1_per_class_equals_pooled_ridge(gamma):
    rng = np.random.default_rng(7)
    feats, labels, actives = _make_clients(rng, num_clients=5, d=12, num_classes=4)
    stats = [
        local_statistics(h, y, active=a) for h, y, a in zip(feats, labels, actives, strict=True)
    ]
    weights, plan = federated_solve(stats, gamma=gamma, gram_scope="per-class")
    for c in range(4):
        members = sorted(plan.class_cover[c])
        assert members == [k for k in range(5) if actives[k][c]]
        oracle = _ridge_oracle(feats, labels, actives, cls=c, members=members, gamma=gamma)
        assert relative_error(weights[:, c], oracle) <= 1e-9


def test_global_scope_equals_ridge_on_all_rows_with_zero_targets_for_non_labellers():
    rng = np.random.default_rng(3)
    feats, labels, actives = _make_clients(rng, num_clients=4, d=10, num_classes=3)
    stats = [
        local_statistics(h, y, active=a) for h, y, a in zip(feats, labels, actives, strict=True)
    ]
    weights, plan = federated_solve(stats, gamma=1.0, gram_scope="global")
    assert plan.gram_releases == (frozenset(range(4)),)
    for c in range(3):
        oracle = _ridge_oracle(feats, labels, actives, cls=c, members=range(4), gamma=1.0)
        assert relative_error(weights[:, c], oracle) <= 1e-9


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    num_parts=st.integers(1, 9),
    gamma=st.floats(0.05, 10.0),
)
def test_partition_invariance(seed, num_parts, gamma):
    """Re-partitioning the same labelled rows across any number of clients leaves W unchanged.

    Balanced targets are per-client, so invariance holds for the statistics Σ G and Σ b of a fixed
    set of rows and targets: we fix the targets on the pooled rows and split them arbitrarily.
    """
    rng = np.random.default_rng(seed)
    n, d = 120, 8
    rows = rng.normal(size=(n, d))
    target = rng.normal(size=n)
    cuts = np.sort(rng.choice(np.arange(1, n), size=num_parts - 1, replace=False))
    parts = np.split(rng.permutation(n), cuts)
    gram_sum = np.sum([rows[p].T @ rows[p] for p in parts], axis=0)
    b_sum = np.sum([rows[p].T @ target[p] for p in parts], axis=0)
    plan = plan_aggregation(np.ones((len(parts), 1), dtype=bool), gram_scope="per-class")
    w = solve_from_sums(
        plan, gram_sums={plan.participants: gram_sum}, b_sums=b_sum[:, None], gamma=gamma
    )
    oracle = Ridge(alpha=gamma, fit_intercept=False, solver="svd").fit(rows, target).coef_
    assert relative_error(w[:, 0], oracle) <= 1e-9


def test_classes_with_same_cover_share_one_factorisation():
    contributes = np.array([[1, 1, 0], [1, 1, 1], [0, 0, 1]], dtype=bool)
    plan = plan_aggregation(contributes, gram_scope="per-class")
    assert plan.gram_releases == (frozenset({0, 1}), frozenset({1, 2}))
    assert plan_aggregation(contributes, gram_scope="global").gram_releases == (
        frozenset({0, 1, 2}),
    )


def test_uncovered_class_gets_zero_weights_and_is_reported():
    contributes = np.array([[1, 0], [1, 0]], dtype=bool)
    plan = plan_aggregation(contributes, gram_scope="per-class")
    assert plan.uncovered_classes == (1,)
    w = solve_from_sums(
        plan,
        gram_sums={frozenset({0, 1}): np.eye(3)},
        b_sums=np.ones((3, 2)),
        gamma=1.0,
    )
    np.testing.assert_array_equal(w[:, 1], 0.0)
    np.testing.assert_allclose(w[:, 0], 0.5)


def test_solve_errors_are_clear():
    plan = plan_aggregation(np.ones((2, 1), dtype=bool), gram_scope="global")
    with pytest.raises(AggregationError, match="missing the Gram sum"):
        solve_from_sums(plan, gram_sums={}, b_sums=np.zeros((3, 1)), gamma=1.0)
    with pytest.raises(AggregationError, match="positive"):
        solve_from_sums(
            plan, gram_sums={plan.participants: np.eye(3)}, b_sums=np.zeros((3, 1)), gamma=0
        )
    with pytest.raises(AggregationError, match="not positive definite"):
        solve_from_sums(
            plan, gram_sums={plan.participants: -5 * np.eye(3)}, b_sums=np.zeros((3, 1)), gamma=1.0
        )
    with pytest.raises(AggregationError, match="gram_scope"):
        plan_aggregation(np.ones((2, 1), dtype=bool), gram_scope="bogus")  # type: ignore[arg-type]


def test_load_solver_imports_scipy_linalg_which_importing_the_module_does_not() -> None:
    """afl-server calls it in a thread at start (its first solve, under the coordinator's lock,
    does not wait for the import); importing afl.core.aggregation alone loads no scipy."""
    code = (
        "import sys\n"
        "import afl.core.aggregation as a\n"
        "before = 'scipy.linalg' in sys.modules\n"
        "a.load_solver()\n"
        "print(before, 'scipy.linalg' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    assert out.stdout.split() == ["False", "True"]
