"""The site daemon's aggregation modes by the plan's ``AggregationMode`` value
(docs/architecture.md §4).

An explicit, literal mapping: adding a mode means adding its module and one line here. A plan in
a mode this mapping does not list is refused.
"""

from __future__ import annotations

from collections.abc import Mapping

from afl.client.modes.base import AggregationMode, PlaintextMode
from afl.client.modes.ckks import CkksMode
from afl.client.modes.mask import MaskMode
from afl.proto.v1 import common_pb2 as cpb

__all__ = ["MODES"]

MODES: Mapping[int, AggregationMode] = {
    int(cpb.AGGREGATION_MODE_PLAINTEXT): PlaintextMode(),
    int(cpb.AGGREGATION_MODE_MASK): MaskMode(),
    int(cpb.AGGREGATION_MODE_CKKS): CkksMode(),
}
