"""Numerical comparisons shared by the tests that check a federated W against an oracle."""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray


def relative_error(a: NDArray[np.float64], b: NDArray[np.float64]) -> float:
    """‖a - b‖ / ‖b‖ in the Frobenius (vector 2-) norm: ``b`` is the reference."""
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))
