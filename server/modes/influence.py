"""Bounded influence where the coordinator sees a site's statistics (``plaintext``; docs/protocol.md
§6.2, :mod:`afl.core.influence`).

A site declares at enrolment N rows of norm at most L (rounded up to powers of two). An upload
whose class vectors or Gram no dataset of that size could produce is refused
(:class:`~afl.server.errors.InvalidRequestError`, naming the release, the bound and the
declaration, never a value of the statistic beyond the offending norm): ``‖b_c‖₂ ≤ 2L`` for every
class, ``trace(G) ≤ N·L²`` with a non-negative diagonal and ``|G_ij| ≤ sqrt(G_ii·G_jj)``. DP
uploads carry noise and are not checked here (their sensitivity bounds a site instead, §7); a
site that declared no bounds is not checked (mask needs them anyway, §4.2).
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from afl.core.influence import InfluenceBound, class_vector_problem, gram_problem
from afl.core.row_bounds import RowBounds
from afl.proto.v1 import common_pb2 as cpb
from afl.server.plan.release import PlannedRelease

__all__ = ["upload_bound_problem"]


def upload_bound_problem(
    release: PlannedRelease, values: NDArray[np.float64], *, declared: RowBounds
) -> str:
    """Why one site's ``values`` (logical shape) of ``release`` exceed what its ``declared``
    dataset could produce ("" when they do not, or when the release is not bounded here)."""
    bound = InfluenceBound.of_dataset(rows=declared.rows, max_row_norm=declared.max_row_norm)
    if release.kind == cpb.STATISTIC_KIND_GRAM:
        problem = gram_problem(values, bound=bound)
    elif release.kind == cpb.STATISTIC_KIND_CLASS_VECTOR:
        problem = class_vector_problem(values, bound=bound, classes=release.class_names)
    else:
        return ""
    if not problem:
        return ""
    return (
        f"release {release.name!r}: {problem} (the site declared N <= {declared.rows}, "
        f"L <= {declared.max_row_norm:g}; docs/protocol.md §6.2)"
    )
