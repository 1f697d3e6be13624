"""MEASUREMENT BASELINE ONLY: the site daemon and the coordinator with the federation log's
methods timed (``shipped``) or patched out (``unlogged``), for `afl bench log`
(:mod:`afl.lab.bench.daemons.logcost`).

Usage: ``python -m afl.lab.bench.daemons.unlogged ROLE VARIANT TIMINGS <arguments>`` where ROLE is
``client`` (the arguments of ``afl-client``: ``run --config client.toml`` or ``run-many``) or
``server`` (those of ``afl-server``), VARIANT ``shipped`` or ``unlogged``, and TIMINGS a folder
where the process writes ``ROLE-PID.json`` when the daemon exits: ``{"seconds": total, "calls":
{method: [count, seconds]}}``, the wall time spent in the log's methods (outermost calls only: a
method the log calls from another timed method counts once; summed over the sites a
``run-many`` process hosts), quorum waits included. The plan's log check runs in a thread beside
the site's own plan check (``_plan_in_log``) and ``_logged`` waits for it, so their times
overlap: the sum overstates the log's wall time.

* ``shipped``: the product as it ships; each method of :data:`CLIENT_METHODS` /
  :data:`SERVER_METHODS` is wrapped by a ``time.perf_counter`` timer (two clock reads per call).
* ``unlogged``: the same timers, around no-ops. The site neither witnesses nor cosigns any
  checkpoint, nor waits for a quorum, nor checks the plan's inclusion or the log's history
  (``_plan_in_log`` finds nothing to refuse and ``_logged`` returns the policy's decision as it
  is), nor checks the published round's
  `release` statement, nor publishes or reconciles its DP ledger in the log, nor logs a masked
  round's `opening` (its consistency signature carries none, and its unmask shares go at
  once); the coordinator appends no statement (``Store.append_log`` does nothing, so no
  leaf is hashed or stored) and signs no checkpoint (nobody asks for one).

The ``unlogged`` variant removes a protocol rule (docs/protocol.md §11a: no site acts on a plan
the federation log does not hold under a quorum's cosignatures): it exists only to measure what
that rule costs, is reachable only through this lab module, and no product configuration or
command line can select it, as :mod:`tests.adversarial.malicious_server` wraps the real server.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["CLIENT_METHODS", "SERVER_METHODS", "VARIANTS", "LogTimer", "main"]

VARIANTS = ("shipped", "unlogged")
#: (module, class, method) of the site's federation-log work: the plan's log check (witness,
#: quorum wait, inclusion proof, whole-history audit), witnessing on status answers and after a
#: model, the check of the published round's `release` statement, the DP ledger's anchoring
#: (start-up reconciliation, a release's statement) and a masked round's `opening` statement.
CLIENT_METHODS = (
    ("afl.client.daemon.loop", "ClientDaemon", "_plan_in_log"),
    ("afl.client.daemon.loop", "ClientDaemon", "_logged"),
    ("afl.client.daemon.loop", "ClientDaemon", "_witness_log"),
    ("afl.client.daemon.transparency", "LogWitness", "check_release"),
    ("afl.client.daemon.anchor", "LedgerAnchor", "reconcile"),
    ("afl.client.daemon.anchor", "LedgerAnchor", "publish"),
    ("afl.client.daemon.opening", "OpeningPublication", "start"),
    ("afl.client.daemon.opening", "OpeningPublication", "carried"),
    ("afl.client.daemon.opening", "OpeningPublication", "wait"),
)
#: The coordinator's: a statement appended in its state change's transaction, checkpoints signed
#: and served, cosignatures verified and kept, proofs and entries served (``proofs``: those a
#: GetCheckpoint answer carries, one call per answer beside its ``checkpoint`` or ``cosigned``;
#: ``consistency`` and ``inclusion``: the separate GetConsistencyProof, GetInclusionProof;
#: ``_commit``: a batch of cosignatures and DP-ledger statements, :mod:`afl.server.groupcommit`).
SERVER_METHODS = (
    ("afl.server.store", "Store", "append_log"),
    ("afl.server.transparency", "FederationLog", "checkpoint"),
    ("afl.server.transparency", "FederationLog", "cosigned"),
    ("afl.server.transparency", "FederationLog", "cosign"),
    ("afl.server.transparency", "FederationLog", "proofs"),
    ("afl.server.transparency", "FederationLog", "consistency"),
    ("afl.server.transparency", "FederationLog", "inclusion"),
    ("afl.server.transparency", "FederationLog", "entries"),
    ("afl.server.transparency", "FederationLog", "record_dp_release"),
    ("afl.server.transparency", "FederationLog", "record_opening"),
    # The sites' cosignatures and DP-ledger statements commit in one transaction per batch (the
    # steps above run inside it and count once, with the commit).
    ("afl.server.groupcommit", "GroupCommit", "_commit"),
)


class LogTimer:
    """Wall seconds and calls per wrapped method, outermost calls only (thread-safe)."""

    def __init__(self) -> None:
        self.calls: dict[str, list[float]] = {}
        self._lock = threading.Lock()
        self._depth = threading.local()

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        self.calls.setdefault(name, [0, 0.0])

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            depth = getattr(self._depth, "n", 0)
            self._depth.n = depth + 1
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                self._depth.n = depth
                if depth == 0:
                    with self._lock:
                        self.calls[name][0] += 1
                        self.calls[name][1] += elapsed

        return timed

    def summary(self) -> dict[str, Any]:
        with self._lock:
            calls = {k: [int(v[0]), float(v[1])] for k, v in self.calls.items()}
        return {"seconds": sum(v[1] for v in calls.values()), "calls": calls}


def _unlogged_client() -> None:
    from afl.client.daemon.anchor import LedgerAnchor
    from afl.client.daemon.loop import ClientDaemon
    from afl.client.daemon.opening import OpeningPublication
    from afl.client.daemon.transparency import LogWitness
    from afl.client.policy.plan import PolicyDecision

    def logged(self: ClientDaemon, plan: Any, sha: bytes, d: PolicyDecision, check: Any) -> Any:
        return d

    def nothing(self: object, *args: Any, **kwargs: Any) -> None:
        return None

    def not_in_log(self: object, *args: Any, **kwargs: Any) -> tuple[str, None]:
        return "", None

    def no_opening(self: object, *args: Any, **kwargs: Any) -> bytes:
        return b""

    ClientDaemon._logged = logged  # type: ignore[method-assign,assignment]
    ClientDaemon._plan_in_log = not_in_log  # type: ignore[method-assign]
    ClientDaemon._witness_log = nothing  # type: ignore[method-assign]
    ClientDaemon.anchors_ledger = False
    LedgerAnchor.reconcile = nothing  # type: ignore[method-assign]
    LedgerAnchor.publish = nothing  # type: ignore[method-assign]
    LogWitness.check_release = nothing  # type: ignore[method-assign]
    OpeningPublication.start = nothing  # type: ignore[method-assign]
    OpeningPublication.carried = no_opening  # type: ignore[method-assign]
    OpeningPublication.wait = nothing  # type: ignore[method-assign]


def _unlogged_server() -> None:
    from afl.server.store import Store

    def append_nothing(self: Store, kind: str, fields: object) -> int:
        return 0

    Store.append_log = append_nothing  # type: ignore[method-assign]


def instrument(methods: Sequence[tuple[str, str, str]], timer: LogTimer) -> None:
    """Wrap each (module, class, method) by ``timer`` (on the class: every instance)."""
    import importlib

    for module_name, class_name, method in methods:
        cls = getattr(importlib.import_module(module_name), class_name)
        setattr(cls, method, timer.wrap(f"{class_name}.{method}", getattr(cls, method)))


def main(argv: Sequence[str]) -> int:
    """``ROLE VARIANT TIMINGS <arguments>`` (module docstring); the daemon's exit code."""
    if len(argv) < 3 or argv[0] not in ("client", "server") or argv[1] not in VARIANTS:
        print(
            "usage: python -m afl.lab.bench.daemons.unlogged client|server shipped|unlogged TIMINGS "
            "<daemon arguments>",
            file=sys.stderr,
        )
        return 2
    role, variant, timings, rest = argv[0], argv[1], Path(argv[2]), list(argv[3:])
    timer = LogTimer()
    if role == "client":
        if variant == "unlogged":
            _unlogged_client()
        instrument(CLIENT_METHODS, timer)
        from afl.client.cli import main as daemon_main
    else:
        if variant == "unlogged":
            _unlogged_server()
        instrument(SERVER_METHODS, timer)
        from afl.server.daemon.main import main as daemon_main
    try:
        return daemon_main(rest)
    finally:
        timings.mkdir(parents=True, exist_ok=True)
        doc = {"role": role, "variant": variant, **timer.summary()}
        path = timings / f"{role}-{os.getpid()}.json"
        path.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
