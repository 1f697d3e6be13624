"""Row bounds of a site's features: what masked aggregation needs instead of hand arithmetic
(docs/protocol.md §4.2).

A site with N rows h_i, each ‖h_i‖ <= L, has statistics bounded entry-wise by

    |G_jl| = |Σ_i h_ij·h_il| <= Σ_i ‖h_i‖² <= N·L²       (Cauchy–Schwarz per row)
    |b_j|  = |S⁺_j/N⁺ − S⁻_j/N⁻| <= 2·L                 (a difference of two means of rows)

The site measures N and L on its own cache (:func:`measure`) and declares them at enrolment
rounded UP to powers of two (:meth:`RowBounds.declared`), so the coordinator learns only
⌈log2 N⌉ and ⌈log2 L⌉ (docs/protocol.md §6), never the exact size or norm. A release's fixed-point
bound is the largest declared bound among its members (:func:`release_bounds`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

__all__ = ["RowBounds", "measure", "next_power_of_two", "release_bounds"]

# Float64 statistics may exceed the real-arithmetic bound by a few ulps; the declared norm keeps
# this much relative headroom before rounding up (far below the factor <= 2 of the rounding).
_MARGIN = 2.0**-20
_SMALLEST_NORM = 2.0**-20


def next_power_of_two(x: float) -> float:
    """The smallest power of two >= ``x`` (``x`` > 0, finite)."""
    if not (math.isfinite(x) and x > 0):
        raise ValueError(f"expected a finite positive number, got {x!r}")
    mantissa, exponent = math.frexp(x)  # x = m·2^e, 0.5 <= m < 1
    return math.ldexp(1.0, exponent - 1) if mantissa == 0.5 else math.ldexp(1.0, exponent)


@dataclass(frozen=True)
class RowBounds:
    """N rows of feature-row norm at most L (measured, or declared = rounded up)."""

    rows: int
    max_row_norm: float

    @property
    def gram_bound(self) -> float:
        """N·L²: bound on any entry of the site's Gram matrix."""
        return self.rows * self.max_row_norm**2

    @property
    def vector_bound(self) -> float:
        """2·L: bound on any entry of a balanced class vector."""
        return 2.0 * self.max_row_norm

    def declared(self) -> RowBounds:
        """What a site declares for these measured bounds: N and L rounded up to powers of two
        (L with a 2^-20 relative margin first, so float64 round-off stays inside)."""
        norm = max(self.max_row_norm * (1.0 + _MARGIN), _SMALLEST_NORM)
        return RowBounds(max(self.rows, 1), norm).powers_of_two()

    def powers_of_two(self) -> RowBounds:
        """N and L rounded up to powers of two (unchanged if they already are; what the
        coordinator keeps of a declaration, whatever the site sent)."""
        return RowBounds(int(next_power_of_two(self.rows)), next_power_of_two(self.max_row_norm))

    @property
    def valid(self) -> bool:
        """A usable declaration: at least one row and a finite positive norm."""
        return self.rows >= 1 and math.isfinite(self.max_row_norm) and self.max_row_norm > 0


def measure(features: NDArray[Any], *, block: int = 8192) -> RowBounds:
    """N and the largest row norm of a (N, d) feature matrix, in float64, block by block (a
    memory-mapped cache is never loaded whole)."""
    n = int(features.shape[0])
    largest = 0.0
    for start in range(0, n, block):
        rows = np.asarray(features[start : start + block], dtype=np.float64)
        if rows.size:
            largest = max(largest, float(np.sqrt(np.einsum("ij,ij->i", rows, rows).max())))
    return RowBounds(n, largest)


def release_bounds(members: Iterable[RowBounds]) -> tuple[float, float]:
    """(Gram bound, class-vector bound) covering every member: max N_k·L_k² and max 2·L_k."""
    items = list(members)
    if not items:
        raise ValueError("a release needs at least one member")
    return max(b.gram_bound for b in items), max(b.vector_bound for b in items)
