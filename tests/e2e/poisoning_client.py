"""An ``afl-client`` that poisons the model within today's bounds (docs/protocol.md §2, §6.2).

Usage: ``python poisoning_client.py <afl-client arguments>``. The site replaces every class
vector it uploads by ``-sign(b) * 0.99 * B``, where B is the release's per-entry fixed-point bound
in the plan (``mask``: what masking enforces, so the upload is accepted), and otherwise behaves
like an honest site: its Gram, its plan checks, its evaluation of the candidate. The attack is
injected here, around the real daemon's payload code, so no product code path knows about it.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import numpy as np

from afl.client import cli
from afl.client.payloads import stats
from afl.proto.v1 import common_pb2 as cpb

#: The fraction of the bound the attacker uses (inside it, so the masked upload is accepted).
FRACTION = 0.99


def command() -> tuple[str, ...]:
    """The argv prefix that starts a poisoning client (for ``Daemons.start_clients``)."""
    return (sys.executable, os.path.abspath(__file__))


def main() -> int:
    original = stats.release_values

    def poisoned(release: cpb.Release, **kw: Any) -> Any:
        values = original(release, **kw)
        if release.kind != cpb.STATISTIC_KIND_CLASS_VECTOR:
            return values
        bound = release.encoding.fixed_point.bound
        if not bound > 0:  # plaintext / ckks: the per-entry vector bound a mask plan would set
            bound = float(os.environ.get("AFL_POISON_BOUND", "0")) or float(np.abs(values).max())
        return -np.sign(values) * FRACTION * bound

    stats.release_values = poisoned
    return cli.main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
