"""The coordinator's aggregation modes by configured name (docs/architecture.md §4).

An explicit, literal mapping: adding a mode means adding its module and one line here. Each entry
builds the mode from the validated server configuration.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from afl.server.config import ServerConfig
from afl.server.mode_ckks import CkksMode
from afl.server.mode_mask import MaskMode
from afl.server.modes import AggregationMode, PlaintextMode

__all__ = ["MODES", "mode_for"]

MODES: Mapping[str, Callable[[ServerConfig], AggregationMode]] = {
    "plaintext": PlaintextMode.from_config,
    "mask": MaskMode.from_config,
    "ckks": CkksMode.from_config,
}


def mode_for(config: ServerConfig) -> AggregationMode:
    """The mode ``[round] aggregation`` names (the config loader already validated the name)."""
    try:
        build = MODES[config.round.aggregation]
    except KeyError:
        raise ValueError(f"aggregation mode {config.round.aggregation!r} is not known") from None
    return build(config)
