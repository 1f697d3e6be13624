"""An ``afl-client`` that vanishes mid-round like a killed site, for the drop-out tests.

Usage: ``python vanishing_client.py STAGE <afl-client arguments>``. The process exits abruptly
(``os._exit(70)``: no report, no goodbye) right after sending the MASK message of ``STAGE``
(``advertise``, ``share-keys``, ``consistency``), or its `opening` statement (``opening``: a CKKS
site lost during its uploads, once its opening is logged), or, for ``masked-input``, after its masked
uploads, before it asks for the survivor list, or, for ``plan-review``, before it answers the
release plan. The fault is injected here, around the real
daemon's RPC client, so no product code path knows about it.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from afl.client import cli
from afl.client.daemon.rpc import CoordinatorClient

EXIT_CODE = 70
AFTER = {
    "advertise": "AdvertiseKeys",
    "share-keys": "ShareKeys",
    "consistency": "ConsistencyCheck",
    "opening": "RecordOpening",
}
BEFORE = {"masked-input": "GetSurvivors", "plan-review": "RespondToPlan"}


def command(stage: str) -> tuple[str, ...]:
    """The argv prefix that starts a client vanishing at ``stage`` (for ``run_loopback``)."""
    if stage not in AFTER and stage not in BEFORE:
        raise ValueError(f"unknown stage {stage!r}")
    return (sys.executable, os.path.abspath(__file__), stage)


def main() -> int:
    stage, args = sys.argv[1], sys.argv[2:]
    original = CoordinatorClient.call

    def call(self: CoordinatorClient, what: str, request: Any, **kw: Any) -> Any:
        if BEFORE.get(stage) == what:
            os._exit(EXIT_CODE)
        result = original(self, what, request, **kw)
        if AFTER.get(stage) == what:
            os._exit(EXIT_CODE)
        return result

    CoordinatorClient.call = call  # type: ignore[method-assign]
    return cli.main(args)


if __name__ == "__main__":
    sys.exit(main())
