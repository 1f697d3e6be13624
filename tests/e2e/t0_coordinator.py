"""An ``afl-server`` that sizes plaintext DP noise for the wrong adversary, for the adversarial
test of docs/protocol.md [M-86].

Usage: ``python t0_coordinator.py <afl-server arguments>``. In plaintext mode the coordinator sees
every site's upload alone, so an honest plan makes each site add the full σ (t = n - 1 assumed
colluders). This coordinator calibrates as if it saw only the sum (t = 0): each site adds σ/√n,
while the plan's budgets still state the target ε. The patch is applied here, around the real
daemon's plan opening (afl.server.plan.open), so no product code path knows about it.
"""

from __future__ import annotations

import sys
from typing import Any

from afl.server.daemon import main as daemon
from afl.server.plan import dp as dp_plan
from afl.server.plan import open as plan_open


def command() -> tuple[str, ...]:
    """The argv prefix that starts this coordinator (for ``run_loopback(server_command=...)``)."""
    return (sys.executable, __file__)


def main() -> int:
    def t0_calibrate(*args: Any, **kwargs: Any) -> Any:
        kwargs["plaintext"] = False  # noise split over n shares: t = min(tolerated, n - 1) = 0
        return dp_plan.calibrate(*args, **kwargs)

    setattr(plan_open, "calibrate", t0_calibrate)  # noqa: B010 (the name open_plan calls)
    return daemon.main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
