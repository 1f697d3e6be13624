"""M-180 (docs/protocol.md §7, "The sampler and floating point"): a DP upload depends on the
site's statistic only through its rounding to the release's grid, whatever its floating-point
value, so the low bits of a released double carry nothing of the statistic (Mironov's attack on
floating-point noise, CCS 2012): the same noise draw on two statistics with one grid rounding
gives the same bytes, and every released value is the grid value plus an integer number of
steps, exactly."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from afl.client.payloads import dp as dp_payloads
from afl.client.payloads.dp import noisy_values
from afl.proto.v1 import common_pb2 as cpb
from tests.client.payloads.test_dp_payloads import _release

FINITE = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, allow_infinity=False)


class _FixedNoise:
    """The sampler replaced by a fixed integer draw, the same for every call."""

    def __init__(self, draw: np.ndarray) -> None:
        self.draw = draw

    def __call__(self, sigma: float, size: Any) -> np.ndarray:
        assert sigma > 0
        return self.draw.reshape(size).copy()


@settings(max_examples=60, deadline=None)
@given(
    x=st.lists(FINITE, min_size=4, max_size=4),
    f=st.integers(min_value=0, max_value=20),
    z=st.lists(st.integers(min_value=-(2**20), max_value=2**20), min_size=4, max_size=4),
)
def test_the_upload_depends_on_the_statistic_only_through_its_grid_value(
    x: list[float], f: int, z: list[int]
) -> None:
    values = np.asarray(x, dtype=np.float64).reshape(4, 1)
    scale = 2.0**f
    grid = np.rint(values * scale)
    # another statistic with the same grid rounding, as far from the first as the grid allows
    other = (grid + np.where(grid >= 0, 0.49, -0.49)) / scale
    assert np.array_equal(np.rint(other * scale), grid)
    release = _release(cpb.STATISTIC_KIND_POSITIVE_SUM, (4, 1), sigma=1.0, f=f)
    draw = np.asarray(z, dtype=np.int64)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(dp_payloads, "discrete_gaussian", _FixedNoise(draw))
        first, second = noisy_values(release, values), noisy_values(release, other)
    assert first.tobytes() == second.tobytes()  # bit for bit
    steps = first * scale - grid  # exact: the value is the grid value plus z steps
    assert np.array_equal(steps.ravel(), draw.astype(np.float64))
