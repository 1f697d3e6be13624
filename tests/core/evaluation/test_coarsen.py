"""The rule without DP (docs/protocol.md §6.1, M-212): a site's evaluation histograms leave it
with every bin 0 or holding at least ``min_cohort`` rows' worth of mass, so every bin of any sum
of sites' uploads is 0 or ≥ k as well; the confusion counts are derived from them. Checked as
properties over random histograms (hypothesis), against a brute-force reading of the rule."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from afl.core.evaluation.federated import (
    EvaluationError,
    coarsen_histograms,
    confusion_from_histograms,
    decision_edge,
    evaluation_statistics,
)
from afl.core.evaluation.scorebins import DEFAULT_SCORE_BINS, ScoreBins
from tests.helpers.evaluation_oracle import coarsened_bins


@settings(max_examples=200, deadline=None)
@given(
    counts=st.lists(st.integers(0, 4), min_size=12, max_size=12),
    others=st.lists(st.integers(0, 6), min_size=12, max_size=12),
    k=st.integers(1, 6),
    edge=st.integers(1, 5),
)
def test_property_every_bin_is_zero_or_at_least_k_and_rows_stay_on_their_side(
    counts: list[int], others: list[int], k: int, edge: int
) -> None:
    hist = np.array([[counts[:6], counts[6:]], [others[:6], others[6:]]], dtype=np.int64)
    out = coarsen_histograms(hist, min_count=k, edge=edge)
    assert ((out == 0) | (out >= k)).all()
    for c in range(2):
        for y in range(2):
            row, got = hist[c, y], out[c, y]
            if row.sum() < k:
                assert got.sum() == 0  # left out at this site, never a bin below k
                continue
            assert got.sum() == row.sum()  # every row released once
            below, above = row[:edge].sum(), row[edge:].sum()
            if below >= k and above >= k:  # no row crosses the decision
                assert got[:edge].sum() == below and got[edge:].sum() == above
                # rows merge only with their neighbours: released bins are a subset of the
                # occupied ones
                assert set(np.flatnonzero(got)) <= set(np.flatnonzero(row))
    # the sum of sites' uploads: every bin 0 or ≥ k
    total = out + coarsen_histograms(hist[::-1], min_count=k, edge=edge)
    assert ((total == 0) | (total >= k)).all()
    conf = confusion_from_histograms(out, edge=edge)
    assert ((conf == 0) | (conf >= k)).all()
    assert (conf[:, 0] + conf[:, 1] == out[:, 1].sum(1)).all()


def test_the_derived_confusion_counts_are_the_decision_at_the_threshold() -> None:
    rng = np.random.default_rng(2)
    feats = rng.normal(size=(300, 4))
    labels = (rng.random((300, 2)) < 0.4).astype(np.int8)
    w = rng.normal(size=(4, 2))
    stats = evaluation_statistics(
        feats, labels, weights=w, classes=("a", "b"), bins=DEFAULT_SCORE_BINS
    )
    edge = decision_edge(DEFAULT_SCORE_BINS, 0.5)
    assert np.array_equal(confusion_from_histograms(stats.histograms, edge=edge), stats.confusion)
    with pytest.raises(EvaluationError, match="not a bin edge"):
        decision_edge(ScoreBins.from_edges([-1.0, 1.0]), 0.5)


@settings(max_examples=100, deadline=None)
@given(
    bins=st.lists(st.integers(0, 9), min_size=0, max_size=30),
    k=st.integers(1, 5),
    edge=st.integers(1, 9),
)
def test_property_the_site_coarsens_as_the_row_by_row_oracle_says(
    bins: list[int], k: int, edge: int
) -> None:
    rows = np.asarray(bins, dtype=np.int64)
    hist = np.zeros((1, 2, 10), dtype=np.int64)
    hist[0, 1] = np.bincount(rows, minlength=10)
    moved = coarsened_bins(rows, k=k, edge=edge)  # tests/helpers/evaluation_oracle.py
    want = np.bincount(moved[moved >= 0], minlength=10)
    assert np.array_equal(coarsen_histograms(hist, min_count=k, edge=edge)[0, 1], want)
