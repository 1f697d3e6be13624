"""Many logical sites in one process: ``afl-client run-many`` (docs/operations.md "Many sites on
one machine").

For tests and benchmarks with hundreds of sites on one machine. Each site is a complete
:class:`afl.client.daemon.loop.ClientDaemon` with its own client.toml, kit, state folder, identity key,
mutual-TLS channel (a local subchannel pool, so no two sites ever share a connection and each
call carries its own certificate) and round loop, in its own thread; what they share is what
holds no site's data or keys: the interpreter, the imported modules, the stateless aggregation
modes and gRPC's runtime. A site's failure is its own (its exit code and report), never its
neighbour's. A hospital runs one site per process (``afl-client run``).

Memory: a site process spends most of its resident memory on the interpreter and libraries;
here that is paid once per host, and a site keeps only its statistics
and the buffers of its current exchange, which go back to the operating system when freed
(:func:`afl.core.memory.map_large_blocks`). Measured per site: docs/benchmarks.md §3c.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from afl.client.config import ClientConfig
from afl.core.memory import map_large_blocks

__all__ = ["EXIT_SITE_CRASHED", "run_sites", "worst_exit_code"]

log = logging.getLogger("afl.client")

#: Exit code recorded for a site whose daemon raised an unexpected exception (a bug).
EXIT_SITE_CRASHED = 70

Runner = Callable[[ClientConfig], int]


def _daemon_runner(*, insecure: bool, max_rounds: int | None) -> Runner:
    def run(config: ClientConfig) -> int:
        from afl.client.daemon.loop import ClientDaemon

        return ClientDaemon(config, insecure=insecure, max_rounds=max_rounds).run()

    return run


def run_sites(
    configs: Sequence[ClientConfig],
    *,
    insecure: bool = False,
    max_rounds: int | None = None,
    summary: Path | None = None,
    runner: Runner | None = None,
    known_errors: tuple[type[BaseException], ...] = (),
) -> dict[str, int]:
    """Run one daemon per config in its own thread until each ends; {site id: exit code}.

    A daemon ending with one of ``known_errors`` (a condition a user can cause) is logged in one
    line and counted as a failure (1); any other exception as :data:`EXIT_SITE_CRASHED`.
    ``summary``: a JSON file written with the exit codes at the end.
    """
    ids = [c.site_id for c in configs]
    if len(set(ids)) != len(ids):
        raise ValueError(f"run-many: a site is given twice: {sorted(ids)}")
    states = [c.state_dir.resolve() for c in configs]
    if len(set(states)) != len(states):
        raise ValueError("run-many: two sites share a state_dir")
    map_large_blocks()  # each site's freed vectors go back to the OS (afl.core.memory)
    run = runner or _daemon_runner(insecure=insecure, max_rounds=max_rounds)
    codes: dict[str, int] = {}
    lock = threading.Lock()

    def one(config: ClientConfig) -> None:
        try:
            code = run(config)
        except known_errors as exc:
            log.error("site=%s: %s", config.site_id, exc)
            code = 1
        except Exception:  # a bug in one site must not take the others down
            log.exception("site=%s: the daemon failed unexpectedly", config.site_id)
            code = EXIT_SITE_CRASHED
        with lock:
            codes[config.site_id] = code

    threads = [
        threading.Thread(target=one, args=(c,), name=f"afl-site-{c.site_id}", daemon=True)
        for c in configs
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if summary is not None:
        summary.write_text(json.dumps(codes, sort_keys=True), encoding="utf-8")
    return codes


def worst_exit_code(codes: Mapping[str, int]) -> int:
    """0 when every site completed, else the largest site exit code."""
    return max(codes.values(), default=0)
