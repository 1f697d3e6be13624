"""Splitting one site's extraction into shards, and the row bookkeeping shared with merging.

Rows are cut into global batches of ``batch_size`` consecutive rows (the last may be shorter);
a shard owns whole global batches: a contiguous run of them or every n-th one (``strided``).
Every image is therefore run through the network in exactly the batch it would meet in a
single, unsharded run, which is what makes shard + merge byte-identical to a single run
(batch composition can change convolution kernels' rounding, on GPUs in particular).
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from afl.client.features.sitedata import SiteSource

SHARD_MODES = ("contiguous", "strided")
UNREADABLE_FILE = "unreadable.csv"


class ShardError(Exception):
    """Bad shard specification, or shard caches that do not belong together."""


def parse_shard(text: str) -> tuple[int, int]:
    """``"i/n"`` → (i, n) with 0 <= i < n."""
    try:
        left, right = text.split("/")
        index, count = int(left), int(right)
    except ValueError:
        raise ShardError(f"shard must look like i/n (e.g. 0/4), got {text!r}") from None
    if not 0 <= index < count:
        raise ShardError(f"shard {text!r}: need 0 <= i < n")
    return index, count


def plan_batches(
    n: int, *, batch_size: int, shard: tuple[int, int] = (0, 1), mode: str = "contiguous"
) -> list[list[int]]:
    """The global batches (lists of source row indices) that shard ``(i, n_shards)`` extracts."""
    if batch_size < 1:
        raise ShardError(f"batch_size must be >= 1, got {batch_size}")
    if mode not in SHARD_MODES:
        raise ShardError(f"shard mode must be one of {SHARD_MODES}, got {mode!r}")
    index, count = shard
    if not 0 <= index < count:
        raise ShardError(f"shard {index}/{count}: need 0 <= i < n")
    starts = range(0, n, batch_size)
    batches = [list(range(s, min(n, s + batch_size))) for s in starts]
    if mode == "strided":
        return batches[index::count]
    chunks = np.array_split(np.arange(len(batches)), count)
    return [batches[b] for b in chunks[index].tolist()]


def data_fingerprint(source: SiteSource) -> str:
    """SHA-256 over classes, ids and labels of the full list (machine independent)."""
    digest = hashlib.sha256(json.dumps(list(source.classes)).encode())
    for rec in source.records:
        digest.update(f"{rec.id}\t{','.join(map(str, rec.labels))}\n".encode())
    return digest.hexdigest()


@dataclass(frozen=True)
class Unreadable:
    """One image that could not be read: its row in the full source list, id, path, reason."""

    row: int
    id: str
    path: str
    error: str


def write_unreadable(root: str | os.PathLike[str], items: Iterable[Unreadable]) -> Path:
    """Write the unreadable-file report (CSV: row, id, path, error) into a cache directory."""
    path = Path(root) / UNREADABLE_FILE
    with open(path, "w", newline="", encoding="utf-8") as fh:
        out = csv.writer(fh)
        out.writerow(["row", "id", "path", "error"])
        for it in sorted(items, key=lambda u: u.row):
            out.writerow([it.row, it.id, it.path, it.error])
    return path


def read_unreadable(root: str | os.PathLike[str]) -> list[Unreadable]:
    """Read a cache's unreadable-file report (an absent report means none)."""
    path = Path(root) / UNREADABLE_FILE
    if not path.exists():
        return []
    with open(path, newline="", encoding="utf-8") as fh:
        return [
            Unreadable(int(r["row"]), r["id"], r["path"], r["error"]) for r in csv.DictReader(fh)
        ]


def kept_rows(batches: Sequence[Sequence[int]], unreadable: Iterable[Unreadable]) -> list[int]:
    """Source rows of a finished shard cache, in cache order (unreadable rows removed)."""
    bad = {u.row for u in unreadable}
    return [r for b in batches for r in b if r not in bad]
