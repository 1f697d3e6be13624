"""What a held GetCheckpoint waits for (docs/protocol.md §11a): the federation log's committed
size and the witnesses who cosigned each of its recent checkpoints, as the store commits them.

A site that waits for a quorum of cosignatures, or for a statement to cosign, asks the
coordinator to hold its GetCheckpoint answer (``wait_ms``) instead of polling: the answer leaves
as soon as the store commits what the site waits for. The state kept here is only a wake-up
hint: the held call computes its answer afresh from the store, and the site verifies every
signature in it. Each waiter is registered with its own condition and event: a commit touches
only the waiters of the checkpoint it cosigned (one set insertion each) or, when the log grew,
the waiters for growth, and wakes only those whose condition it meets. K sites holding calls
while K cosignatures arrive cost O(K²) set insertions at most, and no thread wakes before its
condition holds.
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Iterable

__all__ = ["KEPT_CHECKPOINTS", "LogChanges"]

#: Checkpoints whose new cosigners are kept (the newest sizes): a held call waits on the
#: checkpoint it was answered, always among the newest.
KEPT_CHECKPOINTS = 64


class _Waiter:
    """One held call's condition: ``want`` cosigners of ``checkpoint`` (it counts them in
    ``cosigners``) or a log larger than ``grown_past``; ``woken`` is set when it holds."""

    __slots__ = ("checkpoint", "cosigners", "grown_past", "want", "woken")

    def __init__(self, checkpoint: int, cosigners: set[str], want: int, grown_past: int) -> None:
        self.checkpoint, self.cosigners = checkpoint, cosigners
        self.want, self.grown_past = want, grown_past
        self.woken = threading.Event()


class LogChanges:
    """The log's committed size and the new cosigners of its recent checkpoints, and the
    waiters for them (thread-safe)."""

    def __init__(self, size: int = 0) -> None:
        self._lock = threading.Lock()
        self._size = size
        self._cosigners: dict[int, set[str]] = {}  # checkpoint size -> cosigned since start
        self._for_cosigners: dict[int, set[_Waiter]] = {}  # checkpoint size -> its waiters
        self._for_growth: set[_Waiter] = set()
        self._waiting: set[_Waiter] = set()  # every waiter, for close()
        self._closed = False

    def committed(self, *, size: int = 0, cosigned: Iterable[tuple[int, str]] = ()) -> None:
        """A transaction committed: the log now has ``size`` statements (0: unchanged) and the
        witnesses ``cosigned`` (checkpoint size, witness) checkpoints. Wakes the waiters whose
        condition that meets."""
        with self._lock:
            for checkpoint, witness in cosigned:
                self._cosigners.setdefault(checkpoint, set()).add(witness)
                for waiter in self._for_cosigners.get(checkpoint, ()):
                    waiter.cosigners.add(witness)
                    if len(waiter.cosigners) >= waiter.want:
                        waiter.woken.set()
            for old in sorted(self._cosigners)[:-KEPT_CHECKPOINTS]:
                del self._cosigners[old]
            if size > self._size:
                self._size = size
                for waiter in self._for_growth:
                    if size > waiter.grown_past:
                        waiter.woken.set()

    def close(self) -> None:
        """The store closed: every wait returns now, and later ones at once."""
        with self._lock:
            self._closed = True
            for waiter in self._waiting:
                waiter.woken.set()

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
        waiter = _Waiter(checkpoint, set(cosigners), want_cosigners, grown_past)
        with self._lock:
            waiter.cosigners.update(self._cosigners.get(checkpoint, ()))
            if (
                self._closed
                or (grown_past and self._size > grown_past)
                or (want_cosigners and len(waiter.cosigners) >= want_cosigners)
            ):
                return True
            self._waiting.add(waiter)
            if want_cosigners:
                self._for_cosigners.setdefault(checkpoint, set()).add(waiter)
            if grown_past:
                self._for_growth.add(waiter)
        try:
            return waiter.woken.wait(timeout_s)
        finally:
            with self._lock:
                self._waiting.discard(waiter)
                self._for_growth.discard(waiter)
                waiting = self._for_cosigners.get(checkpoint)
                if waiting is not None:
                    waiting.discard(waiter)
                    if not waiting:
                        del self._for_cosigners[checkpoint]
