"""Packed upper triangle of a symmetric matrix: d(d+1)/2 values on the wire (docs/method.md §1).

For d = 1024 that is 524,800 float64 values instead of 1,048,576. Row-major order of
``numpy.triu_indices(d)``; the same order is used by every aggregation mode.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
from numpy.typing import NDArray


def packed_length(d: int) -> int:
    """Number of values in the packed upper triangle of a d x d matrix."""
    if d < 1:
        raise ValueError(f"dimension must be positive, got {d}")
    return d * (d + 1) // 2


def dimension_of_packed(length: int) -> int:
    """Inverse of ``packed_length``; raises if ``length`` is not triangular."""
    d = int((np.sqrt(8 * length + 1) - 1) // 2)
    if d < 1 or packed_length(d) != length:
        raise ValueError(f"{length} is not the packed length of any square matrix")
    return d


@lru_cache(maxsize=8)
def _triu(d: int) -> tuple[NDArray[np.intp], NDArray[np.intp]]:
    rows, cols = np.triu_indices(d)
    return rows, cols


def pack_upper(matrix: NDArray[np.float64]) -> NDArray[np.float64]:
    """Upper triangle (diagonal included) of a square matrix, row-major."""
    if matrix.ndim != 2 or matrix.shape[0] != matrix.shape[1]:
        raise ValueError(f"expected a square matrix, got shape {matrix.shape}")
    rows, cols = _triu(matrix.shape[0])
    return np.ascontiguousarray(matrix[rows, cols], dtype=np.float64)


def unpack_upper(packed: NDArray[np.float64]) -> NDArray[np.float64]:
    """Symmetric matrix from its packed upper triangle."""
    d = dimension_of_packed(packed.shape[0])
    rows, cols = _triu(d)
    out = np.zeros((d, d), dtype=np.float64)
    out[rows, cols] = packed
    out[cols, rows] = packed
    return out
