"""The evaluation part of the DP rulebook (afl.core.dp.evaluation) and the site's colluder floor
(afl.core.dp.accounting.site_colluders). Oracles: brute-force neighbouring histograms for the
sensitivity, the independent analytic-Gaussian accountant (tests/helpers/dp_oracle.py) for σ,
scipy's normal quantiles for the bins."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from afl.core.dp.accounting import AccountingError, site_colluders
from afl.core.dp.evaluation import dp_score_bins, evaluation_sensitivity, evaluation_sigma
from afl.core.evaluation.federated import evaluation_statistics
from afl.core.evaluation.scorebins import DEFAULT_SCORE_BINS
from tests.helpers import dp_oracle


@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(2, 30),
    classes=st.integers(1, 6),
    m=st.integers(1, 3),
    seed=st.integers(0, 2**31 - 1),
)
def test_removing_one_unit_moves_the_histogram_and_confusion_by_at_most_m_sqrt_c(
    rows: int, classes: int, m: int, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    h = rng.normal(size=(rows, 3))
    w = rng.normal(size=(3, classes))
    y = rng.integers(0, 2, size=(rows, classes)).astype(np.int8)
    names = tuple(f"c{i}" for i in range(classes))
    full = evaluation_statistics(h, y, weights=w, classes=names, bins=DEFAULT_SCORE_BINS)
    unit = min(m, rows - 1)  # one patient: its (at most m) rows
    kept = evaluation_statistics(
        h[unit:], y[unit:], weights=w, classes=names, bins=DEFAULT_SCORE_BINS
    )
    bound = evaluation_sensitivity(n_classes=classes, rows_per_individual=m)
    for a, b in ((full.histograms, kept.histograms), (full.confusion, kept.confusion)):
        moved = float(np.linalg.norm((a - b).astype(np.float64)))
        assert moved <= bound + 1e-12
    # one row labelled in every class moves exactly √C (the bound is tight)
    one = evaluation_statistics(h[:1], y[:1], weights=w, classes=names, bins=DEFAULT_SCORE_BINS)
    assert float(np.linalg.norm(one.histograms.astype(np.float64))) == pytest.approx(
        math.sqrt(classes)
    )


@pytest.mark.parametrize(("epsilon", "classes", "m"), [(1.0, 8, 1), (0.5, 14, 2), (4.0, 3, 1)])
def test_the_evaluation_sigma_costs_exactly_epsilon(epsilon: float, classes: int, m: int) -> None:
    sigma = evaluation_sigma(epsilon=epsilon, delta=1e-5, n_classes=classes, rows_per_individual=m)
    mu = dp_oracle.composed_mu([(m * math.sqrt(classes), sigma)])
    assert dp_oracle.epsilon(mu, 1e-5) == pytest.approx(epsilon, rel=1e-6)


def test_dp_bins_are_equal_mass_quantiles_with_the_decision_edge() -> None:
    from scipy.stats import norm

    bins = dp_score_bins(scale=2e-4, num_bins=12)
    assert 0.0 in bins.edges and bins.num_bins == 12  # 11 quantile edges, 0 among them
    expected = norm.ppf(np.arange(1, 12) / 12) * 2e-4
    assert np.allclose(np.asarray(bins.edges), np.unique(np.r_[expected, 0.0]), atol=1e-18)
    odd = dp_score_bins(scale=1.0, num_bins=5)
    assert 0.0 in odd.edges and odd.num_bins == 6  # 0 added between the middle quantiles
    with pytest.raises(AccountingError):
        dp_score_bins(scale=0.0)


def test_site_colluders_is_the_larger_floor_below_n() -> None:
    assert site_colluders(members=4, stated=0, fraction=0.333) == 2  # ⌈4/3⌉
    assert site_colluders(members=4, stated=3, fraction=0.333) == 3  # the plan's is larger
    assert site_colluders(members=10, stated=0, fraction=0.3) == 3  # 0.3·10 is not 3.0000…04
    assert site_colluders(members=2, stated=0, fraction=0.9) == 1  # at most n - 1
    assert site_colluders(members=5, stated=0, fraction=0.0) == 0
    with pytest.raises(AccountingError):
        site_colluders(members=4, stated=0, fraction=1.0)
