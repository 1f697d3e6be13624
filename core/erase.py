"""Deleting files so that their bytes do not stay behind (docs/operations.md §10, M-175).

:func:`erase_file` overwrites a file with zeros, flushes it to disk and unlinks it, returning the
SHA-256 and size of what it deleted: the deletion evidence an audit record or an offboarding
record lists. :class:`Eraser` erases files in a background thread, so that a caller that holds a
lock (the coordinator publishing a round, whose run's payloads are then deleted) does not make
everyone wait for the disk. On a copy-on-write or log-structured file system, or an SSD that
remaps blocks, the old blocks may survive the overwrite; full-disk encryption of the state
folders is what covers those (docs/compliance.md).
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

__all__ = ["Eraser", "erase_file", "erase_tree"]

log = logging.getLogger(__name__)

_BLOCK = 1 << 20


def erase_file(path: Path, *, evidence: bool = True) -> dict[str, object]:
    """Overwrite ``path`` with zeros, fsync, unlink; ``{"path", "sha256", "size"}`` of the
    deleted content (``evidence`` False: the content is not read, and ``sha256`` is ""). A
    symbolic link is unlinked, its target left alone."""
    if path.is_symlink():
        path.unlink()
        return {"path": str(path), "sha256": "", "size": 0}
    digest = hashlib.sha256()
    size = 0
    with path.open("r+b") as handle:
        if evidence:
            while chunk := handle.read(_BLOCK):
                digest.update(chunk)
                size += len(chunk)
            handle.seek(0)
        else:
            size = os.fstat(handle.fileno()).st_size
        left = size
        while left:
            step = min(left, _BLOCK)
            handle.write(bytes(step))
            left -= step
        handle.flush()
        os.fsync(handle.fileno())
    path.unlink()
    return {"path": str(path), "sha256": digest.hexdigest() if evidence else "", "size": size}


_Job = tuple[list[Path], Callable[[], None] | None]


class Eraser:
    """Erases files (:func:`erase_file`, no evidence digest: the caller recorded what it deletes)
    in one background thread, in the order they were handed over. :meth:`submit` returns at once;
    :meth:`drain` waits until everything handed over is erased; :meth:`close` drains and ends the
    thread. A file already gone is skipped; one that cannot be erased is logged as an error and
    kept for :meth:`retry_failed` (and the coordinator's start-up sweep erases what a purge left
    behind, docs/protocol.md M-140); a failing ``then`` is logged. The thread is a daemon: a
    killed process leaves the rest to that sweep."""

    def __init__(self, *, name: str = "afl-eraser") -> None:
        self.name = name
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._failed: list[Path] = []  # files that could not be erased, for retry_failed

    def submit(self, paths: Sequence[Path], *, then: Callable[[], None] | None = None) -> None:
        """Erase ``paths``, then call ``then`` (tidying the emptied folders), in the background;
        :class:`RuntimeError` once closed."""
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.name} is closed: nothing more is erased")
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
            self._jobs.put((list(paths), then))

    def drain(self, timeout_s: float | None = None) -> bool:
        """Wait until every file handed over so far is erased (at most ``timeout_s``); whether
        it was."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._jobs.all_tasks_done:
            while self._jobs.unfinished_tasks:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._jobs.all_tasks_done.wait(left)
        return True

    def retry_failed(self) -> int:
        """Hand the files that could not be erased over again (a caller's periodic tick: a
        long-running daemon does not keep them until its next start); how many."""
        with self._lock:
            if self._closed:  # kept: the start-up sweep erases them
                return 0
            failed, self._failed = self._failed, []
        if failed:
            self.submit(failed)
        return len(failed)

    def close(self) -> None:
        """Erase everything handed over, then end the thread (no later :meth:`submit`; a second
        call does nothing more)."""
        with self._lock:
            closing = not self._closed
            self._closed, thread = True, self._thread
        if thread is None:
            return
        if closing:
            self._jobs.put(None)
        thread.join()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            paths, then = job
            try:
                for path in paths:
                    try:
                        erase_file(path, evidence=False)
                    except FileNotFoundError:
                        pass
                    except Exception as exc:  # keep erasing; retried (retry_failed), swept
                        with self._lock:
                            self._failed.append(path)
                        log.error("could not erase %s (tried again later): %s", path, exc)
                if then is not None:
                    try:
                        then()
                    except Exception as exc:  # an empty folder left behind holds no byte
                        log.warning(
                            "could not tidy up after erasing %d file(s): %s", len(paths), exc
                        )
            finally:
                self._jobs.task_done()
        self._jobs.task_done()


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
