"""Fixed score bins for the histogram release statistics (docs/method.md §3.1).

A site never releases a per-image score. Evaluation and calibration release per-class histograms
of the head's raw score ``z = h · w_c`` (the logit; the paper's probability is σ(z), eq. 23) over
bins that the release plan declares before any site computes anything, so every site bins the
same way and the histograms are additive (summable under masking or CKKS like any release).

Bins are given by ``m`` strictly increasing finite edges ``e_0 < … < e_{m-1}``; bin ``j`` is
``(e_{j-1}, e_j]`` with ``e_{-1} = −∞`` and ``e_m = +∞`` (``m + 1`` bins). A score's bin is the
number of edges strictly below it (``numpy.searchsorted(edges, z, side="left")``).

The default, :func:`symmetric_log_bins`, needs no data: edges ``±10^k`` for ``k`` on a grid of
``per_decade`` steps per decade between ``min_abs`` and ``max_abs``, plus 0. With balanced targets
the scores are tiny (about 1e-4 on the embedded default, docs/method.md §1.6) and their scale
depends on the number of training rows, which the coordinator does not know; a logarithmic grid
gives every scale the same relative resolution (``10^(1/per_decade)``, 6 % at 40 per decade)
without looking at the data. Scores within ``min_abs`` of 0 share the two bins around 0; the
edge 0 separates the paper's decision ``σ(z) > 0.5`` from the rest.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

__all__ = ["DEFAULT_SCORE_BINS", "MAX_EDGES", "ScoreBins", "ScoreBinsError", "symmetric_log_bins"]

#: The most edges a site accepts in a plan (a finer grid isolates single images in a bin).
MAX_EDGES = 4096


class ScoreBinsError(ValueError):
    """Bin edges are not finite, not strictly increasing, empty or too many."""


@dataclass(frozen=True)
class ScoreBins:
    """Edges of the plan-declared score bins (module docstring)."""

    edges: tuple[float, ...]

    def __post_init__(self) -> None:
        edges = np.asarray(self.edges, dtype=np.float64)
        if edges.ndim != 1 or edges.size == 0:
            raise ScoreBinsError("score bins need at least one edge")
        if edges.size > MAX_EDGES:
            raise ScoreBinsError(f"{edges.size} score-bin edges > the limit {MAX_EDGES}")
        if not np.isfinite(edges).all():
            raise ScoreBinsError("score-bin edges must be finite")
        if not (np.diff(edges) > 0).all():
            raise ScoreBinsError("score-bin edges must be strictly increasing")

    @classmethod
    def from_edges(cls, edges: Sequence[float] | NDArray[np.floating]) -> ScoreBins:
        return cls(tuple(float(e) for e in np.asarray(edges, dtype=np.float64).ravel()))

    @property
    def num_bins(self) -> int:
        return len(self.edges) + 1

    @property
    def array(self) -> NDArray[np.float64]:
        return np.asarray(self.edges, dtype=np.float64)

    def index(self, scores: NDArray[np.floating]) -> NDArray[np.int64]:
        """Bin of each score: the number of edges strictly below it."""
        z = np.asarray(scores, dtype=np.float64)
        if not np.isfinite(z).all():
            raise ScoreBinsError("scores must be finite")
        out: NDArray[np.int64] = np.searchsorted(self.array, z, side="left").astype(np.int64)
        return out

    def representatives(self) -> NDArray[np.float64]:
        """One score per bin: the midpoint of an inner bin, the finite edge of an outer one."""
        e = self.array
        return np.concatenate([e[:1], 0.5 * (e[:-1] + e[1:]), e[-1:]])


def symmetric_log_bins(
    *, min_abs: float = 1e-12, max_abs: float = 1e4, per_decade: int = 40
) -> ScoreBins:
    """Edges ``−max_abs … −min_abs, 0, min_abs … max_abs`` on a log grid (module docstring)."""
    if not 0 < min_abs < max_abs or not math.isfinite(max_abs):
        raise ScoreBinsError(f"need 0 < min_abs < max_abs < inf, got {min_abs}, {max_abs}")
    if per_decade < 1:
        raise ScoreBinsError(f"per_decade must be >= 1, got {per_decade}")
    lo, hi = math.log10(min_abs), math.log10(max_abs)
    steps = max(1, round((hi - lo) * per_decade))
    positive = 10.0 ** np.linspace(lo, hi, steps + 1)
    return ScoreBins.from_edges(np.concatenate([-positive[::-1], [0.0], positive]))


#: The default grid: 1e-12 … 1e4 at 40 edges per decade (1,283 edges, 1,284 bins per class).
DEFAULT_SCORE_BINS = symmetric_log_bins()
