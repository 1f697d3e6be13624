"""`afl bench store`: what one commit of the coordinator's state costs, and how much of it the
anchor is (docs/benchmarks.md §3i).

Every state change of the coordinator is one SQLite transaction (WAL, ``synchronous = FULL``)
followed by a write of ``anchor.json`` (:class:`afl.server.store.Store`): a K = 256 round
commits thousands of times under the coordinator's lock (every message, upload, cosignature).
This times, in one run, in a fresh state folder under ``--dir``:

* ``in_place``: the shipped store: the anchor padded to whole sectors and rewritten in place,
  ``fdatasync``-ed;
* ``replaced``: MEASUREMENT BASELINE ONLY, the same store with the anchor written as before:
  a new file each commit, fsync-ed and renamed over the old one;

each over ``--commits`` transactions that keep one witness cosignature (the commit a
``CosignCheckpoint`` makes), alternating the two in ``--rounds`` rounds; the reported figure per
variant is the median of its rounds' mean seconds per commit.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from afl.lab.bench.common import describe_machine, emit_json

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--commits", type=int, default=300, help="commits per round (default 300)")
    p.add_argument("--rounds", type=int, default=5, help="rounds per variant, alternating")
    p.add_argument(
        "--dir",
        metavar="DIR",
        help="where the state folders are made (default: the system's temporary folder; "
        "name the disk the coordinator's state lives on)",
    )
    p.add_argument("--out", metavar="FILE", help="write JSON here (default: stdout)")


def _replacing_store() -> type:
    """The shipped Store with its anchor written as before the in-place rewrite (baseline)."""
    from afl.crypto.identity.pki import write_private_file
    from afl.server.store import Store

    class ReplacingStore(Store):
        def _write_anchor(self, commits: int | None = None) -> None:
            count, head = self._audit_tail()
            anchor = {
                "federation_id": self.federation_id,
                "commits": self._commits() if commits is None else commits,
                "audit_count": count,
                "audit_head": head.hex(),
                "log_size": self.log_size(),
            }
            data = (json.dumps(anchor, sort_keys=True) + "\n").encode()
            write_private_file(self.anchor_path, data)

    return ReplacingStore


def _seconds_per_commit(store: object, commits: int, offset: int) -> float:
    start = time.perf_counter()
    for i in range(commits):
        store.put_log_cosignature(  # type: ignore[attr-defined]
            size=1, root=b"r" * 32, witness=f"site-{offset + i}", signature=b"s" * 64
        )
    return (time.perf_counter() - start) / commits


def run(args: argparse.Namespace) -> int:
    if args.commits < 1 or args.rounds < 1:
        raise SystemExit("afl bench store: --commits and --rounds must be at least 1")
    from afl.server.store import Store

    variants = {"in_place": Store, "replaced": _replacing_store()}
    times: dict[str, list[float]] = {name: [] for name in variants}
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        stores = {
            name: cls(Path(folder) / name, federation_id="bench-store")
            for name, cls in variants.items()
        }
        try:
            for r in range(args.rounds):
                for name, store in stores.items():
                    times[name].append(_seconds_per_commit(store, args.commits, r * args.commits))
        finally:
            for store in stores.values():
                store.close()
    med = {name: statistics.median(t) for name, t in times.items()}
    result = {
        "commits_per_round": args.commits,
        "rounds": args.rounds,
        "seconds_per_commit": med,
        "rounds_seconds_per_commit": times,
        "replaced_over_in_place": med["replaced"] / med["in_place"],
    }
    print(
        f"store: a commit {med['in_place'] * 1e3:.3f} ms with the anchor rewritten in place, "
        f"{med['replaced'] * 1e3:.3f} ms with it replaced (x{result['replaced_over_in_place']:.2f})"
    )
    emit_json({"benchmark": "store", "machine": describe_machine(), "results": [result]}, args.out)
    return 0
