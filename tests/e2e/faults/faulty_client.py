"""An ``afl-client`` with one fault, for the fault suite.

Usage: ``python faulty_client.py POINT <afl-client arguments>``. The process kills itself
(SIGKILL) when POINT is

* ``after-upload``: a site, once the coordinator's receipt of its first upload came back (the
  upload is stored; the site's report and model are not);
* ``after-decrypt-record``: the CKKS decryptor, once its decrypt-once record of the first release
  is on disk (before the secret key is applied and before the outcome is reported).

The faults are injected here, around the real daemon, so no product code path knows them.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

from afl.client import cli
from afl.client.daemon.decryptor import DecryptionLedger
from afl.client.daemon.rpc import CoordinatorClient


def _kill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def install(point: str) -> None:
    """Patch the daemon so that the process dies at ``point``."""
    if point == "after-upload":
        upload = CoordinatorClient.upload

        def patched_upload(self: CoordinatorClient, data: bytes, **kw: Any) -> Any:
            receipt = upload(self, data, **kw)
            _kill()
            return receipt

        setattr(CoordinatorClient, "upload", patched_upload)  # noqa: B010
    elif point == "after-decrypt-record":
        record = DecryptionLedger.record

        def patched_record(
            self: DecryptionLedger, round_id: str, release: str, digest: bytes
        ) -> None:
            record(self, round_id, release, digest)
            _kill()

        setattr(DecryptionLedger, "record", patched_record)  # noqa: B010
    else:
        raise SystemExit(f"unknown crash point {point!r}")


if __name__ == "__main__":
    install(sys.argv[1])
    sys.exit(cli.main(sys.argv[2:]))
