"""The development flag that ``--insecure`` needs (docs/operations.md §5, docs/protocol.md M-170).

Plaintext gRPC (no TLS, no client authentication) is for development on one machine only. Every
command that takes ``--insecure`` (``afl-server``, ``afl-server check``, ``afl-client run``,
``run-many``, ``doctor``, ``status``, ``afl admin``) refuses it unless the environment also sets
``AFL_DEV=1``: a production unit file or a copied command line never turns TLS off by one flag.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = ["DEV_ENV", "insecure_refusal"]

#: The environment variable that allows ``--insecure``; only the value ``1`` sets it.
DEV_ENV = "AFL_DEV"


def insecure_refusal(program: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The one-line refusal of ``program --insecure`` without ``AFL_DEV=1``, or None when the
    development flag is set."""
    env = os.environ if environ is None else environ
    if env.get(DEV_ENV) == "1":
        return None
    return (
        f"{program}: error: --insecure (plaintext gRPC, no TLS) is for development only and needs "
        f"the development flag: set {DEV_ENV}=1 in the environment, or drop --insecure"
    )
