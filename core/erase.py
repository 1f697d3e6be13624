"""Deleting files so that their bytes do not stay behind (docs/operations.md §10, M-175).

:func:`erase_file` overwrites a file with zeros, flushes it to disk and unlinks it, returning the
SHA-256 and size of what it deleted: the deletion evidence an audit record or an offboarding
record lists. On a copy-on-write or log-structured file system, or an SSD that remaps blocks, the
old blocks may survive the overwrite; full-disk encryption of the state folders is what covers
those (docs/compliance.md).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

__all__ = ["erase_file", "erase_tree"]

_BLOCK = 1 << 20


def erase_file(path: Path) -> dict[str, object]:
    """Overwrite ``path`` with zeros, fsync, unlink; ``{"path", "sha256", "size"}`` of the
    deleted content. A symbolic link is unlinked, its target left alone."""
    if path.is_symlink():
        path.unlink()
        return {"path": str(path), "sha256": "", "size": 0}
    digest = hashlib.sha256()
    size = 0
    with path.open("r+b") as handle:
        while chunk := handle.read(_BLOCK):
            digest.update(chunk)
            size += len(chunk)
        handle.seek(0)
        left = size
        while left:
            step = min(left, _BLOCK)
            handle.write(b"\0" * step)
            left -= step
        handle.flush()
        os.fsync(handle.fileno())
    path.unlink()
    return {"path": str(path), "sha256": digest.hexdigest(), "size": size}


def erase_tree(root: Path) -> list[dict[str, object]]:
    """:func:`erase_file` every file under ``root`` (paths relative to ``root``'s parent), then
    remove the emptied folders; [] when ``root`` does not exist."""
    if not root.exists():
        return []
    if not root.is_dir() or root.is_symlink():
        found = erase_file(root)
        return [{**found, "path": root.name}]
    erased = []
    for path in sorted(root.rglob("*")):
        if path.is_file() or path.is_symlink():
            found = erase_file(path)
            erased.append({**found, "path": str(path.relative_to(root.parent))})
    for folder in sorted(root.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        if folder.is_dir():
            folder.rmdir()
    root.rmdir()
    return erased
