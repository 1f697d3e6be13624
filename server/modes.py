"""Aggregation modes of the coordinator as strategy objects (design §6, §7; issue 4).

A mode checks each site's payload for a release and turns a release's payloads into the released
sum. ``plaintext`` (this module) is the baseline: float64 statistics in the clear over TLS,
summed with :func:`afl.core.aggregation.sum_members` in sorted site order. The masking and CKKS
modes implement the same two methods (and add their own stages) later.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np
from numpy.typing import NDArray

from afl.core.aggregation import sum_members
from afl.core.packing import packed_length, unpack_upper
from afl.proto.v1 import common_pb2
from afl.server.errors import InvalidRequestError
from afl.server.plan import PlannedRelease
from afl.server.uploads import decode_float64

__all__ = ["AggregationStrategy", "PlaintextStrategy", "strategy_for"]


class AggregationStrategy(Protocol):
    """What the round state machine needs from an aggregation mode."""

    name: str
    proto_mode: int

    def check_payload(self, release: PlannedRelease, data: bytes) -> None:
        """Raise :class:`InvalidRequestError` unless ``data`` is a valid upload for ``release``."""

    def release_sum(
        self, release: PlannedRelease, payloads: Mapping[str, bytes]
    ) -> NDArray[np.float64]:
        """The released sum over ``release.members`` in its logical shape ((d, d) or (d, k))."""


def _wire_length(release: PlannedRelease) -> int:
    if release.packed:
        return packed_length(release.shape[0])
    return int(np.prod(release.shape))


class PlaintextStrategy:
    """Little-endian float64 payloads (packed upper triangle for Gram), summed in the clear."""

    name = "plaintext"
    proto_mode = int(common_pb2.AGGREGATION_MODE_PLAINTEXT)

    def check_payload(self, release: PlannedRelease, data: bytes) -> None:
        decode_float64(data, length=_wire_length(release), what=f"release {release.name!r}")

    def release_sum(
        self, release: PlannedRelease, payloads: Mapping[str, bytes]
    ) -> NDArray[np.float64]:
        missing = sorted(set(release.members) - set(payloads))
        if missing:
            raise InvalidRequestError(f"release {release.name!r} lacks uploads from {missing}")
        members = list(release.members)
        arrays = [
            decode_float64(payloads[s], length=_wire_length(release), what=release.name)
            for s in members
        ]
        total = sum_members(arrays, frozenset(range(len(members))))
        if release.packed:
            return unpack_upper(total)
        return total.reshape(release.shape)


def strategy_for(aggregation: str, *, config: Any = None) -> AggregationStrategy:
    """The strategy object of a configured aggregation mode (``config``: the ServerConfig)."""
    if aggregation == "plaintext":
        return PlaintextStrategy()
    if aggregation == "ckks":
        from afl.server.mode_ckks import CkksStrategy

        return CkksStrategy(
            gram_bound=config.round.ckks_gram_bound if config is not None else 1.0e6,
            vector_bound=config.round.ckks_vector_bound if config is not None else 1.0e3,
            state_dir=config.state_dir if config is not None else None,
            configured_context=config.ckks_public_context if config is not None else None,
        )
    if aggregation == "mask" and config is not None and config.round.mask is not None:
        from afl.server.mode_mask import MaskStrategy  # imports the protocol only when used

        identities = {s: e.identity_public_key for s, e in config.sites.items()}
        return MaskStrategy(config.round.mask, identities=identities)
    raise ValueError(f"aggregation mode {aggregation!r} is not available yet")
