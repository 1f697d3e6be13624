"""`afl bench fedlog`: what one witnessing call's Merkle work costs as the federation log grows
(docs/benchmarks.md §3f).

Every witnessing step asks the coordinator for its newest checkpoint (the root of the whole log
when it grew), a consistency proof from the site's last cosigned size and an inclusion proof of
the statement the site waits for (docs/protocol.md §11a); a site's whole-history audit checks the
entries it fetched against a cosigned root. For each log size n (random leaf hashes, in process)
this times, in the same run:

* ``list``: the functions over the list of leaf hashes (:mod:`afl.crypto.transparency.merkle`,
  what the coordinator and the sites computed on every call before the kept tree): the root of
  n leaves, PROOF(n − 16, D[n]) and PATH(n // 3, D[n]), each rehashing the n leaves;
* ``tree``: the same three answers from :class:`afl.crypto.transparency.tree.MerkleTree`, which
  keeps its perfect subtrees (one append per new statement, timed too);

and checks that both give the same bytes. Times are the best of ``--repeats`` calls.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

from afl.lab.bench.common import best_seconds, describe_machine, emit_json

__all__ = ["add_arguments", "run"]

#: How many statements the consistency proof spans (about one K = 8 round's statements).
GROWTH = 16


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--sizes",
        type=int,
        nargs="+",
        default=[1_000, 10_000, 100_000],
        help="log sizes n (statements; default 1000 10000 100000)",
    )
    p.add_argument("--repeats", type=int, default=5, help="calls per measurement (best kept)")
    p.add_argument("--out", metavar="FILE", help="write JSON here (default: stdout)")


def _row(n: int, repeats: int) -> dict[str, object]:
    from afl.crypto.transparency.merkle import consistency_proof, inclusion_proof, root_hash
    from afl.crypto.transparency.tree import MerkleTree

    leaves = [os.urandom(32) for _ in range(n)]
    t0 = time.perf_counter()
    tree = MerkleTree(leaves)
    append_s = (time.perf_counter() - t0) / n
    old, index = max(1, n - GROWTH), n // 3
    calls: dict[str, tuple[Callable[[], object], Callable[[], object]]] = {
        "root": (lambda: root_hash(leaves), lambda: tree.root(n)),
        "consistency_proof": (
            lambda: consistency_proof(leaves, old),
            lambda: tree.consistency_proof(old, n),
        ),
        "inclusion_proof": (
            lambda: inclusion_proof(leaves, index),
            lambda: tree.inclusion_proof(index, n),
        ),
    }
    row: dict[str, object] = {"size": n, "tree_append_seconds_per_leaf": append_s}
    for name, (listed, kept) in calls.items():
        if listed() != kept():
            raise AssertionError(f"{name} of {n} leaves: the tree and the list disagree")
        a, b = best_seconds(listed, repeats=repeats), best_seconds(kept, repeats=repeats)
        row[name] = {"list_seconds": a, "tree_seconds": b, "speedup": a / b}
    return row


def run(args: argparse.Namespace) -> int:
    rows = []
    for n in args.sizes:
        row = _row(n, args.repeats)
        rows.append(row)
        parts = ", ".join(
            f"{k} {v['list_seconds'] * 1e3:.2f} -> {v['tree_seconds'] * 1e3:.3f} ms"
            for k, v in row.items()
            if isinstance(v, dict)
        )
        print(f"fedlog n={n}: {parts}")
    emit_json({"benchmark": "fedlog", "machine": describe_machine(), "results": rows}, args.out)
    return 0
