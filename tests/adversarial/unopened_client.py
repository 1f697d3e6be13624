"""An ``afl-client`` that colludes with the coordinator: it sends its ciphertexts of its first
CKKS round without logging its `opening` statement of it (docs/protocol.md M-232), and otherwise
behaves like an honest site (later rounds are opened as the daemon opens them).

Usage: ``python unopened_client.py <afl-client arguments>``. The attack is injected here, around
the real daemon, so no product code path knows it.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from afl.client import cli
from afl.client.daemon.background import Background
from afl.client.daemon.loop import ClientDaemon


def command() -> tuple[str, ...]:
    """The argv prefix that starts this client (for ``Daemons.start_clients``)."""
    return (sys.executable, os.path.abspath(__file__))


def main() -> int:
    honest = ClientDaemon._ckks_opening
    skipped: list[str] = []

    def unopened(self: ClientDaemon, plan: Any, plan_sha256: bytes, **kw: Any) -> Any:
        if skipped:
            return honest(self, plan, plan_sha256, **kw)
        skipped.append(plan.round_id)
        opening = self._opening(plan, plan_sha256, stage_timeout_s=kw["stage_timeout_s"])
        return opening, Background(lambda: None, name=f"no-opening-{plan.round_id}")

    setattr(ClientDaemon, "_ckks_opening", unopened)  # noqa: B010
    return cli.main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
