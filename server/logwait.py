"""What a held GetCheckpoint waits for (docs/protocol.md §11a): the federation log's committed
size and the witnesses who cosigned each of its recent checkpoints, as the store commits them.

A site that waits for a quorum of cosignatures, or for a statement to cosign, asks the
coordinator to hold its GetCheckpoint answer (``wait_ms``) instead of polling: the answer leaves
as soon as the store commits what the site waits for. The state kept here is only a wake-up
hint: the held call computes its answer afresh from the store, and the site verifies every
signature in it. Waiters are woken only when their own condition holds (a cosignature on
another checkpoint, or one short of the count, wakes nobody), so K sites holding calls while K
cosignatures arrive cost K wake-ups, not K².
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Iterable

__all__ = ["KEPT_CHECKPOINTS", "LogChanges"]

#: Checkpoints whose new cosigners are kept (the newest sizes): a held call waits on the
#: checkpoint it was answered, always among the newest.
KEPT_CHECKPOINTS = 64


class LogChanges:
    """The log's committed size and the new cosigners of its recent checkpoints (thread-safe)."""

    def __init__(self, size: int = 0) -> None:
        self._changed = threading.Condition()
        self._size = size
        self._cosigners: dict[int, set[str]] = {}  # checkpoint size -> cosigned since start
        self._closed = False

    def committed(self, *, size: int = 0, cosigned: Iterable[tuple[int, str]] = ()) -> None:
        """A transaction committed: the log now has ``size`` statements (0: unchanged) and the
        witnesses ``cosigned`` (checkpoint size, witness) checkpoints."""
        with self._changed:
            self._size = max(self._size, size)
            for checkpoint, witness in cosigned:
                self._cosigners.setdefault(checkpoint, set()).add(witness)
            for old in sorted(self._cosigners)[:-KEPT_CHECKPOINTS]:
                del self._cosigners[old]
            self._changed.notify_all()

    def close(self) -> None:
        """The store closed: every wait returns now, and later ones at once."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()

    def wait(
        self,
        *,
        checkpoint: int,
        cosigners: Collection[str],
        want_cosigners: int,
        grown_past: int,
        timeout_s: float,
    ) -> bool:
        """Wait up to ``timeout_s`` until the checkpoint of size ``checkpoint``, cosigned by
        ``cosigners`` when the wait began, has at least ``want_cosigners`` (0: no such
        condition), or until the log has more than ``grown_past`` statements (0: no such
        condition), or the store closes; whether one of them happened."""
        held = frozenset(cosigners)

        def done() -> bool:
            if self._closed:
                return True
            if grown_past and self._size > grown_past:
                return True
            new = self._cosigners.get(checkpoint, ())
            return bool(want_cosigners) and len(held.union(new)) >= want_cosigners

        with self._changed:
            return self._changed.wait_for(done, timeout_s)
