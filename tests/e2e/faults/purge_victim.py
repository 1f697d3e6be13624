"""A process that stores uploads and is killed (SIGKILL) inside the purge, between the commit
that marks them purged and the first unlink of a payload file (the first
item). Usage: ``python purge_victim.py STATE_DIR``; it never returns normally.

The fault is injected here, around the real :class:`Store`, so no product code path knows it.
"""

from __future__ import annotations

import hashlib
import os
import signal
import sys
from pathlib import Path

from afl.server.store import Store

FEDERATION = "fed-purge"
ROUNDS = ("r1-aaaa", "r2-bbbb")
SITES = ("site-a", "site-b", "site-c")


def payload(round_id: str, site: str) -> bytes:
    """The bytes ``site`` uploaded in ``round_id`` (stand-ins for statistics)."""
    return f"statistics of {site} in {round_id}".encode() * 64


def main(state_dir: Path) -> None:
    store = Store(state_dir, federation_id=FEDERATION)
    for round_id in ROUNDS:
        for site in SITES:
            data = payload(round_id, site)
            store.put_upload(
                round_id, site, "gram", data=data, sha256=hashlib.sha256(data).digest()
            )
    unlink = Path.unlink

    def killed_unlink(self: Path, missing_ok: bool = False) -> None:
        if "payloads" in self.parts:  # the purge's record is committed; its unlinks are next
            os.kill(os.getpid(), signal.SIGKILL)
        unlink(self, missing_ok=missing_ok)

    Path.unlink = killed_unlink  # type: ignore[method-assign]
    store.purge_payloads(list(ROUNDS))
    raise SystemExit("the purge finished: the kill was not reached")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
