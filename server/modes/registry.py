"""The coordinator's aggregation modes by configured name (docs/architecture.md §4).

An explicit, literal mapping: adding a mode means adding its module and one line here. Each entry
builds the mode of one run from its :class:`~afl.server.modes.base.ModeEnvironment` (the server
configuration, the run's settings, the federation's CKKS context).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from afl.server.modes.base import AggregationMode, ModeEnvironment, PlaintextMode
from afl.server.modes.ckks import CkksMode
from afl.server.modes.mask import MaskMode

__all__ = ["MODES", "mode_for"]

MODES: Mapping[str, Callable[[ModeEnvironment], AggregationMode]] = {
    "plaintext": PlaintextMode.for_run,
    "mask": MaskMode.for_run,
    "ckks": CkksMode.for_run,
}


def mode_for(env: ModeEnvironment) -> AggregationMode:
    """The mode a run's ``aggregation`` names (the settings loader already validated the name)."""
    try:
        build = MODES[env.settings.aggregation]
    except KeyError:
        raise ValueError(f"aggregation mode {env.settings.aggregation!r} is not known") from None
    return build(env)
